"""Calibration of sass-model v1: small kernels whose V100 speed is known, compiled to sm_70 SASS.

A model earns trust only if it lands on known answers. Each kernel here has one resource it
must saturate, so its ideal V100 figure is that resource's peak (v100_limits): a pure HMMA.884
loop (tensor pipe, 125.3 TFLOP/s), a pure FFMA loop (15.7 TFLOP/s), a pure LDS.128 loop (shared
memory, 128 B/clk/SM = 15.7 TB/s), a pure copy (HBM, 900 GB/s). A plain HGEMM on the same
m8n8k4 fragments (128x128 CTA tile, K step 32, no software pipelining) is compared with the
published cuBLAS HGEMM range on V100 (100-112 TFLOP/s of 125 at large square sizes) and with the
seed's reported 38-60 TFLOP/s for Volta attention prefill kernels. All model figures are
`projected (sass-model v1)`; the ideal and published figures are what they say they are.
"""
from __future__ import annotations

import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from onecat.engine.kernel_tools import v100_limits as V
from onecat.engine.kernel_tools.nvrtc import Nvrtc
from onecat.engine.kernel_tools.sass_model import Launch, functions, project
from onecat.engine.kernel_tools.sm70_check import CSRC, _parse_ptxas, v100_occupancy
from onecat.engine.kernel_tools.toolchain import find_toolchain

SOURCE = r"""
#include "flash_attn_v100/hmma.cuh"
using namespace fa_v100;
#define MMA(d, a0, a1, b0, b1) asm volatile("mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 " \
  "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n" \
  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
  : "r"(a0), "r"(a1), "r"(b0), "r"(b1))

extern "C" __global__ void __launch_bounds__(256) cal_hmma(float* out, int iters) {
  unsigned a0 = threadIdx.x, a1 = a0 * 3u, b0 = a0 ^ 5u, b1 = a0 + 7u;
  float d[8][8];
  for (int j = 0; j < 8; ++j) for (int e = 0; e < 8; ++e) d[j][e] = 0.f;
#pragma unroll 1
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) MMA(d[j], a0, a1, b0, b1);
  }
  float s = 0.f;
  for (int j = 0; j < 8; ++j) for (int e = 0; e < 8; ++e) s += d[j][e];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(256) cal_ffma(float* out, float x, int iters) {
  float a[8];
  for (int j = 0; j < 8; ++j) a[j] = threadIdx.x + j;
#pragma unroll 1
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int j = 0; j < 8; ++j) a[j] = fmaf(a[j], x, 1.0f);
  }
  float s = 0.f;
  for (int j = 0; j < 8; ++j) s += a[j];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(256) cal_lds(uint4* out, int iters) {
  __shared__ uint4 buf[1024];
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) buf[i] = make_uint4(i, i + 1, i + 2, i + 3);
  __syncthreads();
  uint4 acc = make_uint4(0, 0, 0, 0);
#pragma unroll 1
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint4 v = buf[(threadIdx.x + 32 * j + i) & 1023];
      acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

extern "C" __global__ void __launch_bounds__(256) cal_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n) {
#pragma unroll 1
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

extern "C" __global__ void __launch_bounds__(128) cal_gemm(const __half* A, const __half* B, float* C, int M, int N, int K) {
  constexpr int BM = 128, BK = 32, LD = 40;
  __shared__ __align__(16) __half a_s[BM * LD];
  __shared__ __align__(16) __half b_s[BM * LD];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BM, wm = (warp >> 1) * 64, wn = (warp & 1) * 64;
  const QuadPairLane ql(lane);
  const int rb = ql.qp & 1, cb = ql.qp >> 1;
  float acc[4][4][8];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][j][e] = 0.f;
#pragma unroll 1
  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int idx = tid + l * 128, r = idx >> 2, c = (idx & 3) * 8;
      *reinterpret_cast<uint4*>(a_s + r * LD + c) = *reinterpret_cast<const uint4*>(A + (long long)(m0 + r) * K + k0 + c);
      *reinterpret_cast<uint4*>(b_s + r * LD + c) = *reinterpret_cast<const uint4*>(B + (long long)(n0 + r) * K + k0 + c);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK / 4; ++kk) {
      uint2 a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = *reinterpret_cast<const uint2*>(a_s + (wm + 16 * i + rb * 8 + ql.frag_row) * LD + 4 * kk);
        b[i] = *reinterpret_cast<const uint2*>(b_s + (wn + 16 * i + cb * 8 + ql.frag_row) * LD + 4 * kk);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) hmma884_row_col(acc[i][j], a[i], b[j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        C[(long long)(m0 + wm + 16 * i + rb * 8 + acc_row(lane, e)) * N + n0 + wn + 16 * j + cb * 8 + acc_col(lane, e)] = acc[i][j][e];
}
"""

ITERS = 4096
CTAS = 2 * V.SMS * 4  # eight 256-thread CTAs' worth per SM: plenty of warps for every pipe
COPY_VECS = 1 << 24  # 16-byte vectors: 256 MB read + 256 MB written
GEMM = 8192  # M = N = K
TENSOR_TFLOPS = V.PEAK_TENSOR_FLOPS / 1e12
FP32_TFLOPS = V.PEAK_FP32_FLOPS / 1e12
SMEM_TBPS = V.SMEM_BYTES_PER_CLK * V.SMS * V.CLOCK_HZ / 1e12


@dataclass
class CalibrationRow:
    kernel: str
    what: str
    reference: str  # where the compared figure comes from
    reference_value: float  # ideal (peak) or published
    unit: str
    model_value: float
    model_binding: str
    ratio: float  # model / reference
    label: str = "projected (sass-model v1)"


def compile_sm70(source: str, toolchain=None) -> tuple[str, dict[str, dict[str, int]]]:
    """CUDA source -> (sm_70 SASS text, ptxas resource info per kernel), with the sm70 check's chain."""
    tc = toolchain or find_toolchain()
    opts = ["--gpu-architecture=compute_70", "--std=c++17", f"-I{CSRC}", f"-I{tc.cuda_include}"]
    ptx, _ = Nvrtc(tc.nvrtc_lib).compile(source, "sass_calibration.cu", opts, [])
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = Path(tmp) / "cal.ptx", Path(tmp) / "cal.cubin"
        ptx_path.write_text(ptx)
        res = subprocess.run([str(tc.ptxas), "-arch=sm_70", "-v", "-O3", str(ptx_path), "-o", str(cubin)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"ptxas failed for sm_70:\n{res.stderr}")
        dis = subprocess.run([str(tc.nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True)
    return dis.stdout, _parse_ptxas(res.stderr)


def launches() -> dict[str, tuple[Launch, float, str]]:
    """Per kernel: its launch, the amount of work it does (for the rate) and the rate's unit."""
    warps256 = 8
    hmma_flops = CTAS * warps256 * ITERS * 8 * 2048.0  # mma.sync m8n8k4 = 1024 FMA per warp
    ffma_flops = CTAS * 256 * ITERS * 32 * 2.0
    lds_bytes = CTAS * 256 * ITERS * 8 * 16.0
    copy_bytes = 2.0 * COPY_VECS * 16
    gemm_flops = 2.0 * GEMM ** 3
    gemm_ctas = (GEMM // 128) ** 2
    return {
        "cal_hmma": (Launch(CTAS, 256, CTAS * ITERS, 0, 0, 0.0, hmma_flops), hmma_flops, "TFLOP/s"),
        "cal_ffma": (Launch(CTAS, 256, CTAS * ITERS, 0, 0, 0.0, ffma_flops), ffma_flops, "TFLOP/s"),
        "cal_lds": (Launch(CTAS, 256, CTAS * ITERS, 0, 16384, 0.0, 0.0), lds_bytes, "TB/s"),
        "cal_copy": (Launch(CTAS, 256, COPY_VECS / 256, 0, 0, copy_bytes, 0.0), copy_bytes, "TB/s"),
        "cal_gemm": (Launch(gemm_ctas, 128, gemm_ctas * GEMM / 32, 0, 20480, 3.0 * 2 * GEMM ** 2, gemm_flops),
                     gemm_flops, "TFLOP/s"),
    }


REFERENCES = {  # kernel -> [(what, reference, value)]
    "cal_hmma": [("pure HMMA.884 loop", "ideal: V100 tensor peak", TENSOR_TFLOPS)],
    "cal_ffma": [("pure FFMA loop", "ideal: V100 FP32 peak", FP32_TFLOPS)],
    "cal_lds": [("pure LDS.128 loop", "ideal: 128 B/clk/SM shared memory", SMEM_TBPS)],
    "cal_copy": [("pure 16-byte copy", "ideal: HBM2 peak", V.HBM_BYTES_PER_S / 1e12)],
    "cal_gemm": [("HGEMM 8192^3, m8n8k4, 128x128 tile", "published: cuBLAS HGEMM on V100, low end", 100.0),
                 ("HGEMM 8192^3, m8n8k4, 128x128 tile", "published: cuBLAS HGEMM on V100, high end", 112.0)],
}


def calibrate(toolchain=None) -> list[CalibrationRow]:
    sass, info = compile_sm70(SOURCE, toolchain)
    fns = functions(sass)
    rows = []
    for name, (launch, work, unit) in launches().items():
        res = info.get(name, {})
        launch.registers, launch.smem_bytes = res.get("regs", 0), max(launch.smem_bytes, res.get("smem", 0))
        proj = project(fns[name], launch, v100_occupancy(launch.registers, launch.smem_bytes, launch.threads))
        value = work / (proj.ms * 1e-3) / 1e12
        for what, ref, ref_value in REFERENCES[name]:
            rows.append(CalibrationRow(name, what, ref, round(ref_value, 2), unit, round(value, 2), proj.binding,
                                       round(value / ref_value, 3)))
    return rows


def as_dicts(rows: list[CalibrationRow]) -> list[dict]:
    return [asdict(r) for r in rows]
