// Packed-weight GEMV for 1-16 activation rows on the tensor cores (SM80 and newer): y = x @ dequant(W)^T for
// W4A16 with fp16 scale pairs and groups of 128 (w4_mma.cuh: fp16 activations), NVFP4 (fp4_mma.cuh: fp16 or
// bf16), MXFP4 (bf16), FP8 E4M3 (fp8_mma.cuh: fp16 or bf16) and dense weights in the activation dtype
// (dense_mma.cuh: fp16 or bf16).
//
// Why: one mma.sync.m16n8k16 multiplies 16 weight rows by 16 columns of all 8 activation rows (the activations
// are the 8-wide B operand: rows past m_rows are zero and never stored), so the arithmetic per weight is its
// decode alone, and 8 rows cost what one does. 9-16 rows (NB = 2: a verify step's 1 + k) take two B operands, rows
// 0-7 and 8-15, against each decoded A fragment: the weight read and decoded once where two 8-row calls read and
// decode it twice, and each row's products and sums in the order an 8-row call gives them (its B operand alone,
// the same k steps, warps and splits), so a row's bits do not depend on NB. Each format's header says how a lane's
// registers map to columns; the sum over k does not care which physical column a k is, as long as A and B agree.
//
// Work split: a block of W warps owns T tiles of 16 output rows and one of `splits` runs of K; its warps take
// the block's 128-column runs in turn (U runs a batch, their loads issued together while the previous batch
// is computed; a warp's B operand serves all T tiles), then add their accumulators in warp order through
// shared memory. With splits > 1 the blocks write fp32 partials and the last block of a row tile adds them in
// split order (as quant_gemv.cuh): the same order on every call. The launcher's choice U = 1, T = 2 was the
// fastest over the Llama-3-8B projections at 1 and 8 rows on an H200 (benchmarks/results/quant_gemv_h200.json;
// a ring of cp.async stages was slower); W (Params.warps) is 8 where the grid leaves under 2 blocks a SM, 2 from
// 6 on, else 4; FP8's 8 under 1 block a SM, else 4 (mma_warps in csrc/bindings/quant_gemv.cpp).
//
// GLU (p.glu, a [gate | up] weight of 2 n_out rows): block i takes gate tile i and up tile i (rows 16 i .. and
// n_out + 16 i ..) and writes SiLU(gate) * up of its 16 outputs, rounded as the separate SiLU * mul kernel
// (engine/kernels/triton_fused.py silu_mul) rounds them: one kernel a decode step fewer per MLP.
#pragma once

#include "dense_mma.cuh"
#include "formats.cuh"
#include "fp4_mma.cuh"
#include "fp8_mma.cuh"
#include "mma_ops.cuh"
#include "w4_mma.cuh"

namespace onecat_qgemv {

// kMmaRun (params.h): columns a warp takes at once (a run): 16 words of each of its rows (FP8: 32).

// The first weight row of the block's tile t: GLU's gate (t = 0) and up (t = 1) tiles of its 16 outputs, else
// consecutive tiles.
template <int T>
__device__ __forceinline__ int tile_row(const Params& p, int t) {
  return p.glu ? t * p.n_out + 16 * blockIdx.x : (blockIdx.x * T + t) * 16;
}

// The end of a block: its W warps' sums of its T tiles (NB B operands each) added in warp order through shared
// memory (red: W * T * NB * 4 * 32 floats), then written (splits == 1), or written as fp32 partials of which the
// last block of the row tile adds all in split order: the same order on every call. With GLU the block's 16
// outputs are SiLU(gate) * up.
template <typename X, int T, int W, int NB>
__device__ __forceinline__ void finish(const Params& p, float (*acc)[NB][4], float* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[(((warp * T + t) * NB + b) * 4 + e) * 32 + lane] = acc[t][b][e];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = red[((t * NB + b) * 4 + e) * 32 + lane];
#pragma unroll
        for (int w = 1; w < W; ++w) v += red[(((w * T + t) * NB + b) * 4 + e) * 32 + lane];
        acc[t][b][e] = v;
      }
  // tile t, B operand b, element e: row tile_row(t) + g + 8 * (e / 2), activation row 8 b + 2c + e % 2; the
  // output, or this split's fp32 partial
  X* y = static_cast<X*>(p.y);
  if (p.glu && p.splits == 1) {
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int out = tile_row<T>(p, 0) + g + 8 * (e >> 1), mm = 8 * b + 2 * c + (e & 1);
        if (mm < p.m_rows) y[static_cast<int64_t>(mm) * p.n_out + out] = silu_mul<X>(acc[0][b][e], acc[1][b][e]);
      }
    return;
  }
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = tile_row<T>(p, t) + g + 8 * (e >> 1), mm = 8 * b + 2 * c + (e & 1);
        if (row >= p.n || mm >= p.m_rows) continue;
        if (p.splits == 1) {
          y[static_cast<int64_t>(mm) * p.n + row] = from_float<X>(acc[t][b][e]);
        } else {
          p.partial[(static_cast<int64_t>(blockIdx.y) * p.m_rows + mm) * p.n + row] = acc[t][b][e];
        }
      }
  if (p.splits == 1) return;
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(p.tickets + blockIdx.x, 1) == p.splits - 1;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  __threadfence();
  auto summed = [&](int mm, int row) {
    float v = 0.f;
    for (int sp = 0; sp < p.splits; ++sp) v += __ldcg(p.partial + (static_cast<int64_t>(sp) * p.m_rows + mm) * p.n + row);
    return v;
  };
  if (p.glu) {
    for (int item = lane; item < 16 * p.m_rows; item += 32) {
      const int mm = item / 16, out = tile_row<T>(p, 0) + item % 16;
      y[static_cast<int64_t>(mm) * p.n_out + out] = silu_mul<X>(summed(mm, out), summed(mm, p.n_out + out));
    }
  } else {
    for (int item = lane; item < 16 * T * p.m_rows; item += 32) {
      const int mm = item / (16 * T), row = tile_row<T>(p, 0) + item % (16 * T);
      if (row < p.n) y[static_cast<int64_t>(mm) * p.n + row] = from_float<X>(summed(mm, row));
    }
  }
  if (lane == 0) p.tickets[blockIdx.x] = 0;
}

// The scale bits of run r for the row whose first scale element is `base`: W4A16 its (scale, zero) pair, FP4 the
// lane's block-scale bytes, FP8 none (the row's scale comes at the end), dense weights none.
template <int FMT>
__device__ __forceinline__ uint32_t run_scales(const void* base, int r, int c) {
  if constexpr (FMT == kInt4H) {
    return __ldg(static_cast<const uint32_t*>(base) + r);  // a run is a group
  } else if constexpr (FMT == kFp8 || FMT == kDense) {
    return 0u;
  } else {
    return fp4_run_scales<FMT>(static_cast<const uint8_t*>(base), r, c);
  }
}

// One run (128 columns starting at col0) of all T tiles: w[t][2 h + v] the lane's 16-byte vectors of row g + 8 h,
// sz[t][h] its scale bits; the NB B operands (activation rows 8 b + g, zero past m_rows) are loaded here, through L1.
template <int FMT, typename X, int T, int kVecs, bool SLOTS, int NB>
__device__ __forceinline__ void mma_run(const uint4 (*w)[2 * kVecs], const uint32_t (*sz)[2], const X* const* xm,
                                        int col0, int c, const bool* b_live, float (*acc)[NB][4]) {
  uint32_t xb[NB][16] = {};  // rows past m_rows: zero
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (b_live[b]) {
      if constexpr (FMT == kInt4H) {
        w4_load_b(xm[b], col0, c, xb[b]);
      } else {
        load_b_32cols(xm[b], col0, c, xb[b]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
    if constexpr (SLOTS) {
      slots_run<FMT, X, NB>(w[t], sz[t], xb, acc[t]);
    } else if constexpr (FMT == kInt4H) {
      w4_run<NB>(w[t], sz[t], xb, acc[t]);
    } else if constexpr (FMT == kFp8) {
      fp8_run<X, NB>(w[t], xb, acc[t]);
    } else if constexpr (FMT == kDense) {
      dense_run<X, NB>(w[t], xb, acc[t]);
    } else {
      fp4_run<FMT, X, NB>(w[t], sz[t], xb, acc[t]);
    }
  }
}

// NVFP4 and FP8: the scale per row, and the power of two the decode left out, on the sums of rows tile_row(t) + ...
template <int FMT, int T, int NB>
__device__ __forceinline__ void scale_rows(const Params& p, float (*acc)[NB][4], int g) {
  if constexpr (FMT == kNvfp4 || FMT == kFp8) {
    constexpr float kLeft = FMT == kNvfp4 ? 128.f : 256.f;
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float scale = p.row_scale[min(tile_row<T>(p, t) + g + 8 * (e >> 1), p.n - 1)] * kLeft;
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[t][b][e] *= scale;
      }
  }
}

// SLOTS: FP4 words in X's code slots (fp4_mma.cuh), tiled (Params.tiled kTilesFp16Slots / kTilesBf16Slots).
// NB: B operands of 8 activation rows (1: up to 8 rows, 2: up to 16).
template <int FMT, typename X, int U, int T, int W, bool SLOTS = false, int NB = 1>
__global__ void __launch_bounds__(W * 32) mma_gemv_kernel(const Params p) {
  static_assert(FMT == kInt4H ? Same<X, __half>::value : FMT != kInt4B, "formats this kernel takes");
  static_assert(!SLOTS || FMT == kNvfp4 || FMT == kMxfp4, "code slots are FP4's");
  // 16-byte loads a lane takes of a row's run (FP8: 32 words a run, dense: 64)
  constexpr int kVecs = FMT == kFp8 ? 2 : (FMT == kDense ? 4 : 1);
  static_assert(NB == 1 || NB == 2, "8 or 16 activation rows");
  __shared__ float red[W * T * NB * 4 * 32];
  const int runs = p.k / kMmaRun / p.splits;  // this block's runs of K
  const int r0 = blockIdx.y * runs;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  static_assert(T == 2, "GLU pairs a gate tile with an up tile");
  const int kw = p.k / Traits<FMT>::kCodes;
  // tile t, half h: weight row tile_row(t) + 8 h + g (past N: re-read, not stored). wr: the lane's first 16 bytes
  // of the row's run 0; run r is run_step * r further. Row-major: a row's runs follow each other. Tiled
  // (p.tiled, mma_tiles in engine/kernels/quant_gemv.py): the 16 rows of a tile own one contiguous block per run,
  // so a warp's load of a run's half tile is 512 contiguous bytes (1 KB for FP8), lane order.
  const uint4* wr[T][2];
  const void* sz[T][2];  // the row's first (scale, zero) pair (W4A16) or scale byte (FP4)
  const int64_t run_step = p.tiled ? 16 * 4 * kVecs : 4 * kVecs;  // 16-byte units
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = min(tile_row<T>(p, t) + 8 * h + g, p.n - 1);
      const int64_t tile = min(tile_row<T>(p, t) / 16, p.n / 16 - 1);  // tiled: N is a multiple of 16
      wr[t][h] = reinterpret_cast<const uint4*>(p.w) +
                 (p.tiled ? tile * (p.k / kMmaRun) * run_step + (h * 32 + lane) * kVecs : row * (kw / 4) + c * kVecs);
      if constexpr (FMT == kInt4H) {
        sz[t][h] = static_cast<const uint32_t*>(p.scales) + row * (p.k / kMmaRun);  // a run is a group
      } else if constexpr (FMT == kDense) {
        sz[t][h] = nullptr;
      } else {
        sz[t][h] = static_cast<const uint8_t*>(p.scales) + row * (p.k / Traits<FMT>::kBlock);
      }
    }
  bool b_live[NB];  // this lane's B-operand rows 8 b + g: rows past m_rows are zero
  const X* xm[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    b_live[b] = 8 * b + g < p.m_rows;
    xm[b] = static_cast<const X*>(p.x) + static_cast<int64_t>(b_live[b] ? 8 * b + g : 0) * p.k;
  }

  // U runs of all T tiles a batch; two batches alternate, so one is in flight while the other is computed
  struct Batch {
    uint4 w[U][T][2 * kVecs];
    uint32_t sz[U][T][2];
  };
  auto load = [&](Batch& bt, int rb) {  // runs rb, rb + W, ... of this block
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = rb + u * W;
      const bool live = r < runs;
#pragma unroll
      for (int t = 0; t < T; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int v = 0; v < kVecs; ++v)
            bt.w[u][t][h * kVecs + v] = live ? __ldcs(wr[t][h] + run_step * (r0 + r) + v) : make_uint4(0, 0, 0, 0);
          bt.sz[u][t][h] = live ? run_scales<FMT>(sz[t][h], r0 + r, c) : 0u;
        }
    }
  };
  float acc[T][NB][4] = {};
  auto compute = [&](const Batch& bt, int rb) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = rb + u * W;
      if (r >= runs) break;
      mma_run<FMT, X, T, kVecs, SLOTS, NB>(bt.w[u], bt.sz[u], xm, (r0 + r) * kMmaRun, c, b_live, acc);
    }
  };
  Batch even, odd;
  constexpr int kStep = U * W;
  load(even, warp);
  wait_previous_kernel_then_release_next();  // the first weights are in flight; x is the previous kernel's output
  for (int rb = warp; rb < runs; rb += 2 * kStep) {
    load(odd, rb + kStep);
    compute(even, rb);
    load(even, rb + 2 * kStep);
    compute(odd, rb + kStep);
  }
  scale_rows<FMT, T, NB>(p, acc, g);
  finish<X, T, W, NB>(p, acc, red);
}

}  // namespace onecat_qgemv
