"""load_format dummy_peaked (engine/loader/dummy.py): random weights whose next token wins by a wide margin, so
speculation can be timed against target-only on them. The projections that write the residual stream are drawn
as load_format dummy draws them and scaled by PEAK_SCALE, everything else (norms included) as dummy draws it, and
the LM head is the embedding; greedy decoding then repeats the prompt's last token, alone, in a batch and through
speculation alike (a dense, a hybrid and a MoE shape); an LM head that cannot take the embedding is refused."""
from __future__ import annotations

import pytest
import torch

from onecat.engine import LLM, SamplingParams
from onecat.engine.errors import ConfigError
from onecat.engine.loader.dummy import PEAK_SCALE, RESIDUAL_WRITERS, fill_random_weights

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ONECAT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_peaked_weights_repeat_the_last_token_alone_in_a_batch_and_speculating(shape):
    prompts = ["t5 t6 t7 t8", "t9 t10 t11", "t12 t40"]
    spec = {"method": "synthetic", "num_speculative_tokens": 3, "acceptance_length": 3.0, "disable_when_slower": False}
    with LLM(f"random:{shape}", load_format="dummy_peaked", max_model_len=128) as llm:
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


def test_peaked_weights_are_the_dummy_draw_with_the_residual_writers_scaled():
    def model():
        m = torch.nn.Module()
        m.embed_tokens = torch.nn.Embedding(10, 8)
        m.layer = torch.nn.Module()
        m.layer.o_proj, m.layer.down_proj, m.layer.up_proj = (torch.nn.Linear(8, 8, bias=False) for _ in range(3))
        m.norm = torch.nn.LayerNorm(8)
        m.lm_head = torch.nn.Linear(8, 10, bias=False)
        return m

    plain, peaked = model(), model()
    fill_random_weights(plain, seed=3)
    fill_random_weights(peaked, seed=3, peaked=True)
    drawn, got = dict(plain.named_parameters()), dict(peaked.named_parameters())
    for name, p in got.items():
        if name == "lm_head.weight":
            assert torch.equal(p, got["embed_tokens.weight"])
        elif name.endswith(RESIDUAL_WRITERS):
            assert torch.allclose(p, drawn[name] * PEAK_SCALE)
        else:
            assert torch.equal(p, drawn[name]), name


def test_an_lm_head_that_cannot_take_the_embedding_is_refused():
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(10, 4)
    model.lm_head = torch.nn.Linear(4, 12, bias=False)  # another vocabulary than the embedding's
    with pytest.raises(ConfigError, match="load_format dummy"):
        fill_random_weights(model, seed=0, peaked=True)
