"""The `mtp.*` tensors of a Qwen3.5 / Qwen3.5-MoE checkpoint into the MTP head (models/qwen3_5_mtp.py), read
only when method mtp asks for them: the target's loader skips them, so a target without speculation holds
nothing of the head. Only the head's tensors are read (from the safetensors headers' names), dequantized
as the target's are when the checkpoint is quantized."""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from onecat.engine.config import ModelConfig
from onecat.engine.errors import ConfigError, CorruptModelError
from onecat.engine.loader.dummy import fill_random_weights
from onecat.engine.loader.hf import read_hf_config
from onecat.engine.models.qwen3_5_mtp import Qwen3_5MTP
from onecat.engine.support_matrix.axes import RANDOM_LOAD_FORMATS
from onecat.engine.models.weight_loading import fused_route, load_by_name
from onecat.engine.quant.checkpoint_formats import dense_weights, quant_format

PREFIX = "mtp."
ALTERNATIVES = "use speculative method ngram or draft_model instead"


def mtp_layer_count(cfg: ModelConfig) -> int:
    """The head's decoder layers as the config declares them (Qwen3.5's or Qwen3-Next's key; one if neither)."""
    return int(cfg.raw.get("mtp_num_hidden_layers", cfg.raw.get("num_nextn_predict_layers", 1)) or 1)


def _mtp_tensor_names(path: Path) -> dict[str, Path]:
    """The checkpoint's `mtp.*` tensor names and the safetensors file holding each (headers only are read)."""
    where = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                where.update((name, f) for name in fh.keys() if name.startswith(PREFIX))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CorruptModelError(f"cannot read the tensor names of {f}: {e}; the file is truncated or corrupt") \
                from None
    return where


def _read(where: dict[str, Path], quant) -> list[tuple[str, torch.Tensor]]:
    """The `mtp.*` tensors, dense (a quantized checkpoint's MTP linears dequantized as the target's are)."""
    with ExitStack() as stack:
        files = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(where.values())}

        def get(name: str) -> torch.Tensor:
            return files[where[name]].get_tensor(name)

        names = sorted(where)
        if quant is None:
            return [(n, get(n)) for n in names]
        return list(dense_weights(names, get, quant))


def _unplaced(head: Qwen3_5MTP, route, names) -> list[str]:
    """The head's parameters (as checkpoint names) that none of the dense tensors `names` fills."""
    placed = set()
    for name in names:
        try:
            target = route(name)
        except CorruptModelError:  # a tensor of no place in the head: load_by_name says so
            continue
        if target is not None:
            placed.add(target[0])
    return [PREFIX + n for n, _ in head.named_parameters() if n not in placed]


@torch.no_grad()
def load_mtp_head(cfg: ModelConfig, make_mlp, source, load_format: str, seed: int, max_positions: int,
                  dtype: torch.dtype, device: torch.device) -> Qwen3_5MTP:
    """The MTP head of the checkpoint at `source` (a ResolvedModel), from its `mtp.*` tensors only (random
    weights under load_format dummy, as the target's). A ConfigError when the checkpoint carries none or
    an incomplete set, naming what is missing."""
    layers = mtp_layer_count(cfg)
    if layers != 1:
        raise ConfigError(f"the checkpoint's MTP head has {layers} layers (mtp_num_hidden_layers); method mtp runs a "
                          f"head of one layer; {ALTERNATIVES}")
    with torch.device("meta"):
        head = Qwen3_5MTP(cfg, make_mlp, max_positions)
    head = head.to(dtype).to_empty(device=device).requires_grad_(False)
    head.rotary.build_tables(device)
    if load_format in RANDOM_LOAD_FORMATS:  # the head itself is never peaked: it proposes, the target decides
        fill_random_weights(head, seed)
        return head.eval()
    if source.format != "hf":
        raise ConfigError(f"{source.path} is a {source.format} file, whose reader does not keep the MTP head; "
                          f"method mtp needs the HF checkpoint; {ALTERNATIVES}")
    path = Path(source.path)
    where = _mtp_tensor_names(path)
    if not where:
        raise ConfigError(f"the checkpoint {path} carries no multi-token-prediction head (no mtp.* tensors: "
                          f"mtp.fc.weight, mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight, "
                          f"mtp.layers.0.*, mtp.norm.weight), which method mtp drafts with; {ALTERNATIVES}")
    weights = _read(where, quant_format(read_hf_config(path), path))
    route = fused_route(head, prefixes=(PREFIX,), skip=("rotary_emb",))
    missing = _unplaced(head, route, [name for name, _ in weights])
    if missing:
        raise ConfigError(f"the checkpoint {path} has an incomplete multi-token-prediction head: no tensor for "
                          f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; {ALTERNATIVES}")
    load_by_name(head, weights, route)
    return head.eval()
