"""The C++ CPU ops (csrc/cpu/): fused row-wise ops of the float32 decoder layer, the paged attention
(engine/attention/cpu_paged.py), the one-call decode step and the packed layers' int8 many-row matmul
(engine/quant/int4/int8_matmul.py); built on first use.

In eager torch a decode step's small ops (residual add + RMSNorm, RoPE, the K/V cache write, SiLU * up)
are ~25 calls per layer whose fixed cost, not their arithmetic, dominates a CPU step at small batches.
The extension does each group in one call with the same per-row arithmetic for any number of rows, so a
token's result still does not depend on its batch; and it runs a whole batch-1 decode step of a packed
model in one call (engine/models/llama_cpu_decode.py). It is compiled with torch's C++ extension builder
(needs a C++ compiler; ~20 s once) into the onecat cache folder, keyed by the sources' content, flags and
torch version (any checkout of the same sources reuses it); without a compiler the engine keeps the torch
ops and the reference attention and reports why.
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path

import torch

from onecat.engine.kernels.cache import cache_root

SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
SOURCES = (SOURCE_DIR / "fused_ops.cpp", SOURCE_DIR / "paged_attention.cpp", SOURCE_DIR / "decode_layers.cpp",
           SOURCE_DIR / "int8_matmul.cpp", SOURCE_DIR / "f32_rows.cpp", SOURCE_DIR / "amx_bf16_matmul.cpp",
           SOURCE_DIR / "amx_attention.cpp")
_FLAGS = ["-O3", "-ffp-contract=off"]  # no fused multiply-adds: products and sums round as in the torch ops
_lock = threading.Lock()
_state: dict = {}  # "ops": torch.ops.onecat_cpu once loaded, or "failure": why it cannot be


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The words of /proc/cpuinfo (its feature flags among them); empty where it cannot be read."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def _vector_flags() -> list[str]:
    """AVX2 + FMA code (ATen's Vectorized<float>, SLEEF's exp) where this CPU has them, else portable code."""
    if {"avx2", "fma", "f16c"} <= cpu_flags():
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return []


def vector_isa() -> str:
    """The instruction set the CPU ops are compiled for here (engine info: what onecat's own kernels use)."""
    return "AVX2+FMA+F16C" if _vector_flags() else "portable (no AVX2)"


def _openmp_flags() -> tuple[list[str], list[str]]:
    """(compile, link) flags that make at::parallel_for's OpenMP pragmas real, linked to the OpenMP runtime
    torch itself has loaded: one thread pool, sized by torch.set_num_threads (a second runtime would spin
    its own threads against torch's). Without them (no OpenMP in torch, none found) the ops run serially."""
    if not torch.backends.openmp.is_available():
        return [], []
    try:
        maps = Path("/proc/self/maps").read_text().split("\n")
    except OSError:
        return [], []
    for line in maps:
        path = line.split()[-1] if line.strip() else ""
        if Path(path).name.startswith(("libgomp", "libiomp5", "libomp")):
            return ["-fopenmp"], [path]
    return [], []


def _build_directory() -> Path:
    flags = _FLAGS + _vector_flags() + [f for part in _openmp_flags() for f in part]
    h = hashlib.sha256(torch.__version__.encode() + " ".join(flags).encode())
    for f in sorted(SOURCE_DIR.glob("*")):
        h.update(f.name.encode() + f.read_bytes())
    key = h.hexdigest()[:16]
    return cache_root() / "torch_extensions" / f"cpu_fused_ops-{key}"


def _staged_sources(folder: Path) -> list[Path]:
    """The sources copied into the build folder (named by their content), so that every checkout of the same
    sources (git worktrees, other clones) builds from the same paths and reuses the built library instead of
    rebuilding it; a file is written only when missing or different (its time stamp is what ninja checks)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in sorted(SOURCE_DIR.glob("*")):
        target = folder / f.name
        data = f.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            partial = folder / f".{f.name}.{os.getpid()}.partial"
            partial.write_bytes(data)
            os.replace(partial, target)
    return [folder / s.name for s in SOURCES]


def load():
    """torch.ops.onecat_cpu, building the extension on first use; RuntimeError saying why if it cannot."""
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        if "failure" not in _state:
            try:
                from torch.utils import cpp_extension

                build_dir = _build_directory()
                sources = _staged_sources(build_dir / "src")
                omp_compile, omp_link = _openmp_flags()
                cpp_extension.load(name="onecat_cpu_fused_ops", sources=[str(s) for s in sources],
                                   extra_include_paths=[str(build_dir / "src")], is_python_module=False,
                                   extra_cflags=_FLAGS + _vector_flags() + omp_compile, extra_ldflags=omp_link,
                                   build_directory=str(build_dir), verbose=False)
                _state["ops"] = torch.ops.onecat_cpu
                return _state["ops"]
            except Exception as exc:  # no compiler, a failed build, an unloadable library
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                _state["failure"] = f"the CPU fused ops could not be built ({type(exc).__name__}: {first})"
        raise RuntimeError(_state["failure"])


def unavailable_reason() -> str | None:
    """None when the ops are loaded (building them if needed), else why not."""
    try:
        load()
    except RuntimeError as exc:
        return str(exc)
    return None
