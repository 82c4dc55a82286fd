"""quantization='w4a16' (or 'awq', 'gptq', 'compressed-tensors'): a 4-bit checkpoint's linears stay packed
on the GPU and run through the W4A16 kernels (engine/quant/w4a16/linear.py); 'nvfp4' / 'mxfp4' likewise
keep an NVFP4 (ModelOpt) or MXFP4 checkpoint's linears packed for the FP4 GEMV (engine/quant/fp4/linear.py),
and 'fp8' an FP8 E4M3 checkpoint's for the packed GEMV's FP8 path (engine/quant/fp8/linear.py).

The packer sits beside the loader like the GGUF one (gguf_packer.py): the loader shows it each quantized
linear's stored tensors before dequantizing them (the model still loads dense weights, so loading and its
shape/completeness checks stay the same), it converts them to the packed layout (w4a16/packing.py, which
re-packs without changing a value), and after loading each linear whose every source shard was packed
alike (q/k/v and gate/up are fused) is replaced by a `W4A16Linear`. A fused linear whose shards carry
different act-order permutations stays dense (one input permutation per layer), and so does anything the
checkpoint stored dense. With 'w4a16' a dense checkpoint (HF, or a GGUF file's dequantized tensors) is
quantized at load instead: round to nearest, asymmetric, every decoder linear (not the LM head), groups of
128 input columns (64 or 32 where 128 does not divide in_features).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from onecat.engine.errors import ConfigError
from onecat.engine.quant.fp4.layout import cat_fp4
from onecat.engine.quant.fp4.packing import FP4_NAMES, fp4_convert, fp4_unsupported_reason
from onecat.engine.quant.fp8.packing import FP8_METHODS, cat_fp8, fp8_convert
from onecat.engine.quant.w4a16.layout import W4A16Weight, quantize_w4
from onecat.engine.support_matrix import NO_CPU_KERNEL, Combination, refuse  # NO_CPU_KERNEL: refused on CPU

# quantization name -> the checkpoint quant_method it requires (None: any 4-bit one, or a dense checkpoint);
# nvfp4 / mxfp4 keep FP4 checkpoints packed for the FP4 GEMV (engine/quant/fp4/packing.py)
W4A16_NAMES = {"w4a16": None, "awq": "awq", "gptq": "gptq", "compressed-tensors": "compressed-tensors",
               "nvfp4": "modelopt", "mxfp4": "mxfp4", "fp8": FP8_METHODS}
RTN_GROUPS = (128, 64, 32)  # the largest that divides in_features
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


def cat_shards(shards: list[W4A16Weight]) -> W4A16Weight | None:
    """The shards of a fused projection stacked along N (None when their groups or permutations differ)."""
    first = shards[0]
    for w in shards[1:]:
        same_perm = (w.perm is None and first.perm is None) or (
            w.perm is not None and first.perm is not None and torch.equal(w.perm, first.perm))
        if w.group != first.group or w.in_features != first.in_features or not same_perm \
                or w.scales.dtype != first.scales.dtype:
            return None
    return W4A16Weight(torch.cat([w.qweight for w in shards]), torch.cat([w.scales for w in shards]),
                       torch.cat([w.zeros for w in shards]), first.group, first.perm)


class W4A16Packer:
    """Collects packed linears while the checkpoint streams (`keep`), then swaps them in (`apply`)."""

    def __init__(self, quantization: str) -> None:
        self.quantization = quantization
        self.method = None  # the checkpoint's quant_method, once a quantized linear was seen
        self.packed: dict[str, W4A16Weight] = {}  # "<module>.weight" in checkpoint names

    def keep(self, fmt, module: str, stored: dict[str, torch.Tensor]) -> None:
        from onecat.engine.quant.w4a16.packing import convert

        want = W4A16_NAMES[self.quantization]
        if self.quantization == "fp8":
            self.method = fmt.describe()
            weight = fp8_convert(fmt, module, stored)  # refuses non-FP8 checkpoints by name
            if weight is not None:  # block-scaled layers load dense
                self.packed[f"{module}.weight"] = weight
            return
        if want is not None and fmt.method != want:
            raise ConfigError(f"quantization={self.quantization!r} but the checkpoint is {fmt.describe()}; use "
                              "quantization='w4a16' (any 4-bit AWQ / GPTQ / compressed-tensors checkpoint) or "
                              f"'{fmt.method}'")
        self.method = fmt.describe()
        if self.quantization in FP4_NAMES:
            self.packed[f"{module}.weight"] = fp4_convert(fmt, module, stored)  # refuses FP8 ModelOpt by name
            return
        self.packed[f"{module}.weight"] = convert(fmt, module, stored)  # refuses non-4-bit variants by name

    def apply(self, model: nn.Module) -> dict:
        """Replaces the packed linears of a loaded model; returns what was done (for the engine's info)."""
        want = W4A16_NAMES[self.quantization]
        if not self.packed:
            if self.quantization == "fp8":
                raise ConfigError("quantization='fp8' needs an FP8 checkpoint with per-tensor or per-channel scales "
                                  f"(compressed-tensors float-quantized or ModelOpt FP8); {self.method or 'this one'} "
                                  "has none to pack: leave quantization unset")
            if want is not None:
                raise ConfigError(f"quantization={self.quantization!r} needs a {want} checkpoint; this one has no "
                                  "quantized linears (use quantization='w4a16' to quantize a dense checkpoint at "
                                  "load, or leave it unset)")
            return self._quantize_dense(model)
        fused: dict[str, tuple[str, int]] = getattr(model, "_FUSED", {})
        need = Counter(target for target, _ in fused.values())
        groups: dict[str, dict[int, W4A16Weight]] = {}
        for name, weight in self.packed.items():
            path = name.removeprefix("model.")[: -len(".weight")]
            parent, _, leaf = path.rpartition(".")
            target, shard = (f"{parent}.{fused[leaf][0]}", fused[leaf][1]) if leaf in fused else (path, 0)
            groups.setdefault(target, {})[shard] = weight
        replaced, kept_dense = 0, []
        for target, shards in groups.items():
            module = _submodule(model, target)
            n_shards = need.get(target.rpartition(".")[2], 1)
            weight = None
            if isinstance(module, nn.Linear) and sorted(shards) == list(range(n_shards)):
                cat = cat_fp4 if self.quantization in FP4_NAMES else cat_fp8 if self.quantization == "fp8" \
                    else cat_shards
                weight = cat([shards[i] for i in range(n_shards)])
            if weight is None or weight.out_features != module.out_features or fp4_unsupported_reason(weight) \
                    or not _swap(model, target, module, weight):
                kept_dense.append(target)
                continue
            replaced += 1
        self.packed.clear()
        return self._report(model, replaced, kept_dense, f"checkpoint {self.method}")

    def _quantize_dense(self, model: nn.Module) -> dict:
        replaced, kept_dense, groups = 0, [], set()
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear) or not name.startswith("layers."):
                continue
            group = next((g for g in RTN_GROUPS if module.in_features % g == 0), None)
            if group is None:
                kept_dense.append(name)
                continue
            if not _swap(model, name, module, quantize_w4(module.weight.detach(), group)):
                kept_dense.append(name)
                continue
            groups.add(group)
            replaced += 1
        return self._report(model, replaced, kept_dense, "round-to-nearest w4 g" + "/".join(
            str(g) for g in sorted(groups, reverse=True)) + " at load")

    def _report(self, model: nn.Module, replaced: int, kept_dense: list[str], source: str) -> dict:
        from onecat.engine.kernels.quant_gemv import MAX_ROWS, backend

        dense = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})

        kind, why = backend() if next(model.parameters()).is_cuda else ("", "")
        gemv = (f"packed GEMV up to {MAX_ROWS} rows: {why}" if kind in ("auto", "folded")
                else f"Triton {'FP4' if self.quantization in FP4_NAMES else 'W4A16'} GEMV up to {MAX_ROWS} rows ({why})")
        if self.quantization == "fp8":
            return {"method": "fp8", "source": source, "packed_linears": replaced,
                    "kernel": gemv if kind in ("auto", "folded") else f"weight dequantized per call, cuBLAS ({why})",
                    "large_batch_path": f"weight dequantized per call, cuBLAS, above {MAX_ROWS} rows",
                    "kept_dense": kept_dense, "dense_linears": dense}
        if self.quantization in FP4_NAMES:
            return {"method": self.quantization, "source": source, "packed_linears": replaced,
                    "kernel": gemv, "large_batch_path":
                    f"weight dequantized per call, cuBLAS, above {MAX_ROWS} rows", "kept_dense": kept_dense,
                    "dense_linears": dense}
        if next(model.parameters()).device.type == "cpu" and CPU_INT4_KERNEL:
            from onecat.engine.quant.int4.linear import DENSE_FROM_ROWS, Int4PackedLinear

            return {"method": "w4a16", "source": source, "packed_linears": replaced, "kernel":
                    Int4PackedLinear.kernel + "; scales rounded to bfloat16", "large_batch_path":
                    f"bf16 GEMM on a dequantized copy from {DENSE_FROM_ROWS} rows on", "kept_dense": kept_dense,
                    "dense_linears": dense}
        return {"method": "w4a16", "source": source, "packed_linears": replaced,
                "kernel": gemv, "large_batch_path":
                f"weight dequantized per call, cuBLAS, above {MAX_ROWS} rows", "kept_dense": kept_dense,
                "dense_linears": dense}


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _swap(model: nn.Module, path: str, module: nn.Linear, weight) -> bool:
    """Replace the linear at `path` by its packed form on the model's device; False (left dense) where that
    device has no packed form of it (CPU: act-order W4A16 layers)."""
    from onecat.engine.quant.fp4.layout import FP4Weight
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8.layout import FP8Weight
    from onecat.engine.quant.fp8.linear import FP8Linear
    from onecat.engine.quant.int4.linear import Int4PackedLinear
    from onecat.engine.quant.w4a16.cpu import int4_blocks
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    device = module.weight.device
    bias = None if module.bias is None else module.bias.detach()
    if device.type == "cpu" and CPU_INT4_KERNEL and isinstance(weight, W4A16Weight):
        blocks = int4_blocks(weight)
        if blocks is None:
            return False
        layer = Int4PackedLinear([blocks], bias, module.weight.dtype)
    else:
        weight = weight.to(device)
        kind = FP4Linear if isinstance(weight, FP4Weight) else FP8Linear if isinstance(weight, FP8Weight) else W4A16Linear
        layer = kind(weight, bias)
        layer.use_tiles(module.weight.dtype)
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    return True
