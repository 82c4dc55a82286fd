"""The CUDA packed-weight GEMVs: W4A16, NVFP4, MXFP4 and FP8 weights read packed, 1-8 activation rows. Plain
FMAs on SM70 and newer (csrc/quant_gemv/quant_gemv.cuh); on SM80 and newer the tensor-core GEMV
(mma_gemv.cuh) for fp16 W4A16 with groups of 128, NVFP4 and FP8 (fp16 or bf16) and MXFP4 (bf16). Built on
first use.

Packed layers call these for every decode call of 1-8 rows (ONECAT_QUANT_GEMV=auto): one kernel per layer and
a split of K that does not depend on the row count, so a row's result is the same alone or in a batch, as the
fp16 GEMV's is (the harness's determinism workload checks exactly that). Measured on an H200, the Llama-3-8B
layer (benchmarks/results/quant_gemv_h200.json): the tensor-core GEMV is 1.0-1.8x cuBLAS fp16 at 8 rows
(the FMA and Triton GEMVs 0.25-0.5x) and at one row the fastest of the three for W4A16, NVFP4 and MXFP4.
ONECAT_QUANT_GEMV=triton runs the Triton GEMVs instead (not batch-invariant); =folded also folds the residual
add + RMSNorm and SiLU * mul into one-row calls of the FMA GEMV (measured slower than the separate kernels:
benchmarks/results/quant_decoder_h200.json). Where the extension cannot be built the Triton GEMVs run (FP8:
dequantize + cuBLAS).
"""
from __future__ import annotations

import functools
import os

import torch

from onecat.engine.kernels import pdl
from onecat.engine.kernels.cuda_extension import CSRC, CudaExtension
from onecat.engine.kernels.device import capability
from onecat.engine.switches import switch

BACKEND_ENV = "ONECAT_QUANT_GEMV"
BACKENDS = ("auto", "folded", "triton")
MAX_ROWS = 8
MMA_MAX_ROWS = 16  # the most rows the tensor-core GEMV takes in one call (two B operands)
# 9-16 rows in one tensor-core GEMV call (the weight read and decoded once where two 8-row calls read it twice; a
# row's bits those of an 8-row call, csrc/quant_gemv/mma_gemv.cuh). Timed on an H100 over the Qwen3.5-27B
# projections (benchmarks/results/gpu_gemv16_{nvfp4,w4a16}_h100.json): 16 rows 1.1-1.6x two 8-row calls, 32 rows
# 1.1-1.6x four; route 1 at batch 1 2.131x -> 2.220x target-only (read once; benchmarks set it per process)
MMA_16_ROWS = switch("ONECAT_GEMV_16_ROWS", True)
# a layer's call of up to blocked_rows(its words format, rows a GEMV call takes) rows (a verify step's 1 + k: a DFlash
# block is 16; at batch 2, 32; at batch 4, 64) takes the GEMV in calls of that many rows (packed_gemv_blocks), where
# the library GEMM needs the weight dequantized on every call (the packed bytes read, the fp16 copy written and read:
# ~2.3 fp16 reads of the weight) and the packed many-row GEMM (triton_packed_rows.py) decodes every tile for all its
# rows. Timed on an H100 over the Qwen3.5-27B projections: in calls of 8 rows
# (benchmarks/results/gpu_packed_rows_{nvfp4,w4a16}_h100.json) the GEMV beats both at 17 and 32 rows on all five
# NVFP4 projections and on all five W4A16 ones (17 rows) / four of five (32), and the many-row GEMM wins at 64; in
# calls of 16 (gpu_packed_rows_16_{nvfp4,w4a16}_h100.json) the GEMV takes about half the many-row GEMM's time at 32
# rows and at 64 the five projections' sum is 872 against 997 us (NVFP4) and level (W4A16: 830 against 830); at 128
# the many-row GEMM wins. FP8 was not timed past 16 rows: 16.
BLOCKED_ROWS_BY_FORMAT = {MAX_ROWS: {"int4": 32, "nvfp4": 32, "mxfp4": 32, "fp8": 16},
                          MMA_MAX_ROWS: {"int4": 64, "nvfp4": 64, "mxfp4": 64, "fp8": 16}}
BLOCKED_ROWS = max(max(t.values()) for t in BLOCKED_ROWS_BY_FORMAT.values())  # the most packed_gemv_blocks takes
# "dense": not packed, a weight in the activation dtype read as int32 words of two (engine/kernels/dense_rows.py)
FMT_IDS = {"int4_fp16": 0, "int4_bf16": 1, "nvfp4": 2, "mxfp4": 3, "fp8": 4, "dense": 5}
CODES_PER_WORD = {"fp8": 4, "dense": 2}  # the rest: 8
KERNELS = ("auto", "fma", "mma")  # packed_gemv's choices (the binding takes 1 = FMA, 2 = tensor cores)
MMA_RUN = 128  # the tensor-core GEMV's unit of K (csrc/quant_gemv/params.h kMmaRun), W4A16's group size there
TICKETS = 1 << 16  # row tiles of one call (>= N / 16)
# packed layers keep their words in the tensor-core GEMV's tiles where it takes their calls (tiles_apply), FP4 also
# with its codes in the activation dtype's slots (engine/quant/fp4/slots.py); the benchmarks turn these off for A/B arms
TILES = True
CODE_SLOTS = True
GLU_IN_GEMV = True  # a packed [gate | up] layer's SiLU * mul in its tensor-core GEMV (tiled_words.py glu_gemv)
# how the words lie (csrc/quant_gemv/params.h Layout): packed_gemv's `tiled`; the slots' activation dtype
ROW_MAJOR, TILED, TILED_FP16_SLOTS, TILED_BF16_SLOTS = 0, 1, 2, 3
SLOT_DTYPES = {TILED_FP16_SLOTS: torch.float16, TILED_BF16_SLOTS: torch.bfloat16}
SMEM_BUDGET_MAX = 64 * 1024  # staged activations per block (csrc/bindings/quant_gemv.cpp: also <= a third of an SM)
# --ftz=false: the W4A16 decode multiplies float32 denormals (a code masked in place), which must not flush
EXTENSION = CudaExtension("onecat_quant_gemv", (CSRC / "bindings" / "quant_gemv.cpp",
                                                CSRC / "bindings" / "quant_gemv_launch.cu"),
                          ("quant_gemv", "bindings"), cuda_flags=("--ftz=false",))


def _wanted() -> str:
    want = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if want not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={want!r}: expected one of {', '.join(BACKENDS)}")
    return want


def backend() -> tuple[str, str]:
    """("auto", "folded" or "triton", why): which GEMVs the packed layers call on this machine."""
    want = _wanted()
    if want == "triton":
        return "triton", f"{BACKEND_ENV}=triton: the Triton GEMVs (not batch-invariant)"
    reason = EXTENSION.unavailable_reason()
    if reason is not None:
        return "triton", f"CUDA packed GEMV unavailable: {reason}"
    if want == "folded":
        return "folded", (f"{BACKEND_ENV}=folded: the CUDA packed GEMVs, the norm and SiLU * mul folded into "
                          "one-row calls")
    return "auto", "the CUDA packed GEMVs for every decode call (batch-invariant)"


@functools.lru_cache(maxsize=None)
def _backend_kind() -> str:
    return backend()[0]


def use_cuda() -> bool:
    """Whether packed layers call the CUDA GEMVs (built, and not turned off) for their 1-8-row calls."""
    return _backend_kind() != "triton"


def use_folded() -> bool:
    """Whether one-row calls after an RMSNorm take the CUDA GEMV with the norm (and SiLU * mul) folded in."""
    return _backend_kind() == "folded"


@functools.lru_cache(maxsize=None)
def _tickets(device_index: int) -> torch.Tensor:
    """Per-device split-K tickets: zero between calls (the last block of a row tile resets its own)."""
    return torch.zeros(TICKETS, dtype=torch.int32, device=torch.device("cuda", device_index))


def check_call(x: torch.Tensor, fmt: str, qweight: torch.Tensor, splits: int,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, glu: bool = False,
               mma: bool = False) -> None:
    """The argument checks the binding makes, raised here as ValueError with what to change (a C++
    exception must not cross into Python: on some builds that takes the process down)."""
    codes = CODES_PER_WORD.get(fmt, 8)
    k = qweight.shape[1] * codes
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features; the packed weight takes {k}")
    m = x.numel() // k
    most = MMA_MAX_ROWS if mma else MAX_ROWS
    if not 1 <= m <= most:
        raise ValueError(f"the packed GEMV takes 1 to {most} rows{'' if mma else ' (off the tensor cores)'}, got {m}: "
                         "call it per row block (packed_gemv_blocks)")
    if k % (4 * codes):
        raise ValueError(f"in_features {k} must be a multiple of {4 * codes}")
    if not x.is_contiguous() or x.data_ptr() % 8:
        raise ValueError("x must be contiguous and 8-byte aligned (pass x.contiguous().clone())")
    if (residual is None) != (norm_weight is None):
        raise ValueError("the folded norm needs both residual and norm_weight")
    if residual is not None and m != 1:
        raise ValueError(f"the folded norm takes one row, got {m}: run the norm and the GEMV apart")
    if glu and m != 1 and not mma:
        raise ValueError(f"glu takes one row on the FMA GEMV, got {m}: more rows need the tensor-core GEMV")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
            raise ValueError(f"residual must be contiguous with x's shape {tuple(x.shape)} and dtype {x.dtype}")
        if norm_weight.numel() != k or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
            raise ValueError(f"norm_weight must be a contiguous [{k}] tensor of dtype {x.dtype}")
        if residual.data_ptr() % 8 or norm_weight.data_ptr() % 8:
            raise ValueError("residual and norm_weight must be 8-byte aligned (pass a .clone())")
    if glu and qweight.shape[0] % 2:  # the tensor-core GEMV's 16-row halves: tensor_cores_apply's glu_rows
        raise ValueError(f"glu needs a [gate | up] weight of an even number of rows, got {qweight.shape[0]}")
    width = MMA_RUN if mma else 4 * codes  # columns of the unit K is split in: a run of 128, or a chunk
    chunks = k // width
    if splits:
        if chunks % splits:
            raise ValueError(f"splits {splits} must divide the row's {chunks} {'runs' if mma else 'chunks'} of "
                             f"{width} columns")
        if mma:  # the tensor-core GEMV stages nothing
            return
        m_tmpl = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8
        smem = m_tmpl * codes * (chunks // splits) * 16 + (m_tmpl * (chunks // splits) * 4 if codes == 8 else 0)
        if smem > SMEM_BUDGET_MAX:
            raise ValueError(f"splits {splits} leave {smem} bytes of staged activations per block; at most "
                             f"{SMEM_BUDGET_MAX}: use more splits (or 0, the kernel's choice)")


def tensor_cores_take(fmt: str, act_dtype: torch.dtype, scales_dtype: torch.dtype, group: int, k: int,
                      device: torch.device) -> bool:
    """Whether the tensor-core GEMV (csrc/quant_gemv/mma_gemv.cuh) takes a format's calls on this CUDA device, SM80
    or newer: W4A16 with fp16 activations and scale pairs and groups of 128, NVFP4 and FP8 with fp16 or bf16
    activations, MXFP4 with bf16 (its scaled codes can leave fp16's range); K a multiple of 128."""
    if k % MMA_RUN:
        return False
    fits = {"int4": act_dtype == torch.float16 and scales_dtype == torch.float16 and group == MMA_RUN,
            "nvfp4": act_dtype in (torch.float16, torch.bfloat16), "mxfp4": act_dtype == torch.bfloat16,
            "fp8": act_dtype in (torch.float16, torch.bfloat16), "dense": act_dtype in (torch.float16, torch.bfloat16)}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return fits.get(fmt, False) and capability(index) >= 80


def tensor_cores_apply(x: torch.Tensor, fmt: str, scales: torch.Tensor, group: int, folded: bool,
                       glu_rows: int = 0) -> bool:
    """Whether the tensor-core GEMV takes this call (tensor_cores_take; no folded norm; glu_rows: the [gate | up]
    weight's rows of a glu call, whose halves it takes in tiles of 16)."""
    return (not folded and glu_rows % 32 == 0
            and tensor_cores_take(fmt, x.dtype, scales.dtype, group, x.shape[-1], x.device))


def tiles_apply(fmt: str, act_dtype: torch.dtype, scales: torch.Tensor, group: int, n: int, k: int) -> bool:
    """Whether a packed layer keeps its words in mma_tiles' layout: TILES is on, its 1-8-row calls take the
    tensor-core GEMV (the CUDA GEMVs without the folded norm, a format and dtype it takes) and N is a multiple
    of 16. Measured on an H200, the Llama-3-8B layer at one row: 46.0 vs 50.2 us row-major (W4A16), the same
    bits (benchmarks/results/quant_h200.json "mma_tiles")."""
    return (TILES and scales.is_cuda and _backend_kind() == "auto" and n % 16 == 0
            and tensor_cores_take(fmt, act_dtype, scales.dtype, group, k, scales.device))


def mma_layout(fmt: str, act_dtype: torch.dtype, scales: torch.Tensor | None = None) -> int:
    """The tiled layout a packed layer keeps where tiles_apply: FP4 with its codes in the activation dtype's
    slots where fp4_slot_bits.slots_take and layout_takes (measured on an H200: benchmarks/results/quant_h200.json
    "code_slots"), the rest TILED. MXFP4 needs its scales to say."""
    from onecat.engine.kernels.fp4_slot_bits import slots_take

    if not CODE_SLOTS or fmt not in ("nvfp4", "mxfp4") or (fmt == "mxfp4" and scales is None):
        return TILED
    layout = next((layout for layout, dtype in SLOT_DTYPES.items() if dtype == act_dtype), TILED)
    return layout if layout_takes(layout, fmt, act_dtype) and slots_take(fmt, scales) else TILED


def layout_takes(layout: int, fmt: str, act_dtype: torch.dtype) -> bool:
    """Whether the tensor-core GEMV decodes words of this layout at this activation dtype."""
    if layout not in SLOT_DTYPES:
        return True
    return SLOT_DTYPES[layout] == act_dtype and (fmt == "nvfp4" or (fmt, act_dtype) == ("mxfp4", torch.bfloat16))


def _device_index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


def _words_per_run(fmt: str) -> int:
    return MMA_RUN // CODES_PER_WORD.get(fmt, 8)


def mma_tiles(qweight: torch.Tensor, fmt: str) -> torch.Tensor:
    """The packed words [N, K / codes-per-word] in the tensor-core GEMV's tiles (same shape): for each 16 output
    rows and each run of 128 columns, the 16 rows' words of the run in one contiguous block. A warp then reads
    512 contiguous bytes where it read 64 from each of 8 rows. Only that GEMV reads them (packed_gemv(...,
    tiled=True)); mma_untile gives the rows back. N must be a multiple of 16 and K of 128."""
    n, kw = qweight.shape
    wpr = _words_per_run(fmt)
    if n % 16 or kw % wpr:
        raise ValueError(f"mma_tiles takes N a multiple of 16 and K a multiple of {MMA_RUN}, got a {tuple(qweight.shape)} "
                         f"{fmt} weight")
    return qweight.view(n // 16, 16, kw // wpr, wpr).transpose(1, 2).contiguous().view(n, kw)


def mma_untile(tiles: torch.Tensor, fmt: str) -> torch.Tensor:
    """The row-major packed words of mma_tiles' output."""
    n, kw = tiles.shape
    wpr = _words_per_run(fmt)
    return tiles.view(n // 16, kw // wpr, 16, wpr).transpose(1, 2).contiguous().view(n, kw)


def blocked_rows(words_format: str, per_call: int) -> int:
    """The most rows a layer whose words are `words_format` ("int4", "nvfp4", "mxfp4", "fp8") sends to
    packed_gemv_blocks when a GEMV call takes `per_call` rows (rows_per_call: MAX_ROWS or MMA_MAX_ROWS;
    BLOCKED_ROWS_BY_FORMAT)."""
    return BLOCKED_ROWS_BY_FORMAT[per_call][words_format]


def rows_per_call(x: torch.Tensor, fmt: str, scales: torch.Tensor, group: int = 0) -> int:
    """Rows of one packed_gemv call in packed_gemv_blocks: MMA_MAX_ROWS where the tensor-core GEMV takes x's call
    and MMA_16_ROWS is on, else MAX_ROWS."""
    if MMA_16_ROWS and x.is_cuda and tensor_cores_apply(x, fmt, scales, group, False):
        return MMA_MAX_ROWS
    return MAX_ROWS


def packed_gemv_blocks(x: torch.Tensor, fmt: str, qweight: torch.Tensor, scales: torch.Tensor,
                       row_scale: torch.Tensor | None = None, group: int = 0, *,
                       tiled: int = ROW_MAJOR) -> torch.Tensor:
    """packed_gemv (plain) of up to BLOCKED_ROWS rows, rows_per_call(...) rows a call. The GEMV is batch-invariant,
    so each row's result is the one it gets alone."""
    k = x.shape[-1]
    m = x.numel() // k
    block = rows_per_call(x, fmt, scales, group)
    if m <= block:
        return packed_gemv(x, fmt, qweight, scales, row_scale, group, tiled=tiled)
    if m > BLOCKED_ROWS:
        raise ValueError(f"packed_gemv_blocks takes 1 to {BLOCKED_ROWS} rows, got {m}")
    rows = x.reshape(m, k)
    y = torch.cat([packed_gemv(rows[i:i + block], fmt, qweight, scales, row_scale, group, tiled=tiled)
                   for i in range(0, m, block)])
    return y.view(*x.shape[:-1], y.shape[-1])


def packed_gemv(x: torch.Tensor, fmt: str, qweight: torch.Tensor, scales: torch.Tensor,
                row_scale: torch.Tensor | None = None, group: int = 0, splits: int = 0, *,
                residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                glu: bool = False, kernel: str = "auto", tiled: int = ROW_MAJOR):
    """y = x @ dequant(W)^T for a contiguous fp16/bf16 x of 1-8 rows, 1-16 on the tensor-core GEMV (leading shape
    kept). fmt: "int4" (scales
    = W4A16 (scale, zero) pairs [N, K/G, 2] in fp16 or bf16, group G), "nvfp4" (scales = E4M3 bytes, row_scale
    = global scale per row), "mxfp4" (E8M0 bytes), "fp8" (row_scale = scale per row; scales unused).
    splits: runs of K per row tile (0: the kernel's choice).
    One row can fold in the ops around a projection, as the fp16 GEMV does (engine/kernels/triton_gemv.py): with
    residual and norm_weight, x is replaced by RMSNorm(x + residual) * norm_weight and the call returns
    (y, x + residual); with glu the weight is [gate | up] and y = SiLU(gate) * up (half the rows): one row on the
    FMA GEMV, 1-16 rows on the tensor-core GEMV (halves of a multiple of 16 rows), the bits of the separate
    SiLU * mul kernel (engine/kernels/triton_fused.py silu_mul) on the unfused projection's output.
    kernel: "auto" (the tensor-core GEMV where tensor_cores_apply, else the FMA GEMV), "fma" or "mma"
    (forced, for comparison). tiled: ROW_MAJOR, or TILED (mma_tiles' layout, which only the tensor-core GEMV reads),
    or TILED_FP16_SLOTS / TILED_BF16_SLOTS (NVFP4 or MXFP4 with fp16 / bf16 x: mma_tiles of fp4.slots.to_slots).
    fmt "dense" (the tensor-core GEMV only): qweight is a weight in x's dtype viewed as int32 (dense_rows.py)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    applies = tensor_cores_apply(x, fmt, scales, group, residual is not None, qweight.shape[0] if glu else 0)
    if kernel == "mma" and not applies:
        raise ValueError("the tensor-core GEMV takes W4A16 (fp16 activations and scale pairs, groups of 128), NVFP4, "
                         "FP8 or dense weights (fp16 or bf16) or MXFP4 (bf16), K a multiple of 128, no folded norm, "
                         "glu only with gate and up halves of a multiple of 16 rows, on SM80 or newer")
    mma = applies and kernel != "fma"
    if tiled and not mma:
        raise ValueError("tiled weights (mma_tiles) are read by the tensor-core GEMV only, and it does not take this "
                         "call: pass the row-major words (mma_untile)")
    if tiled not in (ROW_MAJOR, TILED, *SLOT_DTYPES):
        raise ValueError(f"tiled {tiled!r}: expected ROW_MAJOR (0), TILED (1), TILED_FP16_SLOTS (2) or "
                         "TILED_BF16_SLOTS (3)")
    if not layout_takes(tiled, fmt, x.dtype):
        raise ValueError(f"words in code slots are FP4 laid for {SLOT_DTYPES[tiled]} activations, got {fmt} with "
                         f"{x.dtype} (engine/quant/fp4/slots.py from_slots gives the plain words)")
    check_call(x, fmt, qweight, splits, residual, norm_weight, glu, mma)
    if fmt == "int4":
        fmt = "int4_fp16" if scales.dtype == torch.float16 else "int4_bf16"
    mod = EXTENSION.load()
    if fmt in ("fp8", "dense"):  # no block scales: any CUDA tensor fills the argument
        scales = qweight
    y, h, error = mod.gemv(x, qweight, scales, row_scale, _tickets(_device_index(x)),
                           FMT_IDS[fmt], group, splits, residual, norm_weight, eps, glu, 2 if mma else 1,
                           mma and pdl.options(x.device)["PDL"], int(tiled))
    if error:
        raise RuntimeError(f"packed GEMV: {error}")
    return y if residual is None else (y, h)


def fold_takes(x: torch.Tensor, residual: torch.Tensor, norm, in_features: int) -> bool:
    """Whether the one-row CUDA GEMV with the residual add + RMSNorm (and SiLU * mul) folded in takes a packed
    layer's call: asked for (use_folded), fused ops on, one fp16/bf16 row of a CUDA input."""
    return (use_folded() and getattr(norm, "use_fused", False) and x.is_cuda and x.numel() == in_features
            and in_features % 32 == 0 and x.dtype in (torch.float16, torch.bfloat16) and residual is not None
            and residual.dtype == x.dtype and residual.numel() == x.numel() and norm.weight.dtype == x.dtype)


def folded_call(linear, x: torch.Tensor, residual: torch.Tensor, norm, glu: bool, fmt: str, qweight: torch.Tensor,
                scales: torch.Tensor, row_scale: torch.Tensor | None = None, group: int = 0):
    """(linear(norm(x + residual)) or, with glu, SiLU(gate) * up of it, x + residual) in one kernel, or None
    where fold_takes says no (the caller then runs the steps apart). A bias is added after the GEMV (glu: not
    folded, None)."""
    if not fold_takes(x, residual, norm, linear.in_features) or (glu and linear.bias is not None):
        return None
    y, h = packed_gemv(x.contiguous(), fmt, qweight, scales, row_scale, group, residual=residual.contiguous(),
                       norm_weight=norm.weight.contiguous(), eps=norm.eps, glu=glu)
    return (y if linear.bias is None else y + linear.bias), h
