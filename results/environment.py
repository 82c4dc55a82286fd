"""What machine and software a run measured on: recorded per arm with the engine's effective fast paths."""
from __future__ import annotations

import os
import platform
import socket
import subprocess
from typing import Any

from onecat.results.records import Environment


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


CPUINFO = "/proc/cpuinfo"
# the CPU features that decide which kernels an engine can run: AMX tiles, AVX-512 BF16 / VNNI, AVX2
ISA_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2")


def cpu_isa() -> dict[str, Any]:
    """The CPU model and, for each of ISA_FLAGS, whether the first processor's flags have it (None: no
    /proc/cpuinfo to read)."""
    try:
        with open(CPUINFO, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return {"cpu": _cpu_model(), "isa": {flag: None for flag in ISA_FLAGS}}
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 None)
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return {"cpu": model or platform.processor() or None, "isa": {flag: flag in flags for flag in ISA_FLAGS}}


def machine_record(label: str | None = None) -> dict[str, Any]:
    """What a comparison's engines ran on: a label (given, else the CPU, its thread count and its widest
    vector features), the CPU model and its ISA flags."""
    found = cpu_isa()
    widest = [name for name, flags in (("AMX", ("amx_tile",)), ("AVX512-BF16", ("avx512_bf16",)),
                                       ("AVX512", ("avx512f",)), ("AVX2", ("avx2",)))
              if all(found["isa"].get(f) for f in flags)][:1]
    default = ", ".join(filter(None, [found["cpu"] or platform.machine(), f"{os.cpu_count()} threads", *widest]))
    return {"label": label or default, "cpu_threads": os.cpu_count(), **found}


def load_1min() -> float | None:
    """The 1-minute load average now: what else was running as an engine started."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _gpu() -> dict[str, Any]:
    out: dict[str, Any] = {"gpu_name": None, "gpu_count": 0, "gpu_driver": None}
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu_count"] = torch.cuda.device_count()
            out["gpu_name"] = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(out["gpu_count"])}))
    except Exception:  # noqa: BLE001
        pass
    if out["gpu_count"]:
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10)
            out["gpu_driver"] = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def capture_environment(engine_info: dict[str, Any] | None = None) -> Environment:
    """This machine and its software, with the fast paths an engine reports in `engine_info` (its `info()`)."""
    info = dict(engine_info or {})
    env: dict[str, Any] = {
        "hostname": socket.gethostname(), "platform": platform.platform(),
        "python_version": platform.python_version(), "cpu_model": _cpu_model(), "cpu_threads": os.cpu_count(),
        "torch_threads": None, "torch_version": None, "cuda_version": None,
    }
    try:
        import torch

        env["torch_version"] = torch.__version__
        env["cuda_version"] = torch.version.cuda
        env["torch_threads"] = torch.get_num_threads()
    except Exception:  # noqa: BLE001
        pass
    env.update(_gpu())

    def s(key: str) -> str | None:
        v = info.get(key)
        if isinstance(v, dict):  # e.g. attention_backend: {requested, selected, effective, ...}
            v = v.get("effective", v.get("selected"))
        return None if v is None else str(v)

    env.update(device=s("device"), kv_cache_dtype=s("kv_cache_dtype"), attention_backend=s("attention_backend"),
               cuda_graph=s("cuda_graph"),
               prefix_caching=s("enable_prefix_caching") if "enable_prefix_caching" in info else s("prefix_caching"),
               model_sha256=s("model_sha256") or s("sha256"), engine_info=info)
    return Environment(**env)

