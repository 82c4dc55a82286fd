"""The embedded SmolLM2 GGUF through onecat vs transformers' own GGUF loader: tokens, template, greedy."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "import numpy as np\n\nx = np.arange(10)\n",
    "The answer to 12 * 7 is",
    "Water boils at",
    "In 1969, astronauts",
]
TEXTS = PROMPTS + ["  spaces   and\ttabs\n\nnewlines 3.14159 ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def hf(embedded_path):
    import functools

    import gguf

    from onecat.engine.loader.gguf import open_gguf

    d, f = str(embedded_path.parent), embedded_path.name
    # Only repeated work is saved, not what transformers computes: it parses the file's header anew for the config,
    # the weights and the tokenizer (seconds each), and it gets the file's reader parsed once (open_gguf's: gguf's
    # reader over plain views of the mapping, the same fields and tensors), which it only reads; and it builds
    # gguf's name table for the same architecture once per submodule (~400 times), a pure function of its
    # arguments, here built once.
    reader, parse = open_gguf(embedded_path), gguf.GGUFReader
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", lambda path: reader if Path(path) == embedded_path else parse(path))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    yield model, tok
    del model


def test_tokenizer_matches(hf, embedded_llm):
    _, tok = hf
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert embedded_llm.tokenizer.encode(text) == ids, text
        assert embedded_llm.tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_chat_template_matches(hf, embedded_llm):
    _, tok = hf
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for msgs in (messages, messages[1:]):
        ours = embedded_llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        theirs = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ours == theirs


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain greedy loop with HF's KV cache; EOS is neither masked nor a stop (like ignore_eos)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            x = torch.tensor([[tok]])
    return out


# every prompt's first 32 greedy tokens in the default run (transformers' loop is most of this file's time on a
# 2-core machine), 64 with -m slow
@pytest.mark.parametrize("n", [32, pytest.param(64, marks=pytest.mark.slow)])
def test_greedy_tokens_equal_transformers(hf, embedded_llm, n):
    from onecat.engine import SamplingParams

    model, _ = hf
    prompts = [embedded_llm.tokenizer.encode(p) for p in PROMPTS]
    outs = embedded_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, ids, n)
        assert out.finish_reason == "length" and out.num_completion_tokens == n
