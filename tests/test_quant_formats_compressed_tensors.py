"""compressed-tensors checkpoints written by the compressed-tensors library itself: pack-quantized W4A16
(group, symmetric), W4 per channel and W8 per group (asymmetric, packed zero points), float-quantized FP8
per tensor, channel and block, naive-quantized int8, nvfp4-pack-quantized. onecat's dense weights equal
the library's own decompression; logits equal transformers' on those weights; unsupported variants are
refused by name."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.errors import UnsupportedModelError
from tests.quant_checkpoints import (
    KEPT_DENSE, check_logits, check_weights, dense_dir, linear_modules, onecat_weights, quantized_dir, tiny_llama)

pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402

GROUP = 32
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def scale_parts(w: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Min-max scales (and zero points, global scale) of [N, K] `w` in the library's convention: q = round(w /
    scale + zero) clamped to the signed b-bit range, or cast to float8 / E2M1 for float types."""
    n, k = w.shape
    if args.strategy == "block":
        bh, bw = args.block_structure
        amax = w.view(n // bh, bh, k // bw, bw).abs().amax((1, 3))
        return {"weight_scale": (amax / FP8_MAX).to(scale_dtype)}
    cols = {"group": args.group_size, "tensor_group": args.group_size, "channel": k, "tensor": n * k}[args.strategy]
    g = w.reshape(-1, cols)
    if args.strategy == "tensor_group":  # NVFP4: FP8 block scales under a float32 global scale
        global_scale = (FP8_MAX * 6 / w.abs().max()).reshape(1)
        scale = (g.abs().amax(1) / 6 * global_scale).to(torch.float8_e4m3fn).float()
        return {"weight_scale": scale.view(n, -1), "weight_global_scale": global_scale}
    if args.type == "float":
        scale = (g.abs().amax(1) / FP8_MAX).to(scale_dtype)
        return {"weight_scale": scale.reshape(1) if args.strategy == "tensor" else scale.view(n, -1)}
    top = 2 ** (args.num_bits - 1)
    if args.symmetric:
        return {"weight_scale": (g.abs().amax(1) / (top - 1)).clamp(min=1e-4).to(scale_dtype).view(n, -1)}
    lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
    scale = ((hi - lo) / (2 * top - 1)).clamp(min=1e-4).to(scale_dtype)
    zero = (-top - (lo / scale.float()).round()).clamp(-top, top - 1).to(torch.int8)
    return {"weight_scale": scale.view(n, -1), "weight_zero_point": zero.view(n, -1)}


def compress(state: dict[str, torch.Tensor], fmt: str, args: QuantizationArgs, scale_dtype: torch.dtype):
    """Each linear through the library's compressor for `fmt`: the stored parts, and the library's own
    decompression of them (the reference)."""
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored, reference = {}, {}
    for m in linear_modules(state):
        w = state[f"{m}.weight"].to(scale_dtype)
        parts = {"weight": w, **scale_parts(w.float(), args, scale_dtype)}
        stored[m] = dict(compressor.compress(parts, scheme))
        reference[m] = compressor.decompress(dict(stored[m]), scheme)["weight"]
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=["lm_head", KEPT_DENSE]).model_dump(mode="json")
    return stored, reference, config


CASES = {
    "w4a16-group-sym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                               group_size=GROUP), torch.float16),
    "w4-channel-asym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="channel"),
                        torch.bfloat16),
    "w8-group-asym": ("pack-quantized", dict(num_bits=8, type="int", symmetric=False, strategy="group",
                                             group_size=GROUP), torch.float32),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                   torch.float32),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                    torch.bfloat16),
    "fp8-block": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="block",
                                          block_structure=[16, 32]), torch.float32),
    "int8-channel-asym": ("naive-quantized", dict(num_bits=8, type="int", symmetric=False, strategy="channel"),
                          torch.float16),
    "nvfp4": ("nvfp4-pack-quantized", dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                                           group_size=16), torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_library_checkpoints_dequantize_to_the_library_values(tmp_path, case):
    fmt, kw, scale_dtype = CASES[case]
    src, state = tiny_llama(tmp_path / "src", tie_word_embeddings=case == "w4a16-group-sym")
    stored, reference, config = compress(state, fmt, QuantizationArgs(**kw), scale_dtype)
    qdir = quantized_dir(src, tmp_path / "ct", stored, config)
    # The library dequantizes in the scale's dtype (bf16 for nvfp4); onecat computes the same products in
    # float32, where they are exact (or, with float32 scales, the same single rounding), then rounds once:
    # cast to the library's dtype, onecat's weight is bit-identical to the library's.
    got = onecat_weights(qdir)
    for m, ref in reference.items():
        assert got[f"{m}.weight"].dtype == torch.float32
        assert torch.equal(got[f"{m}.weight"].to(ref.dtype), ref), m
    exact = {m: got[f"{m}.weight"] for m in reference}
    check_weights(qdir, state, exact)
    described = onecat_describe(config)
    check_logits(qdir, dense_dir(src, tmp_path / "dense", exact), described)


def test_activation_ordered_groups_follow_weight_g_idx():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from onecat.engine.quant.checkpoint_formats.compressed_tensors import CompressedTensors

    torch.manual_seed(0)
    n, k = 48, 64
    w = torch.randn(n, k)
    g_idx = (torch.randperm(k) // GROUP).int()  # each input column's group, scattered
    scale = torch.stack([w[:, g_idx == g].abs().amax(1) / 7 for g in range(k // GROUP)], 1).half()
    q = (w / scale.float()[:, g_idx.long()]).round().clamp(-8, 7).to(torch.int8)
    stored = {"weight_packed": pack_to_int32(q, 4), "weight_shape": torch.tensor([n, k]), "weight_scale": scale,
              "weight_g_idx": g_idx}
    # checkpoints from llm-compressor's former actorder="group" store weight_g_idx (the library no longer writes it)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    config = QuantizationConfig(config_groups={"g": QuantizationScheme(targets=["Linear"], weights=args)},
                                format="pack-quantized").model_dump(mode="json")
    got = CompressedTensors(config).dequantize("model.layers.0.mlp.up_proj", stored)
    assert torch.equal(got, q.float() * scale.float()[:, g_idx.long()])


def onecat_describe(config: dict) -> str:
    from onecat.engine.quant.checkpoint_formats.compressed_tensors import CompressedTensors

    return CompressedTensors(config).describe()


def test_description_names_format_and_scheme():
    _, _, config = compress({}, "pack-quantized", QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                   strategy="group", group_size=128), torch.float16)
    assert onecat_describe(config) == "compressed-tensors pack-quantized int4 g128"


@pytest.mark.parametrize("override,message", [
    ({"format": "marlin-24"}, "compressed-tensors format marlin-24 is not supported: onecat reads pack-quantized"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity format 'sparse-24-bitmask' is not supported"),
    ({"transform_config": {"config_groups": {}}}, "transform_config .* are not supported"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported; onecat reads awq, "
                                       "compressed-tensors, gptq, modelopt, mxfp4"),
])
def test_unsupported_variants_are_refused_by_name(tmp_path, override, message):
    src, _ = tiny_llama(tmp_path / "src")
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}, **override}
    with pytest.raises(UnsupportedModelError, match=message):
        onecat_weights(quantized_dir(src, tmp_path / "q", {}, config))


def test_pack_quantized_with_unpackable_bits_is_refused(tmp_path):
    src, state = tiny_llama(tmp_path / "src")
    stored, _, config = compress(state, "pack-quantized", QuantizationArgs(num_bits=3, type="int", symmetric=True,
                                                                           strategy="channel"), torch.float16)
    with pytest.raises(UnsupportedModelError, match="num_bits=3 .* not supported: onecat reads 2, 4, 8-bit"):
        onecat_weights(quantized_dir(src, tmp_path / "q", stored, config))
