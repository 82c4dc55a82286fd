"""Runs one scheduled step on the model: flatten the batch, build attention metadata, forward, logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onecat.engine.attention.forward_context import ForwardContext, PromptRows, set_forward_context
from onecat.engine.attention.metadata import AttentionMetadata
from onecat.engine.attention.selector import AttentionDispatcher
from onecat.engine.core.scheduler_output import ScheduledSeq
from onecat.engine.core.step_result import PromptLogprobs, StepResult
from onecat.engine.transfers import to_device


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows]: a view when the rows are consecutive (the usual case), else a gather."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return t[rows[0]:rows[-1] + 1]
    return t[to_device(rows, t.device)]


def _logit_rows(s: ScheduledSeq) -> tuple[int, int]:
    """(prompt rows, then tail rows) of a scheduled sequence that need logits, in step order: the chunk's
    positions whose next token is in the prompt (prompt logprobs), then its 1 + k verify rows, or its
    last row when it reached its end (a sample)."""
    seq, start = s.seq, s.seq.num_computed_tokens
    prompt = 0
    if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens:
        prompt = max(0, min(start + s.num_new_tokens + s.num_lookahead, seq.num_prompt_tokens - 1) - start)
    if s.num_lookahead:
        return prompt, s.num_lookahead + 1
    return prompt, int(start + s.num_new_tokens == seq.num_tokens)


@dataclass(slots=True)
class StepInputs:
    """One step's flattened batch as plain lists: all a tensor-parallel rank needs to run the step."""

    ids: list[int]
    pos: list[int]
    slots: list[int]
    qsl: list[int]
    seq_lens: list[int]
    qlens: list[int]
    tables: list[list[int]]
    logit_rows: list[int]  # hidden rows whose logits the step needs, in the order _outputs reads them
    gemv_rows: int  # rows that may take the batch-1 GEMV (ForwardContext.gemv_rows)
    state_slots: list[int | None] | None = None  # hybrid models: each sequence's recurrent-state slot
    lookaheads: list[int] | None = None  # each sequence's draft tokens under verification (their last rows)
    prompt_rows: list[int] | None = None  # rows at prompt positions (ForwardContext.prompt_rows)
    prompt_lens: list[int] | None = None  # each sequence's rows at prompt positions (AttentionMetadata)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, attention: AttentionDispatcher, block_size: int,
                 device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.attention = attention
        self.block_size = block_size
        self.device = device
        self.peers = None  # tensor parallel: the other ranks, sent each step's inputs (engine/parallel)
        self.collectives = None  # tensor parallel: the layers' collectives (their failure marks)

    def step_inputs(self, sched: list[ScheduledSeq]) -> StepInputs:
        """The step's flattened batch, and which hidden rows need logits: each verifying sequence's
        1 + k rows, the last row of each sequence that reached its end, the rows of a prefill chunk
        whose next token is in the prompt (prompt logprobs)."""
        bs = self.block_size
        ids, pos, slots, qsl, seq_lens, qlens, rows, prompt_rows, prompt_lens = [], [], [], [0], [], [], [], [], []
        for s in sched:
            seq = s.seq
            start = seq.num_computed_tokens
            n = s.num_new_tokens + s.num_lookahead
            ids.extend(seq.token_ids[start:start + s.num_new_tokens])
            drafts = seq.draft_tokens[:s.num_lookahead]
            ids.extend(drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts)  # an eager step reads them
            table = seq.block_table
            for p in range(start, start + n):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            prompt_lens.append(max(0, min(n, seq.num_prompt_tokens - start)))
            prompt_rows.extend(range(qsl[-1], qsl[-1] + prompt_lens[-1]))
            prompt, tail = _logit_rows(s)
            rows.extend(range(qsl[-1], qsl[-1] + prompt))
            rows.extend(range(qsl[-1] + n - tail, qsl[-1] + n))  # verify rows, or the last row
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            qlens.append(n)
        max_blocks = max(len(s.seq.block_table) for s in sched)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in sched]
        batch1_verify = len(sched) == 1 and sched[0].num_new_tokens == 1  # one sequence's decode/verify rows
        return StepInputs(ids, pos, slots, qsl, seq_lens, qlens, tables, rows,
                          self.verify_gemv_rows if batch1_verify else 1, [s.seq.state_slot for s in sched],
                          [s.num_lookahead for s in sched], prompt_rows, prompt_lens)

    def _metadata(self, x: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=to_device(x.qsl, dev, torch.int32),
            seq_lens=to_device(x.seq_lens, dev, torch.int32),
            block_tables=to_device(x.tables, dev, torch.int32),
            slot_mapping=to_device(x.slots, dev, torch.int64),
            max_query_len=max(x.qlens), max_seq_len=max(x.seq_lens), block_size=self.block_size,
            query_lens_cpu=x.qlens, seq_lens_cpu=x.seq_lens, extras={}, prompt_lens_cpu=x.prompt_lens)
        return (to_device(x.ids, dev, torch.int64), to_device(x.pos, dev, torch.int64), meta)

    def run_inputs(self, x: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [T, H], float32 logits of x.logit_rows [R, V]): the forward every tensor-parallel rank
        runs in step (the other ranks get `x` from the first)."""
        input_ids, positions, meta = self._metadata(x)
        set_forward_context(ForwardContext(meta, self.kv_caches, self.attention, x.gemv_rows, x.state_slots,
                                           x.lookaheads, prompt_rows=PromptRows.of(x.prompt_rows, len(x.ids))))
        try:
            hidden = self.model(input_ids, positions)
            if not x.logit_rows:
                return hidden, hidden.new_zeros(0)
            return hidden, self.model.compute_logits(_take(hidden, x.logit_rows)).float()
        finally:
            set_forward_context(None)

    def run_remote(self, kind: str, payload) -> None:
        """A tensor-parallel worker rank: run what rank 0 sent (WorkerRanks.send_step)."""
        if kind == "step":
            self.run_inputs(payload)
        elif kind == "capture":  # a failure disables graphs here as on rank 0, which then steps eagerly
            size, q, self.graphs.verify_gemv_rows = payload  # captured with rank 0's GEMV rows
            self.graphs.ensure_captured(size, q)
        elif kind == "graph":
            if self.graphs is None or self.graphs.replay_step(payload) is None:
                raise RuntimeError("rank 0 replayed a CUDA graph this rank could not: "
                                   f"{self.cuda_graph_report()['disabled_reason']}")
        else:
            raise ValueError(f"unknown step kind {kind!r}")

    def ensure_graph(self, size: int, q: int = 1) -> bool:
        """Capture the graph for (size, q) now (start-up warm-up), on every tensor-parallel rank alike."""
        if self.peers is not None:
            self.peers.send_step((size, q, self.graphs.verify_gemv_rows), "capture")
        return self.graphs.ensure_captured(size, q)

    def _check_peers(self) -> None:
        """Tensor parallel: fail if a GPU collective of an earlier step gave up waiting on a rank."""
        reason = self.collectives.failure() if self.collectives is not None else None
        if reason:
            raise self.peers.collective_failed(RuntimeError(reason))

    @torch.inference_mode()
    def execute(self, sched: list[ScheduledSeq]) -> StepResult:
        if self.peers is not None:
            self._check_peers()
            try:
                return self._execute(sched)
            except RuntimeError as e:  # a collective fails when another rank died or raised mid-step
                raise self.peers.collective_failed(e) from e
            finally:
                self.collectives.after_step()
        return self._execute(sched)

    def _execute(self, sched: list[ScheduledSeq]) -> StepResult:
        graphed = self._execute_graph(sched)
        if graphed is not None:
            return graphed
        x = self.step_inputs(sched)
        if self.peers is not None:
            self.peers.send_step(x)
        return self._outputs(sched, self.run_inputs(x)[1])

    def _outputs(self, sched: list[ScheduledSeq], logits: torch.Tensor) -> StepResult:
        """Split the step's logits rows (in step_inputs' order) into samples, verifies and prompt logprobs."""
        sample_rows, sample_logits = [], []
        prompt_lp: dict[int, PromptLogprobs] = {}
        verify: dict[int, torch.Tensor] = {}
        at = 0
        for i, s in enumerate(sched):
            prompt, tail = _logit_rows(s)
            if s.seq.prompt_logprobs is not None and s.seq.num_computed_tokens < s.seq.num_prompt_tokens:
                prompt_lp[i] = self._prompt_logprobs(logits[at:at + prompt], s.seq)
            at += prompt
            if s.num_lookahead:
                verify[i] = logits[at:at + tail]
            elif tail:
                sample_rows.append(i)
                sample_logits.append(at)
            at += tail
        picked = _take(logits, sample_logits) if sample_logits else logits.new_zeros(0)
        return StepResult(picked, sample_rows, prompt_lp, verify)

    def _prompt_logprobs(self, logits: torch.Tensor, seq) -> PromptLogprobs:
        """log p(prompt[t+1] | prompt[:t+1]) from the logits of a chunk's positions t whose next token is in
        the prompt (the chunk starts at seq.num_computed_tokens)."""
        start = seq.num_computed_tokens
        top_n = seq.params.prompt_logprobs
        if logits.shape[0] == 0:
            return PromptLogprobs([], [] if top_n else None, [] if top_n else None)
        lp = logits.log_softmax(dim=-1)
        targets = to_device(seq.token_ids[start + 1:start + 1 + logits.shape[0]], lp.device)
        own = lp.gather(1, targets.unsqueeze(1))
        if not top_n:
            return PromptLogprobs(own.squeeze(1).tolist())
        ranks = (lp > own).sum(dim=1).add(1).tolist()  # 1 + tokens strictly likelier than the prompt's own
        vals, ids = lp.topk(top_n, dim=-1)
        tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        return PromptLogprobs(own.squeeze(1).tolist(), tops, ranks)

    # ---- speculative verify steps ------------------------------------------------------------------
    verify_gemv_rows = 1  # rows of a decode/verify step that may take the batch-1 GEMV
    verify_query_len = 1  # tokens a sequence brings to a verify step (1 + k; 1: no speculation)

    def setup_verify(self, query_len: int, gemv: bool, narrow: bool = False) -> None:
        """Verify steps run 1 + k tokens per sequence: they replay CUDA graphs too, and with `gemv` (the
        fused kernels on and exact batch-1 verification asked for) a batch-1 verify step's rows go through
        the batch-1 GEMV, which computes each row as a batch-1 decode step does. Greedy speculation then gives
        target-only's tokens exactly at batch 1 (the library GEMM sums 1 + k rows in another order than 1, and
        near-ties flip), at the price of reading the weights once per row (triton_gemv.ROW_LOOP: from cache)."""
        self.verify_gemv_rows = query_len if gemv else 1
        self.verify_query_len = query_len
        states = getattr(self.model, "states", None)
        if states is not None:  # a hybrid model keeps each verify row's inputs: its trail buffers are made now,
            before = states.verify_trails  # for the widest row, before any verify graph is captured
            if states.reserve_verify(query_len) is not before and self.graphs is not None:
                self.graphs.drop_verify_graphs()  # captured on the buffers just replaced
        if self.graphs is not None:
            self.graphs.verify_query_len = query_len
            self.graphs.narrow_verify = narrow
            self.graphs.verify_gemv_rows = self.verify_gemv_rows

    # ---- CUDA graphs for pure decode and uniform verify steps (cuda_graph.py) ---------------
    graphs = None

    def setup_cuda_graphs(self, enabled: bool, max_model_len: int, max_num_seqs: int) -> None:
        if enabled and self.device.type == "cuda":
            from onecat.engine.worker.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.attention, self.block_size, self.device,
                                       max_model_len, max_num_seqs)

    def cuda_graph_report(self) -> dict:
        if self.graphs is None:
            return {"used": False, "replays": 0, "verify_replays": 0, "captured_sizes": [],
                    "captured_verify_sizes": [], "captured_verify_widths": [], "captures": 0, "capture_s": 0.0,
                    "disabled_reason": "not enabled (or not CUDA)"}
        return self.graphs.report()

    def _execute_graph(self, sched: list[ScheduledSeq]) -> StepResult | None:
        if self.graphs is None:
            return None
        announce = (lambda kind, payload: self.peers.send_step(payload, kind)) if self.peers is not None else None
        out = self.graphs.run(sched, announce)
        if out is None:
            return None
        logits, q = out
        if q == 1:
            return StepResult(logits, list(range(len(sched))), {}, {})
        # a row's own tokens are its last 1 + d rows (padding first); a row without drafts is a plain sample
        verify = {i: logits[(i + 1) * q - 1 - s.num_lookahead:(i + 1) * q]
                  for i, s in enumerate(sched) if s.num_lookahead}
        sample_rows = [i for i, s in enumerate(sched) if not s.num_lookahead]
        picked = logits[[(i + 1) * q - 1 for i in sample_rows]] if sample_rows else logits.new_zeros(0)
        return StepResult(picked, sample_rows, {}, verify)
