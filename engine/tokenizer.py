"""Tokenizer + chat template on the `tokenizers` library, from an HF directory (GGUF metadata: see
engine/loader/gguf_tokenizer.py)."""
from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from onecat.engine.errors import CorruptModelError, UnsupportedModelError


class Tokenizer:
    """Encodes/decodes text and renders chat prompts the way the checkpoint defines them."""

    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 add_bos: bool, chat_template: str | None):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = [e for e in eos_token_ids if e is not None]
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: Path, eos_from_config: list[int]) -> "Tokenizer":
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise CorruptModelError(f"{path} has no tokenizer.json (needed to encode prompts)")
        tok = HFTokenizer.from_file(str(tj))
        tcfg_path = path / "tokenizer_config.json"
        tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}

        def token_id(entry) -> int | None:
            if isinstance(entry, dict):
                entry = entry.get("content")
            return tok.token_to_id(entry) if entry else None

        eos = list(eos_from_config)
        eos_tok = token_id(tcfg.get("eos_token"))
        if eos_tok is not None and eos_tok not in eos:
            eos.append(eos_tok)
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        bos = token_id(tcfg.get("bos_token"))
        return cls(tok, bos_token_id=bos, eos_token_ids=eos, add_bos=bool(tcfg.get("add_bos_token", False)),
                   chat_template=template)

    # ---- use ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        special = lambda i: self._tok.id_to_token(i) if i is not None else ""  # noqa: E731
        return self._template().render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=special(self.bos_token_id),
            eos_token=special(self.eos_token_ids[0] if self.eos_token_ids else None), **kwargs)

    def _template(self):
        """The chat template compiled once (compiling is ~2 ms a prompt, most of a chat request's host time and
        of a regeneration's start over tens of thousands of prompts); recompiled if `chat_template` changes."""
        if not self.chat_template:
            raise UnsupportedModelError("this model has no chat template; pass plain prompts to generate()")
        cached = self.__dict__.get("_compiled")
        if cached is not None and cached[0] == self.chat_template:
            return cached[1]

        def raise_exception(msg):
            raise ValueError(f"chat template refused the messages: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, indent=indent, ensure_ascii=False)
        template = env.from_string(self.chat_template)
        self._compiled = (self.chat_template, template)
        return template

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}  # a compiled template does not pickle
