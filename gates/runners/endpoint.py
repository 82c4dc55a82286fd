"""`endpoint` workload: load an OpenAI-compatible server the way users do and time what they see.

Arrivals are either a fixed number of concurrent clients (`concurrency`) or an open-loop process
at `request_rate` req/s whose gaps are Gamma-distributed with shape `burstiness` (1.0 = Poisson,
< 1 burstier, > 1 more regular; as in vLLM's benchmark_serving). Every request streams, so TTFT,
inter-token latency (ITL), TPOT and end-to-end latency are measured on the client. Goodput counts
the requests that meet every given SLO. Speculative-decoding acceptance comes from the difference
of the server's /metrics before and after the measured requests (not from server lifetime totals).

The engine may be an endpoint adapter (`openai`, `onecat_serve`: anything with `base_url`) or the
in-process onecat engine, which is then served on a loopback port for the duration of the unit.

    - {kind: endpoint, api: chat, input_len: 256, output_len: 128, num_requests: 64, concurrency: 16,
       warmup_requests: 2, repeats: 3, slo: {ttft_s: 2.0, tpot_s: 0.2}}
    - {kind: endpoint, name: poisson, request_rate: 4.0, burstiness: 0.5, num_requests: 100, max_duration_s: 120}
    - {kind: endpoint, name: mixed, api: completions, input_len: 16, input_len_max: 4096, request_rate: 4.0,
       warmup_requests: 0, num_requests: 200, output_len: 8}   # TTFT with prompt lengths never seen before
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from contextlib import contextmanager
from typing import Any, Literal, Optional

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from onecat.engine.server.sampling_body import body_fields
from onecat.gates.contract import SamplingSpec, WorkloadBase
from onecat.gates.engines.base import Engine
from onecat.gates.engines.openai_client import metrics_delta, parse_prometheus, spec_acceptance, stream_completion
from onecat.gates.registry import register_runner
from onecat.gates.runners.base import Metric, RequestRecord, Runner, Sink, Unit, to_sampling_params

WORDS = ("time river number light house story music water garden market winter letter mountain window bridge "
         "forest engine signal paper morning harbor silver question village machine").split()


class Slo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ttft_s: Optional[float] = Field(default=None, gt=0)
    tpot_s: Optional[float] = Field(default=None, gt=0)
    e2e_s: Optional[float] = Field(default=None, gt=0)


class EndpointWorkload(WorkloadBase):
    kind: Literal["endpoint"] = "endpoint"
    api: Literal["chat", "completions"] = "chat"
    input_len: int = Field(default=128, ge=1)  # approximate prompt length in words (about tokens)
    # set: each request's length is drawn log-uniformly from [input_len, input_len_max] (real traffic mixes
    # lengths; a server that compiles or plans per new length shows it in its TTFT tail)
    input_len_max: Optional[int] = Field(default=None, ge=1)
    output_len: int = Field(default=64, ge=1)  # max_tokens
    ignore_eos: bool = True  # fixed output lengths, comparable across engines
    shared_prefix_len: int = Field(default=0, ge=0)  # words shared by every prompt (prefix-cache workloads)
    num_requests: int = Field(default=32, ge=1)
    concurrency: Optional[int] = Field(default=None, ge=1)
    request_rate: Optional[float] = Field(default=None, gt=0)
    burstiness: float = Field(default=1.0, gt=0)
    warmup_requests: int = Field(default=1, ge=0)
    max_duration_s: Optional[float] = Field(default=None, gt=0)  # stop sending new requests after this
    repeats: int = Field(default=1, ge=1)
    request_timeout_s: float = Field(default=600.0, gt=0)
    slo: Slo = Field(default_factory=Slo)

    @model_validator(mode="after")
    def _one_arrival_mode(self) -> "EndpointWorkload":
        if self.concurrency is not None and self.request_rate is not None:
            raise ValueError("give either concurrency (closed loop) or request_rate (open loop), not both")
        if self.input_len_max is not None and self.input_len_max <= self.input_len:
            raise ValueError(f"input_len_max {self.input_len_max} must be above input_len {self.input_len} (the "
                             "shortest prompt); remove it for prompts of one length")
        return self


def prompt_lengths(n: int, input_len: int, input_len_max: int | None, seed: int) -> list[int]:
    """Each request's prompt length in words: input_len, or log-uniform in [input_len, input_len_max]."""
    if input_len_max is None:
        return [input_len] * n
    rng = np.random.default_rng(seed + 104729)
    return np.rint(np.exp(rng.uniform(np.log(input_len), np.log(input_len_max), size=n))).astype(int).tolist()


def make_prompts(n: int, input_len: int, shared_prefix_len: int, seed: int,
                 input_len_max: int | None = None) -> list[str]:
    """Deterministic distinct prompts of about `input_len` words (or lengths drawn up to `input_len_max`);
    the same for every engine and arm."""
    rng = np.random.default_rng(seed)
    prefix = " ".join(WORDS[i % len(WORDS)] for i in rng.integers(0, len(WORDS), shared_prefix_len))
    out = []
    for i, length in enumerate(prompt_lengths(n, input_len, input_len_max, seed)):
        body_len = max(length - shared_prefix_len, 1)
        words = " ".join(WORDS[k] for k in rng.integers(0, len(WORDS), body_len))
        out.append((prefix + " " if prefix else "") + f"[{i}] " + words)
    return out


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gamma(shape=burstiness, scale=1/(rate*burstiness)) gaps: mean 1/rate; Poisson at burstiness 1."""
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n).tolist()


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[int, float]:
    return {q: float(np.percentile(values, q)) for q in qs} if values else {}


@contextmanager
def _endpoint_of(engine: Engine):
    """(base_url, headers, model, adjust_body) for an endpoint adapter, or a loopback server around
    the in-process onecat engine for the duration of the block."""
    if getattr(engine, "base_url", None):
        yield (engine.base_url, getattr(engine, "headers", {}), getattr(engine, "model", None),
               getattr(engine, "adjust_body", lambda body: body))
        return
    llm = getattr(engine, "llm", None)
    if llm is None:
        raise TypeError(f"the endpoint workload needs an endpoint backend (openai, onecat_serve) or the onecat "
                        f"engine; got {type(engine).__name__}")
    from onecat.engine.server.app import ServeConfig, ServerState
    from onecat.engine.server.launch import start_in_thread

    name = "onecat"
    state = ServerState(llm, ServeConfig(model=name, max_queue_len=4096))
    srv = start_in_thread(state)
    try:
        yield srv.url, {}, name, lambda body: body
    finally:
        srv.stop()


@register_runner("endpoint")
class EndpointRunner(Runner):
    Workload = EndpointWorkload

    def plan(self, workload: EndpointWorkload, sampling: SamplingSpec, seeds: list[int]) -> list[Unit]:
        return [Unit(key=f"seed={s}/rep={r}", seed=s, repeat=r, interleave=True, series=f"seed={s}",
                     size=workload.num_requests) for s in seeds for r in range(workload.repeats)]

    def min_request_tokens(self, workload: EndpointWorkload, sampling: SamplingSpec) -> int:
        # every prompt word is at least one token, so input_len words is a lower bound on the prompt
        return max(workload.input_len_max or workload.input_len, workload.shared_prefix_len) + workload.output_len

    _adjust = staticmethod(lambda body: body)

    def _body(self, workload: EndpointWorkload, sampling: SamplingSpec, model: str | None, prompt: str,
              seed: int) -> dict:
        params = to_sampling_params(sampling, seed=seed, max_tokens=workload.output_len, ignore_eos=workload.ignore_eos)
        body: dict[str, Any] = body_fields(params)
        if model:
            body["model"] = model
        if workload.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return self._adjust(body)

    def run_unit(self, engine: Engine, workload: EndpointWorkload, sampling: SamplingSpec, unit: Unit,
                 sink: Sink) -> None:
        seed = unit.seed or 0
        prompts = make_prompts(workload.num_requests, workload.input_len, workload.shared_prefix_len, seed,
                               workload.input_len_max)
        warm = make_prompts(workload.warmup_requests, workload.input_len, 0, seed + 7919)
        path = "/v1/chat/completions" if workload.api == "chat" else "/v1/completions"
        with _endpoint_of(engine) as (url, headers, model, adjust):
            self._adjust = adjust
            async def go():
                limit = (workload.concurrency or workload.num_requests) + 8
                async with httpx.AsyncClient(base_url=url, headers=headers,
                                             limits=httpx.Limits(max_connections=limit)) as client:
                    for i, p in enumerate(warm):  # un-timed, one at a time
                        await stream_completion(client, path, self._body(workload, sampling, model, p, seed + i),
                                                chat=workload.api == "chat", timeout_s=workload.request_timeout_s)
                    before = await _scrape(client)
                    t0 = time.perf_counter()
                    results = await self._drive(client, path, workload, sampling, model, prompts, seed)
                    wall = time.perf_counter() - t0
                    after = await _scrape(client)
                    return results, wall, metrics_delta(before, after) if before and after else {}
            results, wall, delta = asyncio.run(go())
        self._store(workload, unit, sink, prompts, results, wall, delta)

    async def _drive(self, client, path, workload, sampling, model, prompts, seed) -> list:
        chat = workload.api == "chat"
        deadline = time.perf_counter() + workload.max_duration_s if workload.max_duration_s else None
        results: list = [None] * len(prompts)
        sent_at: list = [None] * len(prompts)
        t0 = time.perf_counter()

        async def one(i: int):
            sent_at[i] = time.perf_counter() - t0
            results[i] = await stream_completion(client, path, self._body(workload, sampling, model, prompts[i],
                                                                         seed * 1_000_003 + i),
                                                 chat=chat, timeout_s=workload.request_timeout_s)

        if workload.request_rate is None:
            sem = asyncio.Semaphore(workload.concurrency or len(prompts))

            async def gated(i: int):
                async with sem:
                    if deadline is None or time.perf_counter() < deadline:
                        await one(i)
            await asyncio.gather(*(gated(i) for i in range(len(prompts))))
        else:
            gaps = arrival_gaps(len(prompts), workload.request_rate, workload.burstiness, seed)
            tasks = []
            for i, gap in enumerate(gaps):
                if i:
                    await asyncio.sleep(gap)
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        return [(i, sent_at[i], r) for i, r in enumerate(results) if r is not None]

    def _store(self, workload, unit, sink, prompts, results, wall, delta) -> None:
        slo = workload.slo
        ttft, tpot, itl, e2e, good, n_out = [], [], [], [], 0, 0
        for i, sent, r in results:
            n = r.completion_tokens if r.completion_tokens is not None else r.num_chunks
            n_out += n if r.ok else 0
            meets = r.ok and (slo.ttft_s is None or (r.ttft_s is not None and r.ttft_s <= slo.ttft_s)) \
                and (slo.tpot_s is None or r.tpot_s is None or r.tpot_s <= slo.tpot_s) \
                and (slo.e2e_s is None or (r.e2e_s is not None and r.e2e_s <= slo.e2e_s))
            good += bool(meets)
            if r.ok:
                if r.ttft_s is not None:
                    ttft.append(r.ttft_s)
                if r.tpot_s is not None:
                    tpot.append(r.tpot_s)
                itl.extend(r.chunk_gaps_s)
                e2e.append(r.e2e_s)
            text_sha = hashlib.sha256(r.text.encode("utf-8")).hexdigest()
            tok_sha = hashlib.sha256(repr(r.token_ids).encode()).hexdigest() if r.token_ids else None
            sink.request(RequestRecord(
                request_key=f"{unit.key}/req={i}", determinism_group=f"seed={unit.seed}/req={i}", seed=unit.seed,
                repeat=unit.repeat, batch_size=workload.concurrency, prompt_sha256=hashlib.sha256(prompts[i].encode()).hexdigest(),
                num_prompt_tokens=r.prompt_tokens or 0, num_completion_tokens=n, ttft_s=r.ttft_s,
                prefill_s=r.ttft_s, decode_s=(r.e2e_s - r.ttft_s) if r.ttft_s is not None and r.e2e_s else None,
                e2e_s=r.e2e_s, tpot_s=r.tpot_s, finish_reason=r.finish_reason if r.ok else "error",
                natural_stop_eligible=not workload.ignore_eos,
                natural_stop=(r.finish_reason == "stop") if r.ok and not workload.ignore_eos else None,
                capped=(r.finish_reason == "length") if r.ok else None, text_sha256=text_sha, token_sha256=tok_sha,
                error=r.error, extra={"status": r.status, "sent_at_s": sent, "num_chunks": r.num_chunks,
                                      "itl_p50_s": float(np.median(r.chunk_gaps_s)) if r.chunk_gaps_s else None,
                                      "meets_slo": bool(meets)}))
        sink.advance(len(prompts))
        key, rep = "endpoint", unit.repeat

        def m(name: str, value: Optional[float], unit_name: str, **tags) -> None:
            if value is not None:
                sink.metric(Metric(name=name, value=float(value), unit=unit_name, key=key, repeat=rep, seed=unit.seed,
                                   tags=tags))

        done = len(results)
        succeeded = sum(1 for _, _, r in results if r.ok)
        m("wall_s", wall, "s")
        m("num_requests", done, "req")
        m("num_failed", done - succeeded, "req")
        m("request_throughput", succeeded / max(wall, 1e-9), "req/s")  # a failed request is not throughput
        m("output_tok_s", n_out / max(wall, 1e-9), "tok/s")
        m("goodput", good / max(wall, 1e-9), "req/s", slo=slo.model_dump(exclude_none=True))
        m("slo_attainment", good / done if done else None, "fraction")
        for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
            if values:
                m(f"{name}_mean_s", float(np.mean(values)), "s")
                for q, v in percentiles(values).items():
                    m(f"{name}_p{q}_s", v, "s")
        spec = spec_acceptance(delta) if delta else None
        if spec and spec["num_drafts"]:
            m("spec_num_drafts", spec["num_drafts"], "count")
            m("spec_num_draft_tokens", spec["num_draft_tokens"], "tok")
            m("spec_num_accepted_tokens", spec["num_accepted_tokens"], "tok")
            m("spec_acceptance_rate", spec["acceptance_rate"], "fraction")
            m("spec_mean_acceptance_length", spec["mean_acceptance_length"], "tok")
            for pos, v in enumerate(spec["accepted_per_position"]):
                sink.metric(Metric(name="spec_accepted_per_position", value=v, unit="tok", key=key, repeat=rep,
                                   seed=unit.seed, tags={"position": pos}))
        if delta:
            m("server_prefix_cache_hit_rate",
              delta.get("vllm:prefix_cache_hits_total", 0) / delta["vllm:prefix_cache_queries_total"]
              if delta.get("vllm:prefix_cache_queries_total") else None, "fraction")
            m("server_preemptions", delta.get("vllm:num_preemptions_total"), "count")


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    try:
        r = await client.get("/metrics", timeout=10)
        return parse_prometheus(r.text) if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}
