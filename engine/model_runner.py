"""Runs one scheduled step on the model: flatten the batch, build attention metadata, forward, logits."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.attention.selector import AttentionDispatcher
from onecat.engine.forward_context import ForwardContext, set_forward_context
from onecat.engine.scheduler import ScheduledSeq


@dataclass(slots=True)
class PromptLogprobs:
    """For a prefill chunk's positions whose next token is in the prompt: that token's logprob and, when
    the request asked for N > 0, its rank and the N likeliest tokens there."""

    values: list[float]
    tops: list[dict[int, float]] | None = None
    ranks: list[int] | None = None


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [num_sampling_rows, V]: for each sequence that reached its end this step
    sample_rows: list[int]  # index into `scheduled` of each logits row (last position only)
    prompt_logprobs: dict[int, PromptLogprobs]  # scheduled index -> the chunk's next prompt tokens' logprobs
    verify_logits: dict[int, torch.Tensor]  # scheduled index -> [num_lookahead + 1, V] for speculative verify


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, attention: AttentionDispatcher, block_size: int,
                 device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.attention = attention
        self.block_size = block_size
        self.device = device

    def _metadata(self, sched: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids, pos, slots, qsl, seq_lens, qlens = [], [], [], [0], [], []
        for s in sched:
            seq = s.seq
            start = seq.num_computed_tokens
            n = s.num_new_tokens + s.num_lookahead
            ids.extend(seq.token_ids[start:start + s.num_new_tokens])
            ids.extend(seq.draft_tokens[:s.num_lookahead])
            table = seq.block_table
            for p in range(start, start + n):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            qlens.append(n)
        max_blocks = max(len(s.seq.block_table) for s in sched)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in sched]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(qlens), max_seq_len=max(seq_lens), block_size=bs,
            query_lens_cpu=qlens, seq_lens_cpu=seq_lens, extras={})
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                meta)

    @torch.inference_mode()
    def execute(self, sched: list[ScheduledSeq]) -> StepResult:
        graphed = self._execute_graph(sched)
        if graphed is not None:
            return graphed
        input_ids, positions, meta = self._metadata(sched)
        batch1_verify = len(sched) == 1 and sched[0].num_new_tokens == 1  # one sequence's decode/verify rows
        set_forward_context(ForwardContext(meta, self.kv_caches, self.attention,
                                           self.verify_gemv_rows if batch1_verify else 1))
        try:
            hidden = self.model(input_ids, positions)
            return self._outputs(sched, meta, hidden)
        finally:
            set_forward_context(None)

    def _outputs(self, sched: list[ScheduledSeq], meta, hidden: torch.Tensor) -> StepResult:
        starts = [0, *itertools.accumulate(meta.query_lens_cpu)]  # host copy: no device sync
        sample_rows, rows = [], []
        prompt_lp: dict[int, PromptLogprobs] = {}
        verify: dict[int, torch.Tensor] = {}
        for i, s in enumerate(sched):
            seq = s.seq
            end_computed = seq.num_computed_tokens + s.num_new_tokens
            if s.num_lookahead:
                lo = starts[i] + s.num_new_tokens - 1
                verify[i] = self.model.compute_logits(hidden[lo:lo + s.num_lookahead + 1]).float()
            elif end_computed == seq.num_tokens:
                sample_rows.append(i)
                rows.append(starts[i + 1] - 1)
            if seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_lp[i] = self._prompt_logprobs(hidden[starts[i]:starts[i + 1]], seq, s.num_new_tokens)
        logits = (self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
                  if rows else hidden.new_zeros(0))
        return StepResult(logits, sample_rows, prompt_lp, verify)

    def _prompt_logprobs(self, hidden: torch.Tensor, seq, n: int) -> PromptLogprobs:
        """log p(prompt[t+1] | prompt[:t+1]) for the chunk's positions whose next token is in the prompt."""
        start = seq.num_computed_tokens
        last = min(start + n, seq.num_prompt_tokens - 1)  # positions start..last-1 predict a prompt token
        top_n = seq.params.prompt_logprobs
        if last <= start:
            return PromptLogprobs([], [] if top_n else None, [] if top_n else None)
        lp = self.model.compute_logits(hidden[:last - start]).float().log_softmax(dim=-1)
        targets = torch.tensor(seq.token_ids[start + 1:last + 1], device=lp.device)
        own = lp.gather(1, targets.unsqueeze(1))
        if not top_n:
            return PromptLogprobs(own.squeeze(1).tolist())
        ranks = (lp > own).sum(dim=1).add(1).tolist()  # 1 + tokens strictly likelier than the prompt's own
        vals, ids = lp.topk(top_n, dim=-1)
        tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        return PromptLogprobs(own.squeeze(1).tolist(), tops, ranks)

    # ---- speculative verify steps ------------------------------------------------------------------
    verify_gemv_rows = 1  # rows of a decode/verify step that may take the batch-1 GEMV

    def setup_verify(self, query_len: int, gemv: bool) -> None:
        """Verify steps run 1 + k tokens per sequence: they replay CUDA graphs too, and with the fused
        kernels on, a batch-1 verify step's rows go through the batch-1 GEMV, which computes each row as
        a batch-1 decode step does. Greedy speculation then gives target-only's tokens exactly at batch 1
        (the library GEMM sums 1 + k rows in another order than 1, and near-ties flip)."""
        self.verify_gemv_rows = query_len if gemv else 1
        if self.graphs is not None:
            self.graphs.verify_query_len = query_len
            self.graphs.verify_gemv_rows = self.verify_gemv_rows

    # ---- CUDA graphs for pure decode and uniform verify steps (engine/cuda_graph.py) ---------------
    graphs = None

    def setup_cuda_graphs(self, enabled: bool, max_model_len: int, max_num_seqs: int) -> None:
        if enabled and self.device.type == "cuda":
            from onecat.engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.attention, self.block_size, self.device,
                                       max_model_len, max_num_seqs)

    def cuda_graph_report(self) -> dict:
        if self.graphs is None:
            return {"used": False, "replays": 0, "captured_sizes": [], "disabled_reason": "not enabled (or not CUDA)"}
        return self.graphs.report()

    def _execute_graph(self, sched: list[ScheduledSeq]) -> StepResult | None:
        out = self.graphs.run(sched) if self.graphs is not None else None
        if out is None:
            return None
        logits, q = out
        if q == 1:
            return StepResult(logits, list(range(len(sched))), {}, {})
        verify = {i: logits[i * q:(i + 1) * q] for i in range(len(sched))}  # every row verifies q - 1 drafts
        return StepResult(logits.new_zeros(0), [], {}, verify)
