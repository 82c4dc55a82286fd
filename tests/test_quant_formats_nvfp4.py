"""ModelOpt checkpoints (NVFP4, FP8), from config.json or hf_quant_config.json: the E2M1 table and nibble
order, exact dequantization, logits equal to transformers' on the dequantized weights, and refusals."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.errors import CorruptModelError, UnsupportedModelError
from onecat.engine.quant.bits import e2m1, fp4_bytes
from tests.fp4_writer import E2M1_MAGNITUDES, pack_nibbles, to_e2m1
from tests.quant_checkpoints import (
    KEPT_DENSE, check_logits, check_weights, dense_dir, linear_modules, onecat_weights, quantized_dir, tiny_llama)

pytest.importorskip("transformers")

BLOCK = 16
FP8_MAX = 448.0


def nvfp4_quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """ModelOpt's recipe: a float32 global scale (amax / (6 * 448)), an FP8 E4M3 scale per 16 inputs, E2M1
    codes; the reference is e2m1 * (block_scale * global_scale) in float32."""
    n, k = weight.shape
    global_scale = (weight.abs().max() / (6 * FP8_MAX)).float()
    blocks = weight.float().view(n, k // BLOCK, BLOCK)
    block_scale = (blocks.abs().amax(-1) / 6 / global_scale).to(torch.float8_e4m3fn)
    per_block = block_scale.float() * global_scale
    codes, values = to_e2m1(blocks / per_block.unsqueeze(-1))
    stored = {"weight": pack_nibbles(codes.view(n, k)), "weight_scale": block_scale,
              "weight_scale_2": global_scale.reshape(()), "input_scale": torch.tensor(0.5)}
    return stored, (values * per_block.unsqueeze(-1)).view(n, k)


def fp8_quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = (weight.abs().max() / FP8_MAX).float().reshape(())
    q = (weight / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor(0.25)}, q.float() * scale


def test_e2m1_table_and_nibble_order():
    assert e2m1(torch.arange(8)).tolist() == E2M1_MAGNITUDES
    assert e2m1(torch.arange(8, 16)).tolist() == [-v for v in E2M1_MAGNITUDES]
    # byte 0x2F: low nibble 0xF (-6.0) is element 0, high nibble 0x2 (1.0) element 1
    codes = fp4_bytes(torch.tensor([[0x2F, 0x71]], dtype=torch.uint8))
    assert codes.tolist() == [[0xF, 0x2, 0x1, 0x7]]
    assert e2m1(codes).tolist() == [[-6.0, 1.0, 0.5, 6.0]]
    assert pack_nibbles(torch.tensor([[0xF, 0x2, 0x1, 0x7]])).tolist() == [[0x2F, 0x71]]


@pytest.mark.parametrize("algo,sidecar,tie", [("NVFP4", True, False), ("NVFP4", False, True), ("FP8", True, False)])
def test_modelopt_dequantizes_exactly_and_matches_transformers(tmp_path, algo, sidecar, tie):
    src, state = tiny_llama(tmp_path / "src", tie_word_embeddings=tie)
    quantize = nvfp4_quantize if algo == "NVFP4" else fp8_quantize
    stored, reference = {}, {}
    for m in linear_modules(state):
        stored[m], reference[m] = quantize(state[f"{m}.weight"])
    config = {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head", KEPT_DENSE]}
    if algo == "NVFP4":
        config["group_size"] = BLOCK
    if not sidecar:
        config["quant_method"] = "modelopt"
    kv_scales = {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(1.0),
                 "model.layers.0.self_attn.v_proj.v_scale": torch.tensor(1.0)}
    qdir = quantized_dir(src, tmp_path / "q", stored, config, sidecar=sidecar, extra=kv_scales)
    # same float32 operations in the same order as the writer: bit-identical; input and KV scales dropped
    check_weights(qdir, state, reference)
    described = "modelopt nvfp4 g16" if algo == "NVFP4" else "modelopt fp8"
    check_logits(qdir, dense_dir(src, tmp_path / "dense", reference), described)


@pytest.mark.parametrize("config,message", [
    ({"quant_algo": "W4A8_AWQ"}, "ModelOpt quant_algo 'W4A8_AWQ' is not supported: onecat reads NVFP4, FP8"),
    ({"quant_algo": "NVFP4_AWQ"}, "quant_algo 'NVFP4_AWQ' is not supported"),
    ({"quant_algo": "NVFP4", "group_size": 32}, "NVFP4 with group_size=32 is not supported"),
])
def test_modelopt_variants_are_refused_by_name(tmp_path, config, message):
    src, _ = tiny_llama(tmp_path / "src")
    with pytest.raises(UnsupportedModelError, match=message):
        onecat_weights(quantized_dir(src, tmp_path / "q", {}, config, sidecar=True))


def test_nvfp4_misshapen_scales_are_corrupt(tmp_path):
    src, state = tiny_llama(tmp_path / "src")
    m = linear_modules(state)[0]
    parts, _ = nvfp4_quantize(state[f"{m}.weight"])
    parts["weight_scale"] = parts["weight_scale"][:, :-1]
    with pytest.raises(CorruptModelError, match="is not one scale per 16 inputs"):
        onecat_weights(quantized_dir(src, tmp_path / "q", {m: parts}, {"quant_algo": "NVFP4"}, sidecar=True))
