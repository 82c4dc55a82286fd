"""PROJECTED (not measured) V100 speed of the FLASH_ATTN_V100 kernels and the packed-weight GEMV from a
roofline model.

Model: time >= max(useful FLOPs / compute peak, bytes moved / peak HBM2 bandwidth), with
V100-SXM2 peaks of 900 GB/s and, as compute peak, 125 TFLOP/s FP16 HMMA for prefill (tensor
cores) but 15.7 TFLOP/s FP32 FMA for decode/verify (that kernel computes on the FP32 pipes). The
projection is the roofline *bound* (an upper bound on speed); real kernels reach a fraction of it.
Useful FLOPs count only the causal QK^T and PV work (4 * q * k * d per head, halved on the causal
triangle); decode bytes count each sequence's K/V (and FP8 scales) once per kv head plus Q and
output; the packed GEMV counts its codes and scales once, on the FP32 pipes (quant_gemv). Nothing here runs on
a GPU, and no figure it gives is a V100 measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

V100_FP16_TENSOR_TFLOPS = 125.0
V100_FP32_TFLOPS = 15.7
V100_HBM_GBPS = 900.0
MODEL = "roofline bound, V100-SXM2: 125 TFLOP/s FP16 HMMA (prefill), 15.7 TFLOP/s FP32 (decode), 900 GB/s HBM2"


@dataclass
class Projection:
    kernel: str
    shape: str
    useful_tflop: float
    bytes_gb: float
    bound: str
    projected_ms: float
    projected_tflops: float
    label: str = "projected"
    model: str = MODEL


def _project(kernel: str, shape: str, flops: float, nbytes: float, peak_tflops: float) -> Projection:
    t_compute = flops / (peak_tflops * 1e12)
    t_memory = nbytes / (V100_HBM_GBPS * 1e9)
    t = max(t_compute, t_memory)
    return Projection(kernel, shape, flops / 1e12, nbytes / 1e9, "compute" if t_compute >= t_memory else "memory",
                      t * 1e3, flops / t / 1e12)


def prefill_flops(batch: int, seq: int, heads: int, head_dim: int, causal: bool = True) -> float:
    """Useful QK^T + PV FLOPs of a prefill (the causal triangle only when causal)."""
    pairs = seq * (seq + 1) / 2 if causal else seq * seq
    return 4.0 * batch * heads * head_dim * pairs


def decode_flops(batch: int, ctx: int, heads: int, head_dim: int, q_len: int = 1) -> float:
    """Useful QK^T + PV FLOPs of one decode (or verify) step."""
    return 4.0 * batch * heads * head_dim * ctx * q_len


def decode_kv_bytes(batch: int, ctx: int, kv_heads: int, head_dim: int, kv_bytes: int = 2) -> float:
    """K and V bytes a decode step must read once (plus the FP32 per-slot scales of FP8 caches)."""
    return float(batch * ctx * kv_heads * (2 * head_dim * kv_bytes + (8 if kv_bytes == 1 else 0)))


def prefill(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, causal: bool = True) -> Projection:
    flops = prefill_flops(batch, seq, heads, head_dim, causal)
    nbytes = 2.0 * batch * seq * head_dim * (2 * heads + 2 * kv_heads)  # Q, O, K, V once (FP16)
    return _project("prefill", f"B={batch} L={seq} H={heads}/{kv_heads} D={head_dim} causal={causal}", flops, nbytes,
                    V100_FP16_TENSOR_TFLOPS)


def decode(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, kv_bytes: int = 2, q_len: int = 1,
           kv_name: str | None = None) -> Projection:
    flops = decode_flops(batch, ctx, heads, head_dim, q_len)
    kv = decode_kv_bytes(batch, ctx, kv_heads, head_dim, kv_bytes)
    qo = 2.0 * 2 * batch * q_len * heads * head_dim
    kind = kv_name or {2: "f16", 1: "fp8"}[kv_bytes]
    name = "decode" if q_len == 1 else f"verify(q_len={q_len})"
    return _project(name, f"B={batch} ctx={ctx} H={heads}/{kv_heads} D={head_dim} KV={kind}", flops, kv + qo,
                    V100_FP32_TFLOPS)


# packed-weight GEMV (csrc/quant_gemv): bytes per weight of codes, and of scales (W4A16: an fp16 scale and zero
# per group of 128; NVFP4: an E4M3 byte per 16; MXFP4: an E8M0 byte per 32; FP8: codes only, a float32 row scale)
GEMV_BYTES_PER_WEIGHT = {"int4": (0.5, 4 / 128), "nvfp4": (0.5, 1 / 16), "mxfp4": (0.5, 1 / 32), "fp8": (1.0, 0.0)}
GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # 8B layer


def quant_gemv(fmt: str, n: int, k: int, rows: int) -> Projection:
    """The packed GEMV y[rows, n] = x[rows, k] @ W^T: the weight's codes and scales read once, x and y in fp16,
    2 * rows FLOPs a weight on the FP32 pipes (it decodes to float32 and uses no tensor cores)."""
    codes, scales = GEMV_BYTES_PER_WEIGHT[fmt]
    row_scales = 4.0 * n if fmt in ("nvfp4", "fp8") else 0.0
    nbytes = n * k * (codes + scales) + row_scales + 2.0 * rows * (k + n)
    return _project(f"gemv_{fmt}", f"N={n} K={k} rows={rows}", 2.0 * rows * n * k, nbytes, V100_FP32_TFLOPS)


def quant_gemv_table(rows: tuple[int, ...] = (1, 8)) -> list[Projection]:
    """Each format on the four projections of a Llama-3-8B layer, at each row count."""
    return [quant_gemv(fmt, n, k, m) for fmt in GEMV_BYTES_PER_WEIGHT for m in rows
            for n, k in GEMV_SHAPES.values()]


def default_table() -> list[Projection]:
    rows = [prefill(1, n, 32, 8, 128) for n in (2048, 8192, 32768)]
    rows += [prefill(1, 8192, 16, 16, 64), prefill(1, 8192, 8, 8, 256)]
    rows += [decode(b, c, 32, 8, 128, kb) for b, c in ((1, 4096), (32, 4096), (64, 32768)) for kb in (2, 1)]
    rows += [decode(32, 4096, 32, 8, 128, 2, q_len=5)]
    return rows
