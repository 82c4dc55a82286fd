"""Hostile contracts: each is refused by `contract check` and `gate run` with exit 2, a message that
says what is wrong and how to fix it, within seconds, and never with a traceback."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from onecat.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
ONECAT = Path(sys.executable).with_name("onecat")

BASE = """\
name: hostile
model: {source: "embedded:smollm2-135m-instruct"}
sampling: {temperature: 0.0, top_p: 1.0, top_k: 0, max_tokens: 16}
seeds: [0, 1]
execution: {interleave: true}
arms:
  candidate:
    engine: {kv_cache_dtype: fp8_e5m2}
workloads:
  - {kind: decode_throughput, input_len: 32, output_len: 8, batch_sizes: [1, 2], repeats: 2}
  - {kind: ppl, dataset: wikitext2, segments: 2, segment_len: 64}
  - {kind: gsm8k, dataset: gsm8k_sample, subset: {first: 5}}
gates:
  - {check: ppl_delta, workload: ppl, max_relative: 0.01}
  - {check: speedup, workload: decode_throughput, min_ratio: 1.0}
"""


def sub(old: str, new: str, text: str = BASE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""
ACCEPTANCE_GATE = "  - {check: acceptance_min, workload: decode_throughput, min_length: 1.5, bootstrap: 1000000000}\n"
ALIAS_HINT = "anchors and aliases are not allowed"
LIMIT_HINT = "above the limit"
WHOLE_HINT = "whole number"
BOOL_HINT = "true/false is not a number"
FINITE_HINT = "not a finite number"

# (id, file content, fragments the message must contain)
CASES = [
    ("alias-bomb", BILLION_LAUGHS, [ALIAS_HINT, "write the value out"]),
    ("alias-bomb-in-contract", BASE + "description: &x [a, b]\nx: *x\n", [ALIAS_HINT]),
    ("alias-simple", sub("seeds: [0, 1]", "seeds: &s [0, 1]") + "x: *s\n", [ALIAS_HINT]),
    ("anchor-only", sub("seeds: [0, 1]", "seeds: &s [0, 1]"), [ALIAS_HINT]),
    ("merge-key", sub("sampling: {", "sampling: {<<: {max_tokens: 4}, "), ["merge key"]),
    ("latin-1", sub("name: hostile", "name: hostile\ndescription: caf\xe9").encode("latin-1"),
     ["not utf-8", "byte 0xe9", "line 2"]),
    ("binary", bytes(range(256)) * 4, ["not utf-8", "byte 0x80"]),
    ("inf-float", sub("temperature: 0.0", "temperature: .inf"), [FINITE_HINT, ".inf"]),
    ("nan-float", sub("max_relative: 0.01", "max_relative: .nan"), [FINITE_HINT]),
    ("overflowing-float", sub("min_ratio: 1.0", "min_ratio: 1.0e999"), [FINITE_HINT]),
    ("inf-in-options", sub("kv_cache_dtype: fp8_e5m2", "kv_cache_dtype: fp8_e5m2, options: {x: -.inf}"),
     [FINITE_HINT]),
    ("5000-digit-int", sub("seeds: [0, 1]", "seeds: [" + "9" * 5000 + "]"), ["too large", "5000 digits"]),
    ("int-beyond-64-bit", sub("seeds: [0, 1]", f"seeds: [{2 ** 63}]"), ["64 bits"]),
    ("20000-brackets", sub("name: hostile", "name: hostile\ndescription: " + "[" * 20000), ["nested more than"]),
    ("deep-block-nesting", sub("name: hostile", "name: hostile\nengine:\n  options:\n" + "".join(
        "  " * (i + 2) + f"k{i}:\n" for i in range(60)) + "  " * 62 + "v: 1"), ["nested more than"]),
    ("oversized-file", BASE + ("# padding\n" * 120_000), ["larger than", "bytes"]),
    ("too-many-values", sub("seeds: [0, 1]", "seeds: [" + ",".join(["0"] * 60_000) + "]"), ["more than 50000 values"]),
    ("input_len-1e8", sub("input_len: 32", "input_len: 1e8"), [WHOLE_HINT, "100000000"]),
    ("input_len-digits", sub("input_len: 32", "input_len: 100000000"), [LIMIT_HINT, "limits: {tokens:"]),
    ("repeats-1e9", sub("repeats: 2", "repeats: 1000000000"), [LIMIT_HINT, "repeats"]),
    ("segments-1e9", sub("segments: 2", "segments: 1e9"), [WHOLE_HINT]),
    ("segments-digits", sub("segments: 2", "segments: 1000000000"), [LIMIT_HINT, "segments"]),
    ("batch-size-million", sub("batch_sizes: [1, 2]", "batch_sizes: [1, 1000000]"), [LIMIT_HINT, "batch_sizes[1]"]),
    ("batch-tokens", sub("input_len: 32", "input_len: 1048576", sub("batch_sizes: [1, 2]", "batch_sizes: [4096]")),
     [LIMIT_HINT, "batch_tokens"]),
    ("seed-1e41", sub("seeds: [0, 1]", "seeds: [1e41]"), [WHOLE_HINT]),
    ("seed-2**63-1-is-fine-but-2**63-is-not", sub("seeds: [0, 1]", f"seeds: [0, {2 ** 63}]"), ["64 bits"]),
    ("subset-seed-negative", sub("subset: {first: 5}", "subset: {sample: 5, seed: -1}"), ["seed"]),
    ("max_tokens-true", sub("max_tokens: 16", "max_tokens: true"), [BOOL_HINT]),
    ("input_len-true", sub("input_len: 32", "input_len: true"), [BOOL_HINT]),
    ("subset-first-true", sub("subset: {first: 5}", "subset: {first: true}"), [BOOL_HINT]),
    ("interleave-1", sub("interleave: true", "interleave: 1"), ["true or false"]),
    ("segments-8.0", sub("segments: 2", "segments: 8.0"), [WHOLE_HINT, "8"]),
    ("max_tokens-1e18", sub("max_tokens: 16", "max_tokens: 1e18"), [WHOLE_HINT]),
    ("max_tokens-10**18", sub("max_tokens: 16", "max_tokens: 1000000000000000000"), [LIMIT_HINT, "tokens"]),
    ("max_tokens-base-60", sub("max_tokens: 16", "max_tokens: 1:30"), ["base 60"]),
    ("max_tokens-octal", sub("max_tokens: 16", "max_tokens: 010"), ["leading zero"]),
    ("empty-stop-string", sub("max_tokens: 16", "max_tokens: 16, stop: ['', '\\n\\n']"), ["empty"]),
    ("top_p-under-greedy", sub("top_p: 1.0", "top_p: 0.9"), ["no effect", "temperature"]),
    ("top_k-under-greedy", sub("top_k: 0", "top_k: 20"), ["no effect", "temperature"]),
    ("reasoning-effort-while-off", sub("max_tokens: 16", "max_tokens: 16, reasoning: {effort: high}"),
     ["enabled: true"]),
    ("ngram-with-drafter-model", sub("engine: {kv_cache_dtype: fp8_e5m2}",
                                     "speculative: {method: ngram, num_speculative_tokens: 4, model: x/y}"),
     ["ngram", "drafter"]),
    ("prompt-lookup-on-dflash", sub("engine: {kv_cache_dtype: fp8_e5m2}",
                                    "speculative: {method: dflash, model: x/y, num_speculative_tokens: 4, "
                                    "prompt_lookup_max: 3}"), ["prompt_lookup_max", "ngram"]),
    ("prompt-lookup-min-above-max", sub("engine: {kv_cache_dtype: fp8_e5m2}",
                                        "speculative: {method: ngram, num_speculative_tokens: 4, "
                                        "prompt_lookup_min: 5, prompt_lookup_max: 2}"), ["prompt_lookup_min"]),
    ("max-spec-tokens-without-adaptive", sub("engine: {kv_cache_dtype: fp8_e5m2}",
                                             "speculative: {method: ngram, num_speculative_tokens: 4, "
                                             "max_speculative_tokens: 16}"), ["adaptive"]),
    ("bootstrap-1e9", BASE + ACCEPTANCE_GATE, [LIMIT_HINT, "resamples"]),
    ("20000-seeds", sub("seeds: [0, 1]", "seeds: [" + ", ".join(map(str, range(20000))) + "]"),
     [LIMIT_HINT, "list_items"]),
    ("unknown-limit-name", BASE + "limits: {tokns: 5}\n", ["unknown key 'tokns'", "tokens"]),
    ("limit-override-not-an-int", BASE + "limits: {tokens: true}\n", [BOOL_HINT]),
]


def _write(tmp_path: Path, content: str | bytes) -> Path:
    p = tmp_path / "hostile.yaml"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return p


@contextmanager
def deadline(seconds: float):
    """Turn a hang into a TimeoutError inside the command (the CLI runner then reports it)."""
    def fire(signum, frame):
        raise TimeoutError(f"still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _invoke(args: list[str], seconds: float = 10.0):
    t0 = time.perf_counter()
    with deadline(seconds):
        result = CliRunner().invoke(app, args)
    return result, time.perf_counter() - t0


def _assert_refused(result, wall: float, fragments: list[str]) -> None:
    out = " ".join(result.output.split())
    assert not isinstance(result.exception, TimeoutError), f"hung: {result.exception}"
    assert result.exit_code == 2, (result.exit_code, repr(result.exception), out[-2000:])
    assert "Traceback" not in out
    for fragment in fragments:
        assert fragment.lower() in out.lower(), (fragment, out[-2000:])
    assert "hostile.yaml" in out
    assert wall < 8.0, wall


def test_base_contract_is_valid(tmp_path):
    result, _ = _invoke(["contract", "check", str(_write(tmp_path, BASE))])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("content,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_contract_check_refuses(tmp_path, content, fragments):
    result, wall = _invoke(["contract", "check", str(_write(tmp_path, content))])
    _assert_refused(result, wall, fragments)


@pytest.mark.parametrize("content,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gate_run_refuses_before_opening_anything(tmp_path, content, fragments):
    db = tmp_path / "r.duckdb"
    result, wall = _invoke(["gate", "run", str(_write(tmp_path, content)), "--db", str(db), "--no-progress"])
    _assert_refused(result, wall, fragments)
    assert not db.exists()


def _limit_as(nbytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


@pytest.mark.parametrize("command", [["contract", "check"], ["gate", "run"]])
def test_alias_bomb_through_the_installed_command(tmp_path, command):
    """The real entry point, in its own process (memory-capped and killed if it hangs)."""
    path = _write(tmp_path, BILLION_LAUGHS)
    extra = ["--db", str(tmp_path / "r.duckdb"), "--no-progress"] if command[0] == "gate" else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([str(ONECAT), *command, str(path), *extra], capture_output=True, text=True,
                              timeout=30, preexec_fn=_limit_as(6 << 30), cwd=tmp_path,
                              env={**os.environ, "COLUMNS": "200"})
    except subprocess.TimeoutExpired:
        pytest.fail("the alias bomb hung the command")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and ALIAS_HINT in " ".join(proc.stderr.split())
    assert time.perf_counter() - t0 < 25


def test_explicit_limits_block_raises_a_bound(tmp_path):
    big = sub("input_len: 32", "input_len: 2000000")
    refused, _ = _invoke(["contract", "check", str(_write(tmp_path, big))])
    assert refused.exit_code == 2 and "limits: {tokens: 2000000}" in " ".join(refused.output.split())
    allowed, _ = _invoke(["contract", "check", str(_write(tmp_path, big + "limits: {tokens: 2000000}\n"))])
    assert allowed.exit_code == 0, allowed.output


def test_harmless_spellings_still_validate(tmp_path):
    """UTF-8 with a BOM, non-ASCII text, exponent floats and integers where floats are expected."""
    text = sub("name: hostile", "\ufeffname: hostile\ndescription: café ☕ — ok") \
        .replace("max_relative: 0.01", "max_relative: 1e-2").replace("min_ratio: 1.0", "min_ratio: 1")
    result, _ = _invoke(["contract", "check", str(_write(tmp_path, text))])
    assert result.exit_code == 0, result.output
    from onecat.gates.contract import load_contract

    c = load_contract(tmp_path / "hostile.yaml")
    assert c.gates[0].max_relative == 0.01 and c.description.startswith("café")
    assert "limits" not in c.canonical_json()  # no block: fingerprints of existing contracts are unchanged
