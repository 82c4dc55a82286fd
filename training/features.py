"""Teacher-forced target features of the training sequences, captured by the engine's own forward passes.

The drafter at inference reads the hidden states the engine taps while it runs the target (the
HiddenStateTap the DFlash proposer uses); training must see the same numbers. So the sequences
(prompt + response) go through an engine whose speculative slot holds a proposer that drafts nothing
and only records: each step's tapped rows land at their absolute positions in one packed buffer.
Besides the drafter's tap layers it taps the last layer and keeps `norm(last layer)`, the input of the
target's lm_head: the target's next-token distribution for the KL term, for 2 bytes per hidden unit.

The engine is opened with prefix caching off (a cached prefix is never recomputed, so it would yield no
features); a sequence runs with max_tokens=2 because the engine hands over the features of a prompt's
last chunk only while the request goes on; a preempted request recomputes its positions and simply
writes them again.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from onecat.engine import SamplingParams
from onecat.engine.core.sequence import FeatureRows
from onecat.engine.speculative.base import Proposer, SpeculativeDecoder, hidden_state_tap


@dataclass
class FeatureSet:
    """Packed training sequences: sequence i is rows starts[i] .. starts[i] + lengths[i] - 1."""

    tokens: torch.Tensor  # [N] long
    features: torch.Tensor  # [N, len(layer_ids) * H]: the target's hidden states after each tap layer
    final_hidden: torch.Tensor  # [N, H]: norm(last layer), the target's lm_head input at each position
    starts: list[int]
    lengths: list[int]
    response_starts: list[int]  # index (within the sequence) of its first response token
    sampled: list[bool]
    layer_ids: list[int]

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device) -> "FeatureSet":
        return FeatureSet(self.tokens.to(device), self.features.to(device), self.final_hidden.to(device),
                          self.starts, self.lengths, self.response_starts, self.sampled, self.layer_ids)


class FeatureRecorder(Proposer):
    """A proposer that proposes nothing and writes the target's tapped rows of each request into `out`."""

    name = "feature_capture"

    def __init__(self, target_model: torch.nn.Module, num_layers: int, layer_ids: list[int], out: FeatureSet,
                 hidden: int):
        super().__init__(1)
        self.tap = hidden_state_tap(target_model)
        self.last = num_layers - 1
        self.tapped = sorted(set(layer_ids) | {self.last})
        self.tap.aux_layer_ids = list(self.tapped)
        self.norm = target_model.norm
        self.out, self.hidden = out, hidden
        self.feature_cols = torch.cat([torch.arange(j * hidden, (j + 1) * hidden)
                                       for j, layer in enumerate(self.tapped) if layer in layer_ids])
        last_col = self.tapped.index(self.last) * hidden
        self.last_cols = slice(last_col, last_col + hidden)
        self.rows_of: dict[str, int] = {}  # request id -> first row of its sequence in `out`
        self.written = torch.zeros(out.num_tokens, dtype=torch.bool)

    def propose(self, seqs, budgets):
        return [([], None) for _ in seqs]

    @torch.no_grad()
    def record_features(self, seq, span: FeatureRows) -> None:
        rows = span.rows()
        end = seq.num_computed_tokens  # rows are the positions just computed: end - len(rows) .. end - 1
        first = self.rows_of[seq.request_id] + end - rows.shape[0]
        span = slice(first, first + rows.shape[0])
        if self.feature_cols.device != rows.device:
            self.feature_cols = self.feature_cols.to(rows.device)
        self.out.features[span] = rows.index_select(1, self.feature_cols).to(self.out.features.dtype)
        self.out.final_hidden[span] = self.norm(rows[:, self.last_cols].contiguous()).to(self.out.final_hidden.dtype)
        self.written[span] = True

    def release(self, seq) -> None:
        pass


def capture_features(llm, sequences: list[tuple[list[int], int, bool]], layer_ids: list[int],
                     storage_dtype: torch.dtype, log: Callable[[str], None] = print) -> tuple[FeatureSet, dict]:
    """Run (token ids, response start, sampled) sequences through `llm` (opened with prefix caching off)
    and return their features on llm's device; plus timings for the record."""
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"layer_ids {list(layer_ids)} must be distinct and ascending: the engine's tap hands the "
                         "layers over in ascending order, and the drafter reads them in that order")
    if llm.cfg.enable_prefix_caching:
        raise ValueError("capture_features needs an engine opened with enable_prefix_caching=False: a cached "
                         "prefix is not recomputed, so its positions would have no features")
    t0 = time.perf_counter()
    hidden = llm.model_config.hidden_size
    lengths = [len(ids) for ids, _, _ in sequences]
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    total = sum(lengths)
    dev = llm.device
    out = FeatureSet(torch.tensor([t for ids, _, _ in sequences for t in ids], dtype=torch.long, device=dev),
                     torch.empty(total, len(layer_ids) * hidden, dtype=storage_dtype, device=dev),
                     torch.empty(total, hidden, dtype=storage_dtype, device=dev),
                     starts, lengths, [r for _, r, _ in sequences], [s for _, _, s in sequences], list(layer_ids))
    recorder = FeatureRecorder(llm.model, llm.model_config.num_hidden_layers, list(layer_ids), out, hidden)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    core = llm.engine
    rids = []
    last_log = t0
    with core.proposer_swapped(SpeculativeDecoder(recorder, llm.max_model_len)):
        try:
            for i, (ids, _, _) in enumerate(sequences):
                rid = f"capture-{i}"
                recorder.rows_of[rid] = starts[i]
                rids.append(llm.add_request({"prompt_token_ids": ids}, params, request_id=rid,
                                            add_special_tokens=False))
            while core.has_unfinished():
                core.step()
                if time.perf_counter() - last_log >= 10:
                    last_log = time.perf_counter()
                    log(f"[features] {int(recorder.written.sum())}/{total} positions")
        finally:
            for rid in rids:
                core.release(rid)
            recorder.tap.aux_layer_ids = []
    missing = int((~recorder.written).sum())
    if missing:
        raise RuntimeError(f"feature capture left {missing} of {total} positions unwritten; the engine did not "
                           "compute every position (prefix caching on, or a request cut short)")
    seconds = time.perf_counter() - t0
    log(f"[features] {len(sequences)} sequences, {total} positions in {seconds:.1f} s ({total / seconds:.0f} tok/s)")
    return out, {"positions": total, "seconds": round(seconds, 2), "tokens_per_s": round(total / seconds, 1),
                 "storage_dtype": str(storage_dtype).removeprefix("torch."),
                 "bytes": out.features.nbytes + out.final_hidden.nbytes}
