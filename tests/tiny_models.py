"""Builds small random-init checkpoints with transformers (test-only), saved as HF directories."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def make_tiny_model(arch: str, out_dir: Path, **overrides) -> Path:
    import transformers

    torch.manual_seed(1234)
    kw = {**COMMON, **overrides}
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **kw)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=1000000.0, **kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=32, rope_theta=1000000.0, **kw)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # make biases and norms non-trivial so a missed one shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return save_with_word_tokenizer(model, out_dir, kw["vocab_size"])


def save_with_word_tokenizer(model, out_dir: Path, vocab_size: int) -> Path:
    """The model as an HF directory with a word-level tokenizer: token i is the word t{i}."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.save_pretrained(out_dir, safe_serialization=True)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir
