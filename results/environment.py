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

