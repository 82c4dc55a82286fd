"""decode_throughput: fixed input/output lengths and batch sizes, warm-up excluded, A/B/A repeats.

Metrics per (batch size, repeat): decode_tok_s (tokens after the first, over the time from the first
first-token to the last finish; target-only unless the arm speculates), output_tok_s, prefill_tok_s,
ttft_mean_s, tpot_mean_s, wall_s. Requests run with ignore_eos, so they do not count for natural stop.
"""
from typing import Literal

from onecat.gates.registry import register_runner
from onecat.gates.runners._throughput import ThroughputRunner, ThroughputWorkload


@register_runner("decode_throughput")
class DecodeThroughput(ThroughputRunner):
    class Workload(ThroughputWorkload):
        kind: Literal["decode_throughput"] = "decode_throughput"
