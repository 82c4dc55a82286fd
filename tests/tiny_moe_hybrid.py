"""Small random-init MoE and hybrid (Gated DeltaNet + gated attention) checkpoints written by transformers
(test-only): Qwen3-MoE, Qwen3.5, Qwen3.5-MoE, saved as HF directories with a word-level tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=512)
HYBRID = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                     "full_attention"])


def make_tiny_moe_hybrid(arch: str, out_dir: Path, **overrides) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(1234)
    if arch == "qwen3_moe":
        kw = {**BASE, "intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 8,
              "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [2], **overrides}
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(rope_theta=1000000.0, **kw))
    elif arch == "qwen3_5":
        kw = {**BASE, **HYBRID, "intermediate_size": 96, **overrides}
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))
    elif arch == "qwen3_5_moe":
        kw = {**BASE, **HYBRID, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 40, "num_experts": 8,
              "num_experts_per_tok": 2, **overrides}
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kw))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # non-trivial norms, decays and gates, so a missed one shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(kw["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir
