"""The chat template is compiled once per tokenizer (engine/tokenizer.py): the same text as a fresh compile,
recompiled when the template changes, and the tokenizer still pickles (tensor-parallel workers receive it)."""
from __future__ import annotations

import pickle

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from onecat.engine.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


def _tokenizer() -> Tokenizer:
    hf = HFTokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    return Tokenizer(hf, bos_token_id=1, eos_token_ids=[2], add_bos=False, chat_template=TEMPLATE)


def test_the_chat_template_is_compiled_once_and_again_when_it_changes():
    tok = _tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<user>hi<a>"
    compiled = tok._template()
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<user>hi"
    assert tok._template() is compiled
    tok.chat_template = "[{{ messages[0].content }}]"
    assert tok.apply_chat_template(msgs) == "[hi]" and tok._template() is not compiled


def test_a_tokenizer_that_rendered_a_chat_still_pickles():
    tok = _tokenizer()
    tok.apply_chat_template([{"role": "user", "content": "x"}])
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.apply_chat_template([{"role": "user", "content": "y"}]) == "<user>y<a>"
