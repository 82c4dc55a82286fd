"""A tensor-parallel rank loads its shard straight from the checkpoint: no rank ever holds the whole model.

The engine builds the model on the meta device and shards it there (sharding.py): each sliced layer keeps
only its share's shape and records which rows and columns of the full weight it holds. After the shard is
allocated, the checkpoint's full tensors are sliced by those records as they stream in, so a rank needs
memory for its share only (a 70B fp16 model over two GPUs: ~70 GB each, not 140 GB). Each tensor is read
whole from the file before slicing (safetensors reads tensors, not slices, here), one at a time.

The model's own loader (`load_weights`) then places the slices: q/k/v and gate/up are fused, and the
offsets of each part inside the rank's fused projection are this rank's (`local_fused_offsets`; for layers
that name their fused parts themselves, `checkpoint_parts`, sharding made those local). The text model of a
multimodal checkpoint (`model.language_model.`) is cut as the plain one.

Packed weights (quantization) are cut at the same rows and columns: the packer asks `packed_cut` for each stored
linear and slices its packed layout (engine/quant/packed_shard.py). With `note_full_weight` on, each sharded layer
also keeps what a rank that rounds its share at load needs of the full weight (packed_shard.note_full_weight).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from onecat.engine.layers.moe import Experts
from onecat.engine.models.weight_loading import EXPERT_LINEAR, EXPERT_TENSOR, STACKED_EXPERTS
from onecat.engine.quant.packed_shard import note_full_weight

PREFIXES = ("model.language_model.", "model.")  # the text model's names (multimodal checkpoints nest it)
FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")  # the model's own layout: [E, 2I, H] / [E, H, I]


@dataclass(frozen=True)
class _Cut:
    """What a rank keeps of one checkpoint tensor: its rows and columns (None: all), and the sliced layer it
    goes into with the tensor's first row in that layer's full weight (for the row maxima)."""

    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    layer: nn.Module | None = None
    first_row: int = 0


_WHOLE = _Cut()


def _short(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _sliced(module: nn.Module) -> bool:
    return getattr(module, "_tp_full", None) is not None


def _within(rows: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """The recorded full rows that fall in one fused part [start, start + length), as rows of that part."""
    return rows[(rows >= start) & (rows < start + length)] - start


def local_fused_offsets(model: nn.Module, full_offset):
    """`model._shard_offset` for this rank's fused projections: (offset, rows) of each part (q, k, v; gate,
    up) inside the rank's fused weight, from the full offsets (`full_offset`, the model's own) and the
    recorded rows (the same in every layer)."""
    fused_rows = {}
    for m_name, module in model.named_modules():
        leaf = m_name.rpartition(".")[2]
        if leaf in ("qkv_proj", "gate_up_proj") and _sliced(module) and leaf not in fused_rows:
            fused_rows[leaf] = module._tp_rows

    def offsets(fused: str, shard: int) -> tuple[int, int]:
        start, length = full_offset(fused, shard)
        rows = fused_rows[fused]
        return int((rows < start).sum()), int(((rows >= start) & (rows < start + length)).sum())

    return offsets


class ShardLoader:
    """Slices a checkpoint's weight stream to a meta-sharded model's share (see the module docstring).
    `keep_full_vocab` (rank 0 with a DFlash drafter): also keep whole copies of the embedding and LM head,
    which the drafter calls outside the ranks' steps."""

    def __init__(self, model: nn.Module, keep_full_vocab: bool = False):
        self.model = model
        self.fused: dict[str, tuple[str, int]] = getattr(model, "_FUSED", {})
        full_offset = getattr(type(model), "_shard_offset", None)  # models loaded by load_by_name may lack it
        self.full_offset = full_offset.__get__(model) if full_offset is not None else None
        self.keep_full_vocab = keep_full_vocab
        self.full_vocab: dict[str, torch.Tensor] = {}
        self.note_full_weight = False  # set by a packer that may round the shares at load (module docstring)
        if self.full_offset is not None:  # where load_weights puts each part
            model._shard_offset = local_fused_offsets(model, self.full_offset)

    def _module(self, path: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(path)
        except AttributeError:  # e.g. an attention this rank does not run (no query head here)
            return None

    def _expert_share(self, short: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """An MoE expert tensor cut to this rank's intermediate units (sharding._shard_experts), in any of the
        three layouts checkpoints store experts in; None if `short` names no expert tensor."""
        # one expert's [I, H] / [H, I]; all experts stacked [E, I, H] / [E, H, I]; fused [E, 2I, H] / [E, H, I]
        for pattern, unit_dim in ((EXPERT_TENSOR, {"down_proj": 1}), (STACKED_EXPERTS, {"down_proj": 2}),
                                  (FUSED_EXPERTS, {"down_proj": 2})):
            m = pattern.match(short)
            if m is None:
                continue
            experts = self._module(m.group(1))
            units = getattr(experts, "_tp_units", None)
            if not isinstance(experts, Experts) or units is None:
                return tensor
            leaf = m.group(m.lastindex)
            if leaf in unit_dim:
                return tensor.index_select(unit_dim[leaf], units)
            if leaf == "gate_up_proj":
                return tensor.index_select(1, torch.cat([units, experts._tp_intermediate + units]))
            return tensor.index_select(0 if pattern is EXPERT_TENSOR else 1, units)  # gate_proj / up_proj rows
        return None

    def _part(self, owner: str, leaf: str) -> tuple[str, tuple[int, int]] | None:
        """(fused module, (first row, rows) in the full fused weight) of checkpoint projection `leaf` of the module
        at `owner`: from the module's own record of its full fused layout (`_tp_full_parts`: the gated attention,
        Gated DeltaNet, dense MLPs of any size) or the model's `_FUSED` table; None if `leaf` is not fused."""
        parts = getattr(self._module(owner) if owner else self.model, "_tp_full_parts", None) or {}
        if leaf in parts:
            fused, start, length = parts[leaf]
            return fused, (start, length)
        if leaf in self.fused and self.full_offset is not None:
            fused, shard = self.fused[leaf]
            return fused, self.full_offset(fused, shard)
        return None

    def _cut(self, short: str) -> _Cut | None:
        """What this rank keeps of the checkpoint tensor `short` (prefix stripped, not an expert's); None: nothing
        (a row-parallel bias off rank 0, an attention this rank does not run)."""
        parent, _, rest = short.rpartition(".")  # rest: "weight" / "bias" (or a layer's own parameter)
        owner, _, leaf = parent.rpartition(".")
        part = None
        fused = self._part(owner, leaf)
        if fused is not None:
            parent, part = (f"{owner}.{fused[0]}" if owner else fused[0]), fused[1]
        module = self._module(parent)
        own = getattr(module, "_tp_param_rows", None) or {}
        if rest in own:  # a per-head parameter of the layer itself (Gated DeltaNet's A_log, dt_bias)
            return _Cut(rows=own[rest])
        if module is None or not _sliced(module):
            idle = module is None or next(module.parameters(), None) is None
            # unsliced (norms, q/k norms): every rank loads it whole; else an attention this rank does not run
            return None if idle and "self_attn" in parent else _WHOLE
        if rest == "bias" and module.bias is None:
            return None  # a row-parallel bias is added once, by rank 0
        rows = module._tp_rows
        if rows is not None and part:
            rows = _within(rows, *part)
        if rest != "weight":
            return _Cut(rows=rows)
        return _Cut(rows, module._tp_cols, module, part[0] if part else 0)

    def packed_cut(self, module: str) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """(rows, columns) this rank keeps of the checkpoint linear `module` (None: all of them), or None when the
        rank does not run it: an expert's gate/up rows and down columns by its intermediate units, any other
        linear as its dense weight is cut."""
        short = _short(module)
        expert = EXPERT_LINEAR.match(short)
        if expert is not None:
            experts = self._module(expert.group(1))
            units = getattr(experts, "_tp_units", None)
            if units is None:
                return None, None
            return (None, units) if expert.group(3) == "down_proj" else (units, None)
        cut = self._cut(f"{short}.weight")
        return None if cut is None else (cut.rows, cut.cols)

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            short = _short(name)
            expert = self._expert_share(short, tensor)
            if expert is not None:
                yield name, expert
                continue
            if self.keep_full_vocab and short in ("embed_tokens.weight", "lm_head.weight"):
                self.full_vocab[short] = tensor  # the checkpoint's own tensor; the shard gets a slice of it
            cut = self._cut(short)
            if cut is None:
                continue
            if self.note_full_weight and cut.layer is not None and tensor.dim() == 2:  # as the layer holds it
                note_full_weight(cut.layer, tensor.to(cut.layer.weight.dtype), cut.first_row)
            if cut.rows is not None:
                tensor = tensor.index_select(0, cut.rows)
            if cut.cols is not None:
                tensor = tensor.index_select(1, cut.cols)
            yield name, tensor

    def full_vocab_layers(self, tied: bool) -> tuple[nn.Module, nn.Module] | None:
        """Whole embedding and LM head (from the copies taken while loading), or None if not kept."""
        if not self.keep_full_vocab:
            return None
        emb = self.full_vocab["embed_tokens.weight"]
        head_w = emb if tied else self.full_vocab["lm_head.weight"]
        device, dtype = self.model.embed_tokens.weight.device, self.model.embed_tokens.weight.dtype
        embed = nn.Embedding.from_pretrained(emb.to(device, dtype), freeze=True)
        head = type(self.model.lm_head)(head_w.shape[1], head_w.shape[0], bias=False, device=device, dtype=dtype)
        head.weight.data.copy_(head_w)
        return embed.requires_grad_(False), head.requires_grad_(False)
