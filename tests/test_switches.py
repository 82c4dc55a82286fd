"""The engine's environment switches (engine/switches.py): "1" on, "0" off, unset or empty the declared default, and
any other value refused with the fix instead of silently leaving a run on the path it meant to leave."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from onecat.engine.switches import switch


@pytest.mark.parametrize("value,default,want", [("1", False, True), ("0", True, False), (" 1 ", None, True),
                                                 ("", True, True), (None, False, False), (None, None, None)])
def test_switch_values(monkeypatch, value, default, want):
    if value is None:
        monkeypatch.delenv("ONECAT_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("ONECAT_TEST_SWITCH", value)
    assert switch("ONECAT_TEST_SWITCH", default) is want


@pytest.mark.parametrize("value", ["yes", "true", "on", "2", "off"])
def test_a_value_that_is_not_a_switch_is_refused_with_the_fix(monkeypatch, value):
    monkeypatch.setenv("ONECAT_TEST_SWITCH", value)
    with pytest.raises(ValueError, match=r"ONECAT_TEST_SWITCH=.*set it to 1 \(on\) or 0 \(off\)"):
        switch("ONECAT_TEST_SWITCH", True)


def test_a_misspelt_engine_switch_stops_the_import_with_its_name():
    """A module-level switch is read at import: `ONECAT_SAMPLER_GRAPHS=yes` fails there, naming the variable."""
    done = subprocess.run([sys.executable, "-c", "import onecat.engine.core.sampler_graphs"], capture_output=True,
                          text=True, env={**os.environ, "ONECAT_SAMPLER_GRAPHS": "yes"}, timeout=120)
    assert done.returncode != 0 and "ONECAT_SAMPLER_GRAPHS='yes' is not a switch value" in done.stderr
