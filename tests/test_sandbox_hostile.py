"""Hostile EvalPlus "solutions" that try to pass without solving, or to break the harness.

Each one must fail its own task (or pass only on its merits) and never raise out of the
evaluator: reading the dataset or the reference cache, forging or corrupting the result channel,
flooding the output pipes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from onecat.gates.sandbox import SandboxLimits, SandboxUnavailable, probe_isolation, run_python
from onecat.gates.tasks.evalplus import ReferenceCache, check_many, check_solution
from onecat.gates.tasks.evalplus_data import load_problems

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ONECAT_DATA_DIR", "/work/shared/data")) / "evalplus"
HE_FILE = DATA / "HumanEvalPlus-v0.1.10.jsonl.gz"
TASK = "HumanEval/0"

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="sandbox needs a POSIX system"),
    pytest.mark.skipif(not HE_FILE.is_file(), reason="HumanEval+ data not found; set ONECAT_DATA_DIR"),
]


@pytest.fixture(scope="module", autouse=True)
def _sandbox_runs_here():
    try:
        probe_isolation()
    except SandboxUnavailable as exc:
        pytest.skip(f"the sandbox cannot run programs on this machine: {exc}")


def _need(*mechanisms: str) -> None:
    have = set(probe_isolation()["mechanisms"])
    missing = [m for m in mechanisms if m not in have]
    if missing:
        pytest.skip(f"the OS does not give the sandbox {missing} here (have {sorted(have)})")


@pytest.fixture(scope="module")
def problem():
    return {p.task_id: p for p in load_problems(HE_FILE, "humaneval")}[TASK]


@pytest.fixture(scope="module")
def work_dir():
    """A harness work folder in the host's temp dir, open to all as an ordinary work folder is (pytest's
    tmp_path has 0700 parents, which alone would keep the sandbox uid out). The full sandbox hides it
    (fresh root, private /tmp); the no-namespaces test below sees it, and only the cache's 0700 dirs
    keep the program out."""
    d = Path(tempfile.mkdtemp(prefix="onecat-test-hostile-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cache_root(work_dir):
    return work_dir / "cache"


@pytest.fixture(scope="module")
def cache(cache_root):
    return ReferenceCache("hostile-test", cache_root)


@pytest.fixture(scope="module")
def reference(problem, cache):
    ref = cache.get(problem)
    assert ref.error is None, ref.error
    return ref


def _assert_failed(outcome) -> None:
    assert not outcome.base_pass and not outcome.plus_pass, outcome


# ----------------------------------------------------------------------------- reading what it must not see
WALK_FOR_DATASET = '''
import gzip, io, json, os, time

def _find():
    stop = time.monotonic() + 8.0
    for root, dirs, files in os.walk("/"):
        if root == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
        for name in files:
            if name.startswith("HumanEvalPlus") and name.endswith((".jsonl", ".jsonl.gz")):
                return os.path.join(root, name)
        if time.monotonic() > stop:
            return None

def _canonical(path, task_id):
    raw = io.open(path, "rb")
    lines = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
    for line in lines:
        row = json.loads(line)
        if row["task_id"] == task_id:
            return row["prompt"] + row["canonical_solution"]

exec(_canonical(_find(), "HumanEval/0"), globals())
'''


def test_walking_the_filesystem_for_the_dataset_does_not_pass(problem, reference):
    out = check_solution(problem, WALK_FOR_DATASET, reference)
    _assert_failed(out)
    if "mntns" in probe_isolation()["mechanisms"]:
        assert out.filesystem.startswith("fresh-root:"), out


def test_gzip_over_io_open_of_the_dataset_does_not_pass(problem, reference):
    source = (
        "import gzip, io, json\n"
        f"for _line in gzip.GzipFile(fileobj=io.open({str(HE_FILE)!r}, 'rb')):\n"
        "    _row = json.loads(_line)\n"
        "    if _row['task_id'] == 'HumanEval/0':\n"
        "        exec(_row['prompt'] + _row['canonical_solution'], globals())\n"
        "        break\n")
    out = check_solution(problem, source, reference)
    _assert_failed(out)


def _replay_source(cache_file: Path) -> str:
    return (
        "import io, json\n"
        f"_outs = json.load(io.open({str(cache_file)!r}))['outputs']\n"
        "_seq, _n = _outs['base'] + _outs['plus'], [0]\n"
        "def has_close_elements(numbers, threshold):\n"
        "    _n[0] += 1\n"
        "    return _seq[_n[0] - 1]\n")


def test_replaying_the_reference_cache_does_not_pass(problem, reference, cache):
    cache_file = cache._path(problem.task_id)
    assert cache_file.is_file()
    out = check_solution(problem, _replay_source(cache_file), reference)
    _assert_failed(out)


def test_reference_cache_is_private_to_the_harness_user(problem, reference, cache, cache_root):
    """Defence in depth for machines without mount namespaces: the cache is 0700 all the way down."""
    for d in [cache.dir, *cache.dir.parents]:
        if d == cache_root:
            break
        assert d.stat().st_mode & 0o077 == 0, f"{d} is open to other users"
    assert cache._path(problem.task_id).stat().st_mode & 0o077 == 0


def test_without_namespaces_the_sandbox_uid_cannot_read_the_cache(problem, reference, cache, cache_root):
    _need("uid-drop")
    cache_file = cache._path(problem.task_id)
    prog = (f"import os\nprint(os.path.isdir({str(cache_root)!r}))\n"  # the host view: the folder is there
            f"try:\n    print(len(open({str(cache_file)!r}).read()))\n"
            "except PermissionError:\n    print('denied')\n")
    res = run_python(prog, SandboxLimits(wall_s=10, namespaces=False), guard="off")
    assert res.ok, res.stderr_text
    assert res.stdout_text.split() == ["True", "denied"]


def test_program_sees_a_minimal_filesystem():
    _need("mntns", "uid-drop")
    watch = [str(HE_FILE.parent.parent), str(REPO), "/root", "/home", os.path.expanduser("~"), os.getcwd(),
             "/etc/passwd", "/proc/1/root/etc", "/work"]
    prog = ("import json, os\n"
            f"watch = {watch!r}\n"
            "opt = [r for r, _, _ in os.walk('/opt')][:4] if os.path.isdir('/opt') else []\n"
            "print(json.dumps({'root': sorted(os.listdir('/')), 'cwd': os.getcwd(), 'opt': opt,\n"
            "                  'visible': [p for p in watch if os.path.exists(p)]}))\n")
    res = run_python(prog, SandboxLimits(wall_s=10), guard="off")
    assert res.ok, res.stderr_text
    seen = json.loads(res.stdout_text)
    assert seen["visible"] == [], seen
    assert set(seen["root"]) <= {"usr", "lib", "lib64", "lib32", "libx32", "bin", "etc", "dev", "proc", "tmp",
                                 "sandbox", "opt"}, seen
    from onecat.gates.sandbox.run import sandbox_python
    from onecat.gates.sandbox.site import provisioned

    site = provisioned(sandbox_python())  # the numpy folder (gates/sandbox/site.py) is the only thing under /opt
    if "opt" in seen["root"]:
        assert site is not None and str(site).startswith("/opt/")
        assert all(str(site).startswith(d) or d.startswith(str(site)) for d in seen["opt"]), seen
    assert any(m.startswith("fresh-root:") for m in res.mechanisms), res.mechanisms


# ----------------------------------------------------------------------------- corrupting the result channel
def _write_everywhere(payload: str) -> str:
    return ("import os\n"
            f"_payload = {payload}\n"
            "for _fd in range(1, 10):\n"
            "    try:\n        os.write(_fd, _payload)\n    except OSError:\n        pass\n")


def test_forged_message_with_wrong_types_fails_that_task_only(problem, reference):
    forged = _write_everywhere("b'{\"set\": [], \"i\": 0}\\n'") + problem.reference_code
    out = check_solution(problem, forged, reference)
    _assert_failed(out)
    assert out.failure_reason == "sandbox_protocol_error", out


def test_deeply_nested_message_fails_that_task_only(problem, reference, cache):
    deep = _write_everywhere("b'[' * 200000 + b']' * 200000 + b'\\n'") + problem.reference_code
    outcomes = check_many([(problem, deep), (problem, problem.reference_code)], cache, workers=2)
    _assert_failed(outcomes[0])
    assert outcomes[0].failure_reason == "sandbox_protocol_error", outcomes[0]
    assert outcomes[1].base_pass and outcomes[1].plus_pass, outcomes[1]


# ----------------------------------------------------------------------------- flooding the harness
_MEASURE = r'''
import ctypes, gc, json, os, sys, threading, time
from onecat.gates.tasks.evalplus import ReferenceCache, check_solution
from onecat.gates.tasks.evalplus_data import load_problems
data, cache_root, task, code = sys.argv[1:5]
problem = {p.task_id: p for p in load_problems(data, "humaneval")}[task]
ref = ReferenceCache("hostile-test", cache_root).get(problem)
check_solution(problem, problem.reference_code, ref)
gc.collect()
ctypes.CDLL(None).malloc_trim(0)
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
peak, running = [0], [True]
def sample():
    while running[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
before = rss()
sampler = threading.Thread(target=sample)
sampler.start()
start = time.monotonic()
out = check_solution(problem, code, ref)
seconds = time.monotonic() - start
running[0] = False
sampler.join()
print(json.dumps({"growth_mb": (max(peak[0], rss()) - before) / 2**20, "seconds": seconds, "outcome": out.to_dict()}))
'''

FLOOD_64MB = ("import os, sys\n"
              "_chunk = (b'x' * 1023 + b'\\n') * 1024\n"
              "for _fd in (1, 2):\n"
              "    for _ in range(64):\n        os.write(_fd, _chunk)\n"
              "for _ in range(64):\n    print(_chunk.decode(), end='')\n")


def _measure(cache_root, problem, code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(HE_FILE), str(cache_root), problem.task_id, code],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_64mb_of_output_keeps_the_harness_flat_and_judges_on_merits(problem, reference, cache_root):
    noisy_correct = FLOOD_64MB + problem.reference_code
    got = _measure(cache_root, problem, noisy_correct)
    assert got["outcome"]["base_pass"] and got["outcome"]["plus_pass"], got
    assert got["growth_mb"] < 32, got  # stdout/stderr keep 64 KiB: nothing should grow at all
    assert got["seconds"] < 30, got


def test_64mb_on_the_result_channel_fails_the_task_and_keeps_the_harness_flat(problem, reference, cache_root):
    flood = ("import os\n"
             "_chunk = b'[' * (1 << 20)\n"
             "for _fd in range(1, 10):\n"
             "    try:\n"
             "        for _ in range(64):\n            os.write(_fd, _chunk)\n"
             "    except OSError:\n        pass\n") + problem.reference_code
    got = _measure(cache_root, problem, flood)
    assert not got["outcome"]["plus_pass"], got
    assert got["outcome"]["failure_reason"] == "sandbox_protocol_error", got
    assert got["growth_mb"] < 100, got
    assert got["seconds"] < 30, got


# ----------------------------------------------------------------------------- outliving the time limit
IGNORES_THE_ALARM = ("import signal\n"
                     "signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                     "def has_close_elements(numbers, threshold):\n"
                     "    while True:\n        pass\n")
SWALLOWS_THE_TIMEOUT = ("def has_close_elements(numbers, threshold):\n"
                        "    while True:\n"
                        "        try:\n            while True:\n                pass\n"
                        "        except BaseException:\n            pass\n")


@pytest.mark.parametrize("code", [IGNORES_THE_ALARM, SWALLOWS_THE_TIMEOUT], ids=["ignores-alarm", "swallows-timeout"])
def test_a_solution_defeating_the_per_input_alarm_dies_at_the_stated_limit(problem, reference, code, monkeypatch):
    """The per-input alarm is advisory; the task's wall limit is hard (SIGKILL of the process group)
    and the outcome states it. The budget is shrunk so the test takes seconds, not EvalPlus's minute."""
    import onecat.gates.tasks.evalplus as evalplus

    monkeypatch.setattr(evalplus, "TIMEOUT_CAP_S", 0.5)
    monkeypatch.setattr(evalplus, "LOAD_TIME_LIMIT_S", 1.0)
    limit = 0.5 + 1.0 + 5.0          # check_solution's wall: capped input budget + load limit + 5 s
    out = check_solution(problem, code, reference)
    _assert_failed(out)
    assert out.failure_reason == "timeout", out
    assert f"wall-time limit exceeded ({limit:g} s, process group killed)" in out.sandbox, out
    assert out.eval_s <= limit + 1.5, out.eval_s
