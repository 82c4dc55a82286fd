"""Bad input fails early with a message naming what is wrong and how to fix it; nothing else is lost."""
from __future__ import annotations

import json

import pytest

from onecat.engine import LLM, InvalidRequestError, SamplingParams
from onecat.engine.errors import ConfigError, CorruptModelError, ModelNotFoundError, UnsupportedModelError
from tests.tiny_models import make_tiny_model


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found; looked in"):
        LLM(str(tmp_path / "nope"))


def test_hub_id_not_in_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="HF cache .*huggingface-cli download"):
        LLM("someorg/somemodel", revision="abc123")


def test_unknown_embedded_name():
    with pytest.raises(ModelNotFoundError, match="unknown embedded model.*embedded:smollm2-135m-instruct"):
        LLM("embedded:gpt-17")


def test_unsupported_architecture(tmp_path):
    d = make_tiny_model("llama", tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM.*supported: LlamaForCausalLM"):
        LLM(str(d))


def test_truncated_safetensors(tmp_path):
    d = make_tiny_model("llama", tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptModelError, match="truncated or corrupt"):
        LLM(str(d))


def test_truncated_gguf(tmp_path, embedded_path):
    bad = tmp_path / "cut.gguf"
    with open(embedded_path, "rb") as fh:
        bad.write_bytes(fh.read(1_000_000))
    with pytest.raises(CorruptModelError, match="truncated or corrupt"):
        LLM(str(bad))


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 10)
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        LLM(str(f))


def test_bad_engine_settings(embedded_path):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(str(embedded_path), kv_cache_dtype="int3")
    with pytest.raises(ConfigError, match="needs"):
        LLM(str(embedded_path), max_model_len=4096, num_kv_blocks=8)


@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_tokens": -1}, "max_tokens"),
    ({"seed": -3}, "seed"), ({"stop": [""]}, "stop"), ({"n": 3}, "n=3"),
])
def test_invalid_sampling_values(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs)


def test_overlong_prompt_fails_alone(embedded_llm):
    long_prompt = list(range(100, 100 + embedded_llm.max_model_len + 5))
    outs = embedded_llm.generate(["Hello there", long_prompt, [99999999], "Goodbye"],
                                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "abort", "abort", "length"]
    assert "max_model_len" in outs[1].error and "outside the vocabulary" in outs[2].error
    assert outs[0].num_completion_tokens == 4 and outs[3].num_completion_tokens == 4


def test_vocabulary_bound_settings_fail_alone(embedded_llm):
    """A top-n past the vocabulary, or a stop id outside it, fails that request, not the step or the engine."""
    vocab = embedded_llm.model_config.vocab_size
    outs = embedded_llm.generate(["Hello", "Hi", "Hey", "Yo"], [
        SamplingParams(max_tokens=2, logprobs=vocab + 1),
        SamplingParams(max_tokens=1, prompt_logprobs=vocab + 5),
        SamplingParams(max_tokens=2, stop_token_ids=[-1]),
        SamplingParams(max_tokens=2, temperature=0)])
    assert [o.finish_reason for o in outs] == ["abort", "abort", "abort", "length"]
    assert "logprobs" in outs[0].error and "prompt_logprobs" in outs[1].error and "stop_token_ids" in outs[2].error
    assert embedded_llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1.0])
def test_non_finite_temperature_is_refused(temperature):
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=temperature)


def test_tiny_temperature_samples_greedily(embedded_llm):
    greedy = embedded_llm.generate(["The sky is"], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    tiny = embedded_llm.generate(["The sky is"], SamplingParams(max_tokens=6, temperature=1e-30, seed=3))[0]
    assert tiny.token_ids == greedy
