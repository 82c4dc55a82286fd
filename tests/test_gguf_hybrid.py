"""Qwen3.5 and Qwen3.5-MoE GGUF files (`qwen35`, `qwen35moe`) load as their HF checkpoints: the same config,
the same weights tensor by tensor once the converter's transforms are undone, and the same logprobs (and
transformers' within the hybrid parity tolerance) on ragged prompts with chunked prefill.

The fixtures in tests/data were written by llama.cpp's own converter, convert_hf_to_gguf.py at llama.cpp commit
0c1e57098 (the copy in the llama-cpp-python 0.3.36 sdist, vendor/llama.cpp), from the tiny random-init
checkpoints beside them (tests/tiny_moe_hybrid.py, hidden 32, vocab 128, 4 layers, 2 key / 4 value heads in
Gated DeltaNet so the value-head reorder applies), float32:

    tiny-qwen35.gguf           tiny-qwen35/ with its multi-token-prediction head (mtp_num_hidden_layers: 1)
    tiny-qwen35moe.gguf        tiny-qwen35moe/ with --no-mtp
    tiny-qwen35moe-fused.gguf  tiny-qwen35moe/ with --no-mtp --fuse-qkv --fuse-gate-up-exps

Regenerate them with `python -m tests.test_gguf_hybrid LLAMA_CPP_DIR` (the converter runs from LLAMA_CPP_DIR with
its gguf-py on the path, each as `convert_hf_to_gguf.py DIR --outtype f32 --outfile OUT [flags]`). The tiny
word-level tokenizer is none of the BPE pre-tokenizers the converter recognizes by hash, so the generator names
it `qwen2` (the one patch to the converter, in its vocabulary step only); no weight passes through it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.test_moe_hybrid_parity import ATOL, hf_logprobs, max_errors, run_onecat

gguf = pytest.importorskip("gguf")

DATA = Path(__file__).parent / "data"
FIXTURES = {"tiny-qwen35.gguf": "tiny-qwen35", "tiny-qwen35moe.gguf": "tiny-qwen35moe",
            "tiny-qwen35moe-fused.gguf": "tiny-qwen35moe"}
PROMPTS = [[5, 17, 99, 3], list(range(10, 47)), [100], list(range(60, 120))]
ZERO_CENTERED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
                 "model.norm.weight")


def _open(gguf_name: str):
    from onecat.engine.loader.gguf import gguf_to_hf_config, open_gguf

    path = DATA / gguf_name
    reader = open_gguf(path)
    return reader, gguf_to_hf_config(reader, path)


def _hf_tensors(hf_dir: Path, num_experts: int) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors, each projection's experts stacked (as the GGUF stores them), without the
    multi-token-prediction head."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    sd = load_file(str(hf_dir / "model.safetensors"))
    for name, t in sd.items():
        if name.startswith("mtp."):
            continue
        head, sep, tail = name.partition(".experts.")
        if not sep:
            out[name] = t
        elif tail.startswith("0."):
            proj = tail.split(".")[1]
            out[f"{head}.experts.{proj}.weight"] = torch.stack(
                [sd[f"{head}.experts.{e}.{proj}.weight"] for e in range(num_experts)])
    return out


@pytest.mark.parametrize("gguf_name", sorted(FIXTURES))
def test_config_reads_as_the_hf_config(gguf_name):
    from onecat.engine.config import ModelConfig

    _, cfg = _open(gguf_name)
    hf = json.loads((DATA / FIXTURES[gguf_name] / "config.json").read_text())
    keys = ["architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim", "tie_word_embeddings"]
    keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"] \
        if "num_experts" in hf else ["intermediate_size"]
    assert {k: cfg[k] for k in keys} == {k: hf[k] for k in keys}
    assert cfg["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"])
    assert cfg["rope_parameters"]["rope_theta"] == hf["rope_parameters"]["rope_theta"]
    assert cfg["rope_parameters"]["partial_rotary_factor"] == hf["rope_parameters"]["partial_rotary_factor"]
    assert ModelConfig.from_hf(cfg).kv_layer_ids == ModelConfig.from_hf(hf).kv_layer_ids


@pytest.mark.parametrize("gguf_name", sorted(FIXTURES))
def test_weights_equal_the_hf_checkpoint(gguf_name):
    """Every tensor equal to the bit, except the zero-centered norm weights: the file keeps 1 + w in float32, so
    w comes back rounded to that sum's precision, and 1 + w (all the model computes from it) is equal."""
    from onecat.engine.loader.gguf import iter_gguf_weights

    reader, cfg = _open(gguf_name)
    ref = _hf_tensors(DATA / FIXTURES[gguf_name], cfg.get("num_experts", 0))
    got: dict[str, torch.Tensor] = {}
    for name, t in iter_gguf_weights(reader, cfg):
        assert name not in got, f"{name} twice"
        got[name] = t
    assert sorted(got) == sorted(ref)
    for name, want in ref.items():
        have = got[name]
        assert have.dtype == want.dtype and have.shape == want.shape, name
        if name.endswith(ZERO_CENTERED):
            assert torch.equal(1.0 + have, 1.0 + want), name
            assert (have - want).abs().max() <= 2.0 ** -24, name
        else:
            assert torch.equal(have, want), name


@pytest.mark.parametrize("gguf_name", sorted(FIXTURES))
def test_logprobs_equal_the_hf_checkpoint_and_transformers(gguf_name):
    """Ragged prompts in one batch, prefill chunked over steps by a 24-token budget, greedy decode: the GGUF file
    gives onecat's logprobs on the HF directory to the bit, and transformers' within the parity tolerance."""
    hf_dir = DATA / FIXTURES[gguf_name]
    from_gguf = run_onecat(DATA / gguf_name, PROMPTS, max_num_batched_tokens=24)
    from_hf = run_onecat(hf_dir, PROMPTS, max_num_batched_tokens=24)
    assert [o.token_ids for o in from_gguf] == [o.token_ids for o in from_hf]
    assert [o.prompt_logprobs for o in from_gguf] == [o.prompt_logprobs for o in from_hf]
    assert [o.logprobs for o in from_gguf] == [o.logprobs for o in from_hf]
    ref = hf_logprobs(hf_dir, [p + o.token_ids for p, o in zip(PROMPTS, from_gguf)])
    assert max_errors(from_gguf, PROMPTS, ref) <= ATOL


def test_block_quantized_tensors_are_dequantized_before_the_reverse_transforms(tmp_path):
    """Q8_0 tensors (every matrix whose rows fit 32-wide blocks): each loaded tensor is the HF one to within the
    format's rounding, so the reorders and offsets were undone on the dequantized values."""
    from onecat.engine.loader.gguf import gguf_to_hf_config, iter_gguf_weights, open_gguf

    path = _rewrite(DATA / "tiny-qwen35moe.gguf", tmp_path / "q8.gguf", quantize=gguf.GGMLQuantizationType.Q8_0)
    reader = open_gguf(path)
    assert sum(t.tensor_type.name == "Q8_0" for t in reader.tensors) >= 20
    cfg = gguf_to_hf_config(reader, path)
    ref = _hf_tensors(DATA / "tiny-qwen35moe", cfg["num_experts"])
    for name, have in iter_gguf_weights(reader, cfg):
        want = ref[name]
        assert have.shape == want.shape and (have - want).abs().max() <= want.abs().max() / 100, name


# ---- what is refused ------------------------------------------------------------------------------------------

def _rewrite(src: Path, dst: Path, drop_keys=(), set_keys=None, drop_tensors=(), add_tensors=None,
             quantize=None) -> Path:
    """A copy of a GGUF file with some metadata keys or tensors changed; `quantize`: a GGML type that every float32
    tensor of two or more dimensions whose rows fit its blocks is stored in."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype) in (set_keys or {}).items():
        w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        block = gguf.GGML_QUANT_SIZES[quantize][0] if quantize is not None else 0
        if block and t.data.ndim >= 2 and t.data.shape[-1] % block == 0:
            w.add_tensor(t.name, gguf.quants.quantize(t.data, quantize), raw_dtype=quantize)
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for name, arr in (add_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _load(path: Path, **settings):
    from onecat.engine import LLM

    with LLM(str(path), dtype="float32", **settings):
        pass


def test_refusals_say_what_is_missing(tmp_path):
    import numpy as np

    from onecat.engine.errors import ConfigError, UnsupportedModelError
    from onecat.engine.loader.gguf import iter_gguf_weights

    src = DATA / "tiny-qwen35moe.gguf"
    f = _rewrite(src, tmp_path / "no-ssm.gguf", drop_keys=("qwen35moe.ssm.state_size",))
    with pytest.raises(UnsupportedModelError, match="lacks the metadata key qwen35moe.ssm.state_size"):
        _load(f)
    f = _rewrite(src, tmp_path / "scaled.gguf", drop_keys=("qwen35moe.expert_weights_scale",),
                 set_keys={"qwen35moe.expert_weights_scale": (2.5, gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(UnsupportedModelError, match="expert_weights_scale"):
        _load(f)
    f = _rewrite(src, tmp_path / "extra.gguf", add_tensors={"blk.0.ssm_d.weight": np.zeros(4, np.float32)})
    with pytest.raises(UnsupportedModelError, match="unexpected GGUF tensor blk.0.ssm_d.weight"):
        _load(f)
    mtp_only = [t.name for t in gguf.GGUFReader(str(src)).tensors if t.name.startswith("blk.0.")]
    f = _rewrite(src, tmp_path / "draft.gguf", drop_tensors=mtp_only)
    with pytest.raises(UnsupportedModelError, match="multi-token-prediction head"):
        _load(f)
    with pytest.raises(ConfigError, match="quantization 'gguf' is not implemented for hybrid"):
        _load(src, quantization="gguf")  # the engine says it first; the loader too, for its other callers
    reader, cfg = _open("tiny-qwen35moe.gguf")
    with pytest.raises(UnsupportedModelError, match="leave quantization unset"):
        next(iter_gguf_weights(reader, cfg, keep_quantized=True))


# ---- regenerating the fixtures ---------------------------------------------------------------------------------

SMALL = dict(vocab_size=128, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             linear_key_head_dim=8, linear_value_head_dim=8)


def _word_tokenizer_with_eos(d: Path, vocab: int) -> None:
    """Words t0..t{vocab-2} and `<|endoftext|>` as the last id, so the tokenizer fits the vocabulary whichever
    tokenizer class transformers picks for the model type."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = {**{f"t{i}": i for i in range(vocab - 1)}, "<|endoftext|>": vocab - 1}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "eos_token": "<|endoftext|>"}))


def _add_mtp_head(d: Path) -> None:
    """A multi-token-prediction head as published Qwen3.5 checkpoints carry it (`mtp.*`, one full-attention
    layer), random, so the GGUF file gets its extra block."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    h, g = cfg["hidden_size"], torch.Generator().manual_seed(7)
    full = cfg["layer_types"].index("full_attention")
    for name, t in list(sd.items()):
        if name.startswith(f"model.layers.{full}."):
            sd[name.replace(f"model.layers.{full}.", "mtp.layers.0.")] = t + 0.01 * torch.randn(t.shape, generator=g)
    sd["mtp.fc.weight"] = 0.02 * torch.randn(h, 2 * h, generator=g)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=g)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg["mtp_num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def make_fixtures(llama_cpp: Path, out: Path = DATA) -> None:
    import runpy
    import shutil

    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    for d in ("tiny-qwen35", "tiny-qwen35moe"):
        shutil.rmtree(out / d, ignore_errors=True)
    dense = make_tiny_moe_hybrid("qwen3_5", out / "tiny-qwen35", **SMALL, intermediate_size=48)
    moe = make_tiny_moe_hybrid("qwen3_5_moe", out / "tiny-qwen35moe", **SMALL, moe_intermediate_size=16,
                               shared_expert_intermediate_size=24, num_experts=4)
    for d in (dense, moe):
        _word_tokenizer_with_eos(d, SMALL["vocab_size"])
    _add_mtp_head(dense)
    sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]
    for m in [m for m in sys.modules if m.split(".")[0] == "gguf"]:
        del sys.modules[m]  # the converter runs with the gguf-py of its own tree
    import conversion.base  # llama.cpp's converter package

    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    runs = [(dense, "tiny-qwen35.gguf", []), (moe, "tiny-qwen35moe.gguf", ["--no-mtp"]),
            (moe, "tiny-qwen35moe-fused.gguf", ["--no-mtp", "--fuse-qkv", "--fuse-gate-up-exps"])]
    for src, name, flags in runs:
        sys.argv = ["convert_hf_to_gguf.py", str(src), "--outtype", "f32", "--outfile", str(out / name), *flags]
        try:
            runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
        except SystemExit as e:
            if e.code:
                raise


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.test_gguf_hybrid LLAMA_CPP_DIR")
    make_fixtures(Path(sys.argv[1]).resolve())
