"""Build-on-demand loader of the flash_attn_v100 torch extension (engine/kernels/cuda_extension.py)."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from onecat.engine.kernels.cuda_extension import CSRC, CudaExtension, KernelUnavailable

SOURCES = (CSRC / "bindings" / "flash_attn_v100.cpp", CSRC / "bindings" / "flash_attn_v100_launch.cu")
EXTENSION = CudaExtension("onecat_flash_attn_v100", SOURCES, ("flash_attn_v100", "bindings"))

__all__ = ["EXTENSION", "KernelUnavailable", "SOURCES", "build_directory", "load_extension",
           "prerequisites_missing", "unavailable_reason"]


def build_directory() -> Path:
    return EXTENSION.build_directory()


def prerequisites_missing() -> str | None:
    """Why a build cannot even be attempted (cheap; compiles nothing)."""
    return EXTENSION.prerequisites_missing()


def load_extension(verbose: bool = False) -> ModuleType:
    """The compiled extension, building it on first use; KernelUnavailable if that fails."""
    return EXTENSION.load(verbose)


def unavailable_reason() -> str | None:
    """None when the extension is (or can be) loaded; otherwise why not. May trigger the build."""
    return EXTENSION.unavailable_reason()
