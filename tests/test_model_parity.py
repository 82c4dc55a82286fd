"""Each architecture's logits through onecat equal transformers' (fp32, max abs error <= 1e-4)."""
from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_model

transformers = pytest.importorskip("transformers")

RAGGED = [[5, 17, 99, 3], list(range(10, 47)), [200], list(range(300, 319)) + [1, 2, 3]]


def hf_logprobs(model_dir, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out.append(model(x).logits[0].log_softmax(-1))
    return out


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
])
def test_logits_match_transformers(tmp_path, arch, overrides):
    from onecat.engine import LLM, SamplingParams

    d = make_tiny_model(arch, tmp_path / arch, **overrides)
    ref = hf_logprobs(d, RAGGED)
    # a small token budget forces chunked prefill across steps; ragged prompts share each batch
    with LLM(str(d), dtype="float32", max_num_batched_tokens=24, enable_prefix_caching=False) as llm:
        outs = llm.generate(RAGGED, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, logprobs=5))
    for p, o, r in zip(RAGGED, outs, ref):
        mine = torch.tensor(o.prompt_logprobs[1:])
        theirs = r[:-1].gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1)
        assert len(mine) == len(p) - 1
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-4)
        # the last position's distribution: top-5 logprobs of the next token
        top = o.logprobs[0]
        for tok, lp in top.items():
            assert abs(lp - r[-1, tok].item()) <= 1e-4
        assert o.token_ids[0] == int(r[-1].argmax())
