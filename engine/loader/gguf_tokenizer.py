"""The tokenizer and chat template a GGUF file carries in its metadata (`tokenizer.ggml.*`), rebuilt as a
`tokenizers` byte-level BPE behind the engine's `Tokenizer`."""
from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from onecat.engine.errors import UnsupportedModelError
from onecat.engine.loader.gguf import field_value
from onecat.engine.tokenizer import Tokenizer

# Pre-tokenizer split patterns for the GGUF `tokenizer.ggml.pre` names this engine knows (gpt2 uses
# the ByteLevel pre-tokenizer's own regex).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4


def _byte_level_pre(pre: str):
    if pre in ("gpt2", "default", None):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    pattern = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "qwen2": _QWEN2}.get(pre)
    if pattern is None:
        raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: gpt2, smollm, "
                                    "llama-bpe, qwen2")
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_from_gguf(reader) -> Tokenizer:
    """reader: an open GGUFReader (loader.gguf.open_gguf). Only BPE (`gpt2`) tokenizers are supported."""
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (BPE)")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    merges = field_value(reader, "tokenizer.ggml.merges") or []
    types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = _byte_level_pre(field_value(reader, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(special)
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    return Tokenizer(tok, bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
                     eos_token_ids=[eos] + ([eot] if eot is not None and eot != eos else []),
                     add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
                     chat_template=field_value(reader, "tokenizer.chat_template"))
