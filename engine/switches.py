"""The engine's on/off switches from the environment (ONECAT_ROWS_GEMM, ONECAT_SAMPLER_GRAPHS, ...): each is declared
where it is used, with its default, and parsed here. "1" turns it on, "0" off, unset (or empty) keeps the default;
any other value is refused with the fix, so that a typo cannot leave a measurement on the path it meant to leave.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path


def switch(name: str, default: bool | None) -> bool | None:
    """The switch `name`: True for "1", False for "0", `default` when unset (None: the caller decides, e.g. by
    device). Raises ValueError for any other value."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    meaning = {True: "on", False: "off", None: "chosen by the engine"}[default]
    raise ValueError(f"{name}={value!r} is not a switch value: set it to 1 (on) or 0 (off), or unset it for the "
                     f"default ({meaning})")


def declared(root: Path | None = None) -> list[dict]:
    """Every on/off switch the engine declares, read from its source (a switch is declared where its path is
    chosen, some inside functions, so importing the modules would not find them all): name, default, where, what
    the comments (or the enclosing function's docstring) at the declaration say, and the value set in this
    environment. One entry per name: a name declared twice is an error. `root`: the package folder to read (the
    engine's by default)."""
    root = root or Path(__file__).resolve().parent
    sources = {path: path.read_text() for path in sorted(root.rglob("*.py")) if path.name != "switches.py"}
    trees = {path: ast.parse(text) for path, text in sources.items() if "ONECAT_" in text or "switch(" in text}
    constants: dict[str, list[tuple[Path, ast.Assign]]] = {}  # NAME = "ONECAT_..." at module level
    for path, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and str(node.value.value).startswith("ONECAT_"):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants.setdefault(target.id, []).append((path, node))
    found: dict[str, dict] = {}
    for path, tree in trees.items():
        lines = sources[path].splitlines()
        docs = {id(call): ast.get_docstring(fn) or "" for fn in ast.walk(tree)
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) for call in ast.walk(fn)}
        module_doc = ast.get_docstring(tree) or ""
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "switch" and len(node.args) == 2):
                continue
            arg, about = node.args[0], _comments(lines, node.lineno)
            if isinstance(arg, ast.Name) and arg.id in constants:
                defs = constants[arg.id]
                at, assign = next(((p, a) for p, a in defs if p == path), defs[0])  # this module's, else the import
                name = assign.value.value
                about = (_comments(sources[at].splitlines(), assign.lineno) + " " + about).strip()
            elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
            else:
                continue
            about = about or (docs.get(id(node)) or module_doc).split("\n\n")[0].replace("\n", " ")
            entry = {"name": name, "default": ast.literal_eval(node.args[1]),
                     "where": f"{path.relative_to(root.parent)}:{node.lineno}", "about": about,
                     "set_to": os.environ.get(name)}
            if name in found:
                raise RuntimeError(f"{name} is declared twice ({found[name]['where']} and {entry['where']}): a "
                                   "switch has one declaration")
            found[name] = entry
    return sorted(found.values(), key=lambda e: e["name"])


def _comments(lines: list[str], lineno: int) -> str:
    """The comment lines right above line `lineno` (1-based) and the comment at its end, as one text."""
    above, i = [], lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        above.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    tail = lines[lineno - 1].split("#", 1)[1].strip() if "#" in lines[lineno - 1] else ""
    return " ".join(above + ([tail] if tail else []))
