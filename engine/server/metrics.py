"""Prometheus metrics under vLLM's names and meanings, so vLLM dashboards and scrapers work as-is.

Per-request histograms are observed when a request finishes (and inter-token gaps as tokens
arrive); engine totals (tokens, preemptions, prefix-cache lookups) and gauges (running, waiting,
KV usage) are read from the engine at scrape time, so they never drift from the engine's own
counters. Everything lives in the server's own CollectorRegistry (several servers per process in
tests). Names:

    vllm:time_to_first_token_seconds            histogram, arrival -> first output token
    vllm:inter_token_latency_seconds            histogram, gap between successive token arrivals
    vllm:time_per_output_token_seconds          histogram, same gaps (vLLM's older name)
    vllm:request_time_per_output_token_seconds  histogram, per request: decode time / (tokens - 1)
    vllm:e2e_request_latency_seconds            histogram, arrival -> finish
    vllm:request_queue_time_seconds             histogram, arrival -> first scheduled
    vllm:request_prefill_time_seconds / vllm:request_decode_time_seconds
    vllm:request_prompt_tokens / vllm:request_generation_tokens   histograms per finished request
    vllm:request_success_total{finished_reason}
    vllm:prompt_tokens_total, vllm:generation_tokens_total        engine counters
    vllm:num_preemptions_total, vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total
    vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc   gauges
    vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
    vllm:spec_decode_num_accepted_tokens_total, vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
    onecat:kv_blocks_free, onecat:kv_blocks_total   gauges (leak checks: free == total when idle)
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    def __init__(self, model_name: str, engine_getter: Any):
        disable_created_metrics()  # no `*_created` series (vLLM does not export them either)
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": "0"}
        names = list(self.labels)

        def hist(name: str, doc: str, buckets=_LATENCY) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**self.labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (arrival to first output token).")
        self.itl = hist("vllm:inter_token_latency_seconds", "Gap between successive output token arrivals.")
        self.tpot_legacy = hist("vllm:time_per_output_token_seconds", "Gap between successive output token "
                                "arrivals (older vLLM name of inter_token_latency).")
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Per request: decode time / (tokens - 1).")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = hist("vllm:request_decode_time_seconds", "First token to finish.")
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per finished request.", _TOKENS)
        self.gen_len = hist("vllm:request_generation_tokens", "Generated tokens per finished request.", _TOKENS)
        self.success = Counter("vllm:request_success", "Finished requests by reason.", names + ["finished_reason"],
                               registry=self.registry)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative drafts proposed.", names,
                                   registry=self.registry).labels(**self.labels)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens proposed.",
                                         names, registry=self.registry).labels(**self.labels)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
                                     names, registry=self.registry).labels(**self.labels)
        self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted draft tokens per draft position.", names + ["position"],
                                    registry=self.registry)
        self.registry.register(_EngineCollector(engine_getter, self.labels))

    # ---- called from the engine thread --------------------------------------------------------
    def observe_inter_token(self, gap_s: float) -> None:
        self.itl.observe(gap_s)
        self.tpot_legacy.observe(gap_s)

    def observe_engine(self, engine: Any) -> None:
        """Hook per engine step (gauges are read at scrape time; nothing to do yet)."""

    def observe_finished(self, out: Any) -> None:
        t = out.timings
        n = len(out.token_ids)
        if n:
            self.ttft.observe(t.first_token_s)
        self.e2e.observe(t.e2e_s)
        self.queue.observe(t.queue_s)
        self.prefill.observe(t.prefill_s)
        self.decode.observe(t.decode_s)
        if n > 1:
            self.tpot.observe(t.decode_s / (n - 1))
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.gen_len.observe(n)
        self.success.labels(**self.labels, finished_reason=out.finish_reason or "abort").inc()
        spec = out.spec
        if spec.num_drafts:
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted.inc(spec.num_accepted_tokens)
            for pos, k in enumerate(spec.accepted_per_position):
                if k:
                    self.spec_per_pos.labels(**self.labels, position=str(pos)).inc(k)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine-owned totals and gauges, read when scraped."""

    def __init__(self, engine_getter: Any, labels: dict[str, str]):
        self.engine_getter = engine_getter
        self.labels = labels

    def collect(self):
        eng = self.engine_getter()
        names, values = list(self.labels), list(self.labels.values())

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        if eng is None:
            return
        sched, blocks = eng.scheduler, eng.blocks
        yield counter("vllm:prompt_tokens", "Prompt tokens processed (prefill, including recompute).",
                      eng.stats.get("prompt_tokens", 0))
        yield counter("vllm:generation_tokens", "Tokens generated.", eng.stats.get("generation_tokens", 0))
        yield counter("vllm:num_preemptions", "Preemptions (by recompute).", sched.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      blocks.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", blocks.prefix_hits)
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", len(sched.running))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(sched.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", blocks.usage)
        yield gauge("onecat:kv_blocks_free", "Free KV blocks (cached-but-unreferenced blocks count as free).",
                    blocks.num_free_blocks)
        yield gauge("onecat:kv_blocks_total", "Allocatable KV blocks (block 0 is the reserved null block).",
                    blocks.num_blocks - 1)
