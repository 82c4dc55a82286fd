"""prefill_throughput: prompt processing speed; each request generates one token.

Metrics per (batch size, repeat): prefill_tok_s (prompt tokens over the slowest time to first
token), ttft_mean_s, wall_s. Prompts are distinct random ids, so the prefix cache cannot help.
"""
from typing import Literal

from pydantic import Field

from onecat.gates.registry import register_runner
from onecat.gates.runners._throughput import ThroughputRunner, ThroughputWorkload


@register_runner("prefill_throughput")
class PrefillThroughput(ThroughputRunner):
    measure_decode = False

    class Workload(ThroughputWorkload):
        kind: Literal["prefill_throughput"] = "prefill_throughput"
        output_len: int = Field(default=1, ge=1, le=1)

    def output_len(self, workload) -> int:
        return 1
