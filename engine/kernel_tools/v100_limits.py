"""V100-SXM2 (GV100, sm_70) limits used by the SASS performance model, each with its source.

Sources (S1-S5 below are cited by each constant):
  S1  NVIDIA Tesla V100 GPU Architecture whitepaper (WP-08608-001, 2017): 80 SMs, 4 processing
      blocks per SM each with one warp scheduler issuing one warp instruction per clock, 16 FP32
      and 8 LD/ST units per block, 8 tensor cores per SM of 64 FP16 FMA per clock each (640 in all,
      125 TFLOP/s at the 1530 MHz boost), 6 MB L2, 900 GB/s HBM2, up to 96 KB shared memory per SM.
      Also: NVIDIA "Programming Tensor Cores in CUDA 9" (developer.nvidia.com) and the Cornell
      Virtual Workshop page on V100 tensor cores (8 per SM, 2 per processing block, 512 FMA/clk/SM).
  S2  CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table, compute capability
      7.0 (results per clock per SM): FP32 add/mul/fma 64; FP16 add/mul/fma 128 (64 half2
      instructions' worth); rcp/rsqrt/log2/exp2/sin/cos (MUFU) 16; integer add/logic/shift/compare
      64; type conversions 16; warp shuffle 32. "Compute Capabilities" table: 65536 registers,
      2048 threads, 32 resident blocks, 96 KB shared memory per SM.
  S3  Jia, Maggioni, Staiger, Scarpazza, "Dissecting the NVIDIA Volta GPU Architecture via
      Microbenchmarking", arXiv:1804.06826 (2018): 32 shared-memory banks of 4 B (128 B/clk/SM),
      HMMA.884 as the SASS of Volta tensor cores, L2 load throughput of about 2.1-2.5 TB/s
      aggregate (we take 2.5 TB/s, the top of the range, so the L2 bound stays a bound), global
      memory latency of several hundred cycles (we take 400), measured HBM2 streaming below the
      900 GB/s peak.
  S4  PTX ISA, "mma.m8n8k4" (warp-level, f16 inputs): one mma.sync.m8n8k4 per warp computes four
      8x8x4 products, one per quad pair (4 * 8*8*4 = 1024 FMA); ptxas emits it as four HMMA.884
      instructions (STEP0..STEP3), so one HMMA.884 = 256 FMA = 512 FLOP per warp.
  S5  NVIDIA V100 datasheet: SXM2 boost clock 1530 MHz, HBM2 900 GB/s.

These are peaks (or, for latency, typical values): the model's figures are upper bounds on speed.
"""
from __future__ import annotations

SMS = 80  # S1
SCHEDULERS_PER_SM = 4  # S1: one per processing block
ISSUE_PER_SCHEDULER_CLK = 1  # S1: one warp instruction per clock per scheduler
CLOCK_HZ = 1.53e9  # S1/S5: SXM2 boost
REGS_PER_SM = 65536  # S2
SMEM_PER_SM = 96 * 1024  # S1/S2
THREADS_PER_SM = 2048  # S2
CTAS_PER_SM = 32  # S2
WARP = 32

# Per-SM, per-clock throughputs in thread-operations (a warp instruction is 32 of them) unless noted.
TENSOR_FMA_PER_CLK = 512  # S1: 8 tensor cores x 64 FP16 FMA = 1024 FLOP/clk/SM -> 125.3 TFLOP/s at 80 SMs
FMA_PER_HMMA884 = 256  # S4: per warp instruction (a quarter of one m8n8k4 mma.sync)
FP32_PER_CLK = 64  # S2: FFMA / FADD / FMUL
FP16X2_PER_CLK = 64  # S2: 128 FP16 results = 64 half2 instructions' lanes (HFMA2 / HADD2 / HMUL2)
INT_PER_CLK = 64  # S2: integer add / logic / shift / compare, and FP32 compare / min / max / select
MUFU_PER_CLK = 16  # S2: exp2, rcp, rsqrt, log2, sin, cos
CONVERT_PER_CLK = 16  # S2: type conversions (F2F, F2I, I2F)
LSU_PER_CLK = 32  # S1: 4 x 8 LD/ST units -> one warp memory instruction per clock per SM
SHUFFLE_PER_CLK = 32  # S2
SMEM_BYTES_PER_CLK = 128  # S3: 32 banks x 4 B, conflict-free
L2_BYTES_PER_S = 2.5e12  # S3 (aggregate, upper end of the measured range)
HBM_BYTES_PER_S = 900e9  # S1/S5 (peak; S3 measures less, so this stays a bound)
DRAM_LATENCY_CLK = 400  # S3 (order of magnitude; used only by the latency bound)

PEAK_TENSOR_FLOPS = 2 * TENSOR_FMA_PER_CLK * SMS * CLOCK_HZ  # 125.3e12
PEAK_FP32_FLOPS = 2 * FP32_PER_CLK * SMS * CLOCK_HZ  # 15.7e12
