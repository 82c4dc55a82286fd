"""Build-on-demand loader of the flash_attn_v100 torch extension.

Nothing is compiled at import: the first call of `load_extension()` builds with
torch.utils.cpp_extension.load (which honours TORCH_CUDA_ARCH_LIST) into a cache directory keyed
by the sources, torch/CUDA versions and arch list, and later processes reuse that build.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from types import ModuleType

from onecat.engine.kernels.cache import cache_root

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = (CSRC / "bindings" / "flash_attn_v100.cpp", CSRC / "bindings" / "flash_attn_v100_launch.cu")
EXT_NAME = "onecat_flash_attn_v100"

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


class KernelUnavailable(RuntimeError):
    """The extension cannot be built or loaded here; the message says why."""


def _build_key() -> str:
    import torch

    h = hashlib.sha256()
    files = list(SOURCES) + sorted((CSRC / "flash_attn_v100").glob("*")) + sorted((CSRC / "bindings").glob("*.h"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{os.environ.get('TORCH_CUDA_ARCH_LIST', '')}".encode())
    return h.hexdigest()[:16]


def build_directory() -> Path:
    return cache_root() / "torch_extensions" / f"flash_attn_v100-{_build_key()}"


def prerequisites_missing() -> str | None:
    """Why a build cannot even be attempted (cheap; compiles nothing)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency
        return f"torch unavailable: {exc}"
    if torch.version.cuda is None:
        return "this torch build has no CUDA support (install a CUDA build of torch)"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    cuda_major = int(str(torch.version.cuda).split(".")[0])
    if cuda_major >= 13 and torch.cuda.get_device_capability() < (7, 5):
        return (f"CUDA {torch.version.cuda} cannot compile for sm_70; use a CUDA 12.x build of torch "
                "and toolkit on V100")
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found to build the kernels (set CUDA_HOME or put nvcc on PATH)"
    missing = [str(s) for s in SOURCES if not s.is_file()]
    if missing:
        return f"kernel sources missing: {', '.join(missing)}"
    return None


def load_extension(verbose: bool = False) -> ModuleType:
    """The compiled extension, building it on first use; KernelUnavailable if that fails."""
    global _module, _failure
    with _lock:
        if _module is not None:
            return _module
        if _failure is not None:
            raise KernelUnavailable(_failure)
        reason = prerequisites_missing()
        if reason is not None:
            _failure = reason
            raise KernelUnavailable(reason)
        from torch.utils import cpp_extension

        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        includes = [str(CSRC), str(CSRC / "bindings")]
        try:
            _module = cpp_extension.load(
                name=EXT_NAME,
                sources=[str(s) for s in SOURCES],
                extra_include_paths=includes,
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo"],
                build_directory=str(build_dir),
                verbose=verbose,
            )
        except Exception as exc:  # compiler errors arrive as RuntimeError / CalledProcessError
            _failure = f"building {EXT_NAME} failed ({type(exc).__name__}): {exc}"
            raise KernelUnavailable(_failure) from exc
        return _module


def unavailable_reason() -> str | None:
    """None when the extension is (or can be) loaded; otherwise why not. May trigger the build."""
    try:
        load_extension()
    except KernelUnavailable as exc:
        return str(exc)
    return None
