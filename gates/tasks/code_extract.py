"""Turn a model reply into the code to test: pick the code block, repair truncation, keep what the
entry point needs (EvalPlus's sanitize: imports + the definitions reachable from the entry point;
test calls, prints and `if __name__ == "__main__"` blocks are dropped)."""

from __future__ import annotations

import ast
import re
import warnings
from dataclasses import dataclass

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass
class ExtractedCode:
    code: str          # sanitized program ("" when nothing usable was found)
    method: str        # fenced | unclosed_fence | raw | prompt+completion
    has_entry_point: bool
    trimmed_lines: int  # trailing lines dropped to make the code parse (truncated replies)
    syntax_ok: bool


def code_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(language, body, closed) for each markdown code fence; an unclosed last fence runs to the end."""
    blocks = []
    for m in _FENCE.finditer(text):
        closed = text[m.end(2):m.end()].startswith("```")
        blocks.append((m.group(1).lower(), m.group(2), closed))
    return blocks


def _parse(code: str) -> ast.Module:
    with warnings.catch_warnings():  # e.g. invalid escapes in the model's code are not ours to report
        warnings.simplefilter("ignore")
        return ast.parse(code)


def parse_prefix(code: str) -> tuple[ast.Module | None, str, int]:
    """Parse `code`, dropping trailing lines until it parses (a length-capped reply ends mid-line)."""
    lines = code.splitlines()
    for drop in range(0, len(lines) + 1):
        candidate = "\n".join(lines[: len(lines) - drop])
        try:
            return _parse(candidate), candidate, drop
        except (SyntaxError, ValueError):
            if drop > 200:
                break
            continue
    return None, "", len(lines)


def _defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return []


def _used_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def sanitize(code: str, entry_point: str) -> tuple[str, bool]:
    """Keep imports and the top-level definitions the entry point reaches; (code, entry found)."""
    tree = _parse(code)
    lines = code.splitlines()
    defs: dict[str, list[ast.stmt]] = {}
    keep_always: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            keep_always.append(node)
        for name in _defined_names(node):
            defs.setdefault(name, []).append(node)
    if entry_point not in defs:
        return code, False
    wanted, stack = set(), [entry_point]
    while stack:
        name = stack.pop()
        if name in wanted or name not in defs:
            continue
        wanted.add(name)
        for node in defs[name]:
            stack.extend(_used_names(node) - wanted)
    kept = [n for n in tree.body if n in keep_always or any(nm in wanted for nm in _defined_names(n))]
    out = []
    for node in kept:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        out.append("\n".join(lines[start:node.end_lineno]))
    return "\n".join(out) + "\n", True


def _defines(tree: ast.Module | None, entry_point: str) -> bool:
    return tree is not None and any(entry_point in _defined_names(n) for n in tree.body)


def _keeps_reply(parsed: str, prompt: str) -> bool:
    """Whether code parsed from prompt + reply still holds a non-blank line of the reply (else the
    prompt alone parsed, a stub that would only fail later as a wrong answer)."""
    extra = parsed.splitlines()[len(prompt.splitlines()):]
    return any(line.strip() for line in extra)


def extract_code(reply: str, entry_point: str, prompt: str = "", completion_style: bool = False) -> ExtractedCode:
    """The solution program for `entry_point` from a reply.

    completion_style: the reply continues `prompt` (EvalPlus base-model mode), so the program is
    prompt + reply. Otherwise the code block that defines the entry point is used (else the first
    python block, else the raw text); a reply that only has the body is appended to the prompt.
    """
    if completion_style:
        sources = [("prompt+completion", prompt + reply)]
    else:
        blocks = code_blocks(reply)
        sources = [("fenced" if closed else "unclosed_fence", body) for lang, body, closed in blocks
                   if lang in ("", "python", "py", "python3")]
        sources.append(("raw", reply))
    best = None
    for method, src in sources:
        tree, parsed, dropped = parse_prefix(src)
        if completion_style and not _keeps_reply(parsed, prompt):
            tree = None
        if not _defines(tree, entry_point) and prompt and not completion_style:
            tree2, parsed2, dropped2 = parse_prefix(prompt + src)
            if _defines(tree2, entry_point) and _keeps_reply(parsed2, prompt):
                tree, parsed, dropped, method = tree2, parsed2, dropped2, method + "+prompt"
        if _defines(tree, entry_point):
            code, _ = sanitize(parsed, entry_point)
            return ExtractedCode(code, method, True, dropped, True)
        if best is None and tree is not None and parsed.strip():
            best = ExtractedCode(parsed, method, False, dropped, True)
    return best or ExtractedCode("", "none", False, 0, False)
