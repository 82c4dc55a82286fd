"""Which CPU instruction sets an engine used, where that can be known, for the record of a run: the same
machine can run an engine on AMX, AVX-512 or AVX2 kernels depending on how it was built and what it detects,
and a figure means little without it.

    llama_cpp_isa(log)     llama.cpp prints its system_info line (`AVX2 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 |`)
                           and its weight buffers (`AMX model buffer size`, `CPU_REPACK ...`) while loading
    torch_isa(python)      a torch-based engine (vLLM): torch's CPU capability and the ISA oneDNN dispatches to,
                           asked of the engine's own interpreter
    onecat_serve_isa(log)  `onecat serve` writes its engine info (LLM.info(), with `cpu_isa`) once loaded
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from functools import lru_cache

_FEATURE = re.compile(r"\b([A-Z][A-Z0-9_]*) = ([01])\b")
_SYSTEM_INFO = re.compile(r"\b(?:SSE3|AVX|AVX2|AVX512|NEON) = [01]\b")
_MODEL_BUFFER = re.compile(r"(\S+) model buffer size")


def llama_cpp_isa(log_text: str) -> dict | None:
    """The features llama.cpp says it was built with and runs (its last system_info line) and the buffer types
    it put the weights in (an `AMX` buffer: the AMX kernels run the matmuls); None when the log has neither."""
    lines = [line.strip() for line in log_text.splitlines() if _SYSTEM_INFO.search(line)]
    buffers = sorted(set(_MODEL_BUFFER.findall(log_text)))
    if not lines and not buffers:
        return None
    found = _FEATURE.findall(lines[-1]) if lines else []
    return {"source": "llama.cpp system_info", "features": [name for name, on in found if on == "1"],
            "model_buffers": buffers, "system_info": lines[-1] if lines else None}


_TORCH_PROBE = r"""
import json, torch
out = {"torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
       "mkldnn": torch.backends.mkldnn.is_available()}
for name in ("amx_tile", "avx512_bf16", "avx512_vnni"):
    probe = getattr(torch.cpu, "_is_%s_supported" % name, None)
    if probe is not None:
        out["torch_sees_" + name] = bool(probe())
if out["mkldnn"]:  # one oneDNN primitive, so that ONEDNN_VERBOSE names the ISA it dispatches to
    torch.nn.functional.conv2d(torch.randn(2, 8, 32, 32), torch.randn(8, 8, 3, 3))
print("ISA-PROBE " + json.dumps(out), flush=True)
"""
_ONEDNN_ISA = re.compile(r"onednn_verbose,(?:v\d+,)?info,cpu,isa:(.+)")
_ONEDNN_CONV = re.compile(r"onednn_verbose,(?:v\d+,)?primitive,exec,cpu,convolution,([^,]+),")


@lru_cache(maxsize=8)
def torch_isa(python: str, timeout_s: float = 120.0) -> dict:
    """What torch in `python`'s environment dispatches to on this CPU (one probe per interpreter, ~5 s);
    {"error": why} when it cannot be asked."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=timeout_s,
                              env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"source": "torch probe", "error": f"{type(exc).__name__}: {exc}"}
    result = next((line[len("ISA-PROBE "):] for line in done.stdout.splitlines() if line.startswith("ISA-PROBE ")),
                  None)
    if done.returncode != 0 or result is None:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"source": "torch probe", "error": f"{python} exited with {done.returncode}: {last[0][:300]}"}
    out = {"source": "torch probe", **json.loads(result)}
    if m := _ONEDNN_ISA.search(done.stdout):
        out["onednn_isa"] = m.group(1).strip()
    if m := _ONEDNN_CONV.search(done.stdout):
        out["onednn_kernel"] = m.group(1)
    return out


def onecat_serve_isa(log_text: str) -> tuple[dict | None, dict | None]:
    """(the engine info `onecat serve` wrote once loaded, its `cpu_isa`); (None, None) when the log has none."""
    from onecat.engine.server.launch import ENGINE_INFO_PREFIX

    for line in reversed(log_text.splitlines()):
        if line.startswith(ENGINE_INFO_PREFIX):
            try:
                info = json.loads(line[len(ENGINE_INFO_PREFIX):])
            except json.JSONDecodeError:
                return None, None
            return info, ({"source": "onecat info", **info["cpu_isa"]} if info.get("cpu_isa") else None)
    return None, None
