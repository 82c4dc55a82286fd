"""Build-on-demand torch CUDA extensions of csrc/ (the Volta attention kernels, the packed-weight GEMV).

Nothing is compiled at import: the first `load()` builds with torch.utils.cpp_extension.load (which honours
TORCH_CUDA_ARCH_LIST) into a cache folder keyed by the sources, torch/CUDA versions and arch list, and later
processes reuse that build. A failed build is remembered with its reason, so callers fall back once.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from types import ModuleType

from onecat.engine.kernels.cache import cache_root

CSRC = Path(__file__).resolve().parents[2] / "csrc"


class KernelUnavailable(RuntimeError):
    """The extension cannot be built or loaded here; the message says why."""


class CudaExtension:
    """One extension: its sources, the folders whose files key the build, the nvcc flags."""

    def __init__(self, name: str, sources: tuple[Path, ...], header_dirs: tuple[str, ...],
                 cuda_flags: tuple[str, ...] = ()) -> None:
        self.name, self.sources, self.header_dirs, self.cuda_flags = name, sources, header_dirs, cuda_flags
        self.module: ModuleType | None = None
        self.failure: str | None = None
        self._lock = threading.Lock()

    def build_key(self) -> str:
        import torch

        h = hashlib.sha256()
        files = list(self.sources) + [f for d in self.header_dirs for f in sorted((CSRC / d).glob("*"))]
        for f in files:
            h.update(f.name.encode())
            h.update(f.read_bytes())
        h.update(" ".join(self.cuda_flags).encode())
        h.update(f"{torch.__version__}|{torch.version.cuda}|{os.environ.get('TORCH_CUDA_ARCH_LIST', '')}".encode())
        return h.hexdigest()[:16]

    def build_directory(self) -> Path:
        return cache_root() / "torch_extensions" / f"{self.name}-{self.build_key()}"

    def prerequisites_missing(self) -> str | None:
        """Why a build cannot even be attempted (cheap; compiles nothing)."""
        import torch
        from torch.utils import cpp_extension

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
        missing = [str(s) for s in self.sources if not s.is_file()]
        if missing:
            return f"kernel sources missing: {', '.join(missing)}"
        return None

    def load(self, verbose: bool = False) -> ModuleType:
        """The compiled extension, building it on first use; KernelUnavailable if that fails."""
        with self._lock:
            if self.module is not None:
                return self.module
            if self.failure is not None:
                raise KernelUnavailable(self.failure)
            reason = self.prerequisites_missing()
            if reason is not None:
                self.failure = reason
                raise KernelUnavailable(reason)
            from torch.utils import cpp_extension

            build_dir = self.build_directory()
            build_dir.mkdir(parents=True, exist_ok=True)
            try:
                self.module = cpp_extension.load(
                    name=self.name, sources=[str(s) for s in self.sources],
                    extra_include_paths=[str(CSRC), str(CSRC / "bindings")], extra_cflags=["-O3"],
                    extra_cuda_cflags=["-O3", "-lineinfo", *self.cuda_flags], build_directory=str(build_dir),
                    verbose=verbose)
            except Exception as exc:  # compiler errors arrive as RuntimeError / CalledProcessError
                self.failure = f"building {self.name} failed ({type(exc).__name__}): {exc}"
                raise KernelUnavailable(self.failure) from exc
            return self.module

    def unavailable_reason(self) -> str | None:
        """None when the extension is (or can be) loaded; otherwise why not. May trigger the build."""
        try:
            self.load()
        except KernelUnavailable as exc:
            return str(exc)
        return None
