"""Starting and ending a tensor-parallel engine: the worker ranks start from onecat's own entry module, so a
script read on standard input or without an `if __name__ == "__main__"` guard runs; a worker that dies while
starting fails the engine with its own cause within seconds instead of after the rendezvous timeout; and a
run that ends without close() leaves no leaked shared-memory segment and no worker process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from onecat.engine import LLM
from onecat.engine.parallel import rank_process, runtime

# What every script below runs (with the model's path in MODEL); it never calls close() and has no main guard.
SCRIPT = textwrap.dedent("""
    from onecat.engine import LLM, SamplingParams
    llm = LLM(MODEL, tensor_parallel_size=2, max_model_len=96)
    out = llm.generate(["t1 t5 t9"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    print("TOKENS", len(out[0].token_ids), "WORKERS", *[p.pid for p in llm.tp.workers.procs], flush=True)
""")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint: these tests are about starting and ending the ranks, and each process
    loads it in a fraction of the seconds the embedded GGUF's header takes to parse in every process."""
    from tests.tiny_models import make_tiny_model

    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama"))


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["stdin", pytest.param("file without a main guard", marks=pytest.mark.slow)])
def test_a_script_without_close_runs_and_exits_cleanly(tmp_path, model, how):
    """The stdin script used to kill every worker at once (spawn re-imports `<stdin>`, which is no file) and
    the parent then waited 121 s for the rendezvous; the unguarded file made every worker build an engine of
    its own. Both ended, when they ran, with the resource tracker's leaked shared_memory warning."""
    code = f"MODEL = {model!r}\n{SCRIPT}"
    if how == "stdin":
        argv, stdin = [sys.executable, "-"], code
    else:
        script = tmp_path / "generate.py"
        script.write_text(code)
        argv, stdin = [sys.executable, str(script)], None
    t0 = time.monotonic()
    try:
        run = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script did not finish in 100 s; stderr: {(e.stderr or b'')[-2000:]!r}")
    took = time.monotonic() - t0
    assert run.returncode == 0, run.stderr[-3000:]
    words = run.stdout.split()
    assert words[:2] == ["TOKENS", "3"], run.stdout
    assert "leaked" not in run.stderr, run.stderr[-3000:]
    assert all(_gone(int(pid)) for pid in words[3:]), f"a worker outlived the script: {words[3:]}"
    print(f"{how}: {took:.1f} s")


SITECUSTOMIZE = """
import os, sys
child = os.getpid() != int(os.environ["TP_TEST_PARENT_PID"])
if child and "resource_tracker" not in " ".join(sys.orig_argv):  # the engine's worker processes only
    if os.environ["TP_TEST_FAILURE"] == "raise":
        from onecat.engine.worker import worker

        def refuse(self, args):
            raise RuntimeError("injected start failure")

        worker.Worker.__init__ = refuse
    else:
        sys.stderr.write("injected last words\\n")
        sys.stderr.flush()
        os._exit(7)
"""


@pytest.mark.parametrize("failure, cause", [("raise", "RuntimeError: injected start failure"),
                                            ("exit", "injected last words")])
def test_a_worker_that_dies_at_start_fails_the_engine_with_its_cause(tmp_path, monkeypatch, model, failure, cause):
    """A `sitecustomize` on the child processes' path breaks only them: one raises while building its Worker,
    the other writes a line and exits with code 7 before onecat is imported. The parent must name the cause
    within 10 s of starting the workers, and leave no process."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("TP_TEST_PARENT_PID", str(os.getpid()))
    monkeypatch.setenv("TP_TEST_FAILURE", failure)
    started = []
    start_workers = runtime.WorkerRanks.__init__

    def timed_start(self, *args, **kwargs):
        started.append(time.monotonic())
        start_workers(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(runtime.WorkerRanks, "__init__", timed_start)
    with pytest.raises(runtime.TensorParallelError) as err:
        LLM(model, tensor_parallel_size=2, max_model_len=96)
    took = time.monotonic() - started[0]
    message = str(err.value)
    assert "rank 1" in message and cause in message, message
    if failure == "exit":
        assert "exit code 7" in message, message
    assert took <= 10, f"the failure took {took:.1f} s to surface"
    assert not any(started[1].alive())
    print(f"{failure}: failed {took:.1f} s after the workers started")


@pytest.mark.parametrize("code, said", [(3, "exit code 3"), (-9, "killed by signal 9 (SIGKILL)"), (None, "running")])
def test_how_a_worker_ended_is_said_in_words(code, said):
    assert rank_process.describe_exit(code) == said
