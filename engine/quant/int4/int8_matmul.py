"""A packed 4-bit layer's matmul on int8 dot products (csrc/cpu/int8_matmul.cpp: AVX512-VNNI, or AVX2).

The layer's 4-bit codes stay packed two a byte (scale and zero in bfloat16: 0.625 bytes a weight) and each row's
activations are rounded to int8 per 32-value block, as llama.cpp does, so the products are exact integer dot
products and only the per-block scales are float. Every row count of a layer takes this path where it runs, so a
row's result never depends on its batch (a decode step of 1 or 16 sequences, a verify step, a prefill chunk).

Why every row count: measured on a 2-core Intel Xeon with AVX512-VNNI and AMX (the embedded model's four
projections, weights of 30 layers as in a step), one row ran 2.1x faster than torch's 4-bit kernel (79 against
168 us a layer) and 16 rows 1.1-1.8x faster than oneDNN's AMX bfloat16 GEMM on a dequantized copy; on a 2-core
AMD EPYC with AVX2 only, 2.5x torch's 4-bit kernel at 1, 4 and 8 rows, and a 16-sequence step's prefill 25.8 ->
2.66 s, decode 300.9 -> 55.8 ms (benchmarks/cpu_packed_steps.py, results/cpu_packed_steps_epyc_avx2.json). The
numerics: WikiText-2 perplexity of the packed embedded model (16 x 256 tokens) 38.84 against 38.59 with bf16
activations (+0.64%; the float32 engine's 38.62), inside the packed-weights contract's 1%.

Q8_0 (the embedded model's tied LM head) packs as two 4-bit terms (layout.py): with AVX512-VNNI they are one
8-bit term here, codes q + 128 a byte with w = d * (code - 128) (one product, the same integer sums as the two),
d in bfloat16 and no offset stored (1.06 bytes a weight: in a one-row step after the decoder's layers the 49,152 x
576 head took 0.98-1.23 ms against 1.25-1.41 ms with float32 scales and offsets, same bits, 2-core Xeon); on AVX2,
whose VPMADDUBSW would saturate on 8-bit codes, each term's product, summed in term order.
ONECAT_CPU_INT8_MATMUL=0 turns the path off (torch's 4-bit kernel and a bf16 GEMM, for A/B runs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onecat.engine.quant.int4.layout import GROUP, Int4Blocks
from onecat.engine.switches import switch

# the CPU packed layers' int8 dot products (AVX512-VNNI or AVX2, csrc/cpu/int8_matmul.cpp); 0 keeps torch's 4-bit
# kernel and the bf16 GEMM (A/B)
ENV = "ONECAT_CPU_INT8_MATMUL"
TILE = 16  # output columns per tile: one int32 lane each in a 512-bit register
ISA_NAMES = {"avx512vnni": "AVX512-VNNI", "avx2": "AVX2"}


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


def one_eight_bit_term(terms: list[Int4Blocks]) -> bool:
    """Whether a two-term layer is Q8_0's split (layout.py: w = (16 d) * (hi - 8) + d * lo + 8 d) and this CPU's
    kernel multiplies 8-bit codes (AVX512-VNNI), so it runs as one 8-bit term."""
    if _kernel() != "avx512vnni" or len(terms) != 2:
        return False
    hi, lo = terms
    s_hi, s_lo, z_lo = (t.to(torch.bfloat16).float() for t in (hi.scale, lo.scale, lo.zero))
    return bool(torch.equal(s_hi, 16 * s_lo) and not hi.zero.any() and torch.equal(z_lo, 8 * s_lo))


def for_terms(terms: list[Int4Blocks]) -> Int8MatmulWeights | Int8MatmulSum | None:
    """The layer's int8 path, or None where it does not run here."""
    if _kernel() is None:
        return None
    if one_eight_bit_term(terms):
        return Int8MatmulWeights.eight_bit(*terms)
    return Int8MatmulWeights(terms[0]) if len(terms) == 1 else Int8MatmulSum([Int8MatmulWeights(t) for t in terms])


class Int8MatmulWeights:
    """One 4-bit term in a kernel's layout, with w = scale * q + offset and the scale and zero rounded to bf16
    first, as the layer's other kernels hold them. "compact" (the default, both kernels): two 64-byte words' codes
    a byte (the even word's in the low nibble), codes [tiles, K / 8, 64], scale and zero in bfloat16 (the offset
    is formed in the kernel). "bytes" (AVX512-VNNI only): a code a byte, codes [tiles, K / 4, 64] (16 columns x 4
    consecutive values per 64 bytes), scale and offset [tiles, K / 32, 16] in float32: 4-bit codes, to check that
    both layouts give the same bits. "q8" (AVX512-VNNI only, eight_bit): Q8_0's codes q + 128 as "bytes", the scale
    in bfloat16 and no offset stored (the kernel forms -128 x scale, exactly): 1.06 bytes a weight against 1.25,
    since the LM head a one-row step streams is the largest layer. Padding columns have scale and offset 0, so
    whatever their code, their weight is 0."""

    def __init__(self, blocks: Int4Blocks, layout: str = "compact"):
        from onecat.engine.kernels import cpu_ops

        self.ops = cpu_ops.load()  # loaded once here: a step calls the layer ~120 times
        self.layout = layout
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
        elif self.layout == "q8":
            self.codes, self.scales = words.contiguous(), by_tile["scale"].to(torch.bfloat16)
            self.offsets = torch.empty(0, dtype=torch.bfloat16)  # -128 x scale, formed in the kernel
        else:
            pairs = words.view(tiles, k // 8, 2, 4 * TILE)
            self.codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()
            self.scales, self.offsets = (by_tile[name].to(torch.bfloat16) for name in ("scale", "zero"))

    @classmethod
    def eight_bit(cls, hi: Int4Blocks, lo: Int4Blocks) -> Int8MatmulWeights:
        """Q8_0's two terms as one in the q8 layout: code 16 * hi + lo = q + 128 in [1, 255], scale d (the low
        term's, bf16) and offset -128 d, exactly the sum of the two terms' weights."""
        scale = lo.scale.to(torch.bfloat16).float()
        codes = (16 * hi.codes.to(torch.int32) + lo.codes.to(torch.int32)).to(torch.uint8)
        return cls(Int4Blocks(codes, scale, torch.zeros_like(scale)), "q8")

    def dense_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), K]: the weights of output rows `ids` as the kernel computes with them (scale x code +
        offset, the scale and zero bf16-rounded), unpacked from the layout alone: a few rows of a packed LM head
        without a dense copy of the whole head (a drafter's draft vocabulary)."""
        tiles, words = self.codes.shape[0], self.codes.shape[1] * (2 if self.layout == "compact" else 1)
        tile, col = ids // TILE, ids % TILE
        if self.layout == "compact":  # two words' codes a byte, the even word's in the low nibble
            codes = torch.stack([self.codes & 15, self.codes >> 4], dim=2).view(tiles, words, 4 * TILE)
        else:
            codes = self.codes
        code = codes.view(tiles, words, TILE, 4)[tile, :, col].reshape(len(ids), words * 4).float()

        def per_value(by_block: torch.Tensor) -> torch.Tensor:  # [tiles, K / 32, 16] -> the rows' [n, K]
            return by_block.float()[tile, :, col].repeat_interleave(GROUP, dim=1)

        scale = per_value(self.scales)
        offset = {"q8": lambda: -128 * scale, "compact": lambda: per_value(self.offsets) - 8 * scale,
                  "bytes": lambda: per_value(self.offsets)}[self.layout]()
        return code * scale + offset

    def __call__(self, x2: torch.Tensor, kernel: str = "") -> torch.Tensor:
        """x2 [M, K] float32 or bfloat16 -> float32 [M, N]. `kernel` "avx2": the AVX2 kernel where this CPU has a
        faster one (the compact layout; to compare their bits)."""
        return self.ops.int8_matmul(x2.contiguous(), self.codes, self.scales, self.offsets, self.out_features, kernel)


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
