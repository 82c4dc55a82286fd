"""load_format "dummy": random weights of the checkpoint's shapes, read from its config alone."""
from __future__ import annotations

import pytest

from onecat.engine import LLM, SamplingParams
from onecat.engine.errors import ConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A tiny model directory with its weights removed: config and tokenizer only."""
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path_factory.mktemp("dummy") / "tiny")
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    return model_dir


def _run(model_dir, **kw):
    llm = LLM(str(model_dir), load_format="dummy", max_model_len=64, **kw)
    try:
        out = llm.generate("a b c d", GREEDY)[0]
        return out.token_ids, [d[t] for d, t in zip(out.logprobs, out.token_ids)]
    finally:
        llm.close()


def test_dummy_weights_need_no_weight_files_and_follow_the_seed(config_only):
    first, again, other = _run(config_only, seed=0), _run(config_only, seed=0), _run(config_only, seed=1)
    assert first == again
    assert first[1] != other[1]
    with pytest.raises(Exception):  # the real weights are gone: the default format must fail to load
        LLM(str(config_only), max_model_len=64)


def test_dummy_weights_with_quantization_are_refused(config_only):
    with pytest.raises(ConfigError, match="load_format dummy"):
        LLM(str(config_only), load_format="dummy", quantization="gguf")


def test_tensor_parallel_ranks_hold_slices_of_the_same_random_model(config_only):
    """Each rank draws the full matrices and keeps its share: TP=2 scores as TP=1 with the same seed."""
    assert _run(config_only, seed=0, tensor_parallel_size=2)[0] == _run(config_only, seed=0)[0]
