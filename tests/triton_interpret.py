"""Running a Triton kernel's check script under Triton's interpreter (CPU), in a subprocess of its own (the
interpreter is chosen when triton is first imported)."""
from __future__ import annotations

import os
import subprocess
import sys

# Triton 3.6's interpreter takes int() of a 1-element array for a runtime loop bound, which NumPy 2.x refuses;
# the patch reads the element instead
PATCH = r"""
import triton.runtime.interpreter as interpreter

_patch = interpreter._patch_lang_tensor


def _scalar_index(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _scalar_index

# Every call of a jit function (each nested helper, in every program) patches triton.language's builtins again,
# finding them with inspect.getmembers over the language modules and the tensor class: a fifth to a third of an
# interpreted kernel's time. Their names are listed once here; each call then does what the original does with
# them: patches each name whose attribute is a builtin now (inside an outer call it is that call's wrapper, no
# builtin, and is left as it is).
import inspect

import triton.language as tl

_builtin_names = {}


def _patch_builtin(pkg, builder, scope):
    if pkg not in _builtin_names:
        _builtin_names[pkg] = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
    for name in _builtin_names[pkg]:
        member = getattr(pkg, name)
        if tl.core.is_builtin(member):
            interpreter._patch_attr(pkg, name, member, builder, scope)


interpreter._patch_builtin = _patch_builtin
"""


def run_interpreted(script: str, timeout: int = 300) -> None:
    """Run PATCH + `script` with TRITON_INTERPRET=1; the script must print "ok" last."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", PATCH + script], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
