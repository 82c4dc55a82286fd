"""Shared plumbing of the quality-task runners (GSM8K, EvalPlus, structured output): seeded chunk
units, chat vs completion vs pre-filled-chat generation, and recording which items were used."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from onecat.gates.engines.base import Engine
from onecat.gates.runners.base import Metric, Sink, Unit
from onecat.gates.tasks.subset import subset_record


@dataclass
class PromptSpec:
    """One request: chat messages, or a raw text prompt; `prefill` is put at the start of the
    assistant turn (rendered with the model's chat template) and counted as part of the reply."""

    messages: Optional[list[dict]] = None
    text: Optional[str] = None
    prefill: str = ""


def item_seed(seed: int, item_id: str) -> int:
    """Per-request sampling seed that depends only on (contract seed, item): the same in both arms,
    in any batch, and after --resume."""
    return (seed * 1_000_003 + int(hashlib.sha256(item_id.encode()).hexdigest()[:8], 16)) % (2 ** 31)


def chunk_units(num_items: int, seeds: Sequence[int], chunk: int) -> list[Unit]:
    units = []
    for s in seeds:
        for start in range(0, num_items, chunk):
            n = min(chunk, num_items - start)
            units.append(Unit(key=f"seed={s}/items={start}-{start + n - 1}", seed=s, size=n,
                              params=(("start", start), ("count", n))))
    return units


def render_chat(engine: Engine, messages: list[dict]) -> Optional[str]:
    """The model's chat template applied as text (None when the engine cannot render it)."""
    tok = getattr(engine, "tokenizer", None)
    if tok is None or not hasattr(tok, "apply_chat_template") or not getattr(tok, "chat_template", None):
        return None
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=True)
    except Exception:
        return None


def generate(engine: Engine, specs: Sequence[PromptSpec], params: list) -> tuple[list, list[str], list[str], list[Any]]:
    """(outputs, full replies incl. prefill, prompt modes, prompts as sent) in spec order."""
    sent: list[Any] = []
    modes: list[str] = []
    for spec in specs:
        if spec.messages is not None and spec.prefill:
            rendered = render_chat(engine, spec.messages)
            if rendered is not None:
                sent.append(rendered + spec.prefill)
                modes.append("chat_prefill")
                continue
        if spec.messages is not None:
            sent.append(spec.messages)
            modes.append("chat")
        else:
            sent.append(spec.text)
            modes.append("completion")
    outputs: list[Any] = [None] * len(specs)
    for mode_group in ("chat", "text"):
        idx = [i for i, m in enumerate(modes) if (m == "chat") == (mode_group == "chat")]
        if not idx:
            continue
        call = engine.chat if mode_group == "chat" else engine.generate
        outs = call([sent[i] for i in idx], [params[i] for i in idx])
        for i, out in zip(idx, outs):
            outputs[i] = out
    replies = [(specs[i].prefill if modes[i] == "chat_prefill" else "") + (outputs[i].text or "")
               for i in range(len(specs))]
    return outputs, replies, modes, sent


def record_subset(sink: Sink, workload: Any, dataset: Any, chosen_ids: Sequence[str],
                  seed: Optional[int] = None) -> None:
    """Store which items were scored (subset spec, count, hash of ids, dataset pin), once per seed."""
    rec = subset_record(getattr(workload, "subset", None), list(chosen_ids))
    tags = {**rec, "dataset": getattr(dataset, "name", None), "dataset_sha256": getattr(dataset, "sha256", None),
            "dataset_origin": getattr(dataset, "origin", None)}
    sink.metric(Metric(name="task_items", value=float(len(chosen_ids)), unit="items", key=f"subset/seed={seed}",
                       seed=seed, tags=tags))
