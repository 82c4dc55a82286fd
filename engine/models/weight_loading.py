"""Checkpoint tensors into a model's parameters by name, for the models whose layers fuse several checkpoint
tensors into one parameter (q/k/v, gate/up, per-expert weights into expert-indexed 3D tensors).

`load_by_name` copies each tensor where `route(name)` says, checks shapes, and refuses a checkpoint that
leaves any parameter (or part of a fused one) unwritten. `fused_route` is the route of the Qwen families:
HF names, with the fusions of SelfAttention, GatedMLP and the MoE experts. `linear_slot` says the same of a
whole checkpoint linear, for the packers that keep it packed (engine/quant/hf_packer.py).
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from onecat.engine.errors import CorruptModelError
from onecat.engine.layers.attention import SelfAttention
from onecat.engine.layers.mlp import GatedMLP
from onecat.engine.layers.moe import Experts

Select = Callable[[torch.Tensor], torch.Tensor]  # the part of a parameter's data a checkpoint tensor fills
Route = Callable[[str], "tuple[str, Select | None] | None"]  # None: the tensor is not used (said by the route)

EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")  # one expert
STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")  # all experts in one (GGUF)
EXPERT_LINEAR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")  # one expert's linear, by module
CHECKPOINT_PREFIXES = ("model.language_model.", "model.")  # HF prefixes of the decoder (multimodal ones first)


def load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], route: Route) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    written: dict[str, int] = defaultdict(int)
    for name, tensor in weights:
        placed = route(name)
        if placed is None:
            continue
        target, select = placed
        param = params.get(target)
        if param is None:
            raise CorruptModelError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        dst = param.data if select is None else select(param.data)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise CorruptModelError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                    f"{tuple(dst.shape)}; config and weights disagree")
        dst.copy_(tensor)
        written[target] += dst.numel()
    missing = [n for n, p in model.named_parameters() if written[n] < p.numel()]
    if missing:
        raise CorruptModelError(f"checkpoint is missing {len(missing)} tensors (or parts of fused ones), e.g. "
                                f"{missing[:3]}; the weights are incomplete or truncated")


def _rows(start: int, length: int, index: int | None = None) -> Select:
    if index is None:
        return lambda d: d.narrow(0, start, length)
    return lambda d: d[index].narrow(0, start, length)


def fused_route(model: nn.Module, prefixes: tuple[str, ...] = ("model.",),
                skip: tuple[str, ...] = ("rotary_emb", "mtp.")) -> Route:
    """The route of HF names into `model`: `prefixes` are stripped (the first that matches), names containing a
    `skip` part are not used (rotary tables, multi-token-prediction heads), and a tied LM head is the embedding."""
    tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))

    def route(name: str):
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p):]
                break
        if any(s in name for s in skip) or (tied and name == "lm_head.weight"):
            return None
        expert = EXPERT_TENSOR.match(name)
        if expert is not None:
            parent, e, leaf = expert.group(1), int(expert.group(2)), expert.group(3)
            experts = model.get_submodule(parent)
            if not isinstance(experts, Experts) or not 0 <= e < experts.num_experts:
                raise CorruptModelError(f"checkpoint tensor {name!r} names an expert the model does not have")
            i = experts.intermediate
            if leaf == "down_proj":
                return f"{parent}.down_proj", (lambda d: d[e])
            return f"{parent}.gate_up_proj", _rows(0 if leaf == "gate_proj" else i, i, e)
        stacked = STACKED_EXPERTS.match(name)
        if stacked is not None:
            parent, leaf = stacked.group(1), stacked.group(2)
            if leaf == "down_proj":
                return f"{parent}.down_proj", None
            i = model.get_submodule(parent).intermediate
            return f"{parent}.gate_up_proj", (lambda d: d.narrow(1, 0 if leaf == "gate_proj" else i, i))
        parent, _, rest = name.rpartition(".")
        owner, _, leaf = parent.rpartition(".")
        parts = _fused_parts(model, owner)
        if leaf in parts:
            fused, start, length = parts[leaf]
            return f"{owner}.{fused}.{rest}", _rows(start, length)
        return name, None

    return route


def _fused_parts(model: nn.Module, owner: str) -> dict[str, tuple[str, int, int]]:
    """Checkpoint projection name -> (fused parameter's module, first row, rows) for the module at `owner`."""
    try:
        m = model.get_submodule(owner) if owner else model
    except AttributeError:
        return {}
    parts = getattr(m, "checkpoint_parts", None)
    if parts is not None:
        return parts
    if isinstance(m, SelfAttention):
        q, kv = m.q_size, m.kv_size
        return {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv)}
    if isinstance(m, GatedMLP):
        i = m.intermediate
        return {"gate_proj": ("gate_up_proj", 0, i), "up_proj": ("gate_up_proj", i, i)}
    return {}


@dataclass(frozen=True)
class LinearSlot:
    """Where one checkpoint linear's weight sits in a model: rows from `start` of the linear at `module`, or,
    for an MoE expert, projection `leaf` (gate_proj, up_proj, down_proj) of expert `expert` of the Experts at
    `module`."""

    module: str
    start: int = 0
    expert: int | None = None
    leaf: str | None = None


def linear_slot(model: nn.Module, checkpoint_module: str) -> LinearSlot:
    """The slot of the checkpoint linear named `checkpoint_module` (HF names, e.g.
    `model.layers.0.self_attn.k_proj`): the fusions are those `fused_route` loads with."""
    name = checkpoint_module
    for p in CHECKPOINT_PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
            break
    expert = EXPERT_LINEAR.match(name)
    if expert is not None:
        return LinearSlot(expert.group(1), expert=int(expert.group(2)), leaf=expert.group(3))
    owner, _, leaf = name.rpartition(".")
    parts = _fused_parts(model, owner)
    if leaf in parts:
        fused, start, _ = parts[leaf]
        return LinearSlot(f"{owner}.{fused}" if owner else fused, start)
    return LinearSlot(name)
