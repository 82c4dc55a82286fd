"""lm-eval itself (0.4.13, a test dependency), unmodified, against `onecat serve` on the embedded model:
its `local-completions` model finds the remote tokenizer (/tokenizer_info) with no tokenizer argument,
and on a local loglikelihood task every item's `is_greedy` (lm-eval's acc) agrees with the engine's own
greedy continuation and every loglikelihood with the engine's prompt scores. (Through the old echo
reply, whose top_logprobs held only the prompt token, lm-eval scored acc 1.0 on every task.)"""
from __future__ import annotations

import json

import pytest

from tests.conftest import EMBEDDED

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test dependency (scripts/setup.sh test)")

ITEMS = [("The capital of France is", " Paris"), ("One, two, three, four,", " five"),
         ("The sun rises in the", " east"), ("Water is made of hydrogen and", " oxygen"),
         ("The opposite of hot is", " cold"), ("A week has seven", " days"), ("Cats say", " meow"),
         ("The color of grass is", " green"), ("Ice is frozen", " water"), ("Monday, Tuesday,", " Wednesday")]
TASK = """task: onecat_tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow  # the default run keeps the gate-workload test, which drives the same adapter
def test_lm_eval_local_completions_agrees_with_the_engine(tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from onecat.engine import SamplingParams
    from onecat.engine.server.app import ServeConfig, ServerState
    from onecat.engine.server.launch import start_in_thread

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in ITEMS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    state = ServerState.create(ServeConfig(model=EMBEDDED, served_model_name=["smollm2"], max_model_len=512,
                                           max_num_seqs=4, device="cpu"))
    srv = start_in_thread(state)
    try:
        result = simple_evaluate(
            model="local-completions",
            model_args={"model": "smollm2", "base_url": f"{srv.url}/v1/completions", "num_concurrent": 1,
                        "max_retries": 1},
            tasks=["onecat_tiny_ll"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    finally:
        srv.server.should_exit = True
        srv.thread.join(15)
        state.close()  # the engine thread is done: the test may drive the engine itself now
    llm = state.llm
    try:
        tok = llm.tokenizer
        greedy_count = 0
        for s in sorted(result["samples"]["onecat_tiny_ll"], key=lambda s: s["doc_id"]):
            context, continuation = s["doc"]["context"], s["doc"]["continuation"]
            logprob, is_greedy = s["resps"][0][0]
            ctx = tok.encode(context)
            whole = tok.encode(context + continuation)
            cont = whole[len(ctx):]
            out = llm.engine_generate([ctx], [SamplingParams(temperature=0.0, max_tokens=len(cont))])[0]
            assert bool(is_greedy) == (out.token_ids == cont), (context, out.token_ids, cont)
            scored = llm.score([whole])[0].logprobs[len(ctx) - 1:]
            assert float(logprob) == pytest.approx(sum(scored), abs=1e-3)
            greedy_count += out.token_ids == cont
    finally:
        llm.close()
    acc = result["results"]["onecat_tiny_ll"]["acc,none"]
    assert acc == pytest.approx(greedy_count / len(ITEMS)) and 0 < acc < 1


@pytest.mark.slow
def test_onecat_as_an_lm_eval_model_gives_the_servers_numbers(tmp_path, monkeypatch):
    """`model="onecat"` (registered by lm_eval_bridge.register) scores the task in-process: the same
    loglikelihood and is_greedy per document as lm-eval's local-completions against `onecat serve`."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from onecat.engine.server.app import ServeConfig, ServerState
    from onecat.engine.server.launch import start_in_thread
    from onecat.gates.tasks.lm_eval_bridge import register

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in ITEMS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path))
    register()
    local = simple_evaluate(model="onecat", model_args="pretrained=" + EMBEDDED + ",max_model_len=512,device=cpu",
                            tasks=["onecat_tiny_ll"], task_manager=tasks, log_samples=True)
    state = ServerState.create(ServeConfig(model=EMBEDDED, served_model_name=["smollm2"], max_model_len=512,
                                           max_num_seqs=4, device="cpu"))
    srv = start_in_thread(state)
    try:
        remote = simple_evaluate(model="local-completions",
                                 model_args={"model": "smollm2", "base_url": f"{srv.url}/v1/completions",
                                             "num_concurrent": 1, "max_retries": 1},
                                 tasks=["onecat_tiny_ll"], task_manager=tasks, log_samples=True)
    finally:
        srv.server.should_exit = True
        srv.thread.join(15)
        state.close()
        state.llm.close()
    by_doc = [{s["doc_id"]: s["resps"][0][0] for s in r["samples"]["onecat_tiny_ll"]} for r in (local, remote)]
    assert by_doc[0].keys() == by_doc[1].keys() and len(by_doc[0]) == len(ITEMS)
    for doc, (lp, greedy) in by_doc[0].items():
        r_lp, r_greedy = by_doc[1][doc]
        assert float(lp) == pytest.approx(float(r_lp), abs=1e-3) and bool(greedy) == (str(r_greedy) == "True"
                                                                                       or r_greedy is True)
    assert local["results"]["onecat_tiny_ll"]["acc,none"] == remote["results"]["onecat_tiny_ll"]["acc,none"]


def test_lm_eval_gate_workload_pairs_documents_across_arms(tmp_path, monkeypatch):
    """contracts/lm_eval_cpu.yaml: an lm-eval task in both arms, one stored outcome per document and arm,
    and task_score's paired verdict."""
    import lm_eval.tasks
    from typer.testing import CliRunner

    from onecat.cli.main import app
    from onecat.results.store import Store

    class LocalTasks(lm_eval.tasks.TaskManager):
        """Indexes the contract's include_path only: lm-eval's index of its thousands of built-in task YAMLs
        (about 13 s on two cores, once per arm) holds nothing this contract's local task uses."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)  # the runner imports it from there when it runs
    db = tmp_path / "r.duckdb"
    res = CliRunner().invoke(app, ["gate", "run", "contracts/lm_eval_cpu.yaml", "--db", str(db),
                                   "--out", str(tmp_path / "reports"), "--no-progress"])
    assert res.exit_code in (0, 1), res.output[-2000:]
    assert "task_score:lm_eval" in res.output
    assert [p.name for p in (tmp_path / "reports").glob("*.md")], "no report under --out"
    with Store(db, read_only=True) as store:
        rows = store.con.execute("SELECT arm, item_id, measure FROM item_outcomes").fetchall()
    per_arm = {arm: {item for a, item, m in rows if a == arm and m == "acc"} for arm in ("baseline", "candidate")}
    assert len(per_arm["baseline"]) == 24 and per_arm["baseline"] == per_arm["candidate"]


def test_rolling_loglikelihood_over_windows_equals_one_pass(embedded_llm):
    """A text longer than the context is scored in disjoint windows (one token of context each): on a
    short context the windows' sum is close to one pass over the whole text, and exact when it fits."""
    from types import SimpleNamespace

    from onecat.gates.tasks.lm_eval_bridge import make_lm

    text = "The quick brown fox jumps over the lazy dog. " * 6
    whole = make_lm(embedded_llm).loglikelihood_rolling([SimpleNamespace(args=(text,))])[0]
    ids = [embedded_llm.tokenizer.eos_token_ids[0]] + embedded_llm.tokenizer.encode(text)
    assert whole == pytest.approx(sum(embedded_llm.score([ids])[0].logprobs), abs=1e-3)

    class Short:  # the same engine, told its context is 17 tokens: 16 predicted per window
        tokenizer = embedded_llm.tokenizer
        generate, score = embedded_llm.generate, embedded_llm.score

        def info(self):
            return {"max_model_len": 17}

    windowed = make_lm(Short()).loglikelihood_rolling([SimpleNamespace(args=(text,))])[0]
    assert len(ids) > 3 * 16 and windowed < whole  # less context per token: a lower likelihood
