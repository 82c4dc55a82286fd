"""Sparse mixture-of-experts feed-forward: a softmax router sends each token to its top-k experts (SwiGLU
MLPs), whose outputs are summed with the router's weights; optionally a shared expert that every token
also goes through, scaled by a sigmoid gate (Qwen3.5-MoE).

The expert weights are expert-indexed 3D tensors, `experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I] (the layout of transformers' fused checkpoints and of a fused MoE kernel),
so an expert-parallel rank can keep a slice of E. On CPU the experts run in a plain loop over the
experts that got tokens this step: the step's (token, expert) pairs are sorted by expert, each expert
multiplies its own rows, and the results are added back per token in expert order. Float32 on CPU
multiplies through the batch-invariant matmul (batch_invariant_linear.py; each expert's weights are
reordered once, a second copy), so a token's result does not depend on how many other tokens chose the
same expert this step (and the activations go through pointwise.py for the same reason).

On CUDA the experts run as the fused Triton grouped GEMMs of engine/kernels/triton_moe.py (tensor-core
`dot` variant on SM80+, `fma` on SM70); `Experts.variant` forces one ("loop": the per-expert loop). Decode
steps of up to triton_moe_gemv.MAX_TOKENS tokens take that module's per-pair GEMVs (plain multiply-adds on
every GPU, whichever variant is asked for). `Experts.path` says which ran last.

`PackedExperts` holds the experts of a packed checkpoint (quantization set): one packed linear per expert and
projection, only the routed experts run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.kernels.triton_support import grouped_moe_take, moe_unavailable_reason
from onecat.engine.layers import batch_invariant_linear
from onecat.engine.layers.linear import Linear
from onecat.engine.layers.mlp import GatedMLP
from onecat.engine.layers.norm import RMSNorm
from onecat.engine.layers.pointwise import pointwise
from onecat.engine.switches import switch


class _ExpertLinear:
    """What batch_invariant_linear reads of a Linear, for one expert's weight (a view of a 3D tensor); it
    keeps the expert's reordered copy."""

    __slots__ = ("weight", "bias", "out_features", "_batch_invariant_weight")

    def __init__(self):
        self.bias, self._batch_invariant_weight = None, None


class Experts(nn.Module):
    """E SwiGLU experts stored side by side: gate_up_proj [E, 2I, H] ([gate | up] rows), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self._views: dict[tuple[str, int], _ExpertLinear] = {}
        self.variant: str | None = None  # None: fused on CUDA where it can run; "dot" / "fma" / "loop" force one
        self.path = "none"  # what ran last: "loop", "triton_dot", "triton_fma", "triton_gemv"

    def _linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        weight = getattr(self, name)[e]
        if not batch_invariant_linear.supported(x, weight):
            return F.linear(x, weight)
        view = self._views.get((name, e))
        if view is None:
            view = self._views[(name, e)] = _ExpertLinear()
        view.weight, view.out_features = weight, weight.shape[0]
        return batch_invariant_linear.batch_invariant_linear(view, x)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights and experts [T, k]: each token's k routing weights and expert ids."""
        if self.variant != "loop" and x.is_cuda:
            reason = moe_unavailable_reason(x)
            if reason is None:
                from onecat.engine.kernels import triton_moe

                variant = self.variant or triton_moe.default_variant(x.device)
                self.path = "triton_gemv" if triton_moe.takes_gemv(x.shape[0]) else f"triton_{variant}"
                return triton_moe.fused_experts(x, self.gate_up_proj, self.down_proj, weights, experts, variant)
            if self.variant is not None:
                raise RuntimeError(f"fused MoE variant {self.variant!r} cannot run: {reason}")
        self.path = "loop"
        return self._loop(x, weights, experts)

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The reference: one expert at a time over the tokens sorted by expert."""
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = self._linear(rows, "gate_up_proj", e).split(self.intermediate, dim=-1)
            return self._linear(pointwise(F.silu, gate) * up, "down_proj", e)

        return routed_loop(x, weights, experts, self.num_experts, expert)


def routed_loop(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
                expert) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(e, its rows of x), one expert at a time over the
    step's (token, slot) pairs sorted by expert (tokens ascending in each), added back per token in expert
    order. Reads the counts on the host: only the experts that got tokens run."""
    top_k = experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // top_k
    scales = weights.flatten()[order].unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        y = expert(e, x[rows])
        out.index_add_(0, rows, (y * scales[start:start + n]).to(out.dtype))
        start += n
    return out


class PackedExperts(nn.Module):
    """E SwiGLU experts whose weights stay packed (engine/quant/hf_packer.py builds it): one packed linear per
    expert for [gate | up] and one for down, each any layer of engine/quant (W4A16, the CPU int4 layer, FP4,
    FP8). Steps of many tokens run only the experts that got tokens, each through its layers' own path (more
    rows: the dequantized GEMM; CPU: the int4 kernel or the dequantized reference), reading the routing on the
    host. On CUDA, FP4 experts (NVFP4 or MXFP4) and W4A16 experts (one group size a projection, no act-order)
    are also kept stacked per projection, [E, N, K/8] words and their scales (each expert's layer then reads
    its slice of the stack, row-major: no second copy), and steps of up to ROUTED_TOKENS tokens take the
    routed GEMV (engine/kernels/triton_moe_routed.py): every (token, expert) pair multiplied by the expert the
    router picked, read from the device, so a CUDA graph captures the layer. FP8 experts (and act-order W4A16)
    pick the experts on the host, which a CUDA graph cannot capture: their capture fails with the reason below
    and decode steps run eagerly (the support matrix's packed-experts-eager)."""

    ROUTED_TOKENS = 256  # decode and verify steps of up to this many tokens take the routed GEMV
    # the routed experts in two kernels (triton_moe_routed.routed_glu / routed_down_sum) instead of about nine;
    # read once; on: route 2 target-only at batch 1 272.3 -> 301.1 tok/s on an H100
    # (benchmarks/results/moe_fused_routed_h100.json), its GPU tests passed. ONECAT_MOE_FUSED_ROUTED=0 for the A/B
    FUSED = switch("ONECAT_MOE_FUSED_ROUTED", True)
    # steps of more tokens (a prefill) grouped by expert on the device, one many-row GEMM launch a projection
    # (engine/kernels/triton_moe_grouped.py) instead of routed_loop's host-read routing and ~5 launches an expert;
    # on: route 2's 1,024-token prefill 2.38 -> 0.164 s on an H100, its GPU tests passed
    # (benchmarks/results/seed_moe_route_h100_b1_grouped_prefill_{0,1}.json). ONECAT_MOE_GROUPED_PREFILL=0 for the A/B
    GROUPED_PREFILL = switch("ONECAT_MOE_GROUPED_PREFILL", True)
    FP4_FORMATS = {"nvfp4": 0, "mxfp4": 1}  # triton_fp4.NVFP4 / MXFP4

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], intermediate: int):
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"PackedExperts needs one gate_up and one down layer per expert, got {len(gate_up)} "
                             f"and {len(down)}")
        self.num_experts, self.intermediate = len(gate_up), intermediate
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.routed = self._stack() if getattr(gate_up[0], "qweight", torch.empty(0)).is_cuda else None
        self.path = "none"

    def _stack(self) -> str | None:
        """Stack the experts' words and scales per projection (buffers gate_up_qweight, down_scales, ...), each
        expert's layer re-pointed at its slice; the words' format, or None where no routed GEMV takes it."""
        layers = [*self.gate_up, *self.down]
        formats = {getattr(layer, "words_format", None) for layer in layers}
        fmt = formats.pop() if len(formats) == 1 else None
        if fmt in self.FP4_FORMATS:
            parts = ("qweight", "scales", "gscale")
        elif fmt == "int4" and all(m.perm is None for m in layers) \
                and all(len({m.group for m in group}) == 1 for group in (self.gate_up, self.down)):
            parts = ("qweight", "scale_zero")  # one group size per projection (a narrow down may take a smaller one)
        else:
            return None
        for name, group in (("gate_up", self.gate_up), ("down", self.down)):
            for part in parts:
                stacked = torch.stack([m.row_major_words() if part == "qweight" else getattr(m, part) for m in group])
                self.register_buffer(f"{name}_{part}", stacked, persistent=False)
                for e, m in enumerate(group):
                    setattr(m, part, stacked[e])
            for m in group:
                m.tiled = 0
        return fmt

    def routes_on_device(self, x: torch.Tensor) -> bool:
        """Whether a step of x's tokens takes the routed GEMV (stacked experts, CUDA, few tokens, half dtypes)."""
        return (self.routed is not None and x.is_cuda and x.shape[0] <= self.ROUTED_TOKENS
                and x.dtype in (torch.float16, torch.bfloat16))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, H]; weights and experts [T, k]: each token's k routing weights and expert ids. `shared` (FUSED
        routed steps only): the layer's shared expert (gate logit [T, 1], output [T, H]), added in the down kernel."""
        if self.routes_on_device(x):
            self.path = "routed"
            return self._routed(x, weights, experts, shared)
        if shared is not None:
            raise ValueError("the shared expert is added inside the fused routed kernels only (routes_on_device)")
        if self.GROUPED_PREFILL and self.routed is not None and grouped_moe_take(x, (x.shape[-1], self.intermediate)):
            self.path = "grouped"
            return self._grouped(x, weights, experts)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("packed MoE experts in this format pick the routed experts on the host, which a CUDA "
                               "graph cannot capture; decode steps run eagerly")
        self.path = "packed_loop"

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up[e](rows).split(self.intermediate, dim=-1)
            return self.down[e](pointwise(F.silu, gate) * up)

        return routed_loop(x, weights, experts, self.num_experts, expert)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Every (token, expert) pair through the routed GEMV; each token's pairs summed in float32 in its top-k
        order, weighted, rounded once to x's dtype (FUSED: in two kernels, the shared expert added in the second)."""
        tokens, top_k = experts.shape
        ids = experts.reshape(-1).contiguous()
        if self.FUSED:
            from onecat.engine.kernels import triton_moe_routed as kernels

            h = kernels.routed_glu(x.contiguous(), *self._operands("gate_up"), ids, top_k)
            return kernels.routed_down_sum(h, *self._operands("down"), ids, weights, top_k, shared)
        if shared is not None:
            raise ValueError("the shared expert is added inside the fused routed kernels only (PackedExperts.FUSED)")
        h = self._routed_gemv("gate_up", x.contiguous(), ids, top_k, per_pair=False)
        gate, up = h.split(self.intermediate, dim=-1)
        y = self._routed_gemv("down", (F.silu(gate) * up).contiguous(), ids, top_k, per_pair=True)
        out = (y.view(tokens, top_k, -1).float() * weights.float().unsqueeze(-1)).sum(dim=1)
        return out.to(x.dtype)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """A long step's pairs grouped by expert on the device (triton_moe_grouped.grouped_experts)."""
        from onecat.engine.kernels.triton_moe_grouped import grouped_experts

        return grouped_experts(x, weights, experts, self._operands("gate_up"), self._operands("down"),
                               self.num_experts)

    def _operands(self, name: str) -> tuple:
        """(words, scales, second, format, group) of projection `name`'s stack, as triton_moe_routed takes them."""
        if self.routed == "int4":
            sz = getattr(self, f"{name}_scale_zero")
            return getattr(self, f"{name}_qweight"), sz, sz, "int4", getattr(self, name)[0].group
        return (getattr(self, f"{name}_qweight"), getattr(self, f"{name}_scales"), getattr(self, f"{name}_gscale"),
                self.routed, 0)

    def _routed_gemv(self, name: str, x: torch.Tensor, ids: torch.Tensor, top_k: int, per_pair: bool):
        from onecat.engine.kernels import triton_moe_routed as kernels

        words = getattr(self, f"{name}_qweight")
        if self.routed == "int4":
            return kernels.w4a16_routed_gemv(x, words, getattr(self, f"{name}_scale_zero"), getattr(self, name)[0].group,
                                             ids, top_k, per_pair)
        return kernels.fp4_routed_gemv(x, words, getattr(self, f"{name}_scales"), getattr(self, f"{name}_gscale"),
                                       self.FP4_FORMATS[self.routed], ids, top_k, per_pair)


class SparseMoE(nn.Module):
    """Router + experts (+ gated shared expert). `norm_topk_prob`: the k chosen probabilities are renormalized
    to sum to 1 (else they keep their softmax values over all experts), as the checkpoint's config says."""

    use_fused = False  # the engine turns this on per model (CUDA + Triton): the router in one kernel
    # Children that stay dense when the model's weights are packed: the router (a few rows whose logits pick
    # the experts: a rounding there changes which experts run) and the shared expert's one-row gate.
    KEEP_DENSE = ("gate", "shared_expert_gate")

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_intermediate: int = 0):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden, num_experts, bias=False)  # the router
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_expert = GatedMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_intermediate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]): softmax over all experts in float32, top k, rounded to x's dtype.
        The fused router (engine/kernels/triton_router.py) hands the rounded weights over in float32 and the ids
        in int32, as the fused experts read them; the experts' products are the same either way."""
        return self._route_logits(self.gate(x))

    def _route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_fused and logits.is_cuda:
            from onecat.engine.kernels import triton_router

            if logits.shape[-1] <= triton_router.MAX_EXPERTS:
                return triton_router.route(logits, self.top_k, self.norm_topk_prob)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._experts(x, *self.route(x))

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        if self.shared_expert is not None and isinstance(experts, PackedExperts) and experts.FUSED \
                and experts.routes_on_device(x):  # sigmoid(gate) * shared added inside the routed down kernel
            return experts(x, weights, ids, shared=(self.shared_expert_gate(x), self.shared_expert(x)))
        out = experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + pointwise(torch.sigmoid, self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def after_norm(self, norm, x: torch.Tensor, residual: torch.Tensor):
        """(self(norm(x + residual)), x + residual): the decoder layer's call, as GatedMLP.after_norm. At one
        token on CUDA the add and the norm run inside the router's GEMV, which also hands the normed input to
        the experts: one kernel fewer a layer."""
        if self.use_fused and type(norm) is RMSNorm and residual is not None and isinstance(self.gate, Linear) \
                and self.gate.gemv_ok(x):
            from onecat.engine.kernels.triton_gemv import gemv

            logits, residual, h = gemv(x, self.gate.weight, self.gate.bias, residual=residual,
                                       norm_weight=norm.weight, eps=norm.eps, normed_out=True)
            return self._experts(h, *self._route_logits(logits)), residual
        h, residual = norm(x, residual)
        return self(h), residual
