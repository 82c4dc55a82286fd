"""Timing of the FLASH_ATTN_V100 kernels on whatever CUDA GPU is present, beside the V100 projection.

Only a compute capability 7.0 device yields V100 measurements; on any newer GPU the m8n8k4 HMMA
is emulated, so those timings are labelled "emulated-SM70, not representative" and must never be
read as V100 figures. Every measured record is paired with the roofline projection of the same
shape (onecat.engine.kernel_tools.projection), labelled "projected".
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

from onecat.engine.kernel_tools import projection

KV_DTYPES = {"fp16": (0, 2), "fp8_e4m3": (1, 1), "fp8_e5m2": (2, 1)}  # name -> (kernel kv_kind, bytes/elem)
HEAD_DIMS = (64, 128, 256)
PREFILL_SEQ_LENS = (1024, 4096)
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXTS = (1024, 8192)
HEADS, KV_HEADS = 32, 8  # GQA 4:1, the common 8B-model layout
BLOCK_SIZE = 16
MEASURED = "measured"
EMULATED = "emulated-SM70, not representative"
PROJECTED = "projected"


@dataclass
class BenchCase:
    """One shape to time (and project): a causal prefill or a one-token paged decode."""
    kernel: str
    batch: int
    seq: int  # prefill length, or decode context
    head_dim: int
    kv_dtype: str = "fp16"
    heads: int = HEADS
    kv_heads: int = KV_HEADS

    @property
    def shape(self) -> str:
        length = "L" if self.kernel == "prefill" else "ctx"
        return (f"B={self.batch} {length}={self.seq} H={self.heads}/{self.kv_heads} D={self.head_dim} "
                f"KV={self.kv_dtype}")

    def useful_flops(self) -> float:
        if self.kernel == "prefill":
            return projection.prefill_flops(self.batch, self.seq, self.heads, self.head_dim, causal=True)
        return projection.decode_flops(self.batch, self.seq, self.heads, self.head_dim)

    def kv_bytes(self) -> float:
        return projection.decode_kv_bytes(self.batch, self.seq, self.kv_heads, self.head_dim,
                                          KV_DTYPES[self.kv_dtype][1])

    def project(self) -> projection.Projection:
        if self.kernel == "prefill":
            return projection.prefill(self.batch, self.seq, self.heads, self.kv_heads, self.head_dim, causal=True)
        return projection.decode(self.batch, self.seq, self.heads, self.kv_heads, self.head_dim,
                                 KV_DTYPES[self.kv_dtype][1], kv_name=self.kv_dtype)


@dataclass
class BenchRecord:
    kind: str  # "measured" | "emulated-SM70, not representative" | "projected"
    kernel: str
    shape: str
    batch: int
    seq: int
    head_dim: int
    heads: int
    kv_heads: int
    kv_dtype: str
    device: str
    ms: float
    useful_tflops: float
    kv_gbps: float | None = None
    repeats: int | None = None
    bound: str | None = None
    model: str | None = None


def plan(head_dims: list[int], kv_dtypes: list[str]) -> list[BenchCase]:
    """Causal FP16 prefill at 1K/4K, then paged decode at batch 1/8/32, context 1K/8K, each KV dtype."""
    cases = [BenchCase("prefill", 1, s, d) for d in head_dims for s in PREFILL_SEQ_LENS]
    cases += [BenchCase("decode", b, c, d, kv) for d in head_dims for kv in kv_dtypes
              for c in DECODE_CONTEXTS for b in DECODE_BATCHES]
    return cases


def projected_record(case: BenchCase) -> BenchRecord:
    p = case.project()
    gbps = case.kv_bytes() / (p.projected_ms * 1e-3) / 1e9 if case.kernel == "decode" else None
    return BenchRecord(PROJECTED, case.kernel, case.shape, case.batch, case.seq, case.head_dim, case.heads,
                       case.kv_heads, case.kv_dtype, "V100-SXM2 (model)", p.projected_ms, p.projected_tflops,
                       gbps, bound=p.bound, model=p.model)


def device_kind(capability: tuple[int, int]) -> str:
    """Measurements count as V100 figures only on compute capability 7.0."""
    return MEASURED if tuple(capability) == (7, 0) else EMULATED


def _inputs(case: BenchCase, device: str, seed: int = 0):
    """Random paged Q/K/V with shuffled physical blocks, laid out as the FLASH_ATTN_V100 backend sees them."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    q_len = case.seq if case.kernel == "prefill" else 1
    blocks_per_seq = math.ceil(case.seq / BLOCK_SIZE)
    num_blocks = case.batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(case.batch, blocks_per_seq)
    shape = (num_blocks, BLOCK_SIZE, case.kv_heads, case.head_dim)
    kind = KV_DTYPES[case.kv_dtype][0]
    k = torch.randn(shape, device=device, dtype=torch.float16)
    v = torch.randn(shape, device=device, dtype=torch.float16)
    k_scale = v_scale = None
    if kind != 0:
        fp8 = torch.float8_e4m3fn if kind == 1 else torch.float8_e5m2
        k, v = k.to(fp8).view(torch.uint8), v.to(fp8).view(torch.uint8)
        k_scale = torch.ones(shape[:3], device=device, dtype=torch.float32)
        v_scale = torch.ones(shape[:3], device=device, dtype=torch.float32)
    q = torch.randn(case.batch * q_len, case.heads, case.head_dim, device=device, dtype=torch.float16)
    qsl = torch.arange(0, (case.batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    seq_lens = torch.full((case.batch,), case.seq, dtype=torch.int32, device=device)
    return q, k, v, k_scale, v_scale, kind, qsl, seq_lens, tables.to(device), q_len


def time_case(ext, case: BenchCase, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds over `repeats` CUDA-event-timed calls, warm-up excluded, L2 flushed before each."""
    import torch

    q, k, v, k_scale, v_scale, kind, qsl, seq_lens, tables, q_len = _inputs(case, "cuda")
    out = torch.empty_like(q)
    scale = case.head_dim ** -0.5
    args = (out, q, k, v, k_scale, v_scale, kind, qsl, seq_lens, tables, q_len)
    if case.kernel == "prefill":
        def call():
            ext.prefill(*args, scale, True)
    else:
        def call():
            ext.decode(*args, case.seq, scale, 0)
    l2_flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        l2_flush.zero_()
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del q, k, v, out, l2_flush
    return statistics.median(times)


def measured_record(ext, case: BenchCase, repeats: int, device_name: str, kind: str) -> BenchRecord:
    ms = time_case(ext, case, repeats)
    gbps = case.kv_bytes() / (ms * 1e-3) / 1e9 if case.kernel == "decode" else None
    return BenchRecord(kind, case.kernel, case.shape, case.batch, case.seq, case.head_dim, case.heads,
                       case.kv_heads, case.kv_dtype, device_name, ms, case.useful_flops() / (ms * 1e-3) / 1e12,
                       gbps, repeats=repeats)


def as_dicts(records: list[BenchRecord]) -> list[dict]:
    return [asdict(r) for r in records]
