"""Shared fixtures: the embedded model, tiny random-init HF checkpoints, and the data folder."""
from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if "ONECAT_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
    os.environ["ONECAT_DATA_DIR"] = str(SHARED_DATA)

EMBEDDED = "embedded:smollm2-135m-instruct"
# Every CPU engine zero-fills its whole KV budget when it opens; the tests' prompts are short, so a
# small budget keeps each engine (and each `onecat serve` the tests start) near its weights' size.
os.environ.setdefault("ONECAT_CPU_KVCACHE_SPACE", "0.25")
# The CLI's Rich consoles are made at import, and a Console made while COLUMNS is set keeps that width for
# good, so the `env={"COLUMNS": ...}` the CLI tests give CliRunner would be ignored. pytest's capture
# plugin imports readline, and GNU readline writes COLUMNS=80 / LINES=24 into the C environment, which a
# pytest-xdist worker (a child process) then starts with; an exported COLUMNS in the shell does the same.
# Without them the consoles read the width when they print.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_llm():
    from onecat.engine import LLM

    with LLM(EMBEDDED, max_model_len=2048, max_num_seqs=16) as llm:
        yield llm


def _return_freed_memory() -> None:
    """Collects the engines' reference cycles and hands freed heap pages back to the OS, so each test
    module starts from the memory the session really holds, not the high-water mark of the last one."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module():
    yield
    _return_freed_memory()


def _peak_rss_gib() -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def pytest_terminal_summary(terminalreporter):
    peak = _peak_rss_gib()
    if peak is not None:
        terminalreporter.write_line(f"peak RSS of this test process: {peak:.2f} GiB")


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    from onecat.engine.model_source import resolve_model_source

    return resolve_model_source(EMBEDDED).path
