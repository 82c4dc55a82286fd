"""The soak benchmark (benchmarks/soak_cpu.py): its malformed requests, how answers are counted, and a
few seconds of the real script against `onecat serve` on the embedded model."""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_fixtures import MAX_MODEL_LEN, MODEL_NAME, live_server, tiny_chat_dir, tiny_state  # noqa: F401

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from soak_record import Verdicts, summarise_windows, totals  # noqa: E402
from soak_traffic import Malformed, Outcome, answered_as_expected, send  # noqa: E402

TARGETS = {"no_5xx", "no_lost_answers", "malformed_4xx", "rss_growth", "kv_blocks_free", "ttft_p99_drift"}


def test_every_malformed_case_gets_an_openai_4xx_from_the_server(tiny_chat_dir):  # noqa: F811
    """Each malformed request the soak sends is answered 4xx with the OpenAI error body (the unknown-field
    probe 200), as the soak counts it."""
    cases = Malformed(MODEL_NAME, MAX_MODEL_LEN).cases
    assert {c.kind for c in cases} >= {"malformed:bad_json", "malformed:negative_max_tokens",
                                       "malformed:over_max_model_len", "malformed:wrong_type", "unknown_field"}

    async def run(url: str) -> list[Outcome]:
        async with httpx.AsyncClient(base_url=url) as client:
            return [await send(client, plan, time.monotonic(), 60) for plan in cases]

    with tiny_state(tiny_chat_dir) as state, live_server(state) as srv:
        outs = asyncio.run(run(srv.url))
    for plan, out in zip(cases, outs):
        assert answered_as_expected(out), (plan.kind, plan.path, out.status, out.error)
        assert out.status_key == ("200" if plan.kind == "unknown_field" else str(out.status))
        assert plan.kind == "unknown_field" or 400 <= out.status < 500


def _outcome(kind="unique", expect="ok", status=200, finished=1.0, **kw) -> Outcome:
    return Outcome(kind, "/v1/completions", kw.pop("stream", False), expect, started_s=finished - 0.5,
                   finished_s=finished, status=status, **kw)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"rss_baseline_minute": 5.0, "tensor_parallel_size": 1, "fault_deadline_s": 10.0,
                                 **kw})


def test_verdicts_count_5xx_stream_errors_and_wrong_malformed_answers():
    good_stream = _outcome(stream=True, ok=True, ttft_s=0.2, tpot_s=0.05, completion_tokens=20)
    late_stream = _outcome(stream=True, ok=True, ttft_s=0.5, tpot_s=0.05, completion_tokens=20, finished=11.0)
    outs = [good_stream, late_stream,
            _outcome(stream=True, status=200, error_code=500, finished=2.0),  # an error event inside a 200 stream
            _outcome(status=503, error_code=503, openai_error_body=True, finished=3.0),
            _outcome(status=500, error_code=500, openai_error_body=True, fault=True),  # deliberate: not counted
            _outcome("malformed:bad_json", "4xx", 400, error_code=400, openai_error_body=True),
            _outcome("malformed:wrong_type", "4xx", 500, error_code=500, openai_error_body=True),
            _outcome("malformed:negative_max_tokens", "4xx", 400, openai_error_body=False),  # not the OpenAI shape
            _outcome(status=0, error="ConnectError")]
    boundaries = [{"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0},
                  {"vllm:prefix_cache_hits_total": 64.0, "vllm:prefix_cache_queries_total": 128.0},
                  {"vllm:prefix_cache_hits_total": 16.0, "vllm:prefix_cache_queries_total": 32.0}]  # restarted
    windows = summarise_windows(outs, boundaries, 10.0, 2)
    assert [w["requests"] for w in windows] == [8, 1] and windows[0]["fault_requests"] == 1
    assert windows[0]["by_status"]["stream_error_500"] == 1 and windows[0]["by_status"]["no_answer"] == 1
    assert windows[0]["prefix_cache"]["hit_rate"] == 0.5 and windows[1]["prefix_cache"]["hit_tokens"] == 16.0
    end = {"kv_blocks_free": 10.0, "kv_blocks_total": 12.0, "running": 0.0, "waiting": 0.0}
    samples = [{"t_s": t, "generation": 0, "rss_mib": r} for t, r in ((0, 100.0), (5, 100.0), (20, 106.0))]
    v = Verdicts(outs, samples, windows, end, [], [0.0], _args())
    t = v.targets
    assert set(t) == TARGETS and not v.passed
    assert (t["no_5xx"]["verdict"], t["no_5xx"]["value"]) == ("FAIL", 3)  # a malformed request answered 500 too
    assert (t["no_lost_answers"]["verdict"], t["no_lost_answers"]["value"]) == ("FAIL", 1)
    assert t["malformed_4xx"]["verdict"] == "FAIL" and t["malformed_4xx"]["value"] == {"checked": 3, "wrong": 2}
    assert t["rss_growth"]["verdict"] == "FAIL" and t["rss_growth"]["value"] == pytest.approx(0.06)
    assert t["kv_blocks_free"]["verdict"] == "FAIL"
    assert t["ttft_p99_drift"]["verdict"] == "FAIL" and t["ttft_p99_drift"]["value"] == pytest.approx(2.5)
    assert totals(outs)["malformed_answered_4xx"] == 1 and totals(outs)["num_5xx"] == 3

    clean = [good_stream, late_stream, _outcome("malformed:bad_json", "4xx", 400, error_code=400,
                                                openai_error_body=True)]
    late_stream.ttft_s = 0.25
    samples[-1]["rss_mib"] = 104.0
    end["kv_blocks_free"] = 12.0
    v = Verdicts(clean, samples, summarise_windows(clean, boundaries, 10.0, 2), end, [], [0.0], _args())
    assert v.passed, v.targets


@pytest.mark.slow  # starts the embedded model's server: ~40 s on two cores
def test_soak_script_writes_a_well_formed_record(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(BENCH / "soak_cpu.py"), "--minutes", "0.2", "--window-minutes", "0.1",
                           "--clients", "2", "--max-tokens", "8", "16", "--malformed-interval-s", "1",
                           "--sample-seconds", "2", "--out", str(out), "--log-dir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=400, cwd=BENCH.parent)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "soak_cpu" and rec["started_at"] and rec["git"]
    assert rec["machine"]["cores"] >= 1 and rec["machine"]["cpu_model"]
    assert rec["settings"]["speculative_config"]["method"] == "ngram" and "--enable-prefix-caching" in \
        rec["settings"]["server_argv"]
    assert len(rec["windows"]) == 2 and all(w["ttft_s"].keys() >= {"p50", "p99"} for w in rec["windows"])
    assert rec["samples"] and all(s["rss_mib"] > 0 for s in rec["samples"])
    assert set(rec["targets"]) == TARGETS
    assert all(t["verdict"] in ("PASS", "FAIL") for t in rec["targets"].values())
    assert rec["passed"] == (proc.returncode == 0) == all(t["verdict"] == "PASS" for t in rec["targets"].values())
    # a malformed request is counted as a 4xx, and nothing the server did was a 5xx or leaked KV blocks
    assert rec["totals"]["malformed_answered_4xx"] >= 1
    assert sum(v for k, v in rec["totals"]["by_status"].items() if k.startswith("4")) >= 1
    for name in ("no_5xx", "no_lost_answers", "malformed_4xx", "kv_blocks_free"):
        assert rec["targets"][name]["verdict"] == "PASS", rec["targets"][name]
