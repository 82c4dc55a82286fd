"""A small deterministic engine for harness tests (registered as backend "fake"; tests only).

Tokens depend only on (prompt, per-request seed), so batch size and reruns never change them.
kv_cache_dtype fp8_* perturbs scoring log-probs by a tiny amount, like a real low-precision KV cache.
Set FAKE_ENGINE_DELAY (seconds per request) and FAKE_ENGINE_LOG (a file that gets one line per
request) to slow it down and to count calls from another process.
"""
from __future__ import annotations

import hashlib

import os
import time

from onecat.engine.outputs import RequestOutput, RequestTimings, ScoreOutput
from onecat.gates.engines.base import EngineAdapter
from onecat.gates.registry import register_engine

EOS = 2


class FakeTokenizer:
    eos_token_ids = [EOS]

    def encode(self, text: str) -> list[int]:
        return [300 + (ord(c) % 500) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + (i % 26)) if i != EOS else "" for i in ids)


def _h(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


@register_engine("fake")
class FakeEngine(EngineAdapter):
    opened: list = []
    refuse_arms: dict = {}  # arm name -> error text: that arm's engine refuses every request (tests set it)

    @classmethod
    def check(cls, arm):
        if arm.model.source.startswith("missing:"):
            return [f"target model: {arm.model.source} not found; looked in: nowhere (fake)"]
        return []

    @classmethod
    def open(cls, arm, seed=0):
        inst = cls(arm)
        cls.opened.append(arm.name)
        return inst

    def __init__(self, arm):
        self.arm = arm
        self.tokenizer = FakeTokenizer()
        self.vocab_size = 1000
        self.noise = 1e-4 if arm.engine.kv_cache_dtype.startswith("fp8") else 0.0
        self.delay = float(os.environ.get("FAKE_ENGINE_DELAY", "0"))
        self.log = os.environ.get("FAKE_ENGINE_LOG")

    def _tick(self, n: int, what: str) -> None:
        if self.delay:
            time.sleep(self.delay * n)
        if self.log:
            with open(self.log, "a") as fh:
                fh.write(f"{self.arm.name} {what} {n}\n")

    def _refused(self, ids: list, error: str) -> RequestOutput:
        """What an engine returns for a request it refuses: no tokens, an error, and a sub-millisecond
        wall that would look like enormous throughput if anything were derived from it."""
        t = RequestTimings(queue_s=0.0, prefill_s=1e-6, first_token_s=1e-6, decode_s=0.0, e2e_s=2e-6)
        return RequestOutput(request_id=str(_h(ids)), prompt=None, prompt_token_ids=list(ids), token_ids=[], text="",
                             finish_reason="abort", timings=t, error=error)

    def _one(self, prompt, params) -> RequestOutput:
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        if self.arm.name in self.refuse_arms:
            return self._refused(ids, self.refuse_arms[self.arm.name])
        seed = params.seed or 0
        cap = params.max_tokens or 16
        natural = 3 + _h(ids, "len") % 12
        n = cap if params.ignore_eos else min(cap, natural)
        toks = [256 + _h(ids, seed, i) % 700 for i in range(n)]
        finish = "length" if params.ignore_eos or natural > cap else "stop"
        if finish == "stop":
            toks[-1] = EOS
        speed = 1.0 if self.arm.name == "baseline" else 1.0
        t = RequestTimings(queue_s=0.0, prefill_s=0.001 * len(ids) * speed, first_token_s=0.001 * len(ids),
                           decode_s=0.001 * n, e2e_s=0.001 * (len(ids) + n))
        return RequestOutput(request_id=str(_h(ids, seed)), prompt=None, prompt_token_ids=list(ids), token_ids=toks,
                             text=self.tokenizer.decode(toks), finish_reason=finish, timings=t)

    def generate(self, prompts, params):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self._tick(len(prompts), "generate")
        return [self._one(p, sp) for p, sp in zip(prompts, params)]

    def chat(self, conversations, params):
        return self.generate([" ".join(m["content"] for m in conv) for conv in conversations], params)

    def score(self, prompts):
        self._tick(len(prompts), "score")
        out = []
        for p in prompts:
            lp = [-(1.0 + (_h(p[:i + 1]) % 1000) / 500.0) - self.noise * (1 + (i % 3)) for i in range(len(p) - 1)]
            out.append(ScoreOutput(prompt_token_ids=list(p), logprobs=lp))
        return out

    def info(self):
        return {"engine": "fake", "device": "cpu", "kv_cache_dtype": self.arm.engine.kv_cache_dtype,
                "attention_backend": {"effective": "FAKE"}, "cuda_graph": False, "enable_prefix_caching": True}


FAKE_CONTRACT = """
name: fake-gate
model: {source: "fake:tiny"}
engine: {backend: fake}
sampling: {temperature: 0.0, max_tokens: 12}
seeds: [0, 1]
arms:
  candidate: {engine: {kv_cache_dtype: fp8_e5m2}}
datasets:
  tiny_text: {path: "%(text)s", sha256: "%(sha)s"}
workloads:
  - {kind: decode_throughput, input_len: 16, output_len: 8, batch_sizes: [1, 2], repeats: 2, warmup: 1}
  - {kind: ppl, dataset: tiny_text, segments: 6, segment_len: 32}
  - {kind: determinism, num_prompts: 3, reruns: 2}
gates:
  - {check: ppl_delta, workload: ppl, max_relative: 0.01}
  - {check: natural_stop_rate, workload: determinism, min_rate: 0.5, min_samples: 4}
  - {check: token_hash_equal, workload: determinism, compare: within_arm}
  - {check: token_hash_equal, workload: determinism, compare: arms, name: same-tokens}
  - {check: not_slower, workload: decode_throughput, metric: decode_tok_s, tolerance: 0.5, min_observations: 2,
     informative: true}
"""


def write_fake_contract(tmp_path, extra_text: str = "") -> "os.PathLike":
    text = tmp_path / "tiny.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 40) + extra_text, encoding="utf-8")
    sha = hashlib.sha256(text.read_bytes()).hexdigest()
    path = tmp_path / "fake.yaml"
    path.write_text(FAKE_CONTRACT % {"text": text, "sha": sha}, encoding="utf-8")
    return path



