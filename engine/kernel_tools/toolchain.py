"""Locate the CUDA 12.x tools that can still target sm_70 (CUDA 13 cannot) without a GPU.

NVRTC 12.x and its headers come from the `nvidia-cuda-nvrtc-cu12` / `nvidia-cuda-runtime-cu12`
wheels, ptxas from `nvidia-cuda-nvcc-cu12`, and nvdisasm (CUDA 12.8) from the `triton==3.3.1`
wheel, of which only that one binary is extracted into the onecat cache.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from onecat.engine.kernels.cache import cache_root

PIP_INSTALL_HINT = 'pip install "onecat[sm70]"  (or: pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12)'
NVDISASM_HINT = "onecat kernels fetch-nvdisasm  (extracts nvdisasm from the triton==3.3.1 wheel via pip download)"
TRITON_WHEEL_WITH_NVDISASM = "triton==3.3.1"


def _nvidia_dir(sub: str) -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        cand = Path(root) / sub
        if cand.is_dir():
            return cand
    return None


@dataclass(frozen=True)
class Sm70Toolchain:
    nvrtc_lib: Path
    cuda_include: Path
    ptxas: Path
    nvdisasm: Path


class ToolchainMissing(RuntimeError):
    """A tool of the CUDA 12.x chain is not installed; the message says how to install it."""


def nvdisasm_cache_path() -> Path:
    return cache_root() / "toolchain" / "bin" / "nvdisasm"


def _tool_major_version(exe: Path) -> int | None:
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for tok in out.replace(",", " ").split():
        if tok.startswith("V") and tok[1:2].isdigit():
            return int(tok[1:].split(".")[0])
    return None


def find_nvdisasm() -> Path | None:
    """A CUDA 12.x nvdisasm: $ONECAT_NVDISASM, the onecat cache, an installed triton 3.3, PATH."""
    cands: list[Path] = []
    if os.environ.get("ONECAT_NVDISASM"):
        cands.append(Path(os.environ["ONECAT_NVDISASM"]))
    cands.append(nvdisasm_cache_path())
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        cands.append(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "nvdisasm")
    on_path = shutil.which("nvdisasm")
    if on_path:
        cands.append(Path(on_path))
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK) and _tool_major_version(c) == 12:
            return c
    return None


def find_toolchain() -> Sm70Toolchain:
    """The whole chain, or ToolchainMissing naming each missing piece and its install command."""
    missing: list[str] = []
    nvrtc_dir = _nvidia_dir("cuda_nvrtc")
    nvrtc_lib = None
    if nvrtc_dir is not None:
        libs = sorted((nvrtc_dir / "lib").glob("libnvrtc.so.12*"))
        nvrtc_lib = libs[0] if libs else None
    if nvrtc_lib is None:
        missing.append("NVRTC 12.x (nvidia-cuda-nvrtc-cu12)")
    rt_dir = _nvidia_dir("cuda_runtime")
    include = rt_dir / "include" if rt_dir is not None else None
    if include is None or not (include / "cuda_fp16.h").is_file():
        missing.append("CUDA 12.x headers (nvidia-cuda-runtime-cu12)")
    nvcc_dir = _nvidia_dir("cuda_nvcc")
    ptxas = nvcc_dir / "bin" / "ptxas" if nvcc_dir is not None else None
    if ptxas is None or not ptxas.is_file():
        missing.append("ptxas 12.x (nvidia-cuda-nvcc-cu12)")
    nvdisasm = find_nvdisasm()
    if missing:
        raise ToolchainMissing("sm_70 toolchain incomplete: missing " + ", ".join(missing)
                               + f". Install with: {PIP_INSTALL_HINT}")
    if nvdisasm is None:
        raise ToolchainMissing("sm_70 toolchain incomplete: missing a CUDA 12.x nvdisasm. Get it with: "
                               f"{NVDISASM_HINT}, or point ONECAT_NVDISASM at one")
    return Sm70Toolchain(nvrtc_lib, include, ptxas, nvdisasm)


def fetch_nvdisasm(pip_download_dir: Path | None = None) -> Path:
    """Download the triton 3.3.1 wheel (without installing it) and extract only nvdisasm."""
    import tempfile

    target = nvdisasm_cache_path()
    with tempfile.TemporaryDirectory() as tmp:
        dl = Path(pip_download_dir or tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               TRITON_WHEEL_WITH_NVDISASM, "-d", str(dl)]
        subprocess.run(cmd, check=True)
        wheels = sorted(dl.glob("triton-3.3.1-*.whl"))
        if not wheels:
            raise ToolchainMissing(f"pip download of {TRITON_WHEEL_WITH_NVDISASM} produced no wheel in {dl}")
        with zipfile.ZipFile(wheels[0]) as zf:
            data = zf.read("triton/backends/nvidia/bin/nvdisasm")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    target.chmod(0o755)
    return target
