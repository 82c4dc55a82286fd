"""A tensor-parallel rank's share of a packed weight, and how a rank rounds its dense share at load.

Sharding (engine/parallel/sharding.py) keeps a column-parallel linear's output rows and a row-parallel one's input
columns. Rows of a packed weight are independent (each has its own codes, group scales and zeros, NVFP4 global
scale, FP8 scale), so a rank keeps any rows. Columns are packed in units (W4A16: its group of 32/64/128; NVFP4: 16;
MXFP4: 32; FP8: 16, the interleave of its words): a rank's columns must be whole units, whose words and scale
columns it then keeps as stored. Nothing is rounded again, so a share dequantizes to exactly the slice of the full
weight's dequantization. An act-order W4A16 weight (a permutation of K) scatters its groups over the input
columns, so one cut by columns is not sliced: that layer stays dense on the rank (the caller lists it).

Quantization at load under tensor parallelism rounds each rank's dense share (`round_share`) as the full weight
is rounded: the loaders note what a share needs of the rest of the full weight while they hold it whole
(`note_full_weight`, from engine/parallel/shard_loading.py and engine/loader/dummy.py): each row's largest
magnitude (FP8's scale per row, NVFP4's scale per tensor) and the other columns of the W4A16 groups a share cuts.
So a rank's packed linear is the slice of the full weight rounded at once, exactly. MoE experts are noted nothing:
a rank rounds its share of each expert with its own FP8 / NVFP4 scales, and in the largest W4A16 groups its
columns fall on.
"""
from __future__ import annotations

import torch

from onecat.engine.errors import ConfigError
from onecat.engine.quant.fp4.layout import FP4_BLOCKS, FP4Weight
from onecat.engine.quant.fp8.layout import BLOCK as FP8_BLOCK, FP8Weight
from onecat.engine.quant.rtn import RTN_GROUPS, quantize, rtn_group
from onecat.engine.quant.w4a16.layout import W4A16Weight, pack_codes, unpack_codes


def column_unit(weight) -> int:
    """Input columns packed together: a W4A16 group, an FP4 block, FP8's 16-column interleave."""
    if isinstance(weight, W4A16Weight):
        return weight.group
    if isinstance(weight, FP4Weight):
        return weight.block
    return FP8_BLOCK


def whole_units(cols: torch.Tensor, unit: int) -> torch.Tensor | None:
    """The indices of the `unit`-column units that `cols` (sorted input columns) consists of, or None when
    it cuts one."""
    if cols.numel() % unit:
        return None
    runs = cols.view(-1, unit)
    first = runs[:, 0]
    if bool((first % unit).any()) or not torch.equal(runs, first[:, None] + torch.arange(unit, device=cols.device)):
        return None
    return first // unit


def misaligned(what: str, cols: torch.Tensor, full_in: int, unit: int, kind: str) -> ConfigError:
    return ConfigError(
        f"{what} cannot be split for tensor parallelism: this rank keeps {cols.numel()} of its {full_in} input "
        f"columns (from column {int(cols[0]) if cols.numel() else 0}), which do not fall on the boundaries of its "
        f"{unit}-column {kind}; use a tensor_parallel_size that gives every rank whole {kind} of the width it "
        "splits (heads or intermediate units), or tensor_parallel_size 1")


def take_rows(weight, rows: torch.Tensor):
    """The packed weight's output rows `rows`, as stored."""
    rows = rows.to(weight.qweight.device)
    if isinstance(weight, W4A16Weight):
        return W4A16Weight(weight.qweight[rows], weight.scales[rows], weight.zeros[rows], weight.group, weight.perm)
    if isinstance(weight, FP4Weight):
        g = None if weight.gscale is None else weight.gscale[rows]
        return FP4Weight(weight.qweight[rows], weight.scales[rows], g, weight.fmt)
    return FP8Weight(weight.qweight[rows], weight.scale[rows])


def take_units(weight, units: torch.Tensor):
    """The packed weight's input-column units `units` (column_unit each): their words and scale columns."""
    n = weight.qweight.shape[0]
    unit = column_unit(weight)
    per_unit = unit // (4 if isinstance(weight, FP8Weight) else 8)  # int32 words per unit
    units = units.to(weight.qweight.device)
    q = weight.qweight.view(n, -1, per_unit)[:, units].reshape(n, -1).contiguous()
    if isinstance(weight, W4A16Weight):
        return W4A16Weight(q, weight.scales[:, units].contiguous(), weight.zeros[:, units].contiguous(), weight.group)
    if isinstance(weight, FP4Weight):
        return FP4Weight(q, weight.scales[:, units].contiguous(), weight.gscale, weight.fmt)
    return FP8Weight(q, weight.scale)


def packed_share(weight, rows: torch.Tensor | None, cols: torch.Tensor | None, what: str):
    """This rank's share of packed `weight` (the checkpoint linear `what`): output rows `rows`, input columns `cols`
    (None: all). None where it cannot be sliced and the layer stays dense (act-order by columns); a ConfigError
    naming the layer where the columns cut a group or block."""
    if rows is not None:
        weight = take_rows(weight, rows)
    if cols is None:
        return weight
    if isinstance(weight, W4A16Weight) and weight.perm is not None:
        return None
    unit = column_unit(weight)
    units = whole_units(cols, unit)
    if units is None:
        kind = "groups" if isinstance(weight, W4A16Weight) else "blocks"
        raise misaligned(what, cols, weight.in_features, unit, kind)
    return take_units(weight, units)


def regroup(weight: W4A16Weight, group: int) -> W4A16Weight:
    """The same W4A16 weight packed in smaller groups (each group's scale and zero repeated): exact."""
    if group == weight.group:
        return weight
    codes = unpack_codes(weight.qweight, weight.group)
    times = weight.group // group
    return W4A16Weight(pack_codes(codes, group), weight.scales.repeat_interleave(times, 1).contiguous(),
                       weight.zeros.repeat_interleave(times, 1).contiguous(), group, weight.perm)


def _cut_groups(cols: torch.Tensor, group: int) -> torch.Tensor:
    """All columns of the `group`-column groups that `cols` touches (sorted)."""
    touched = torch.unique(cols // group)
    return (touched[:, None] * group + torch.arange(group)).flatten()


def note_full_weight(layer: torch.nn.Module, full: torch.Tensor, first_row: int) -> None:
    """What a rank rounding its share of `layer` at load needs of the full weight (round_share), noted by the
    loaders from each full tensor the share is cut from (`full`: rows from `first_row` of the layer's full weight,
    every column, in the layer's dtype): each row's largest magnitude, and the columns of the round-to-nearest
    groups the share's columns cut."""
    full_rows, full_in = layer._tp_full
    rows = slice(first_row, first_row + full.shape[0])
    if getattr(layer, "_tp_full_row_amax", None) is None:
        layer._tp_full_row_amax = torch.zeros(full_rows)
    layer._tp_full_row_amax[rows] = full.abs().amax(1).float().cpu()
    group = rtn_group(full_in)
    if layer._tp_cols is None or group is None:
        return
    cols = layer._tp_cols.cpu()
    union = _cut_groups(cols, group)
    edge = union[~torch.isin(union, cols)]
    if edge.numel() == 0:
        return
    if getattr(layer, "_tp_full_edge", None) is None:
        layer._tp_full_edge = (edge, torch.zeros(full_rows, edge.numel()))
    layer._tp_full_edge[1][rows] = full[:, edge.to(full.device)].float().cpu()


def noted(module: torch.nn.Module, start: int, rows: int, full_runs: list[tuple[int, int]]) -> dict:
    """round_share's `full` for rows [start, start + rows) of a sharded linear, from what note_full_weight kept:
    each row's largest magnitude, the largest of the run of full rows one rank rounds as one tensor (`full_runs`),
    the cut groups' other columns; {} when nothing was noted (each share then takes its own)."""
    amax = getattr(module, "_tp_full_row_amax", None)
    if amax is None:
        return {}
    kept = module._tp_rows
    full_rows = torch.arange(start, start + rows) if kept is None else kept[start:start + rows].cpu()
    first = int(full_rows[0])
    run_start, run_rows = next((s, n) for s, n in full_runs if s <= first < s + n)
    out = {"row_amax": amax[full_rows], "tensor_amax": amax[run_start:run_start + run_rows].max()}
    edge = getattr(module, "_tp_full_edge", None)
    if edge is not None:
        out["edge"] = (edge[0], edge[1][full_rows])
    return out


def round_share(weight: torch.Tensor, fmt: str, what: str, cols: torch.Tensor | None, full_in: int,
                full: dict) -> W4A16Weight | FP4Weight | FP8Weight | None:
    """A rank's dense share `weight` of the linear `what` (input columns `cols` of `full_in`; None: all of them)
    rounded to nearest in `fmt` as the full weight is (rtn.py), given what was noted of the full weight (`full`,
    from `noted`): W4A16 in the full weight's groups (where the share cuts one, that group is rounded whole, from
    its noted columns, and the share packed in smaller groups with the same scales); FP8 with each full row's
    scale; NVFP4 with the full tensor's scale; MXFP4 in the full weight's blocks. None where the full weight is not
    packed in `fmt` either; a ConfigError where the share's columns cut the format's blocks (W4A16: 32 columns)."""
    if fmt == "w4a16":
        group = rtn_group(full_in)
        if group is None or cols is None:
            return None if group is None else quantize(weight, fmt, group=group)
        fits = next((g for g in (group, *RTN_GROUPS) if group % g == 0 and whole_units(cols, g) is not None), None)
        if fits is None:
            raise misaligned(what, cols, full_in, RTN_GROUPS[-1], "groups")
        if fits == group or "edge" not in full:
            return quantize(weight, fmt, group=fits)
        return _round_cut_groups(weight, cols.cpu(), group, fits, full["edge"])
    unit = FP4_BLOCKS.get(fmt, FP8_BLOCK)
    if full_in % unit:
        return None
    if cols is not None and whole_units(cols, unit) is None:
        raise misaligned(what, cols, full_in, unit, "blocks")
    options = {"row_amax": full["row_amax"]} if fmt == "fp8" and "row_amax" in full else \
        {"tensor_amax": full["tensor_amax"]} if fmt == "nvfp4" and "tensor_amax" in full else {}
    return quantize(weight, fmt, **options)


def _round_cut_groups(weight: torch.Tensor, cols: torch.Tensor, group: int, pack: int,
                      edge: tuple[torch.Tensor, torch.Tensor]) -> W4A16Weight:
    """W4A16 share whose columns cut `group`-column groups: round every group it touches whole (its own columns
    and the noted others), pack in groups of `pack`, keep its own columns."""
    union = _cut_groups(cols, group)
    edge_cols, edge_values = edge
    if cols.numel() + edge_cols.numel() != union.numel():
        raise ValueError("the noted columns do not complete the groups this share cuts")
    whole = torch.empty(weight.shape[0], union.numel(), dtype=torch.float32, device=weight.device)
    own = torch.searchsorted(union, cols)
    whole[:, own.to(weight.device)] = weight.float()
    whole[:, torch.searchsorted(union, edge_cols).to(weight.device)] = edge_values.to(weight.device)
    packed = regroup(quantize(whole, "w4a16", group=group), pack)
    return take_units(packed, own[::pack] // pack)
