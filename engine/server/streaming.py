"""Incremental text for streaming: what may be sent now without ever taking it back.

The engine hands back the full decoded text so far. A delta is the new suffix, minus a held-back
tail: a trailing U+FFFD (an incomplete UTF-8 sequence that the next token completes) and any tail
that could still grow into a stop string or a tag the server parses (`<tool_call>`, `</think>`),
as vLLM does. When the request finishes the engine's final text (stop strings already cut) is sent
in full.
"""
from __future__ import annotations


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with. Only prefixes ending in
    text's last character are compared (found by `rfind`, in C), so the usual cost is one scan of the
    marker, not one comparison per prefix length."""
    limit = min(len(marker) - 1, len(text))
    if limit <= 0:
        return 0
    last = text[-1]
    k = marker.rfind(last, 0, limit)
    while k >= 0:
        if text.endswith(marker[:k + 1]):
            return k + 1
        k = marker.rfind(last, 0, k)
    return 0


def holdback_len(text: str, markers: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`,
    or that ends in U+FFFD (incomplete multi-byte character)."""
    hold = 0
    if text.endswith("\ufffd"):
        hold = len(text) - len(text.rstrip("\ufffd"))
    for m in markers:
        hold = max(hold, _partial_marker_len(text, m))
    return hold


class DeltaTracker:
    """Turns successive full texts into append-only deltas."""

    def __init__(self, markers: list[str] | None = None):
        self.markers = [m for m in (markers or []) if m]
        self.sent = ""

    def safe_text(self, text: str, finished: bool) -> str:
        """The part of `text` that can be committed now."""
        if finished:
            return text
        return text[:len(text) - holdback_len(text, self.markers)]

    def delta(self, text: str, finished: bool) -> str:
        safe = self.safe_text(text, finished)
        if safe.startswith(self.sent):
            out = safe[len(self.sent):]
        elif len(safe) < len(self.sent):  # only the final stop-string cut can shorten the text
            return ""
        else:  # decoding re-merged earlier bytes: send what follows the committed length
            out = safe[len(self.sent):]
        self.sent += out
        return out
