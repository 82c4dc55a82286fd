"""Writes a drafter the way load_drafter (engine/speculative/dflash.py) and public DFlash checkpoints
keep it: `config.json` + `model.safetensors` in bf16 (or fp16), parameter names of the module tree
with the MLP's fused gate/up projection stored as separate `gate_proj` / `up_proj`, as public
checkpoints do. Each file is written next to its final name and renamed into place, so an interrupted
run leaves the previous checkpoint, never half a file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def checkpoint_tensors(drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's parameters under checkpoint names, in `dtype`, on the CPU."""
    out = {}
    for name, tensor in drafter.state_dict().items():
        tensor = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        if name.endswith("mlp.gate_up_proj.weight"):
            gate, up = tensor.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = tensor
    return out


def _replace(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    write(tmp)
    os.replace(tmp, path)


def save_drafter(drafter, config: dict, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Write config.json and model.safetensors into out_dir; returns their paths and the weights' size."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"a drafter is saved in bfloat16 or float16, not {dtype}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(drafter, dtype)
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    weights, cfg_path = out_dir / WEIGHTS, out_dir / CONFIG
    _replace(weights, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _replace(cfg_path, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    return {"config": str(cfg_path), "weights": str(weights), "weights_bytes": weights.stat().st_size,
            "parameters": sum(t.numel() for t in tensors.values())}
