"""Model configuration (what the checkpoint says), and the engine settings turned into torch objects.

The settings themselves are declared once, in engine/args.py (`EngineArgs`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from onecat.engine.args import EngineArgs
from onecat.engine.errors import ConfigError, UnsupportedModelError

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# HF `architectures` entries -> the architecture name the model registry runs.
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                    "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
                    # the published Qwen3.5 checkpoints: their language model runs, the vision tower is not read
                    "Qwen3_5ForConditionalGeneration": "qwen3_5", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe"}
HYBRID_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe")  # layers mix full attention with linear attention
LAYER_TYPES = ("full_attention", "linear_attention")


def architecture_of(cfg: dict) -> str:
    """The engine architecture name for an HF config dict; refuses architectures it cannot run."""
    names = cfg.get("architectures") or []
    for n in names:
        if n in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[n]
    raise UnsupportedModelError(
        f"model architecture {names or cfg.get('model_type')!r} is not supported; supported: "
        f"{', '.join(sorted(HF_ARCHITECTURES))}")


@dataclass
class ModelConfig:
    """The architecture facts the model code needs, normalized from an HF config or GGUF metadata."""

    architecture: str  # a value of HF_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    layer_types: list[str] = field(default_factory=list)  # hybrid models: each layer's kind (LAYER_TYPES)

    @property
    def kv_layer_ids(self) -> list[int]:
        """The layers that keep a paged KV cache: every layer, except a hybrid model's linear-attention layers
        (they keep a recurrent state instead)."""
        if not self.layer_types:
            return list(range(self.num_hidden_layers))
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = architecture_of(cfg)
        if arch in HYBRID_ARCHITECTURES and isinstance(cfg.get("text_config"), dict):
            cfg = _text_config(cfg)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_list = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,  # absent where every layer is MoE
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling") or _rope_params_scaling(cfg.get("rope_parameters")),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
            raw=cfg,
            layer_types=_hybrid_layer_types(cfg) if arch in HYBRID_ARCHITECTURES else [],
        )


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's language-model config: its `text_config`, with the outer architecture and the
    outer settings the text config leaves out (dtype, tied embeddings)."""
    text = dict(cfg["text_config"])
    for key in ("tie_word_embeddings", "torch_dtype", "dtype", "eos_token_id", "bos_token_id"):
        if key in cfg and (key == "tie_word_embeddings" or text.get(key) is None):
            text[key] = cfg[key]
    text["architectures"] = cfg["architectures"]
    return text


def _hybrid_layer_types(cfg: dict[str, Any]) -> list[str]:
    """The config's `layer_types`, or (older configs) every `full_attention_interval`-th layer full attention."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if len(types) != n or unknown:
        raise UnsupportedModelError(f"layer_types {types!r}: expected {n} entries, each one of {', '.join(LAYER_TYPES)}"
                                    + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return list(types)


def _rope_params_scaling(params: dict | None) -> dict | None:
    """Newer HF configs put scaling in `rope_parameters`; 'default' means none."""
    if not params or params.get("rope_type", "default") == "default":
        return None
    return dict(params)


def parse_dtype(dtype: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """EngineArgs.dtype as a torch dtype; auto: float32 on CPU, else the checkpoint's half type (or float16)."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # half precision matmuls are slow or missing on most CPUs
        return TORCH_DTYPES[checkpoint_dtype] if checkpoint_dtype in ("bfloat16", "float16") else torch.float16
    return TORCH_DTYPES[dtype]


def parse_kv_cache_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The float8 storage type, or None for a cache of floats (kv_cache_storage_dtype says which)."""
    if kv_cache_dtype in ("auto", "bfloat16"):
        return None
    return torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn


def kv_cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The float type a cache without fp8 holds: bfloat16 when asked for, else the model dtype."""
    return torch.bfloat16 if kv_cache_dtype == "bfloat16" else model_dtype


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available here; use device='cpu' or 'auto'")
    return dev


CPU_KV_CACHE_ENV = "ONECAT_CPU_KVCACHE_SPACE"  # GiB, like vLLM's VLLM_CPU_KVCACHE_SPACE
CPU_KV_CACHE_DEFAULT_GB = 2.0


def cpu_kv_cache_budget_gb() -> float:
    """The most KV memory a CPU engine allocates when kv_cache_memory_gb is not given: $ONECAT_CPU_KVCACHE_SPACE
    (GiB) or 2. The cache is zero-filled when the engine opens, so this is resident memory from the start."""
    raw = os.environ.get(CPU_KV_CACHE_ENV)
    if raw is None:
        return CPU_KV_CACHE_DEFAULT_GB
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < float("inf")):
        raise ConfigError(f"{CPU_KV_CACHE_ENV}={raw!r}: give the CPU KV cache size in GiB, a positive number")
    return value


# The engine core and scheduler read their settings under this name: one declaration, EngineArgs.
EngineConfig = EngineArgs
