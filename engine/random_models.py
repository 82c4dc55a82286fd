"""`random:NAME` model sources: the real shapes of models onecat is measured on, without their weights.

A shape is a config.json (the published architecture, layer by layer) and a word-level tokenizer (token i
is the word `t{i}`); with load_format dummy the engine fills random weights (engine/loader/dummy.py). They
let a contract or a benchmark measure a model's speed on one GPU without the checkpoint: the kernels,
bytes and graphs are the real model's, the outputs mean nothing. The `tiny-*` shapes have the same
layer kinds at toy sizes, for tests on a CPU.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from onecat.engine.errors import ModelNotFoundError
from onecat.engine.kernels.cache import cache_root

RANDOM_PREFIX = "random:"

_LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=32768,
                 tie_word_embeddings=False, torch_dtype="float16")
_LLAMA_70B = dict(_LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
_QWEN3_8B = dict(_LLAMA_8B, architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                 intermediate_size=12288, num_hidden_layers=36, rms_norm_eps=1e-6, rope_theta=1000000.0)
_QWEN35_27B = dict(
    architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120,
    intermediate_size=17408, num_hidden_layers=64, layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=262144, tie_word_embeddings=False, torch_dtype="bfloat16")
_QWEN35_35B_A3B = dict(
    {k: v for k, v in _QWEN35_27B.items() if k != "intermediate_size"}, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
    num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512)
_SMOLLM2_135M = dict(_LLAMA_8B, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                     max_position_embeddings=8192, tie_word_embeddings=True)  # the embedded default's shape
_TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=2048, torch_dtype="float32")  # runners draw prompt ids up to 1256

# name -> config.json (layer_types holds one period of the pattern; it repeats over num_hidden_layers)
SHAPES: dict[str, dict] = {
    "llama3-8b": _LLAMA_8B,
    "llama3-70b": _LLAMA_70B,
    "qwen3-8b": _QWEN3_8B,
    "smollm2-135m": _SMOLLM2_135M,
    "qwen3.5-27b": _QWEN35_27B,
    "qwen3.5-35b-a3b": _QWEN35_35B_A3B,
    "tiny-llama": dict(_LLAMA_8B, **_TINY, intermediate_size=128, rope_theta=10000.0),
    "tiny-qwen3.5": dict(_QWEN35_27B, **_TINY, intermediate_size=128, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    "tiny-qwen3.5-moe": dict(_QWEN35_35B_A3B, **_TINY, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=64, shared_expert_intermediate_size=64),  # FP4 blocks: 64
}


def shape_config(name: str) -> dict:
    """The full config.json of shape `name` (layer_types spelled out, special tokens at the top of the
    vocabulary so that no token a prompt is made of is one)."""
    if name not in SHAPES:
        raise ModelNotFoundError(f"unknown random shape {RANDOM_PREFIX}{name!r}; known: "
                                 f"{', '.join(RANDOM_PREFIX + n for n in SHAPES)}")
    cfg = dict(SHAPES[name])
    if "layer_types" in cfg:
        period = cfg["layer_types"]
        cfg["layer_types"] = [period[i % len(period)] for i in range(cfg["num_hidden_layers"])]
    vocab = cfg["vocab_size"]
    return cfg | {"bos_token_id": vocab - 2, "eos_token_id": vocab - 1}


def random_model_dir(name: str, weights_required: bool) -> Path:
    """The shape's folder (config.json + tokenizer.json), written once into the onecat cache."""
    if weights_required:
        raise ModelNotFoundError(f"{RANDOM_PREFIX}{name} is a model shape without weights: set load_format dummy "
                                 "or dummy_peaked (engine.options.load_format in a contract) to run it with random "
                                 "weights")
    cfg = shape_config(name)
    text = json.dumps(cfg, indent=1, sort_keys=True)
    folder = cache_root() / "random-models" / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if not (folder / "tokenizer.json").is_file():
        _write(folder, text, cfg["vocab_size"])
    return folder


def _write(folder: Path, config_text: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tmp = folder.with_name(folder.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(config_text)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp / "tokenizer.json"))
    if not folder.exists():  # another process may have written it first
        tmp.replace(folder)
