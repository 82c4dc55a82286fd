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


def test_the_model_is_materialized_in_its_own_dtype(config_only, monkeypatch):
    """A model's storage is allocated once, in the engine's dtype: a float32 copy first and a cast after needed twice
    a 16-bit model's bytes at its peak (a 27B model's 108 GB, past an 80 GB GPU)."""
    import torch

    seen = []
    to_empty = torch.nn.Module.to_empty

    def recording(module, *a, **kw):
        seen.append({p.dtype for p in module.parameters()})
        return to_empty(module, *a, **kw)

    monkeypatch.setattr(torch.nn.Module, "to_empty", recording)
    tokens, _ = _run(config_only, seed=0, dtype="bfloat16")
    assert len(tokens) == GREEDY.max_tokens
    assert seen and all(dtypes == {torch.bfloat16} for dtypes in seen)


def test_a_model_larger_than_the_free_memory_is_refused_before_it_is_allocated():
    import torch

    from onecat.engine.worker.worker import check_model_fits

    with torch.device("meta"):
        model = torch.nn.Linear(32768, 32768, bias=False).to(torch.float16)  # 2 GiB, never allocated
    check_model_fits(model, free=3 * 2**30, total=80 * 2**30, device="cuda:0", quantization=None)
    with pytest.raises(ConfigError, match=r"needs 2\.0 GiB of cuda:0 .*quantization='nvfp4'.*only 1\.5 of 80\.0 GiB"
                                          r".*tensor_parallel_size"):
        check_model_fits(model, free=3 * 2**29, total=80 * 2**30, device="cuda:0", quantization="nvfp4")
