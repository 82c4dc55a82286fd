"""How far bf16 moves the logprobs of a deep random-init Qwen3.5, on CPU: onecat in bf16 and transformers in bf16,
each against transformers in float32, teacher forced on onecat's greedy tokens.

    python benchmarks/hybrid_bf16_noise_cpu.py --layers 32 --hidden 1024 --out record.json

Why: on the GPU, onecat's and transformers' greedy tokens for the random Qwen3.5-27B shape part at the first decode
step (gpu_moe_hybrid.py). If transformers' own bf16 logprobs sit as far from its float32 ones as onecat's do, the
parting is bf16 rounding at a near-tie, not an engine defect. The init is the benchmark's (norms 1, A_log 0,
dt_bias 1, the rest N(0, 0.02)); the Gated DeltaNet and attention head sizes are Qwen3.5-27B's, fewer heads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_hybrid_checks import onecat_top_logprobs, teacher_forced  # noqa: E402


def build(layers: int, hidden: int, root: Path) -> Path:
    import transformers

    from tests.tiny_models import save_with_word_tokenizer

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    conf = transformers.Qwen3_5TextConfig(
        vocab_size=8192, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=1, head_dim=256, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, layer_types=types,
        rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(conf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.zero_()
            else:
                p.normal_(0, 0.02)
    save_with_word_tokenizer(model, root, conf.vocab_size)
    return root


def main() -> None:
    import transformers

    from onecat.engine import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--out", default=".onecat/hybrid_bf16_noise_cpu.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = build(args.layers, args.hidden, Path(tmp) / "m")
        prompt = torch.randint(100, 8092, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        with LLM(str(d), dtype="bfloat16", enable_prefix_caching=False) as llm:
            mine = onecat_top_logprobs(llm, prompt)
        ids = torch.tensor([prompt + mine["tokens"]])
        rows, rec = {}, {}
        for dt in (torch.float32, torch.bfloat16):
            hf = transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=dt).eval()
            rec[f"onecat_bf16_vs_transformers_{str(dt)[6:]}"] = teacher_forced(hf, prompt, mine)
            with torch.no_grad():
                rows[dt] = hf(input_ids=ids, logits_to_keep=len(mine["tokens"]) + 1).logits[0, :-1].float()
            rows[dt] = rows[dt].log_softmax(-1)
    per_step = [max(abs(float(rows[torch.bfloat16][i, t] - rows[torch.float32][i, t])) for t in top)
                for i, top in enumerate(mine["top5"])]
    rec["transformers_bf16_vs_float32"] = {"per_step_max_logprob_diff": per_step,
                                           "median": sorted(per_step)[len(per_step) // 2], "max": max(per_step)}
    rec["config"] = {"layers": args.layers, "hidden": args.hidden, "prompt": args.prompt,
                     "measured_on": f"measured on CPU ({platform.machine()}, {os.cpu_count()} cores)",
                     "torch": torch.__version__, "transformers": transformers.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=2))
    for k, v in rec.items():
        print(k, {a: b for a, b in v.items() if a not in ("steps", "per_step_max_logprob_diff")})


if __name__ == "__main__":
    main()
