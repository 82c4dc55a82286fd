// W4A16 GEMV for 1-8 fp16 activation rows on the tensor cores (SM80 and newer): y = x @ dequant(W)^T.
//
// Why: the FMA GEMV (quant_gemv.cuh) spends about three instructions per weight and row, so at one row an H200
// SM is busy for most of the time its share of the weight takes to arrive, and at eight rows it is bound by
// arithmetic. Here one mma.sync.m16n8k16 multiplies 16 weight rows by 16 columns of all 8 activation rows
// (the activations are the 8-wide B operand: rows past m_rows are never stored), so the arithmetic per
// weight is the decode alone, and 8 rows cost what one does.
//
// The decode: two words' nibble j, gathered by one PRMT into the low bits of the two halves and masked by one
// LOP3 into the mantissas of the fp16 pair (1024, 1024), is the pair (1024 + q, 1024 + q'); one HSUB2 of
// (1024 + z) gives (q - z) exactly (whole numbers -15..15). An odd nibble, masked in place, is 1024 + 16 q: one
// HFMA2 by 1/16 minus (64 + z), also exact. About 1.3 instructions a weight. Products on the tensor cores are
// exact and summed in fp32; each 128-column run (one group: groups are 128 here) is scaled once, as the FMA
// GEMV does.
//
// Which columns a register pair holds: the weight layout (engine/quant/w4a16_layout.py) puts column
// w + 16 j of a group of 128 in nibble j of the group's word w. Lane l (quad position c = l % 4) loads words
// 4c .. 4c + 3 of a 16-word run for rows g = l / 4 and g + 8. At k-step j its A pairs are nibble j of words
// (4c, 4c + 1), columns 16 j + 4c and + 1 (the k pair 2c, 2c + 1), and of words (4c + 2, 4c + 3), columns
// 16 j + 4c + 2 and + 3 (the k pair 2c + 8, 2c + 9). The sum over k does not care which physical column a k
// is, as long as B holds the same one: lane (g, c)'s B pairs at k-step j are activation row g's columns
// 16 j + 4c .. + 3, one 8-byte load (load_b), from global memory (the activations are a few KB, read through
// L1), with no staging, permutation or block barrier.
//
// Work split: a block of W warps owns T tiles of 16 output rows and one of `splits` runs of K; its warps take
// the block's 128-column runs in turn (U runs a batch, their loads issued together while the previous batch
// is computed; a warp's B operand serves all T tiles), then add their accumulators in warp order through
// shared memory. With splits > 1 the blocks write fp32 partials and the last block of a row tile adds them in
// split order (as quant_gemv.cuh): the same order on every call. The launcher's choice (U, T, W) = (1, 2, 4)
// was the fastest over the Llama-3-8B projections at 1 and 8 rows on an H200 (benchmarks/results/
// quant_gemv_h200.json); fewer instructions a weight mattered more there than more loads in flight (a ring of
// cp.async stages was slower).
#pragma once

#include <cuda_fp16.h>

#include "params.h"

namespace onecat_qgemv {

// kMmaRun (params.h): columns a warp takes at once, 16 words of each of its 16 rows (one group of 128).

__device__ __forceinline__ uint32_t h2_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __half2 bits_h2(uint32_t v) { return *reinterpret_cast<__half2*>(&v); }

// d += a (16 x 16, row-major) * b (16 x 8), fp16 inputs, fp32 accumulators.
// (SM80 and newer; the launcher never starts this kernel below that, and builds for older GPUs trap.)
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// (a & MASK) | 0x64006400 in one LOP3 (the compiler's own lowering takes two: both constants are immediates).
template <uint32_t MASK>
__device__ __forceinline__ uint32_t mask_into_1024(uint32_t a) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(a), "n"(MASK), "r"(0x64006400u));
  return r;
}

// Byte B of lo in byte 0 and byte B of hi in byte 2 (bytes 1 and 3 are masked off by the decode).
template <int B>
__device__ __forceinline__ uint32_t gather_byte(uint32_t lo, uint32_t hi) {
  return __byte_perm(lo, hi, B | ((4 + B) << 8));
}

// The low (ODD false) or high nibble of the gathered bytes as the fp16 pair (q_lo - z, q_hi - z).
template <bool ODD>
__device__ __forceinline__ uint32_t decode_pair(uint32_t gathered, __half2 z1024, __half2 z64) {
  if (!ODD) return h2_bits(__hsub2(bits_h2(mask_into_1024<0x000F000Fu>(gathered)), z1024));
  return h2_bits(__hfma2(bits_h2(mask_into_1024<0x00F000F0u>(gathered)), __float2half2_rn(0.0625f), __hneg2(z64)));
}

// The B operand of one run for this lane: activation row g's columns 16 j + 4c .. + 3 for j = 0..7 (chunk j
// holds the k-step j pairs: .x columns 4c, 4c + 1, .y columns 4c + 2, 4c + 3).
__device__ __forceinline__ void load_b(const __half* xm, int col0, int c, uint2* chunks) {
#pragma unroll
  for (int j = 0; j < 8; ++j) chunks[j] = __ldg(reinterpret_cast<const uint2*>(xm + col0 + 16 * j + 4 * c));
}

// k-step j = 2 B + ODD of one run: nibble j of the lane's word pairs of rows g (w[0]) and g + 8 (w[1]).
template <int B, bool ODD>
__device__ __forceinline__ void mma_step(float* part, const uint4* w, const __half2* z1024, const __half2* z64,
                                         const uint2* xb) {
  const uint32_t a[4] = {decode_pair<ODD>(gather_byte<B>(w[0].x, w[0].y), z1024[0], z64[0]),
                         decode_pair<ODD>(gather_byte<B>(w[1].x, w[1].y), z1024[1], z64[1]),
                         decode_pair<ODD>(gather_byte<B>(w[0].z, w[0].w), z1024[0], z64[0]),
                         decode_pair<ODD>(gather_byte<B>(w[1].z, w[1].w), z1024[1], z64[1])};
  mma_16816(part, a, xb[2 * B + ODD].x, xb[2 * B + ODD].y);
}

// One run of one 16-row tile: the two rows' words (w[h]: row g + 8 h) and (scale, zero) pairs against the B
// operand xb; each row's run sum is scaled once into acc (rows g, g, g + 8, g + 8; activation rows 2c, 2c + 1).
__device__ __forceinline__ void mma_run(const uint4* w, const uint32_t* sz, const uint2* xb, float* acc) {
  __half2 z1024[2], z64[2];
  float s[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __half2 pair = bits_h2(sz[h]);  // (scale, zero)
    const __half z = __high2half(pair);
    s[h] = __low2float(pair);
    z1024[h] = __half2half2(__hadd(z, __float2half(1024.f)));
    z64[h] = __half2half2(__hadd(z, __float2half(64.f)));
  }
  float part[4] = {0.f, 0.f, 0.f, 0.f};
  mma_step<0, false>(part, w, z1024, z64, xb);
  mma_step<0, true>(part, w, z1024, z64, xb);
  mma_step<1, false>(part, w, z1024, z64, xb);
  mma_step<1, true>(part, w, z1024, z64, xb);
  mma_step<2, false>(part, w, z1024, z64, xb);
  mma_step<2, true>(part, w, z1024, z64, xb);
  mma_step<3, false>(part, w, z1024, z64, xb);
  mma_step<3, true>(part, w, z1024, z64, xb);
  acc[0] = fmaf(s[0], part[0], acc[0]);
  acc[1] = fmaf(s[0], part[1], acc[1]);
  acc[2] = fmaf(s[1], part[2], acc[2]);
  acc[3] = fmaf(s[1], part[3], acc[3]);
}

// The end of a block: its W warps' sums of its T tiles added in warp order through shared memory (red: W * T *
// 4 * 32 floats), then written (splits == 1), or written as fp32 partials of which the last block of the row
// tile adds all in split order: the same order on every call.
template <int T, int W>
__device__ __forceinline__ void finish(const Params& p, float (*acc)[4], float* red, int row0) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) red[((warp * T + t) * 4 + e) * 32 + lane] = acc[t][e];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = red[(t * 4 + e) * 32 + lane];
#pragma unroll
      for (int w = 1; w < W; ++w) v += red[((w * T + t) * 4 + e) * 32 + lane];
      acc[t][e] = v;
    }
  // tile t, element e: row row0 + 16 t + g + 8 * (e / 2), activation row 2c + e % 2
  if (p.splits == 1) {
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + 16 * t + g + 8 * (e >> 1), mm = 2 * c + (e & 1);
        if (row < p.n && mm < p.m_rows)
          static_cast<__half*>(p.y)[static_cast<int64_t>(mm) * p.n + row] = __float2half_rn(acc[t][e]);
      }
    return;
  }
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + 16 * t + g + 8 * (e >> 1), mm = 2 * c + (e & 1);
      if (row < p.n && mm < p.m_rows)
        p.partial[(static_cast<int64_t>(blockIdx.y) * p.m_rows + mm) * p.n + row] = acc[t][e];
    }
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(p.tickets + blockIdx.x, 1) == p.splits - 1;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  __threadfence();
  for (int item = lane; item < 16 * T * p.m_rows; item += 32) {
    const int mm = item / (16 * T), row = row0 + item % (16 * T);
    if (row >= p.n) continue;
    float v = 0.f;
    for (int sp = 0; sp < p.splits; ++sp) v += __ldcg(p.partial + (static_cast<int64_t>(sp) * p.m_rows + mm) * p.n + row);
    static_cast<__half*>(p.y)[static_cast<int64_t>(mm) * p.n + row] = __float2half_rn(v);
  }
  if (lane == 0) p.tickets[blockIdx.x] = 0;
}

template <int U, int T, int W>
__global__ void __launch_bounds__(W * 32) w4_mma_kernel(const Params p) {
  __shared__ float red[W * T * 4 * 32];
  const int runs = p.k / kMmaRun / p.splits;  // this block's runs of K
  const int r0 = blockIdx.y * runs;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int row0 = blockIdx.x * 16 * T;
  const int kw = p.k / 8;
  // tile t, half h: weight row row0 + 16 t + 8 h + g (past N: re-read, not stored)
  const uint4* wr[T][2];
  const uint32_t* sz[T][2];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = min(row0 + 16 * t + 8 * h + g, p.n - 1);
      wr[t][h] = reinterpret_cast<const uint4*>(p.w + row * kw) + c;
      sz[t][h] = static_cast<const uint32_t*>(p.scales) + row * (p.k / kMmaRun);  // a run is a group
    }
  const bool b_live = g < p.m_rows;  // this lane's B-operand row: rows past m_rows are zero
  const __half* xm = static_cast<const __half*>(p.x) + static_cast<int64_t>(b_live ? g : 0) * p.k;

  // U runs of all T tiles a batch; two batches alternate, so one is in flight while the other is computed
  struct Batch {
    uint4 w[U][T][2];
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
          bt.w[u][t][h] = live ? __ldcs(wr[t][h] + 4 * (r0 + r)) : make_uint4(0, 0, 0, 0);
          bt.sz[u][t][h] = live ? __ldg(sz[t][h] + r0 + r) : 0u;
        }
    }
  };
  float acc[T][4] = {};
  auto compute = [&](const Batch& bt, int rb) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = rb + u * W;
      if (r >= runs) break;
      uint2 xb[8];
      if (b_live) {
        load_b(xm, (r0 + r) * kMmaRun, c, xb);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) xb[j] = make_uint2(0u, 0u);
      }
#pragma unroll
      for (int t = 0; t < T; ++t) mma_run(bt.w[u][t], bt.sz[u][t], xb, acc[t]);
    }
  };
  Batch even, odd;
  constexpr int kStep = U * W;
  load(even, warp);
  for (int rb = warp; rb < runs; rb += 2 * kStep) {
    load(odd, rb + kStep);
    compute(even, rb);
    load(even, rb + 2 * kStep);
    compute(odd, rb + kStep);
  }
  finish<T, W>(p, acc, red, row0);
}

}  // namespace onecat_qgemv
