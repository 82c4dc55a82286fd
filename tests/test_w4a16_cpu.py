"""W4A16 checkpoints on CPU: their 4-bit codes run in the GGUF path's packed int4 layer, scales rounded to
bfloat16 (engine/quant/w4a16/cpu.py)."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.quant.int4.linear import Int4PackedLinear
from onecat.engine.quant.w4a16.cpu import int4_blocks
from onecat.engine.quant.w4a16.layout import dequantize, from_codes, quantize_w4

pytestmark = pytest.mark.skipif(not Int4PackedLinear.supported(torch.device("cpu")),
                                reason="this torch has no CPU int4 kernel")


def test_blocks_hold_the_checkpoint_codes_exactly_where_bf16_holds_the_scales():
    """Power-of-two scales and whole zeros survive bf16: the int4 layer's weights equal the checkpoint's."""
    g = torch.Generator().manual_seed(0)
    n, k, group = 48, 256, 128
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = 2.0 ** -torch.randint(4, 9, (n, k // group), generator=g).float()
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    w = from_codes(q, scales.half(), zeros)
    blocks = int4_blocks(w)
    assert blocks.codes.shape == (n, k) and blocks.scale.shape == (n, k // 32)
    assert torch.equal(Int4PackedLinear._dequantized([blocks]), dequantize(w))


def test_other_scales_lose_only_bf16_rounding_and_act_order_has_no_blocks():
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    w = quantize_w4(weight, 128)
    ref = dequantize(w)
    got = Int4PackedLinear._dequantized([int4_blocks(w)])
    step = w.scales.float().abs().repeat_interleave(128, dim=1)  # one code step of each weight's group
    assert ((got - ref).abs() <= 2 ** -7 * 16 * step).all()  # bf16 keeps 8 bits of scale and offset
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(2)).int()
    assert int4_blocks(from_codes(torch.zeros(64, 512, dtype=torch.int64), w.scales, w.zeros.float(), perm)) is None


def _prompt_logprobs(path, **settings):
    from onecat.engine import LLM, SamplingParams
    from tests.quant_checkpoints import PROMPTS

    with LLM(str(path), dtype="float32", enable_prefix_caching=False, max_model_len=64, **settings) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
        info = llm.info()["quantization"]
    return [torch.tensor(o.prompt_logprobs[1:]) for o in outs], info


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_checkpoint_runs_packed_on_cpu(tmp_path, act_order):
    """The packed engine tracks the checkpoint run dequantized (bf16 activations and scales in the int4
    layer); act-order layers, which have no blocks in input order, stay dense and are listed."""
    pytest.importorskip("transformers")
    from tests.test_w4a16_engine import gptq_dir

    qdir = gptq_dir(tmp_path, act_order)
    packed, info = _prompt_logprobs(qdir, quantization="gptq")
    dense, _ = _prompt_logprobs(qdir)
    a, b = torch.cat(packed), torch.cat(dense)
    assert a.numel() > 0 and (a - b).abs().max() < 0.05
    assert info["kernel"].startswith(Int4PackedLinear.kernel())
    assert info["packed_linears"] == (0 if act_order else 7)
    assert len(info["kept_dense"]) == (7 if act_order else 0)


def test_rtn_at_load_runs_packed_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    from tests.quant_checkpoints import tiny_llama

    src, _ = tiny_llama(tmp_path / "src", hidden_size=128, intermediate_size=256)
    packed, info = _prompt_logprobs(src, quantization="w4a16")
    dense, _ = _prompt_logprobs(src)
    assert info["packed_linears"] == 8 and info["source"] == "round-to-nearest w4 g128 at load"
    a, b = torch.cat(packed), torch.cat(dense)  # 4-bit round to nearest of random weights: close, not equal
    assert a.numel() > 0 and (a - b).abs().max() < 1.0 and not torch.equal(a, b)
