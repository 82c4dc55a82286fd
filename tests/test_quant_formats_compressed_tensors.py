"""compressed-tensors checkpoints written by the compressed-tensors library itself: pack-quantized W4A16
(group, symmetric), W4 and W8 per channel (asymmetric, packed zero points), float-quantized FP8 per tensor
and per channel. onecat's dense weights equal the library's own decompression; logits equal transformers'
on those weights; unsupported variants are refused by name."""
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


def scales_for(w: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype):
    """Min-max scale (and zero point) per group, channel or tensor of [N, K] `w`, in the library's convention
    (q = round(w / scale + zero) clamped to the signed b-bit range, or to float8 for float types)."""
    n, k = w.shape
    cols = {"group": args.group_size, "channel": k, "tensor": n * k}[args.strategy]
    g = w.reshape(-1, cols)
    if args.type == "float":
        scale = (g.abs().amax(1) / torch.finfo(torch.float8_e4m3fn).max).to(scale_dtype)
        return scale.reshape(1) if args.strategy == "tensor" else scale.view(n, -1), None
    top = 2 ** (args.num_bits - 1)
    if args.symmetric:
        scale = (g.abs().amax(1) / (top - 1)).clamp(min=1e-4).to(scale_dtype)
        return scale.view(n, -1), None
    lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
    scale = ((hi - lo) / (2 * top - 1)).clamp(min=1e-4).to(scale_dtype)
    zero = (-top - (lo / scale.float()).round()).clamp(-top, top - 1).to(torch.int8)
    return scale.view(n, -1), zero.view(n, -1)


def compress(state: dict[str, torch.Tensor], fmt: str, args: QuantizationArgs, scale_dtype: torch.dtype):
    """Each linear through the library's compressor for `fmt`: the stored parts, and the library's own
    decompression of them (the reference)."""
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored, reference = {}, {}
    for m in linear_modules(state):
        w = state[f"{m}.weight"].to(scale_dtype)
        scale, zero = scales_for(w.float(), args, scale_dtype)
        parts = {"weight": w, "weight_scale": scale}
        if zero is not None:
            parts["weight_zero_point"] = zero
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_library_checkpoints_dequantize_to_the_library_values(tmp_path, case):
    fmt, kw, scale_dtype = CASES[case]
    src, state = tiny_llama(tmp_path / "src", tie_word_embeddings=case == "w4a16-group-sym")
    stored, reference, config = compress(state, fmt, QuantizationArgs(**kw), scale_dtype)
    qdir = quantized_dir(src, tmp_path / "ct", stored, config)
    # The library dequantizes in the scale's dtype; onecat computes the same products in float32, where
    # they are exact (or, for FP8 with float32 scales, the same single rounding), then rounds once: cast
    # to the scale dtype, onecat's weight is bit-identical to the library's.
    got = onecat_weights(qdir)
    for m, ref in reference.items():
        assert got[f"{m}.weight"].dtype == torch.float32
        assert torch.equal(got[f"{m}.weight"].to(ref.dtype), ref), m
    exact = {m: got[f"{m}.weight"] for m in reference}
    check_weights(qdir, state, exact)
    described = onecat_describe(config)
    check_logits(qdir, dense_dir(src, tmp_path / "dense", exact), described)


def onecat_describe(config: dict) -> str:
    from onecat.engine.quant.formats.compressed_tensors import CompressedTensors

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
