"""Shared fixtures (the embedded model, the data folder) and the hooks that spread the run over pytest-xdist
workers (how many, their threads, the order of the files), report each worker's peak memory, skip the tests
of an absent embedded model (tests/embedded_model.py) and fail a run that leaves files in the checkout
(tests/checkout_guard.py)."""
from __future__ import annotations

import collections
import ctypes
import gc
import math
import os
from pathlib import Path

import pytest
import torch

from onecat.engine.kernels.cache import cache_root
from tests import checkout_guard
from tests.embedded_model import EMBEDDED, require_embedded_model, skip_reason_for

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if "ONECAT_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
    os.environ["ONECAT_DATA_DIR"] = str(SHARED_DATA)

# Caches go where the engine keeps its compiled kernels ($ONECAT_CACHE_DIR, else ~/.cache/onecat), never into
# the checkout: without the variable EvalPlus's reference outputs would go to .onecat/cache in the working folder.
os.environ.setdefault("ONECAT_CACHE_DIR", str(cache_root()))
# Hypothesis keeps its own cache (Unicode tables, examples) in ./.hypothesis unless told otherwise.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(Path(os.environ["ONECAT_CACHE_DIR"]) / "hypothesis"))
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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """How many pytest-xdist workers `-n auto` (the README's test command) starts: two where no CUDA GPU is
    present; none (every test in this one process, in order) where one is, so that no test shares a GPU with
    another worker's. $PYTEST_XDIST_AUTO_NUM_WORKERS overrides; `-n N` sets a count outright."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if torch.cuda.is_available():
        return 0
    workers = min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return workers if workers > 1 else 0


# xdist's loadfile scheduling hands out whole files, those with the most tests first, so a file of a few long
# tests (the transformers comparison, the smoke gate) tends to start last and run alone at the end. Once a full
# default run has recorded how long each file took (in pytest's cache, .pytest_cache/), the controller hands
# those times to the workers, they collect the files longest first, and xdist keeps that order instead: the
# run ends with short files on every worker.
FILE_SECONDS = "onecat/test-file-seconds"
_file_seconds_now: collections.Counter = collections.Counter()


def _recorded_file_seconds(config) -> dict:
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    return (cache.get(FILE_SECONDS, None) if cache is not None else None) or {}


def pytest_configure(config):
    """With xdist workers (started after this, in the controller), each worker's thread pools get its share of
    the cores through OMP_NUM_THREADS, which the workers and every process they start inherit: OpenMP pools
    that together ask for more threads than there are cores spin at barriers waiting for descheduled threads
    (a third slower on two cores). An OMP_NUM_THREADS already set is kept. The checkout guard runs here too."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    workers = getattr(config.option, "numprocesses", None) or 0  # an int once xdist has resolved `-n auto`
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))
    if config.getoption("dist", "no") == "loadfile" and _recorded_file_seconds(config):
        config.option.loadscopereorder = False  # keep the workers' collection order (below)
    checkout_guard.register(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Controller side, per worker: the recorded file times when the workers are to collect longest first."""
    if node.config.getoption("loadscopereorder", True) is False and node.config.getoption("dist") == "loadfile":
        node.workerinput["onecat_file_seconds"] = _recorded_file_seconds(node.config)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    seconds = getattr(config, "workerinput", {}).get("onecat_file_seconds")  # an xdist worker, longest first
    if seconds:
        first = {}
        for i, item in enumerate(items):
            first.setdefault(item.nodeid.split("::")[0], i)
        # longest first, files with no record (new ones) before all; a file's tests keep their order
        items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], math.inf),
                                     first[item.nodeid.split("::")[0]]))


def pytest_runtest_logreport(report):
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller sees every worker's reports
        _file_seconds_now[report.nodeid.split("::")[0]] += report.duration


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that opened the embedded model where its package is absent is skipped, not an error."""
    report = yield
    reason = skip_reason_for(call.excinfo.value) if report.failed and call.excinfo is not None else None
    if reason:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] + 1, f"Skipped: {reason}")
    return report


@pytest.fixture(scope="session")
def embedded_model_installed() -> Path:
    """For `@needs_embedded_model` (tests/embedded_model.py): the GGUF file, or a skip."""
    return require_embedded_model()


@pytest.fixture(scope="session")
def embedded_llm():
    from onecat.engine import LLM

    require_embedded_model()

    with LLM(EMBEDDED, max_model_len=2048, max_num_seqs=16) as llm:
        yield llm


def _return_freed_memory() -> None:
    """Collects the engines' reference cycles and hands freed heap pages back to the OS, so each test
    module starts from the memory the session really holds, not the high-water mark of the last one. What
    survives the collection is frozen (gc.freeze): the next module's collection then looks only at the objects
    made since, not again at the hundreds of thousands a worker keeps (imports, the GGUF readers' fields), which
    took a third of a second in every module's teardown."""
    gc.collect()
    gc.freeze()
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


_WORKER_PEAKS: dict[str, float] = {}  # pytest-xdist worker id -> its peak RSS (GiB), gathered by the controller


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    workeroutput = getattr(config, "workeroutput", None)  # set in an xdist worker only
    if workeroutput is not None:
        workeroutput["peak_rss_gib"] = _peak_rss_gib()
        return
    full_default_run = (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
                        and config.option.markexpr == "not slow")  # pyproject's addopts
    if full_default_run and exitstatus in (0, 1) and _file_seconds_now and getattr(config, "cache", None):
        config.cache.set(FILE_SECONDS, {f: round(t, 1) for f, t in sorted(_file_seconds_now.items())})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    peak = getattr(node, "workeroutput", {}).get("peak_rss_gib")
    if peak is not None:
        _WORKER_PEAKS[node.gateway.id] = peak


def pytest_terminal_summary(terminalreporter):
    if _WORKER_PEAKS:  # the tests ran in xdist workers: their peaks, not this (controller) process's
        each = ", ".join(f"{name} {peak:.2f} GiB" for name, peak in sorted(_WORKER_PEAKS.items()))
        terminalreporter.write_line(f"peak RSS of the test workers: {each} "
                                    f"(at most {sum(_WORKER_PEAKS.values()):.2f} GiB together)")
        return
    peak = _peak_rss_gib()
    if peak is not None:
        terminalreporter.write_line(f"peak RSS of this test process: {peak:.2f} GiB")


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    return require_embedded_model()
