"""The engine's environment switches (engine/switches.py): "1" on, "0" off, unset or empty the declared default, and
any other value refused with the fix instead of silently leaving a run on the path it meant to leave."""
from __future__ import annotations

import json
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


def test_every_declared_switch_is_listed_once_with_its_default_and_what_it_does(monkeypatch):
    """`onecat switches` reads every switch(...) declaration of the engine (module level, class level, inside
    functions, by name or through a NAME = "ONECAT_..." constant of another module) with its default, the value set
    in the environment, its place and its declaration's comment: none may go unexplained."""
    from typer.testing import CliRunner

    from onecat.cli.main import app
    from onecat.engine.switches import declared

    monkeypatch.setenv("ONECAT_GEMV_16_ROWS", "0")
    found = {e["name"]: e for e in declared()}
    assert found["ONECAT_GEMV_16_ROWS"]["default"] is True and found["ONECAT_GEMV_16_ROWS"]["set_to"] == "0"
    assert found["ONECAT_ROWS_GEMM"]["default"] is False
    assert found["ONECAT_GEMV_16_ROWS"]["where"].startswith("engine/kernels/quant_gemv.py:")
    assert found["ONECAT_MOE_FUSED_ROUTED"]["default"] is True  # a class attribute
    assert found["ONECAT_DRAFT_AHEAD"]["default"] is None  # inside a function, through a constant
    assert found["ONECAT_DFLASH_FUSED"]["where"].startswith("engine/speculative/dflash.py:")  # an imported constant
    assert all(e["about"] for e in found.values()), [n for n, e in found.items() if not e["about"]]
    listed = CliRunner().invoke(app, ["switches", "--json"])
    assert listed.exit_code == 0, listed.output
    assert [e["name"] for e in json.loads(listed.output)] == sorted(found)


def test_a_switch_declared_twice_is_refused(tmp_path):
    from onecat.engine.switches import declared

    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text('from onecat.engine.switches import switch\n\n# on\nX = switch("ONECAT_T", True)\n')
    with pytest.raises(RuntimeError, match="ONECAT_T is declared twice"):
        declared(tmp_path)
