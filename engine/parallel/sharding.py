"""Tensor-parallel sharding of a loaded Llama-family model (Megatron-style), in place.

Each rank keeps a slice of every projection: the attention's heads (q/k/v rows, o_proj columns; the hybrid
models' Gated DeltaNet and gated attention by heads likewise), the MLP's intermediate
units (gate/up rows, down_proj columns), every MoE expert's intermediate units likewise (the router whole)
and the vocabulary (embedding and LM-head rows). The layer code runs unchanged on the slices, with smaller
head and unit counts; the only additions are the collectives: a sum over the ranks after each row-parallel
projection (o_proj, out_proj, down_proj, a layer's experts) and after the embedding lookup, and a gather of
the LM head's vocabulary slices, so every rank ends each layer, and the step, with the full hidden state and
the full logits.

The engine shards the model while it is still on the meta device (shapes only), so a rank allocates only
its share; every sliced layer records which rows / columns of the full weight it keeps (`_tp_rows`,
`_tp_cols`, `_tp_full`), and shard_loading.py slices the checkpoint's full tensors by them as they stream
in. Sharding also works on dense weights already loaded (tests), before `pack_weights` (which keeps only a
oneDNN-blocked copy of CPU float32 weights), and never on quantized layers: packed weights are swapped in after
loading, each cut to the rank's share by these records (engine/quant/packed_shard.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from onecat.engine.errors import ConfigError
from onecat.engine.layers.attention import SelfAttention
from onecat.engine.layers.gated_attention import GatedAttention
from onecat.engine.layers.gated_deltanet import GatedDeltaNet
from onecat.engine.layers.linear import Linear
from onecat.engine.layers.mlp import GatedMLP
from onecat.engine.layers.moe import Experts
from onecat.engine.parallel.collectives import Collectives


# ---- partition math ------------------------------------------------------------------------------
def split_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of n items; the first n % world ranks get one more, so a
    share is empty only when n < world."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def attention_heads(num_heads: int, num_kv_heads: int, rank: int, world: int) -> tuple[list[int], list[int]]:
    """(query heads, KV heads) of rank. Query head h reads KV head h // (num_heads // num_kv_heads), and
    a rank holds the KV heads its query heads read: with world <= num_kv_heads the KV heads are split
    and each rank takes their query heads; with more ranks, rank r replicates KV head
    r * num_kv_heads // world and the ranks sharing it split its query heads (some may get none when
    world > num_heads)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if world <= num_kv_heads:
        start, end = split_range(num_kv_heads, rank, world)
        return list(range(start * group, end * group)), list(range(start, end))
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    kv = rank * num_kv_heads // world
    sharers = [r for r in range(world) if r * num_kv_heads // world == kv]
    start, end = split_range(group, sharers.index(rank), len(sharers))
    return list(range(kv * group + start, kv * group + end)), [kv]


def local_num_kv_heads(num_heads: int, num_kv_heads: int, rank: int, world: int) -> int:
    """KV heads rank stores per layer (its KV cache's head count)."""
    return len(attention_heads(num_heads, num_kv_heads, rank, world)[1])


# ---- collectives ---------------------------------------------------------------------------------
def all_reduce(t: torch.Tensor, group) -> None:
    """Sum t over the ranks in place: through `group`'s own path when it is a Collectives (shared memory
    for CPU ranks), else torch.distributed on that process group (None: the default one)."""
    if isinstance(group, Collectives):
        group.all_reduce(t)
    else:
        dist.all_reduce(t, group=group)


def all_gather(pieces: list[torch.Tensor], t: torch.Tensor, group) -> None:
    if isinstance(group, Collectives):
        group.all_gather(pieces, t)
    else:
        dist.all_gather(pieces, t, group=group)


def _sum_hook(group):
    """Forward hook: sum the partial outputs of a row-parallel projection over the ranks."""
    def hook(module, args, out):
        all_reduce(out, group)
        return out
    return hook


def _gather_hook(sizes: list[int], group):
    """Forward hook: concatenate the ranks' output slices (sizes[r] columns each, in rank order).
    all_gather wants equal shapes, so every slice is padded to the widest and trimmed after."""
    widest = max(sizes)

    def hook(module, args, out):
        pieces = [out.new_empty(*out.shape[:-1], widest) for _ in sizes]
        all_gather(pieces, F.pad(out, (0, widest - out.shape[-1])).contiguous(), group)
        return torch.cat([p[..., :n] for p, n in zip(pieces, sizes)], dim=-1)
    return hook


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the vocabulary. An id outside them looks up zeros here;
    the sum over the ranks brings in the row from the rank that holds it."""

    def __init__(self, weight: torch.Tensor, start: int, group, full_rows: int):
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        self.start, self.group = start, group
        self._tp_full, self._tp_cols = (full_rows, weight.shape[1]), None
        self._tp_rows = torch.arange(start, start + weight.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        all_reduce(out, self.group)
        return out


class IdleAttention(nn.Module):
    """Stands in for the attention of a rank that owns no query head (world > num_heads): it still joins
    the sum over the ranks, with zeros. Its qkv_proj is the identity, so the decoder layer's norm still
    runs but no projection does."""

    num_heads = num_kv_heads = q_size = kv_size = 0

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.qkv_proj = nn.Identity()

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(qkv)  # qkv is the normed hidden state here: [T, hidden]
        all_reduce(out, self.group)
        return out


# ---- sharding ------------------------------------------------------------------------------------
def _keep(linear: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> None:
    """Keep these output rows (and bias entries) / input columns of a dense Linear (on meta: their shape),
    and record them for loading. index_select copies, so the full weight is freed."""
    w = linear.weight.detach()
    linear._tp_full, linear._tp_rows, linear._tp_cols = tuple(w.shape), rows, cols
    if rows is not None:
        w = w.index_select(0, rows.to(w.device))
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.detach().index_select(0, rows.to(w.device)), requires_grad=False)
    if cols is not None:
        w = w.index_select(1, cols.to(w.device))
    linear.weight = nn.Parameter(w, requires_grad=False)
    linear.out_features, linear.in_features = w.shape
    linear.__dict__.pop("_batch_invariant_weight", None)  # a blocked copy of the full weight, if any


def _row_parallel(linear: nn.Linear, rank: int, group) -> None:
    """Each rank's output is a partial sum: add them up, with the bias counted once (rank 0's)."""
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.register_forward_hook(_sum_hook(group))


def _head_rows(heads: list[int], head_dim: int) -> torch.Tensor:
    return (torch.tensor(heads, dtype=torch.int64).view(-1, 1) * head_dim + torch.arange(head_dim)).view(-1)


def _shard_attention(attn: SelfAttention, rank: int, world: int, group) -> nn.Module:
    q_heads, kv_heads = attention_heads(attn.num_heads, attn.num_kv_heads, rank, world)
    if not q_heads:
        return IdleAttention(group)
    d = attn.head_dim
    q, kv = _head_rows(q_heads, d), _head_rows(kv_heads, d)
    _keep(attn.qkv_proj, rows=torch.cat([q, attn.q_size + kv, attn.q_size + attn.kv_size + kv]))
    _keep(attn.o_proj, cols=q)
    _row_parallel(attn.o_proj, rank, group)
    attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
    return attn


def _shard_mlp(mlp: GatedMLP, rank: int, world: int, group) -> None:
    start, end = split_range(mlp.intermediate, rank, world)
    units = torch.arange(start, end)
    full = mlp.intermediate  # the checkpoint's gate / up rows in the full fused weight (shard_loading.py)
    mlp._tp_full_parts = {"gate_proj": ("gate_up_proj", 0, full), "up_proj": ("gate_up_proj", full, full)}
    _keep(mlp.gate_up_proj, rows=torch.cat([units, mlp.intermediate + units]))  # still [gate | up]
    _keep(mlp.down_proj, cols=units)
    _row_parallel(mlp.down_proj, rank, group)
    mlp.intermediate = end - start


def _shard_experts(experts: Experts, rank: int, world: int, group) -> None:
    """Every expert keeps the same share of its intermediate units (gate/up rows, down columns), as a dense MLP
    does; the router stays whole on every rank, so each routes alike, and the experts' partial outputs are
    summed over the ranks (one sum for all experts of the layer). Expert parallelism (a share of the experts
    per rank) is not built: the [E, ...] layout would let a rank keep a slice of E instead."""
    full = experts.intermediate
    start, end = split_range(full, rank, world)
    units = torch.arange(start, end)
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    experts.gate_up_proj = nn.Parameter(gate_up.index_select(1, torch.cat([units, full + units]).to(gate_up.device)),
                                        requires_grad=False)
    experts.down_proj = nn.Parameter(down.index_select(2, units.to(down.device)), requires_grad=False)
    experts._tp_units, experts._tp_intermediate = units, full  # what shard_loading.py slices by
    experts.intermediate = end - start
    experts._views.clear()
    experts.register_forward_hook(_sum_hook(group))


def _shard_vocab(model: nn.Module, rank: int, world: int, group) -> None:
    """Vocabulary-parallel embedding and LM head (one shared slice when they are tied); the head's
    forward returns the full logits on every rank."""
    emb, head = model.embed_tokens, model.lm_head
    tied, vocab = head.weight is emb.weight, head.out_features
    start, end = split_range(emb.num_embeddings, rank, world)
    model.embed_tokens = VocabParallelEmbedding(emb.weight.detach()[start:end].clone(), start, group,
                                                emb.num_embeddings)
    if tied:
        head.weight = model.embed_tokens.weight
        head.out_features = end - start
        head.__dict__.pop("_batch_invariant_weight", None)
        head._tp_full, head._tp_rows, head._tp_cols = model.embed_tokens._tp_full, model.embed_tokens._tp_rows, None
    else:
        _keep(head, rows=torch.arange(*split_range(vocab, rank, world)))
    sizes = [b - a for a, b in (split_range(vocab, r, world) for r in range(world))]
    head.register_forward_hook(_gather_hook(sizes, group))


# ---- hybrid models (Qwen3.5): Gated DeltaNet and gated attention by heads -----------------------------------
# Value head j of Gated DeltaNet reads key head j // (Hv / Hk), so a rank keeps whole key heads and the value
# heads grouped under them, as attention_heads splits query heads over KV heads (with more ranks than key heads a
# key head is replicated and its value heads split). in_proj is column-parallel: of [q | k | v | z | b | a] a
# rank keeps its key heads' q and k rows, its value heads' v and z rows and their b and a entries; the depthwise
# conv1d the channels of the q/k/v rows it keeps; A_log and dt_bias its value heads; the gated RMSNorm (one
# weight per head dimension, applied per head) stays whole; out_proj is row-parallel (its value-head columns).
# The layer, the gated delta rule (fla kernels or the torch reference) and the recurrent state cache then run
# on the local head counts unchanged. The gated attention's q_proj holds each head's query and gate side by
# side (2 * head_dim rows per head): a rank keeps both halves of its heads. Each layer records the full layout
# of its fused checkpoint parts (`_tp_full_parts`) and its own per-head parameters (`_tp_param_rows`), and gets
# local `checkpoint_parts`, so shard_loading.py cuts each checkpoint tensor and load_by_name places it.
def linear_attention_heads(v_heads: int, k_heads: int, rank: int, world: int) -> tuple[list[int], list[int]]:
    """(value heads, key heads) of rank's Gated DeltaNet share (attention_heads' rule, value heads in the place
    of query heads)."""
    return attention_heads(v_heads, k_heads, rank, world)


def _localize(parts: dict[str, tuple[str, int, int]], rows: torch.Tensor) -> dict[str, tuple[str, int, int]]:
    """Full checkpoint parts (fused name, first row, rows) -> the same parts inside the kept rows (sorted)."""
    out = {}
    for name, (fused, start, length) in parts.items():
        out[name] = (fused, int((rows < start).sum()), int(((rows >= start) & (rows < start + length)).sum()))
    return out


def _keep_param(module: nn.Module, name: str, rows: torch.Tensor) -> None:
    p = getattr(module, name).detach()
    setattr(module, name, nn.Parameter(p.index_select(0, rows.to(p.device)), requires_grad=False))


def _shard_gated_deltanet(m: GatedDeltaNet, rank: int, world: int, group) -> None:
    vh, kh = linear_attention_heads(m.v_heads, m.k_heads, rank, world)
    key, val = _head_rows(kh, m.k_dim), _head_rows(vh, m.v_dim)
    heads = torch.tensor(vh, dtype=torch.int64)
    qkv = torch.cat([key, m.key_size + key, 2 * m.key_size + val])  # the convolved channels
    z0, b0 = m.conv_dim, m.conv_dim + m.value_size
    rows = torch.cat([qkv, z0 + val, b0 + heads, b0 + m.v_heads + heads])
    m._tp_full_parts = dict(m.checkpoint_parts)
    _keep(m.in_proj, rows=rows)
    m.checkpoint_parts = _localize(m._tp_full_parts, rows)
    conv = m.conv1d
    w = conv.weight.detach()
    conv._tp_full, conv._tp_rows, conv._tp_cols = tuple(w.shape), qkv, None
    conv.weight = nn.Parameter(w.index_select(0, qkv.to(w.device)), requires_grad=False)
    conv.in_channels = conv.out_channels = conv.groups = len(qkv)
    _keep_param(m, "A_log", heads)
    _keep_param(m, "dt_bias", heads)
    m._tp_param_rows = {"A_log": heads, "dt_bias": heads}
    _keep(m.out_proj, cols=val)
    _row_parallel(m.out_proj, rank, group)
    m.k_heads, m.v_heads = len(kh), len(vh)
    m.key_size, m.value_size = m.k_heads * m.k_dim, m.v_heads * m.v_dim
    m.conv_dim = 2 * m.key_size + m.value_size
    m.split_sizes = [m.conv_dim, m.value_size, m.v_heads, m.v_heads]


def _shard_gated_attention(attn: GatedAttention, rank: int, world: int, group) -> nn.Module:
    q_heads, kv_heads = attention_heads(attn.num_heads, attn.num_kv_heads, rank, world)
    if not q_heads:
        return IdleAttention(group)
    d = attn.head_dim
    kv = _head_rows(kv_heads, d)
    rows = torch.cat([_head_rows(q_heads, 2 * d), 2 * attn.q_size + kv, 2 * attn.q_size + attn.kv_size + kv])
    attn._tp_full_parts = dict(attn.checkpoint_parts)
    _keep(attn.qkv_proj, rows=rows)
    attn.checkpoint_parts = _localize(attn._tp_full_parts, rows)
    _keep(attn.o_proj, cols=_head_rows(q_heads, d))
    _row_parallel(attn.o_proj, rank, group)
    attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
    return attn


def _check_dense(model: nn.Module, world: int, on_meta: bool) -> None:
    """Refuse what cannot be sliced by rows/columns: packed, quantized or missing projections, and
    dimensions too small to give every rank a share."""
    def check(name: str, module, kind=Linear):
        w = getattr(module, "weight", None)
        if isinstance(module, kind) and w is not None and w.is_meta == on_meta and w.is_floating_point():
            return
        what = ("packed by pack_weights (only a oneDNN-blocked copy is left)" if w is not None and w.is_meta
                else f"a {type(module).__name__}" + (f" of {w.dtype}" if isinstance(w, torch.Tensor) else "")
                + f", not a dense {kind.__name__}")
        raise ConfigError(f"tensor parallelism shards dense weights only, and {name} is {what}: shard the model "
                          "right after loading, before pack_weights, and run it unquantized (no quantization)")

    check("embed_tokens", getattr(model, "embed_tokens", None), nn.Embedding)
    check("lm_head", getattr(model, "lm_head", None))
    for name, m in model.named_modules():
        if isinstance(m, (SelfAttention, GatedAttention)):
            check(f"{name}.qkv_proj", m.qkv_proj)
            check(f"{name}.o_proj", m.o_proj)
        elif isinstance(m, GatedDeltaNet):
            check(f"{name}.in_proj", m.in_proj)
            check(f"{name}.out_proj", m.out_proj)
            if m.v_heads < world:
                raise ConfigError(f"{name} has {m.v_heads} Gated DeltaNet value heads, fewer than {world} ranks")
        elif isinstance(m, GatedMLP):
            check(f"{name}.gate_up_proj", m.gate_up_proj)
            check(f"{name}.down_proj", m.down_proj)
            if m.intermediate < world:
                raise ConfigError(f"{name} has {m.intermediate} intermediate units, fewer than {world} ranks")
        elif isinstance(m, Experts):
            w = m.gate_up_proj
            if w.is_meta != on_meta or not w.is_floating_point():
                raise ConfigError(f"tensor parallelism shards dense expert weights only, and {name} holds {w.dtype} "
                                  "weights: run the model unquantized")
            if m.intermediate < world:
                raise ConfigError(f"{name} has {m.intermediate} intermediate units per expert, fewer than {world} "
                                  "ranks")
    if model.embed_tokens.num_embeddings < world:
        raise ConfigError(f"a vocabulary of {model.embed_tokens.num_embeddings} cannot be split over {world} ranks")


def shard_model(model: nn.Module, rank: int, world: int, group=None) -> None:
    """Keep rank's share of the model's weights (loaded, or all on the meta device: then only the shapes), in
    place, and hook in the collectives over `group` (None: the default process group; a Collectives: its
    own paths), whose size must be `world`."""
    if world == 1:
        return
    if dist.is_initialized() and not isinstance(group, Collectives) and dist.get_world_size(group) != world:
        raise ValueError(f"the process group has {dist.get_world_size(group)} ranks, not {world}")
    _check_dense(model, world, on_meta=model.embed_tokens.weight.is_meta)
    for name, m in list(model.named_modules()):
        if isinstance(m, SelfAttention):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, _shard_attention(m, rank, world, group))
        elif isinstance(m, GatedMLP):
            _shard_mlp(m, rank, world, group)
        elif isinstance(m, Experts):
            _shard_experts(m, rank, world, group)
        elif isinstance(m, GatedDeltaNet):
            _shard_gated_deltanet(m, rank, world, group)
        elif isinstance(m, GatedAttention):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, _shard_gated_attention(m, rank, world, group))
    _shard_vocab(model, rank, world, group)
