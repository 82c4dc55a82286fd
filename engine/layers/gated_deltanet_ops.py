"""Torch reference ops of Gated DeltaNet (CPU and GPU): the short causal convolution with its carried-over
inputs, the gated delta rule over a chunk of tokens (chunked form), and one decode token (recurrent form).

The gated delta rule keeps, per value head, a state S [Dk, Dv]. For each token t (q, k l2-normalized,
q scaled by Dk^-1/2): S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t. The chunked
form computes the same for 64 tokens at a time with a few matmuls (the WY/UT transform of the DeltaNet
paper), as transformers' torch reference and flash-linear-attention's kernels do; it takes the state left
by the previous chunk of a request, so a prompt split over engine steps gives the same result as one call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onecat.engine.layers.pointwise import pointwise


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's chunk: x [C, n] new inputs, state [C, K-1] the inputs before them (zeros at the start),
    weight [C, K] (depthwise). Returns (SiLU of the convolution [C, n], the new state [C, K-1])."""
    width = weight.shape[1]
    full = torch.cat([state.to(weight.dtype), x.to(weight.dtype)], dim=-1)
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]
    return F.silu(out).to(x.dtype), full[:, full.shape[1] - (width - 1):]


def causal_conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of one-token steps: x [B, C], state [B, C, K-1], weight [C, K] -> (SiLU(conv) [B, C], state)."""
    full = torch.cat([state.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)
    out = (full * weight).sum(dim=-1)
    return pointwise(F.silu, out).to(x.dtype), full[..., 1:]


def prepare_qk(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> float32, l2-normalized, q scaled by Dk^-1/2, each key head repeated for the
    value heads it serves ([..., Hv, Dk])."""
    # contiguous first: the sums over Dk then run in one order whatever the tensor's other dimensions and strides
    q, k = l2norm(q.float().contiguous()), l2norm(k.float().contiguous())
    q = q * q.shape[-1] ** -0.5
    groups = value_heads // k.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q, k


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens, heads first, float32: q, k [H, n, Dk] (from prepare_qk), v [H, n, Dv], g (log
    decay, <= 0) and beta [H, n], state [H, Dk, Dv]. Returns (outputs [H, n, Dv], the state after them)."""
    heads, n, _ = k.shape
    pad = (-n) % chunk  # padded tokens have beta 0 and g 0: they change nothing
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (n + pad) // chunk
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, chunks, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(heads, chunks, chunk).cumsum(dim=-1)  # log of the decay from the chunk's start to each token
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [H, N, c, c], causal
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular system of the UT transform
    intra = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    s = state.float()
    for i in range(chunks):
        v_new = values[:, i] - k_decayed[:, i] @ s  # the part of the new values the state does not predict
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, chunks * chunk, -1)[:, :n], s


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of one-token steps, float32: q, k [B, H, Dk] (from prepare_qk), v [B, H, Dv], g and beta [B, H],
    state [B, H, Dk, Dv]. Returns (outputs [B, H, Dv], the new states)."""
    s = state.float() * pointwise(torch.exp, g)[..., None, None]
    predicted = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v.float() - predicted) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(dim=-2), s


def rows_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    states: torch.Tensor, begin: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of tokens, each row its own request: q, k [R, W, Hk, Dk] as projected, v [R, W, Hv, Dv], g and beta
    [R, W, Hv] float32, states [R, Hv, Dk, Dv] float32; token t of row r updates the state only where
    begin[r] <= t < end[r] (padding before and after a row's own tokens leaves it unchanged). Returns (outputs
    [R, W, Hv, Dv] float32, the states after each row's own tokens). The one-token step of every token in
    turn, so a row's states are those of its tokens' decode steps (a speculative verify step's rows, and the
    recomputed state of a rolled-back request)."""
    q, k = prepare_qk(q, k, v.shape[-2])
    v, s = v.float(), states.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    steps = torch.arange(q.shape[1], device=q.device)
    live = (steps >= begin[:, None]) & (steps < end[:, None])  # [R, W]
    for t in range(q.shape[1]):
        out[:, t], stepped = recurrent_gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        s = torch.where(live[:, t, None, None, None], stepped, s)
    return out, s
