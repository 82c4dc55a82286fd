"""Where onecat keeps kernel build outputs and extracted tools."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The onecat cache folder (ONECAT_CACHE_DIR overrides ~/.cache/onecat)."""
    return Path(os.environ.get("ONECAT_CACHE_DIR", Path.home() / ".cache" / "onecat"))
