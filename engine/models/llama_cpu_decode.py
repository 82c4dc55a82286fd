"""A decode step of a packed-4-bit Llama-family model through all its layers in one C++ call.

On a small CPU a one-token step of the Python layers spends more time in ~40 calls per layer (module
calls, views, casts, the attention plan's index ops) than in the 4-bit matmuls and the attention kernel.
csrc/cpu/decode_layers.cpp makes the same ATen calls on the same inputs in the same order, so the step's
result is the Python path's to the bit (tested), in one call. It applies where the Python layers would do
exactly what it does: float32 activations, every linear a single-term 4-bit packing (GGUF Q4_0/Q4_1)
without bias or padding rows (run by the int8 kernel where the layers take it, int8_matmul.py, else by the
4-bit kernel), no q/k norm, a float32 or bfloat16 KV cache, the CPU paged attention (CPU_PAGED), one new token a
sequence, and one sequence unless the linears run on int8 (row by row like every other op of the step: a
16-sequence step then skips ~40 Python-level calls a layer too; so does a speculative verify step, 1 + drafts rows
a sequence and no prompt row); any other step runs the Python layers.
A feature-conditioned drafter's tapped layer outputs (DFlash) come back from the same call, so a speculative
engine's plain decode steps stay on it too (they ran the Python layers, ~2x a step on a 2-vCPU Xeon).
"""
from __future__ import annotations

import torch
from torch import nn

from onecat.engine.attention.forward_context import get_forward_context
from onecat.engine.layers.attention import SelfAttention
from onecat.engine.layers.mlp import GatedMLP
from onecat.engine.layers.norm import RMSNorm


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the one-call decode step cannot run this model (None: it can)."""
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) == 0:
        return "the model has no decoder layers to run"
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not isinstance(attn, SelfAttention) or not isinstance(mlp, GatedMLP):
            return f"layer {i} is not a plain attention + gated-MLP layer"
        if attn.q_norm is not None:
            return "q/k norm layers run in Python"
        for name, linear in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
                             ("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj)):
            if getattr(linear, "num_terms", 0) != 1 or not hasattr(linear, "int8"):  # a 4-bit packed linear
                return f"layer {i} {name} is not a single-term 4-bit packed linear"
            if linear.bias is not None or linear.out_features % 16:  # the packing pads rows to 16
                return f"layer {i} {name} has a bias or padding rows"
            if linear.dtype != torch.float32:
                return "the one-call step runs float32 models"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not isinstance(norm, RMSNorm) or norm.eps != layers[0].input_layernorm.eps:
                return f"layer {i} norms differ from the first layer's"
    kernels = {_int8_at_one_row(linear) for layer in layers for linear in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)}
    if len(kernels) > 1:
        return "some linears run on int8 dot products, others on the 4-bit kernel"
    return None


def _int8_at_one_row(linear) -> bool:
    """Whether the packed linear runs on int8 dot products (else the 4-bit kernel)."""
    return getattr(linear, "int8", None) is not None


class CpuDecodeLayers:
    """Runs a step's decoder layers in one call when each of its sequences decodes one token (one sequence where
    the linears take torch's 4-bit kernel, whose many-row calls the Python layers send elsewhere)."""

    def __init__(self, model: nn.Module, ops):
        self.ops = ops
        first = model.layers[0].self_attn
        self.q_heads, self.kv_heads = first.num_heads, first.num_kv_heads
        self.scale, self.eps = first.scale, model.layers[0].input_layernorm.eps
        self.rotary = first.rotary
        self.int8 = _int8_at_one_row(first.qkv_proj)
        # prompt rows on AMX tiles (EngineArgs.cpu_prompt_matmul): a step with a prompt row (a one-token prompt, a
        # chunk's last token beside decoding sequences) runs the Python layers, which send that row to the tiles
        self.prompt_tiles = getattr(first.qkv_proj, "prompt_tiles", None) is not None
        self.weights = []  # per layer, in decode_layers.cpp's order (the caches go in per step)
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            self.weights.append([layer.input_layernorm.weight, *self._packed(a.qkv_proj), *self._packed(a.o_proj),
                                 layer.post_attention_layernorm.weight, *self._packed(m.gate_up_proj),
                                 *self._packed(m.down_proj)])
        self.steps = 0  # steps run in one call (reported)
        self.verify_steps = 0  # ... of them, steps of several rows a sequence (speculative verify steps)

    def _packed(self, linear) -> list[torch.Tensor]:
        """The three tensors decode_layers.cpp reads a linear from: the int8 layout's codes, scales and offsets,
        or the 4-bit kernel's packing and scale_zero (and an unused empty third)."""
        if self.int8:
            return [linear.int8.codes, linear.int8.scales, linear.int8.offsets]
        return [linear._buffers["packed0"], linear._buffers["scale_zero0"], torch.empty(0)]

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, taps: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        """(h, residual, tapped) after the last layer, as the Python layers give them (`tapped`: the outputs of the
        layers in `taps` but the last, as llama.py's tapped_layers collects them); None when the step is not one
        this call runs (the caller then runs the Python layers)."""
        ctx = get_forward_context()
        meta, caches = ctx.meta, ctx.kv_caches
        several = h.shape[0] != meta.num_seqs  # a verify step: 1 + drafts rows a sequence
        if (several and (not self.int8 or ctx.prompt_rows is not None)) or (meta.num_seqs != 1 and not self.int8) \
                or not ctx.attention.runs_cpu_paged() or (self.prompt_tiles and ctx.prompt_rows is not None):
            return None
        if caches[0].fp8_dtype is not None or caches[0].k.dtype not in (torch.float32, torch.bfloat16):
            return None
        flat = [t for w, cache in zip(self.weights, caches) for t in (*w, cache.k, cache.v)]
        out = self.ops.decode_layers_int4(h, positions, meta.slot_mapping, self.rotary.cos, self.rotary.sin, flat,
                                          meta.block_tables, meta.query_start_loc, meta.seq_lens, self.q_heads,
                                          self.kv_heads, self.eps, self.scale, self.int8, taps)
        ctx.attention.count_calls(len(self.weights))
        self.steps += 1
        self.verify_steps += several
        return out
