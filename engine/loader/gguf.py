"""Loads a GGUF file: metadata -> HF-style config, tensors dequantized to HF names and layout.

llama.cpp stores Llama's q/k projections permuted for its interleaved RoPE; they are permuted
back so that every architecture runs through the same HF-layout model code. Qwen3.5 and Qwen3.5-MoE
(`qwen35`, `qwen35moe`) have their own metadata and reverse transforms (loader/gguf_qwen35.py).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from onecat.engine.errors import CorruptModelError, UnsupportedModelError
from onecat.engine.loader.gguf_qwen35 import QWEN35_ARCHS, iter_qwen35_weights, qwen35_config
from onecat.engine.quant.int4.layout import PACKABLE_GGUF_TYPES, QuantizedWeight

GGUF_ARCH_TO_HF = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                   "qwen3moe": "Qwen3MoeForCausalLM", **QWEN35_ARCHS}
# Tensor types are decoded by the gguf package (llama.cpp's own Python reference): every type it implements
# loads, dequantized to float32 (K-quants, Q5_0/Q5_1, the IQ types, MXFP4 ...); `quantization="gguf"` keeps
# only Q4_0/Q4_1/Q8_0 packed (engine/quant/int4/layout.py PACKABLE_GGUF_TYPES).

_LAYER_MAP = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # MoE: the router, and every expert's projection stacked in one [experts, rows, cols] tensor
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_TOP_MAP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}


def open_gguf(path: Path):
    """Parsing a GGUF header takes seconds (large vocabularies); reuse it while the file is unchanged."""
    st = path.stat()
    return _open_gguf_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.cache
def _plain_view_reader_class():
    """gguf's reader slices a numpy.memmap once per metadata value (three views per vocabulary entry), and each
    memmap view runs memmap's own bookkeeping: half of a 49K-token header's parse. A plain ndarray view of the
    same mapping gives the same fields and tensors, memory-mapped as before, in about half the time."""
    from gguf import GGUFReader

    class PlainViewGGUFReader(GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._data = mapped.view(np.ndarray)

    return PlainViewGGUFReader


@functools.lru_cache(maxsize=8)  # a process that opens a few small files keeps a large one's parsed header
def _open_gguf_cached(path: str, mtime_ns: int, size: int):
    try:
        return _plain_view_reader_class()(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad files
        raise CorruptModelError(f"cannot read GGUF file {path}: {e}. The file is truncated or corrupt") from None


def field_value(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_to_hf_config(reader, path: Path) -> dict:
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCH_TO_HF:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported: {', '.join(GGUF_ARCH_TO_HF)}")

    def g(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tokens = field_value(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    hybrid = arch in QWEN35_ARCHS  # its own keys (per-layer sizes may be arrays), see gguf_qwen35
    cfg = {
        "architectures": [GGUF_ARCH_TO_HF[arch]],
        "model_type": arch,
        "vocab_size": int(g("vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": 0 if hybrid else int(g("feed_forward_length", 0)),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads if hybrid else int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": any(n.endswith(("attn_q.bias", "attn_qkv.bias")) for n in names),
    }
    if hybrid:
        cfg.update(qwen35_config(reader, arch, path, field_value, names))
    elif g("expert_count"):  # every layer is MoE in the GGUF MoE architectures
        cfg.update(num_experts=int(g("expert_count")), num_experts_per_tok=int(g("expert_used_count")),
                   moe_intermediate_size=int(g("expert_feed_forward_length")), decoder_sparse_step=1,
                   mlp_only_layers=[], norm_topk_prob=bool(g("expert_weights_norm", True)))
    scaling_type = g("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        cfg["rope_scaling"] = {"rope_type": scaling_type, "factor": float(g("rope.scaling.factor", 1.0))}
        if g("rope.scaling.original_context_length"):
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
    return cfg


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permutation of q/k rows (interleaved -> half-split RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Types whose blocks gguf-py decodes here all at once with its own per-block arithmetic (the same float32 values):
# its quants.dequantize walks the rows in groups of 16 in Python, most of a small model's load time.
WHOLE_TENSOR_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def dequantize_tensor(t) -> np.ndarray:
    import gguf
    from gguf import quants

    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    try:
        if t.tensor_type.name in WHOLE_TENSOR_TYPES:
            kind = getattr(quants, t.tensor_type.name)
            blocks = np.asarray(t.data, dtype=np.uint8).reshape(-1, kind.type_size)
            return np.asarray(kind.dequantize_blocks(blocks), dtype=np.float32).reshape(shape)
        arr = quants.dequantize(t.data, t.tensor_type)
        return np.asarray(arr, dtype=np.float32).reshape(shape)
    except NotImplementedError:
        version = getattr(gguf, "__version__", None) or _dist_version("gguf")
        raise UnsupportedModelError(
            f"tensor {t.name} uses GGUF type {t.tensor_type.name}, which the installed gguf package ({version}) "
            "cannot decode; a newer gguf may (pip install -U gguf), or requantize the file to a common type "
            "(Q8_0, Q4_K, ...)") from None
    except ValueError as e:
        raise CorruptModelError(f"tensor {t.name} cannot be decoded ({e}); the file is corrupt") from None


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown version"


def _quantized(t) -> QuantizedWeight:
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    try:
        return QuantizedWeight.from_gguf(t.tensor_type.name, t.data, shape)
    except ValueError as e:
        raise CorruptModelError(f"tensor {t.name} cannot be decoded ({e}); the file is corrupt") from None


def iter_gguf_weights(reader, cfg: dict, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """HF-named weights; with keep_quantized, Q4_0/Q4_1/Q8_0 tensors come as `QuantizedWeight`."""
    arch = cfg["model_type"]
    if arch in QWEN35_ARCHS:
        if keep_quantized:
            raise UnsupportedModelError(f"quantization='gguf' (packed 4-bit linears) is not supported for {arch} "
                                        "GGUF files; leave quantization unset to run the file dequantized")
        yield from iter_qwen35_weights(reader, cfg, dequantize_tensor)
        return
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m:
            part = _LAYER_MAP.get(m.group(2))
            if part is None:
                raise UnsupportedModelError(f"unexpected GGUF tensor {t.name} for architecture {arch}")
            name = f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
        elif t.name in _TOP_MAP:
            name = _TOP_MAP[t.name]
        else:
            raise UnsupportedModelError(f"unexpected GGUF tensor {t.name} for architecture {arch}")
        permuted = arch == "llama" and m and m.group(2) in ("attn_q", "attn_k")
        n_head = cfg["num_attention_heads" if m and m.group(2) == "attn_q" else "num_key_value_heads"]
        if keep_quantized and t.tensor_type.name in PACKABLE_GGUF_TYPES and len(t.shape) == 2:
            blocks = _quantized(t)
            if permuted:
                blocks = blocks.permute_rows(torch.from_numpy(_unpermute_rope(np.arange(blocks.shape[0]), n_head)))
            yield name, blocks
            continue
        arr = dequantize_tensor(t)
        if permuted:
            arr = _unpermute_rope(arr, n_head)
        yield name, torch.from_numpy(np.array(arr, copy=True))
