"""Shared by the MoE / hybrid GPU tests: a tiny model through the engine on CUDA (float32, ragged prompts,
prefill chunked over steps, greedy decode) against transformers' float32 logits for the same tokens, also on
CUDA (where fla is installed transformers runs its Gated DeltaNet through fla too: the fla kernels themselves
are checked against the torch reference ops in test_hybrid_gpu.py)."""
from __future__ import annotations

import torch

from tests.test_moe_hybrid_parity import RAGGED

STEPS = 6


def compare_with_transformers(model_dir, configure, atol: float, dtype: str = "float32", report: dict | None = None,
                              device: str = "cuda") -> set[str]:
    """Runs the engine in `dtype` with `configure(module)` applied to every module, checks every prompt logprob and
    every decode step's top-5 logprobs within atol of transformers' float32 logprobs on the same tokens (teacher
    forced: the greedy token need only be within atol of transformers' top one, so a near-tie may flip it), and
    returns every path the MoE / Gated DeltaNet layers took over the run (report, if given, gets the worst error
    and the attention backends' call counts)."""
    from onecat.engine import LLM, SamplingParams
    from onecat.engine.layers.gated_deltanet import GatedDeltaNet
    from onecat.engine.layers.moe import Experts

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, prompt_logprobs=0, logprobs=5)
    with LLM(str(model_dir), dtype=dtype, device=device, enable_prefix_caching=False,
             max_num_batched_tokens=24) as llm:
        layers = [m for m in llm.model.modules() if isinstance(m, (Experts, GatedDeltaNet))]
        paths: set[str] = set()
        for m in layers:
            configure(m)
            m.register_forward_hook(lambda mod, args, out: paths.add(mod.path))
        outs = llm.generate(RAGGED, params)
        attention_calls = dict(llm.worker.attention.calls)
    ref = _hf_logprobs(model_dir, [p + o.token_ids for p, o in zip(RAGGED, outs)], device)
    worst = 0.0
    for p, o, r in zip(RAGGED, outs, ref):
        assert len(o.token_ids) == STEPS
        if len(p) > 1:
            theirs = r[:len(p) - 1].gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1)
            worst = max(worst, (torch.tensor(o.prompt_logprobs[1:]) - theirs).abs().max().item())
        for step, (tok, top) in enumerate(zip(o.token_ids, o.logprobs)):
            row = r[len(p) - 1 + step]
            assert row[tok] >= row.max() - atol, "the greedy token is not transformers' argmax"
            worst = max(worst, max(abs(lp - row[t].item()) for t, lp in top.items()))
    if report is not None:
        report.update(worst=worst, attention_calls=attention_calls)
    print(f"{model_dir.name} {dtype}: worst logprob error {worst:.3g} (atol {atol}), attention {attention_calls}")
    assert worst <= atol, worst
    return paths


def _hf_logprobs(model_dir, sequences, device: str = "cuda"):
    import json

    import pytest
    import transformers

    [arch] = json.loads((model_dir / "config.json").read_text())["architectures"]
    if not hasattr(transformers, arch):
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        return [model(torch.tensor([s], device=device)).logits[0].log_softmax(-1).cpu() for s in sequences]
