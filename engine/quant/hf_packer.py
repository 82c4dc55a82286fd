"""quantization='w4a16' (or 'awq', 'gptq', 'compressed-tensors'): a 4-bit checkpoint's linears stay packed
on the GPU and run through the W4A16 kernels (engine/quant/w4a16/linear.py); 'nvfp4' / 'mxfp4' likewise
keep an NVFP4 (ModelOpt) or MXFP4 checkpoint's linears packed for the FP4 GEMV (engine/quant/fp4/linear.py),
and 'fp8' an FP8 E4M3 checkpoint's for the packed GEMV's FP8 path (engine/quant/fp8/linear.py). A ModelOpt
MIXED_PRECISION checkpoint (say FP8 projections and NVFP4 experts) takes either name: each layer stays packed
in the format it is stored in, and the layers it left unquantized stay dense.

The packer sits beside the loader like the GGUF one (gguf_packer.py): the loader shows it each quantized
linear's stored tensors before dequantizing them (the model still loads dense weights, so loading and its
shape/completeness checks stay the same), it converts them to the packed layout (w4a16/packing.py, which
re-packs without changing a value), and after loading each linear whose every source shard was packed
alike (q/k/v, gate/up, the Gated DeltaNet's input projections are fused) is replaced by a packed layer
(packed_model.py). A fused linear with some shards stored dense keeps them dense beside its packed runs
(row_split.py); one whose shards carry different act-order permutations stays dense (one input permutation
per layer), and so does anything the checkpoint stored dense. An MoE layer whose every expert was stored
packed runs its experts packed (engine/layers/moe.py PackedExperts). With 'w4a16', 'nvfp4', 'mxfp4' or
'fp8' a dense checkpoint (HF, a GGUF file's dequantized tensors, or random weights: load_format dummy) is
quantized at load instead, round to nearest in that format (rtn.py): every decoder linear (not the LM head)
and MoE expert, less what the layers keep dense (routers and gates: SparseMoE.KEEP_DENSE; the Gated
DeltaNet's beta/decay rows: GatedDeltaNet.KEEP_DENSE_PARTS) and what the format's kernel cannot take.

Under tensor parallelism (`tensor_parallel`) each rank keeps only its share of every packed linear, cut as the
dense sharding cuts it (packed_shard.py), and quantization at load rounds each rank's dense share.
"""
from __future__ import annotations

import torch
from torch import nn

from onecat.engine.errors import ConfigError
from onecat.engine.layers.moe import Experts
from onecat.engine.quant.checkpoint_formats.modelopt import MIXED
from onecat.engine.quant.fp4.packing import FP4_NAMES, fp4_convert
from onecat.engine.quant.fp8.packing import FP8_METHODS, fp8_convert
from onecat.engine.quant.packed_model import replace_experts, replace_rows
from onecat.engine.quant.packed_shard import noted, packed_share, round_share
from onecat.engine.quant.rtn import quantize
from onecat.engine.quant.w4a16.layout import W4A16Weight
from onecat.engine.support_matrix import NO_CPU_KERNEL, QUANTIZED_AT_LOAD, Combination, refuse  # NO_CPU_KERNEL: refused on CPU

# quantization name -> the checkpoint quant_method it requires (None: any 4-bit one, or a dense checkpoint);
# nvfp4 / mxfp4 keep FP4 checkpoints packed for the FP4 GEMV (engine/quant/fp4/packing.py)
W4A16_NAMES = {"w4a16": None, "awq": "awq", "gptq": "gptq", "compressed-tensors": "compressed-tensors",
               "nvfp4": "modelopt", "mxfp4": "mxfp4", "fp8": FP8_METHODS}
# CPU: W4A16 weights run in the GGUF path's int4 layer (bf16 scales). Tests of the loading logic turn it off
# to get W4A16Linear, which computes on the exactly dequantized weight on any device.
CPU_INT4_KERNEL = True


def check_w4a16(quantization: str, model_format: str, device: torch.device) -> None:
    """Refuses what the W4A16 kernels cannot run, with what to use instead (the support matrix's weights stage).
    On CPU the 4-bit W4A16 formats run in the packed int4 layer of the GGUF path (w4a16/cpu.py); FP4 and FP8
    have no CPU kernel."""
    from onecat.engine.quant.int4.linear import Int4PackedLinear

    cpu_kernel = quantization not in NO_CPU_KERNEL and Int4PackedLinear.supported(torch.device("cpu"))
    refuse(Combination(quantization=quantization, checkpoint=model_format, device=device.type,
                       packed_cpu_kernel=cpu_kernel), "weights")


class W4A16Packer:
    """Collects packed linears while the checkpoint streams (`keep`), then swaps them in (`apply`)."""

    def __init__(self, quantization: str) -> None:
        self.quantization = quantization
        self.method = None  # the checkpoint's quant_method, once a quantized linear was seen
        self.packed: dict[str, W4A16Weight] = {}  # "<module>.weight" in checkpoint names
        self.cut = None  # tensor parallel: checkpoint linear -> (rows, columns) this rank keeps, or None: none
        self.dense_by_columns: list[str] = []  # tensor parallel: act-order linears cut by columns, left dense

    def tensor_parallel(self, loader) -> None:
        """This rank keeps only its share of each packed linear, cut where `loader` (engine/parallel's
        ShardLoader, of the model sharded on meta) cuts the dense weights, and the loader notes what rounding a
        share at load needs of each full weight (packed_shard.py)."""
        self.cut = loader.packed_cut
        loader.note_full_weight = True

    def keep(self, fmt, module: str, stored: dict[str, torch.Tensor]) -> None:
        weight = self._convert(fmt, module, stored)
        if weight is not None and self.cut is not None:
            cut = self.cut(module)
            if cut is None:  # a layer this rank does not run
                return
            weight = packed_share(weight, *cut, module)
            if weight is None:
                self.dense_by_columns.append(module)
        if weight is not None:
            self.packed[f"{module}.weight"] = weight

    def _convert(self, fmt, module: str, stored: dict[str, torch.Tensor]):
        """The stored linear in its packed layout, or None where it loads dense."""
        from onecat.engine.quant.w4a16.packing import convert

        want = W4A16_NAMES[self.quantization]
        if getattr(fmt, "algo", "") == MIXED and self.quantization in ("nvfp4", "fp8"):
            self.method = fmt.describe()  # each layer packed in the format it is stored in (FP8 or NVFP4)
            fp8 = fmt.layer_algo(module, fmt.require(module, stored, "weight")[0]) == "FP8"
            return fp8_convert(fmt, module, stored) if fp8 else fp4_convert(fmt, module, stored)
        if self.quantization == "fp8":
            self.method = fmt.describe()
            return fp8_convert(fmt, module, stored)  # refuses non-FP8 checkpoints by name; block-scaled: None
        if want is not None and fmt.method != want:
            raise ConfigError(f"quantization={self.quantization!r} but the checkpoint is {fmt.describe()}; use "
                              "quantization='w4a16' (any 4-bit AWQ / GPTQ / compressed-tensors checkpoint) or "
                              f"'{fmt.method}'")
        self.method = fmt.describe()
        if self.quantization in FP4_NAMES:
            return fp4_convert(fmt, module, stored)  # refuses FP8 ModelOpt by name
        return convert(fmt, module, stored)  # refuses non-4-bit variants by name

    def apply(self, model: nn.Module) -> dict:
        """Replaces the packed linears of a loaded model; returns what was done (for the engine's info)."""
        from onecat.engine.models.weight_loading import linear_slot

        if not self.packed and not self.dense_by_columns:
            if self.quantization == "fp8" and self.method is not None:
                raise ConfigError("quantization='fp8' needs an FP8 checkpoint with per-tensor or per-channel scales "
                                  f"(compressed-tensors float-quantized or ModelOpt FP8); {self.method} has none to "
                                  "pack: leave quantization unset")
            if self.method is not None or self.quantization not in QUANTIZED_AT_LOAD:
                raise ConfigError(f"quantization={self.quantization!r} needs a {W4A16_NAMES[self.quantization]} "
                                  "checkpoint; this one has no quantized linears (use quantization='w4a16', 'nvfp4', "
                                  "'mxfp4' or 'fp8' to quantize a dense checkpoint at load, or leave it unset)")
            return self._quantize_dense(model)  # a dense checkpoint, or random weights
        linears: dict[str, list[tuple[int, object]]] = {}
        experts: dict[str, dict[tuple[int, str], object]] = {}
        for name, weight in self.packed.items():
            slot = linear_slot(model, name[: -len(".weight")])
            if slot.expert is not None:
                experts.setdefault(slot.module, {})[(slot.expert, slot.leaf)] = weight
            else:
                linears.setdefault(slot.module, []).append((slot.start, weight))
        self.packed.clear()
        report = self._replace(model, linears, experts, f"checkpoint {self.method}")
        if self.dense_by_columns:  # act-order weights a rank would cut by columns (packed_shard.py)
            report["kept_dense"] = sorted(set(report["kept_dense"]) | set(self.dense_by_columns))
        return report

    def _replace(self, model: nn.Module, linears: dict[str, list[tuple[int, object]]],
                 experts: dict[str, dict[tuple[int, str], object]], source: str) -> dict:
        """Swap in the packed `linears` (module path -> (first row, weight) shards) and `experts` (Experts path
        -> (expert, projection) -> weight); what cannot be swapped stays dense and is listed."""
        tally = _Tally()
        tally.swap(model, linears, experts)
        return self._tally_report(model, tally, source)

    def _tally_report(self, model: nn.Module, tally: _Tally, source: str) -> dict:
        report = self._report(model, tally.replaced, tally.kept_dense, source)
        if tally.packed_experts:
            report["packed_experts"] = tally.packed_experts  # MoE layers whose every expert runs packed
        if tally.partly:
            report["partly_dense"] = tally.partly  # fused linears with some shards stored (or kept) dense
        return report

    def _quantize_dense(self, model: nn.Module) -> dict:
        """Round to nearest at load (rtn.py): every decoder linear, less what its module keeps dense (KEEP_DENSE
        children: routers and gates; KEEP_DENSE_PARTS rows of a fused linear), and every MoE expert. Each module
        is swapped for its packed form as soon as it is rounded, so the dense weights go one module at a time:
        the load's peak is the dense model and one module's packed weights, not the dense model and all of them."""
        keep = set()
        for name, m in model.named_modules():
            keep.update(f"{name}.{child}" for child in getattr(m, "KEEP_DENSE", ()))
        tally, groups = _Tally(), set()
        names = [name for name, _ in model.named_modules()]  # names only: no reference keeps a swapped module
        for name in names:
            if not name.startswith("layers.") or name in keep:
                continue
            try:
                module = model.get_submodule(name)
            except AttributeError:  # inside a module already swapped
                continue
            if isinstance(module, Experts):
                stored = _quantize_experts(module, self.quantization, name)
                if stored is None:
                    tally.kept_dense.append(name)
                else:
                    groups.update(getattr(w, "group", None) for w in stored.values())
                    del module
                    tally.swap(model, {}, {name: stored})
                continue
            if not isinstance(module, nn.Linear):
                continue
            shards = [(start, _quantize_share(model, name, module, start, rows, self.quantization))
                      for start, rows in _packable_rows(model, name, module.out_features)]
            if any(w is None for _, w in shards):
                tally.kept_dense.append(name)
                continue
            groups.update(getattr(w, "group", None) for _, w in shards)
            del module
            tally.swap(model, {name: shards}, {})
        report = self._tally_report(model, tally,
                                    f"round-to-nearest {_rtn_detail(self.quantization, groups)} at load")
        report["kept_dense"] = sorted(set(report["kept_dense"]))
        return report

    def _report(self, model: nn.Module, replaced: int, kept_dense: list[str], source: str) -> dict:
        from onecat.engine.kernels.quant_gemv import MAX_ROWS, MMA_16_ROWS, MMA_MAX_ROWS, backend, blocked_rows

        dense = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})

        kind, why = backend() if next(model.parameters()).is_cuda else ("", "")
        words = self.quantization if self.quantization in ("fp8", *FP4_NAMES) else "int4"
        per_call = MMA_MAX_ROWS if MMA_16_ROWS else MAX_ROWS  # on the tensor cores; MAX_ROWS a call off them
        cuda_rows = (f"up to {blocked_rows(words, per_call)} rows on the tensor cores, {per_call} a call "
                     f"(elsewhere {blocked_rows(words, MAX_ROWS)}, {MAX_ROWS} a call)")
        gemv = (f"packed GEMV {cuda_rows}: {why}" if kind in ("auto", "folded")
                else f"Triton {'FP4' if self.quantization in FP4_NAMES else 'W4A16'} GEMV up to {MAX_ROWS} rows ({why})")
        above = blocked_rows(words, per_call) if kind in ("auto", "folded") else MAX_ROWS
        large = f"weight dequantized per call, cuBLAS, above {above} rows"
        if kind:
            large = _with_packed_rows(large, above, words)
        if self.quantization == "fp8":
            return {"method": "fp8", "source": source, "packed_linears": replaced,
                    "kernel": gemv if kind in ("auto", "folded") else f"weight dequantized per call, cuBLAS ({why})",
                    "large_batch_path": large, "kept_dense": kept_dense, "dense_linears": dense}
        if self.quantization in FP4_NAMES:
            return {"method": self.quantization, "source": source, "packed_linears": replaced,
                    "kernel": gemv, "large_batch_path": large, "kept_dense": kept_dense, "dense_linears": dense}
        if next(model.parameters()).device.type == "cpu" and CPU_INT4_KERNEL:
            from onecat.engine.quant.int4.linear import Int4PackedLinear

            return {"method": "w4a16", "source": source, "packed_linears": replaced, "kernel":
                    Int4PackedLinear.kernel() + "; scales rounded to bfloat16", "large_batch_path":
                    Int4PackedLinear.large_batch_path(), "kept_dense": kept_dense,
                    "dense_linears": dense}
        return {"method": "w4a16", "source": source, "packed_linears": replaced,
                "kernel": gemv, "large_batch_path": large, "kept_dense": kept_dense, "dense_linears": dense}


def _with_packed_rows(dense_path: str, gemv_rows: int, words_format: str) -> str:
    """The large-batch path's description with the packed many-row GEMM where it takes this format's calls (past
    the GEMV's `gemv_rows`)."""
    from onecat.engine.kernels import triton_support as ts

    high = ts.packed_rows_up_to(words_format)
    low = max(gemv_rows + 1, ts.PACKED_ROWS[0])
    if high < low:
        return dense_path
    return (f"the packed many-row GEMM for {low}-{high} rows on SM{ts.PACKED_ROWS_MIN_CAPABILITY}+ "
            f"(ONECAT_PACKED_ROWS_GEMM=0 turns it off), above that: weight dequantized per call, cuBLAS")


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _packable_rows(model: nn.Module, path: str, out_features: int, full: bool = False) -> list[tuple[int, int]]:
    """(first row, rows) runs of the linear at `path` that quantization at load packs: all of it, less the rows
    of the checkpoint parts its owner names in KEEP_DENSE_PARTS (engine/layers/gated_deltanet.py). `full`: the
    runs of a tensor-parallel shard's full weight (the owner's full layout, `_tp_full_parts`)."""
    owner_path, _, leaf = path.rpartition(".")
    owner = _submodule(model, owner_path)
    parts = (getattr(owner, "_tp_full_parts", None) if full else None) or getattr(owner, "checkpoint_parts", {})
    dense = [(start, size) for part, (fused, start, size) in parts.items()
             if fused == leaf and part in getattr(owner, "KEEP_DENSE_PARTS", ())]
    runs, pos = [], 0
    for start, size in sorted(dense):
        if start > pos:
            runs.append((pos, start - pos))
        pos = max(pos, start + size)
    if pos < out_features:
        runs.append((pos, out_features - pos))
    return runs


def _quantize_share(model: nn.Module, path: str, module: nn.Linear, start: int, rows: int, fmt: str):
    """Rows [start, start + rows) of the linear at `path` rounded to nearest in `fmt`; a tensor-parallel shard
    (sharding records `_tp_full`) with the group and the maxima of its full weight (packed_shard.py)."""
    weight = module.weight[start:start + rows]
    full = getattr(module, "_tp_full", None)
    if full is None:
        return quantize(weight, fmt)
    known = noted(module, start, rows, _packable_rows(model, path, full[0], full=True))
    return round_share(weight, fmt, path, module._tp_cols, full[1], known)


def _quantize_experts(experts: Experts, fmt: str, path: str) -> dict[tuple[int, str], object] | None:
    """Each expert's gate, up and down projections rounded to nearest in `fmt`, as a checkpoint would store
    them; None when the format cannot take one of them (the layer's experts then all stay dense). A
    tensor-parallel shard rounds its own share of each (packed_shard.py: no full-weight scales for experts)."""
    i = experts.intermediate
    units = getattr(experts, "_tp_units", None)
    out = {}
    for e in range(experts.num_experts):
        gate_up = experts.gate_up_proj[e]
        for leaf, weight in (("gate_proj", gate_up[:i]), ("up_proj", gate_up[i:]), ("down_proj", experts.down_proj[e])):
            if units is None:
                out[(e, leaf)] = quantize(weight, fmt)
            else:  # the down projection's columns are the rank's units of the full intermediate width
                cols, width = (units, experts._tp_intermediate) if leaf == "down_proj" else (None, weight.shape[1])
                out[(e, leaf)] = round_share(weight, fmt, f"{path}.{e}.{leaf}", cols, width, {})
            if out[(e, leaf)] is None:
                return None
    return out


def _rtn_detail(fmt: str, groups: set) -> str:
    """The format and its groups (w4a16) or blocks, for the engine's info."""
    if fmt != "w4a16":
        return fmt + {"nvfp4": " (E4M3 scale per 16, tensor scale)", "mxfp4": " (E8M0 scale per 32)",
                      "fp8": " (E4M3, scale per row)"}[fmt]
    return "w4 g" + "/".join(str(g) for g in sorted((g for g in groups if g is not None), reverse=True))


class _Tally:
    """What swapping packed weights in has done so far (for the engine's info)."""

    def __init__(self):
        self.replaced, self.packed_experts, self.partly, self.kept_dense = 0, 0, [], []

    def swap(self, model: nn.Module, linears: dict[str, list[tuple[int, object]]],
             experts: dict[str, dict[tuple[int, str], object]]) -> None:
        for target, shards in linears.items():
            module = _submodule(model, target)
            done = replace_rows(model, target, module, shards, CPU_INT4_KERNEL) \
                if isinstance(module, nn.Linear) else None
            if done is None:
                self.kept_dense.append(target)
                continue
            self.replaced += 1
            if done == "partly packed":
                self.partly.append(target)
        for target, stored in experts.items():
            module = _submodule(model, target)
            if isinstance(module, Experts) and replace_experts(model, target, module, stored, CPU_INT4_KERNEL):
                self.packed_experts += 1
            else:
                self.kept_dense.append(target)
