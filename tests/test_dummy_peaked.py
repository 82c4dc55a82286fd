"""load_format dummy_peaked (engine/loader/dummy.py): random weights whose next token wins by a wide margin, so
speculation can be timed against target-only on them. Each decoder layer's two norms output zeros (the Qwen3.5
zero-centered norms at weight -1, Llama's at 0), the LM head is the embedding, every other weight is drawn as
load_format dummy draws it; greedy decoding then repeats the prompt's last token, alone, in a batch and through
speculation alike; an LM head that cannot take the embedding is refused with the reason."""
from __future__ import annotations

import pytest
import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.errors import ConfigError
from onecat.engine.layers.qwen3_5_norms import ZeroCenteredRMSNorm
from onecat.engine.loader.dummy import fill_random_weights

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ONECAT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3.5"])
def test_peaked_weights_repeat_the_last_token_alone_in_a_batch_and_speculating(shape):
    prompts = ["t5 t6 t7 t8", "t9 t10 t11", "t12 t40"]
    spec = {"method": "synthetic", "num_speculative_tokens": 3, "acceptance_length": 3.0, "disable_when_slower": False}
    with LLM(f"random:{shape}", load_format="dummy_peaked", max_model_len=128) as llm:
        norms = [m for n, m in llm.model.named_modules() if n.endswith(("input_layernorm", "post_attention_layernorm"))]
        zero = -1.0 if isinstance(norms[0], ZeroCenteredRMSNorm) else 0.0
        assert norms and all(bool((m.weight == zero).all()) for m in norms)
        alone = [llm.generate([p], GREEDY)[0] for p in prompts]
        batch = llm.generate(prompts, GREEDY)
    for o in alone:
        assert len(set(o.token_ids)) == 1 and o.token_ids[0] == o.prompt_token_ids[-1], o.token_ids
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    with LLM(f"random:{shape}", load_format="dummy_peaked", max_model_len=128, speculative_config=spec) as llm:
        llm.generate(prompts, GREEDY)  # the synthetic proposer learns the continuations
        spec_outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec_outs] == [o.token_ids for o in alone]
    assert sum(o.spec.num_accepted_tokens for o in spec_outs) > 0


def test_plain_dummy_weights_keep_the_norms_at_one():
    with LLM("random:tiny-llama", load_format="dummy", max_model_len=64) as llm:
        assert all(bool((m.weight == 1).all()) for n, m in llm.model.named_modules() if n.endswith("input_layernorm"))


def test_an_lm_head_that_cannot_take_the_embedding_is_refused():
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(10, 4)
    model.lm_head = torch.nn.Linear(4, 12, bias=False)  # another vocabulary than the embedding's
    with pytest.raises(ConfigError, match="load_format dummy"):
        fill_random_weights(model, seed=0, peaked=True)
