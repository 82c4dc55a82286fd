"""Packed weights into a loaded model: the layer that runs a packed weight on the model's device, a linear
replaced by packed shards (whole, or run by run beside dense rows), and an MoE's experts replaced by
per-expert packed layers (engine/layers/moe.py PackedExperts). Used by hf_packer.py for the checkpoint's
stored linears and for the linears it quantizes at load; each function returns whether it replaced anything,
and what it leaves alone stays dense (the caller lists it)."""
from __future__ import annotations

import torch
from torch import nn

from onecat.engine.layers.linear import Linear
from onecat.engine.layers.moe import Experts, PackedExperts
from onecat.engine.quant.fp4.layout import FP4Weight, cat_fp4
from onecat.engine.quant.fp4.packing import fp4_unsupported_reason
from onecat.engine.quant.fp8.layout import FP8Weight
from onecat.engine.quant.fp8.packing import cat_fp8
from onecat.engine.quant.row_split import RowSplitLinear
from onecat.engine.quant.w4a16.layout import W4A16Weight, cat_w4a16


def cat_packed(shards: list) -> object | None:
    """Shards of one format stacked along N (None when their formats, widths, groups or permutations differ)."""
    kinds = {type(s) for s in shards}
    if len(kinds) != 1:
        return None
    if len(shards) == 1:
        return shards[0]
    kind = kinds.pop()
    return cat_fp4(shards) if kind is FP4Weight else cat_fp8(shards) if kind is FP8Weight else cat_w4a16(shards)


def packed_layer(weight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                 cpu_int4: bool, tiles: bool = True) -> nn.Module | None:
    """The layer that runs `weight` on `device` with outputs in `dtype`, or None where that device has no packed
    form of it: on CPU (cpu_int4) W4A16 runs in the int4 layer, which act-order weights do not fit; the FP4
    GEMV does not take every FP4 weight (fp4_unsupported_reason). `tiles`: its words in the tensor-core GEMV's
    tiles where that GEMV takes its calls (off for experts that PackedExperts stacks row-major)."""
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8.linear import FP8Linear
    from onecat.engine.quant.int4.linear import Int4PackedLinear
    from onecat.engine.quant.w4a16.cpu import int4_blocks
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    if fp4_unsupported_reason(weight):
        return None
    if device.type == "cpu" and cpu_int4 and isinstance(weight, W4A16Weight):
        blocks = int4_blocks(weight)
        return None if blocks is None else Int4PackedLinear([blocks], bias, dtype)
    weight = weight.to(device)
    kind = FP4Linear if isinstance(weight, FP4Weight) else FP8Linear if isinstance(weight, FP8Weight) else W4A16Linear
    layer = kind(weight, bias)
    if tiles:
        layer.use_tiles(dtype)
    return layer


def _set(model: nn.Module, path: str, layer: nn.Module) -> None:
    """Put `layer` in the place of the module at `path`, with that module's forward hooks (tensor parallel's sums
    over the ranks hang on row-parallel layers as hooks: engine/parallel/sharding.py)."""
    parent, _, leaf = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    for hook in getattr(owner, leaf)._forward_hooks.values():
        layer.register_forward_hook(hook)
    setattr(owner, leaf, layer)


def replace_rows(model: nn.Module, path: str, module: nn.Linear, shards: list[tuple[int, object]],
                 cpu_int4: bool) -> str | None:
    """Replace the linear at `path` by its packed `shards` ((first row, packed weight), in any order): one
    packed layer where they cover every row, else a RowSplitLinear of packed runs and dense runs (the rows no
    shard covers keep the loaded dense weight). Returns "packed", "partly packed", or None (left dense: shards
    that overlap or overrun, a run whose shards do not stack, a weight the device has no packed form of)."""
    runs: list[tuple[int, int, object | None]] = []  # (first row, rows, packed weight or None: dense)
    pending: list[object] = []
    pos = 0

    def flush() -> bool:
        if pending:
            w = cat_packed(pending)
            if w is None:
                return False
            runs.append((pos - w.out_features, w.out_features, w))
            pending.clear()
        return True

    for start, w in sorted(shards, key=lambda s: s[0]):
        if start < pos:
            return None
        if start > pos or (pending and type(pending[0]) is not type(w)):  # a dense gap, or another format
            if not flush():
                return None
        if start > pos:
            runs.append((pos, start - pos, None))
        pending.append(w)
        pos = start + w.out_features
    if not flush() or pos > module.out_features:
        return None
    if pos < module.out_features:
        runs.append((pos, module.out_features - pos, None))
    dtype, device = module.weight.dtype, module.weight.device
    bias = None if module.bias is None else module.bias.detach()
    layers = []
    for start, rows, weight in runs:
        part_bias = None if bias is None else bias[start:start + rows].clone()
        if weight is None:
            dense = Linear(module.in_features, rows, bias=bias is not None, device=device, dtype=dtype)
            dense.weight.data.copy_(module.weight.detach()[start:start + rows])
            if part_bias is not None:
                dense.bias.data.copy_(part_bias)
            dense.requires_grad_(False)
            layers.append(dense)
            continue
        layer = packed_layer(weight, part_bias, dtype, device, cpu_int4)
        if layer is None:
            return None
        layers.append(layer)
    _set(model, path, layers[0] if len(layers) == 1 else RowSplitLinear(layers))
    return "packed" if len(layers) == 1 else "partly packed"


def replace_experts(model: nn.Module, path: str, experts: Experts, stored: dict[tuple[int, str], object],
                    cpu_int4: bool) -> bool:
    """Replace the Experts at `path` by PackedExperts when `stored` ((expert, gate_proj|up_proj|down_proj) ->
    packed weight) holds all three projections of every expert, gate and up stack, and the device has a packed
    form of each; else leave them dense (False)."""
    dtype, device = experts.gate_up_proj.dtype, experts.gate_up_proj.device
    gate_up, down = [], []
    for e in range(experts.num_experts):
        parts = [stored.get((e, leaf)) for leaf in ("gate_proj", "up_proj", "down_proj")]
        if any(p is None for p in parts):
            return False
        gu = cat_packed(parts[:2])
        if gu is None or gu.out_features != 2 * experts.intermediate or parts[2].in_features != experts.intermediate:
            return False
        # experts a routed GEMV takes are stacked row-major (PackedExperts): no tiles to undo for each
        stacked = device.type == "cuda" and (isinstance(gu, FP4Weight) or (isinstance(gu, W4A16Weight)
                                                                           and gu.perm is None))
        layers = [packed_layer(w, None, dtype, device, cpu_int4, tiles=not stacked) for w in (gu, parts[2])]
        if any(layer is None for layer in layers):
            return False
        gate_up.append(layers[0])
        down.append(layers[1])
    _set(model, path, PackedExperts(gate_up, down, experts.intermediate))
    return True
