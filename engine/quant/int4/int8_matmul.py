"""Many-row steps of a packed 4-bit layer on int8 dot products (csrc/cpu/int8_matmul.cpp: AVX512-VNNI, or AVX2).

A 16-sequence decode step or a prefill chunk multiplies many rows by the same weights. The bf16 GEMM on a
dequantized copy reads 2 bytes a weight and multiplies bf16 pairs; this path keeps the layer's 4-bit codes
(one byte each in the AVX512-VNNI kernel's tile layout, two a byte in the AVX2 kernel's) and rounds each row's
activations to int8 per 32-value block, as llama.cpp does, so the products are exact integer dot products and
only the per-block scales are float. Measured on a 2-core AMD EPYC (AVX512-VNNI/BF16), the embedded model's
projections, weights of 30 layers (from memory, as in a step): at 16 rows 1.14-1.42x the bf16 GEMM, at 256 rows
1.03-1.23x. On a 2-core AMD EPYC with AVX2 only, where the bf16 GEMM has no bf16 instructions, a 16-sequence
step of the packed embedded model (benchmarks/cpu_packed_steps.py, medians of 3 interleaved runs,
results/cpu_packed_steps_epyc_avx2.json): prefill 25.8 -> 2.66 s, decode 300.9 -> 55.8 ms. The
numerics: WikiText-2 perplexity of the packed embedded model (16 x 256 tokens) 38.84 against 38.59 with
bf16 activations (+0.64%; the float32 engine's 38.62), inside the packed-weights contract's 1%.

Layers of one 4-bit term (Q4_0, Q4_1, 4-bit HF checkpoints) take it where the CPU has AVX512-VNNI or, with the
same bits (VPMADDUBSW + VPMADDWD make VPDPBUSD's exact integer sums), AVX2 + FMA, where the bf16 GEMM has no
bf16 instructions to run on; a two-term layer (Q8_0, the embedded model's tied LM head) would do twice the
integer work and keeps the bf16 GEMM. ONECAT_CPU_INT8_MATMUL=0 turns the path off (the bf16 GEMM everywhere,
for A/B runs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onecat.engine.quant.int4.layout import GROUP, Int4Blocks
from onecat.engine.switches import switch

# the CPU packed layers' int8 dot products for many rows (AVX512-VNNI or AVX2, csrc/cpu/int8_matmul.cpp); 0 keeps
# the bf16 GEMM (A/B)
ENV = "ONECAT_CPU_INT8_MATMUL"
TILE = 16  # output columns per tile: one int32 lane each in a 512-bit register
ISA_NAMES = {"avx512vnni": "AVX512-VNNI", "avx2": "AVX2"}
# The fewest rows a call of a layer takes this path with. On AVX2 every call: torch's 4-bit kernel there widens
# bf16 activations without bf16 instructions, and the int8 kernel ran the embedded model's four projections 2.5x
# faster at 1, 4 and 8 rows (thread time, one thread, 2-core AMD EPYC without AVX512), so a packed model's rows
# all take int8 there and a row's result never depends on its batch. With AVX512-VNNI from 16 rows (where it was
# measured against the bf16 GEMM it replaced); fewer keep the 4-bit kernel.
FROM_ROWS = {"avx2": 1, "avx512vnni": 16}
# The most 4-bit terms a layer takes this path with. A two-term layer (Q8_0: the embedded model's tied LM head)
# runs the kernel once per term, twice the integer work: with AVX512-VNNI its bf16 GEMM stays; on AVX2 that GEMM
# took 129 ms a 16-row call of the 49152 x 576 LM head (26% of a 16-stream step), so there it takes int8 too.
MAX_TERMS = {"avx2": 2, "avx512vnni": 1}


def unavailable_reason() -> str | None:
    """None where the int8 path runs here, else why not."""
    if not switch(ENV, True):
        return f"{ENV}=0"
    from onecat.engine.kernels import cpu_ops

    try:
        ops = cpu_ops.load()
    except RuntimeError as exc:
        return str(exc)
    return None if ops.int8_matmul_isa() else "this CPU has neither AVX512-VNNI nor AVX2+FMA"


def _kernel() -> str | None:
    """The kernel this CPU runs ("avx512vnni", "avx2"); None where the path does not run."""
    if unavailable_reason() is not None:
        return None
    from onecat.engine.kernels import cpu_ops

    return cpu_ops.load().int8_matmul_isa()


def isa() -> str | None:
    """The instruction set the int8 kernel runs on here ("AVX512-VNNI" or "AVX2"); None where it does not run."""
    kernel = _kernel()
    return None if kernel is None else ISA_NAMES[kernel]


def from_rows() -> int | None:
    """FROM_ROWS for this CPU's kernel; None where the path does not run."""
    kernel = _kernel()
    return None if kernel is None else FROM_ROWS[kernel]


def takes_terms(terms: int) -> bool:
    """Whether a layer of `terms` 4-bit terms takes the path here (MAX_TERMS)."""
    kernel = _kernel()
    return kernel is not None and terms <= MAX_TERMS[kernel]


def for_terms(terms: list[Int4Blocks]) -> Int8MatmulWeights | Int8MatmulSum | None:
    """The layer's int8 path where it takes one (takes_terms), else None."""
    if not takes_terms(len(terms)):
        return None
    return Int8MatmulWeights(terms[0]) if len(terms) == 1 else Int8MatmulSum([Int8MatmulWeights(t) for t in terms])


class Int8MatmulWeights:
    """One 4-bit term in a kernel's layout, with w = scale * q + offset and the scale and zero rounded to bf16
    first, as the layer's other kernels hold them. `layout` "bytes" (the AVX512-VNNI kernel): codes [tiles, K / 4,
    64] (16 columns x 4 consecutive values per 64 bytes), scale and offset [tiles, K / 32, 16] in float32.
    "compact" (the AVX2 kernel): two 64-byte words' codes a byte (the even word's in the low nibble), codes
    [tiles, K / 8, 64], scale and zero in bfloat16 (the offset is formed in the kernel, to the same bits). Default:
    this CPU's kernel's."""

    LAYOUTS = {"avx512vnni": "bytes", "avx2": "compact"}

    def __init__(self, blocks: Int4Blocks, layout: str | None = None):
        from onecat.engine.kernels import cpu_ops

        self.ops = cpu_ops.load()  # loaded once here: a step calls the layer ~120 times
        self.layout = layout or self.LAYOUTS[self.ops.int8_matmul_isa()]
        n, k = blocks.shape
        pad = -n % TILE
        tiles = (n + pad) // TILE
        scale = F.pad(blocks.scale.to(torch.bfloat16).float(), (0, 0, 0, pad))  # padding columns: w = 0
        zero = F.pad(blocks.zero.to(torch.bfloat16).float(), (0, 0, 0, pad))
        codes = F.pad(blocks.codes, (0, 0, 0, pad), value=8)
        self.out_features = n
        words = codes.view(tiles, TILE, k // 4, 4).permute(0, 2, 1, 3).reshape(tiles, k // 4, 4 * TILE)
        by_tile = {"scale": scale, "zero": zero, "offset": zero - 8 * scale}
        by_tile = {name: t.view(tiles, TILE, k // GROUP).permute(0, 2, 1).contiguous() for name, t in by_tile.items()}
        if self.layout == "bytes":
            self.codes, self.scales, self.offsets = words.contiguous(), by_tile["scale"], by_tile["offset"]
        else:
            pairs = words.view(tiles, k // 8, 2, 4 * TILE)
            self.codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()
            self.scales, self.offsets = (by_tile[name].to(torch.bfloat16) for name in ("scale", "zero"))

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] float32 or bfloat16 -> float32 [M, N]."""
        return self.ops.int8_matmul(x2.contiguous(), self.codes, self.scales, self.offsets, self.out_features)


class Int8MatmulSum:
    """A layer of several 4-bit terms (Q8_0 as two): each term's int8 product, summed in float32 in term order
    (each row's result still depends on that row alone)."""

    def __init__(self, terms: list[Int8MatmulWeights]):
        self.terms = terms
        self.out_features = terms[0].out_features

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        x2 = x2.contiguous()
        y = self.terms[0](x2)
        for term in self.terms[1:]:
            y += term(x2)
        return y
