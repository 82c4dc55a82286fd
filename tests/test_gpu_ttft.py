"""No compilation on the request path (GPU only; skipped without one): after the engine's start-up
warm-up, a burst of 50 prompt lengths never seen before runs with no request slower than a bound a
Triton compile (0.3-1 s) or a first cuDNN attention plan would break; and the warm-up is reported."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TTFT_BOUND_S = 0.1  # a tiny model prefills in a few ms; a compile on the request path takes 0.3 s or more


@pytest.mark.parametrize("cuda_graph", ["full", "off"])
def test_fifty_new_prompt_lengths_after_startup(tmp_path, cuda_graph):
    from onecat.engine import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "tiny", max_position_embeddings=1024)
    llm = LLM(str(model), dtype="float16", device="cuda", cuda_graph=cuda_graph, max_model_len=1024,
              kv_cache_memory_gb=1.0)
    try:
        warm = llm.info()["warmup"]
        assert warm["seconds"] > 0 and warm["triton_cache_dir"]
        assert bool(warm["graph_sizes"]) == (cuda_graph == "full"), warm
        assert llm.info()["attention_backend"]["calls"] == {}, "warm-up calls must not show in the report"
        rng = random.Random(0)
        lengths = rng.sample(range(3, 1000), 50)
        slow = []
        for i, n in enumerate(lengths):
            ids = [rng.randrange(1, 300) for _ in range(n)]
            out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
            assert out.error is None and len(out.token_ids) == 3
            if out.timings.first_token_s > TTFT_BOUND_S:
                slow.append((n, round(out.timings.first_token_s, 3)))
        assert not slow, f"prompt lengths (tokens, TTFT s) slower than {TTFT_BOUND_S} s: {slow}"
    finally:
        llm.close()
