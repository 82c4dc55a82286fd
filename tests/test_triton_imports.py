"""onecat's Triton modules keep engine/kernels/triton_support.py's rule: with Triton absent every engine module
imports except the Triton kernel modules themselves (those that import triton at their top), and those define
their kernels as module-level @triton.jit functions, no factories."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "engine"

WALK_WITHOUT_TRITON = """
import importlib, json, pkgutil, sys
sys.modules["triton"] = None  # `import triton` raises ImportError, as where it is not installed
import onecat.engine
failed = {}
for m in pkgutil.walk_packages(onecat.engine.__path__, "onecat.engine."):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed[m.name] = repr(e)
print(json.dumps(failed))
"""


def _imports_triton_at_top(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.Import) and any(a.name == "triton" for a in node.names) for node in tree.body)


def _module_path(name: str) -> Path:
    rel = Path(*name.split(".")[2:])
    return ENGINE / rel.with_suffix(".py") if (ENGINE / rel.with_suffix(".py")).exists() else ENGINE / rel / "__init__.py"


def test_only_triton_kernel_modules_need_triton():
    out = subprocess.run([sys.executable, "-c", WALK_WITHOUT_TRITON], capture_output=True, text=True, check=True)
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    kernel_modules = {str(p) for p in ENGINE.rglob("*.py") if _imports_triton_at_top(p)}
    assert kernel_modules, "no Triton kernel module found"
    assert {str(_module_path(name)) for name in failed} == kernel_modules, failed


def test_triton_kernels_are_defined_at_module_level():
    for path in ENGINE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                assert id(node) in top, f"{path}: {node.name} is a @triton.jit function inside another definition"
