"""Small random-init MoE and hybrid (Gated DeltaNet + gated attention) checkpoints written by transformers
(test-only): Qwen3-MoE, Qwen3.5, Qwen3.5-MoE, and Qwen3.5 as published (qwen3_5_vl: the multimodal
class with a tiny vision tower, text config nested), saved as HF directories with a word-level tokenizer (words
t0..t319) and a chat template that keeps the message words.

    python -m tests.tiny_moe_hybrid ARCH OUT_DIR   # e.g. for contracts/hybrid_prefix_cpu.yaml
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.tiny_models import save_with_word_tokenizer

BASE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=512)
HYBRID = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                     "full_attention"])


def make_tiny_moe_hybrid(arch: str, out_dir: Path, mixer_gain: float = 1.0, slow_decay: bool = False,
                         **overrides) -> Path:
    """mixer_gain scales the token mixers' output projections (Gated DeltaNet out_proj, attention o_proj) and
    slow_decay makes the DeltaNet state remember tens of tokens (transformers' init forgets most of it each
    step), so the logits lean on the recurrent state and the KV cache and a defect in either shows at bf16
    tolerances."""
    import transformers

    torch.manual_seed(1234)
    if arch == "qwen3_moe":
        kw = {**BASE, "intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 8,
              "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [2], **overrides}
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(rope_theta=1000000.0, **kw))
    elif arch == "qwen3_5":
        kw = {**BASE, **HYBRID, "intermediate_size": 96, **overrides}
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))
    elif arch == "qwen3_5_vl":
        kw = {**BASE, **HYBRID, "intermediate_size": 96, **overrides}
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=BASE["hidden_size"])
        model = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config=kw, vision_config=vision))
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
            if name.endswith(("linear_attn.out_proj.weight", "self_attn.o_proj.weight")):
                p.mul_(mixer_gain)
            if slow_decay and name.endswith("A_log"):  # decay per step exp(-A softplus(a + dt_bias)) near 1
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.5).log())
            if slow_decay and name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.1 - 2.0)
    save_with_word_tokenizer(model, out_dir, kw["vocab_size"])
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out_dir


CHAT_TEMPLATE = ("{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
                 "{% if add_generation_prompt %}t3{% endif %}")

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.tiny_moe_hybrid qwen3_moe|qwen3_5|qwen3_5_moe|qwen3_5_vl OUT_DIR")
    print(make_tiny_moe_hybrid(sys.argv[1], Path(sys.argv[2])))
