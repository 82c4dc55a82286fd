"""The attention kernel shapes projected by `onecat kernels model`, and how each is launched.

Launch arithmetic mirrors the host code (csrc/bindings/flash_attn_v100.cpp): prefill runs one
CTA per 64-query tile per head, walking key tiles of BN up to the causal diagonal; decode splits
the context so the grid fills the GPU twice (at least four 32-key chunks per split) and packs the
`group` query heads of a KV head into one CTA (the 8-row bucket for GQA 4:1). The small FP32
merge kernel of split decode is not projected (it moves under 2% of the decode bytes here).
"""
from __future__ import annotations

import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from onecat.engine.kernel_tools import projection
from onecat.engine.kernel_tools import v100_limits as V
from onecat.engine.kernel_tools.sass_model import Launch, Projection, functions, project
from onecat.engine.kernel_tools.sm70_check import kernel_specs, run_check, v100_occupancy

HEADS, KV_HEADS = 32, 8  # GQA 4:1, as in `onecat kernels bench`
PREFILL_LENS = (4096, 16384)
HEAD_DIMS = (64, 128, 256)
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 8192
DECODE_KV = {"fp16": ("f16", 2), "fp8_e4m3": ("e4m3", 1)}
BM, DECODE_CHUNK = 64, 32
PREFILL_BN = {64: 64, 128: 32, 256: 16}


@dataclass(frozen=True)
class Shape:
    kernel: str  # "prefill" | "decode"
    batch: int
    seq: int  # prefill length or decode context
    head_dim: int
    kv_dtype: str = "fp16"
    variant: str = ""  # "" the first kernel; else a variant of VARIANTS[kernel]

    @property
    def label(self) -> str:
        if self.kernel == "prefill":
            return f"prefill{'_' + self.variant if self.variant else ''}_d{self.head_dim}_f16"
        kv = DECODE_KV[self.kv_dtype][0]
        if self.variant == "regs":  # q_len 1 x group 4 fits its 4-row bucket
            return f"decode_regs_d{self.head_dim}_{kv}_r4"
        return f"decode_d{self.head_dim}_{kv}_r8"  # ... and the shared variant's 8-row bucket

    @property
    def text(self) -> str:
        length = "L" if self.kernel == "prefill" else "ctx"
        causal = " causal" if self.kernel == "prefill" else ""
        return f"B={self.batch} {length}={self.seq} H={HEADS}/{KV_HEADS} D={self.head_dim} KV={self.kv_dtype}{causal}"


# Kernel variants, each selectable at run time (FlashAttnV100Backend.variants): the first is the
# original kernel, kept buildable so that every step is judged against it.
VARIANTS = {"prefill": ("", "v1", "v2", "v3"), "decode": ("smem", "regs")}


def default_shapes() -> list[Shape]:
    shapes = [Shape("prefill", 1, n, d, variant=v) for v in VARIANTS["prefill"] for d in HEAD_DIMS
              for n in PREFILL_LENS]
    shapes += [Shape("decode", b, DECODE_CONTEXT, d, kv, variant=v) for v in VARIANTS["decode"] for d in HEAD_DIMS
               for kv in DECODE_KV for b in DECODE_BATCHES]
    return shapes


def decode_splits(batch: int, ctx: int, kv_heads: int = KV_HEADS) -> tuple[int, int]:
    """(num_splits, split_len) exactly as the decode binding chooses them on an 80-SM V100."""
    base = batch * kv_heads
    want = -(-2 * V.SMS // base)
    most = max(1, -(-ctx // (4 * DECODE_CHUNK)))
    splits = min(want, most)
    split_len = -(-ctx // splits)
    split_len = -(-split_len // DECODE_CHUNK) * DECODE_CHUNK
    return -(-ctx // split_len), split_len


def launch_for(shape: Shape, registers: int, smem: int) -> Launch:
    d, b, n = shape.head_dim, shape.batch, shape.seq
    if shape.kernel == "prefill":
        bn = PREFILL_BN[d]
        tiles = sum(math.ceil(min(n, BM * (i + 1)) / bn) for i in range(math.ceil(n / BM)))
        ctas = math.ceil(n / BM) * HEADS * b
        hbm = 2.0 * b * n * d * (2 * HEADS + 2 * KV_HEADS)
        return Launch(ctas, 128, float(tiles * HEADS * b), registers, smem, hbm,
                      projection.prefill_flops(b, n, HEADS, d, causal=True), uniform=False)
    kv_bytes = DECODE_KV[shape.kv_dtype][1]
    splits, _ = decode_splits(b, n)
    rows = b * HEADS
    hbm = (projection.decode_kv_bytes(b, n, KV_HEADS, d, kv_bytes) + 2.0 * 2 * rows * d
           + rows * splits * (d + 1) * 4.0)  # + FP32 partial outputs and log-sum-exps
    chunks = b * KV_HEADS * math.ceil(n / DECODE_CHUNK)
    return Launch(splits * KV_HEADS * b, 128, float(chunks), registers, smem, hbm,
                  projection.decode_flops(b, n, HEADS, d))


def mangled(expr: str) -> str:
    """Itanium name of `&fa_v100::kernel<int, ...>(AttnParams)` as NVRTC lowers it."""
    m = re.match(r"&fa_v100::(\w+)<([^>]*)>", expr)
    if not m:
        raise ValueError(f"not a fa_v100 kernel instantiation: {expr}")
    args = "".join(f"Li{a.strip()}E" for a in m.group(2).split(","))
    return f"_ZN7fa_v100{len(m.group(1))}{m.group(1)}I{args}EEvNS_10AttnParamsE"


def project_all(shapes: list[Shape] | None = None, toolchain=None) -> list[tuple[Shape, Projection]]:
    """Compile the kernels for sm_70 (NVRTC/ptxas/nvdisasm) and project every shape."""
    shapes = shapes or default_shapes()
    with tempfile.TemporaryDirectory() as tmp:
        reports = {r.label: r for r in run_check(toolchain, Path(tmp))}
        fns = functions((Path(tmp) / "kernels_sm70.sass").read_text())
    names = {s.label: mangled(s.expr) for s in kernel_specs() if s.expr.startswith("&fa_v100::")}  # attention only
    out = []
    for shape in shapes:
        rep = reports[shape.label]
        fn = fns[names[shape.label]]
        launch = launch_for(shape, rep.registers, rep.smem)
        out.append((shape, project(fn, launch, v100_occupancy(rep.registers, rep.smem, launch.threads))))
    return out
