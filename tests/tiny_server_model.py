"""A tiny random-init chat model for server tests: byte-level BPE tokenizer, ChatML template.

Big enough to exercise every server path (chat templating, constrained decoding through
llguidance, streaming), small enough (a few MB, milliseconds per token) that hostile-input and
fuzz tests can run hundreds of requests.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; 2 is also the model's eos
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog. {\"name\": \"Ada\", \"age\": 36}",
          "Hello, world! What is the weather in Paris today? 0123456789 [true, false, null]",
          "<tool_call> </tool_call> <think> </think> yes no maybe"] * 8


def make_tiny_chat_model(out_dir: Path, vocab_size: int = 384) -> Path:
    """An HF directory loadable by `LLM(str(out_dir))`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.tiny_models import make_tiny_model

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    make_tiny_model("llama", out_dir, vocab_size=vocab_size, num_hidden_layers=2, bos_token_id=1,
                    eos_token_id=2)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False, "chat_template": CHATML}))
    return out_dir
