"""The engine's on/off switches from the environment (ONECAT_ROWS_GEMM, ONECAT_SAMPLER_GRAPHS, ...): each is declared
where it is used, with its default, and parsed here. "1" turns it on, "0" off, unset (or empty) keeps the default;
any other value is refused with the fix, so that a typo cannot leave a measurement on the path it meant to leave.
"""
from __future__ import annotations

import os


def switch(name: str, default: bool | None) -> bool | None:
    """The switch `name`: True for "1", False for "0", `default` when unset (None: the caller decides, e.g. by
    device). Raises ValueError for any other value."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    meaning = {True: "on", False: "off", None: "chosen by the engine"}[default]
    raise ValueError(f"{name}={value!r} is not a switch value: set it to 1 (on) or 0 (off), or unset it for the "
                     f"default ({meaning})")
