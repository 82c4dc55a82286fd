// W4A16 GEMV for 1-8 fp16 activation rows on the tensor cores (SM80 and newer): y = x @ dequant(W)^T.
//
// Why: the FMA GEMV (quant_gemv.cuh) spends about three instructions per weight and row, so at one row an H200
// SM is busy for most of the time its share of the weight takes to arrive, and at eight rows it is bound by
// arithmetic. Here one mma.sync.m16n8k16 multiplies 16 weight rows by 16 columns of all 8 activation rows
// (the activations are the 8-wide B operand: rows past m_rows are never stored), so the arithmetic per
// weight is the decode alone, and 8 rows cost what one does.
//
// The decode: a code pair (nibbles j and j + 4 of a word, bits 4j and 4j + 16) masked into the mantissas of
// the fp16 pair (1024, 1024) is the pair (1024 + q_j, 1024 + q_j+4); one HSUB2 of (1024 + z) gives (q - z)
// exactly (whole numbers -15..15). The odd nibbles, masked in place, are 1024 + 16 q: one HFMA2 by 1/16 minus
// (64 + z), also exact. Products on the tensor cores are exact and summed in fp32; each 128-column run (one
// group, or part of one: groups are multiples of 128 here) is scaled once, as the FMA GEMV does.
//
// Which columns a register pair holds: the weight layout (engine/quant/w4a16_layout.py) puts column
// w + j * G / 8 of a group in nibble j of the group's word w. Lane l (quad position c = l % 4) loads words
// 4c .. 4c + 3 of a 16-word run for rows g = l / 4 and g + 8, i.e. 16 pairs per row; pair p = 4 i + h (word
// 4c + i, nibbles h and h + 4) is the A operand's k pair 2c, 2c + 1 at k-step p / 2 for even p, and 2c + 8,
// 2c + 9 for odd p. The sum over k does not care which physical column a k is, as long as B holds the same
// one: lane (g, c) loads row g's activations at exactly those columns (load_b), from global memory (the
// activations are a few KB, read through L1), with no staging or block barrier before the weight loads.
//
// Work split: a block of kMmaWarps warps owns 16 output rows and one of `splits` runs of K; its warps take
// the block's 128-column runs in turn (U runs a batch, their loads issued together while the previous batch
// is computed), then add their
// accumulators in warp order through shared memory. With splits > 1 the blocks write fp32 partials and the
// last block of a row tile adds them in split order (as quant_gemv.cuh): the same order on every call.
#pragma once

#include <cuda_fp16.h>

#include "params.h"

namespace onecat_qgemv {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
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

// The 8 (q - z) values of one word as 4 fp16 pairs: pair h = (nibble h, nibble h + 4).
__device__ __forceinline__ void decode_word(uint32_t w, __half2 z1024, __half2 z64, uint32_t* out) {
  const __half2 sixteenth = __float2half2_rn(0.0625f);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t v = half ? w >> 8 : w;
    const uint32_t even = (v & 0x000F000Fu) | 0x64006400u;  // (1024 + q, 1024 + q')
    const uint32_t odd = (v & 0x00F000F0u) | 0x64006400u;   // (1024 + 16 q, 1024 + 16 q')
    out[2 * half] = h2_bits(__hsub2(bits_h2(even), z1024));
    out[2 * half + 1] = h2_bits(__hfma2(bits_h2(odd), sixteenth, __hneg2(z64)));
  }
}

// The B operand of one run for this lane, straight from x (no staging): lane (g, c) supplies activation row
// g's pairs 0..15. Pair p = 4 i + h holds the columns of nibbles h and h + 4 of word 4c + i, i.e. (groups of
// 128: a run is a group, word w holds columns w + 16 j) columns 16 h + 4c + i and 16 (h + 4) + 4c + i: eight
// 8-byte loads of 4 neighbouring columns (16 j + 4c .. + 3, j = 0..7) give all of them.
__device__ __forceinline__ void load_b(const __half* xm, int col0, int c, uint32_t* pairs) {
  uint2 q[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) q[j] = __ldg(reinterpret_cast<const uint2*>(xm + col0 + 16 * j + 4 * c));
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      // element i of chunk h (low half) and of chunk h + 4 (high half)
      const uint32_t lo = (i < 2 ? q[h].x : q[h].y) >> (16 * (i & 1));
      const uint32_t hi = (i < 2 ? q[h + 4].x : q[h + 4].y) >> (16 * (i & 1));
      pairs[4 * i + h] = __byte_perm(lo, hi, 0x5410);
    }
}

template <int U>
__global__ void __launch_bounds__(kMmaThreads) w4_mma_kernel(const Params p) {
  __shared__ float red[kMmaWarps * 4 * 32];
  const int runs = p.k / kMmaRun / p.splits;  // this block's runs of K
  const int r0 = blockIdx.y * runs;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int64_t rows[2] = {min(row0 + g, p.n - 1), min(row0 + g + 8, p.n - 1)};  // past N: re-read, not stored
  const int kw = p.k / 8;
  const uint4* wr[2] = {reinterpret_cast<const uint4*>(p.w + rows[0] * kw) + c,
                        reinterpret_cast<const uint4*>(p.w + rows[1] * kw) + c};
  const uint32_t* sz[2] = {static_cast<const uint32_t*>(p.scales) + rows[0] * (p.k / p.group),
                           static_cast<const uint32_t*>(p.scales) + rows[1] * (p.k / p.group)};
  const bool b_live = g < p.m_rows;  // this lane's B-operand row: rows past m_rows are zero
  const __half* xm = static_cast<const __half*>(p.x) + static_cast<int64_t>(b_live ? g : 0) * p.k;
  const int runs_per_group = p.group / kMmaRun;

  // U runs of both rows a batch; two batches alternate, so one is in flight while the other is computed
  struct Batch {
    uint4 w[U][2];
    uint32_t sz[U][2];
  };
  auto load = [&](Batch& bt, int rb) {  // runs rb, rb + kMmaWarps, ... of this block
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = rb + u * kMmaWarps;
      const bool live = r < runs;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        bt.w[u][h] = live ? __ldcs(wr[h] + 4 * (r0 + r)) : make_uint4(0, 0, 0, 0);
        bt.sz[u][h] = live ? __ldg(sz[h] + (r0 + r) / runs_per_group) : 0u;
      }
    }
  };
  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // rows g, g (cols 2c, 2c+1), g + 8, g + 8
  auto compute = [&](const Batch& bt, int rb) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = rb + u * kMmaWarps;
      if (r >= runs) break;
      __half2 z1024[2], z64[2];
      float s[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __half2 pair = bits_h2(bt.sz[u][h]);  // (scale, zero)
        const __half z = __high2half(pair);
        s[h] = __low2float(pair);
        z1024[h] = __half2half2(__hadd(z, __float2half(1024.f)));
        z64[h] = __half2half2(__hadd(z, __float2half(64.f)));
      }
      uint32_t xb[16];
      if (b_live) {
        load_b(xm, (r0 + r) * kMmaRun, c, xb);
      } else {
#pragma unroll
        for (int e = 0; e < 16; ++e) xb[e] = 0u;
      }
      float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // word 4c + i: pairs 4i .. 4i + 3, k-steps 2i and 2i + 1
        const uint4& w0v = bt.w[u][0];
        const uint4& w1v = bt.w[u][1];
        const uint32_t w0 = i == 0 ? w0v.x : i == 1 ? w0v.y : i == 2 ? w0v.z : w0v.w;
        const uint32_t w1 = i == 0 ? w1v.x : i == 1 ? w1v.y : i == 2 ? w1v.z : w1v.w;
        uint32_t a0[4], a1[4];
        decode_word(w0, z1024[0], z64[0], a0);
        decode_word(w1, z1024[1], z64[1], a1);
        const uint32_t s0[4] = {a0[0], a1[0], a0[1], a1[1]};  // k-step 2i: pairs 4i (k 2c..) and 4i + 1 (k 2c+8..)
        const uint32_t s1[4] = {a0[2], a1[2], a0[3], a1[3]};
        mma_16816(part, s0, xb[4 * i], xb[4 * i + 1]);
        mma_16816(part, s1, xb[4 * i + 2], xb[4 * i + 3]);
      }
      acc[0] = fmaf(s[0], part[0], acc[0]);
      acc[1] = fmaf(s[0], part[1], acc[1]);
      acc[2] = fmaf(s[1], part[2], acc[2]);
      acc[3] = fmaf(s[1], part[3], acc[3]);
    }
  };
  Batch even, odd;
  constexpr int kStep = U * kMmaWarps;
  load(even, warp);
  for (int rb = warp; rb < runs; rb += 2 * kStep) {
    load(odd, rb + kStep);
    compute(even, rb);
    load(even, rb + 2 * kStep);
    compute(odd, rb + kStep);
  }

  // the warps' sums, in warp order, through shared memory
#pragma unroll
  for (int e = 0; e < 4; ++e) red[(warp * 4 + e) * 32 + lane] = acc[e];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float t = red[e * 32 + lane];
#pragma unroll
    for (int w = 1; w < kMmaWarps; ++w) t += red[(w * 4 + e) * 32 + lane];
    acc[e] = t;
  }
  // element e: row g + 8 * (e / 2), activation row 2c + e % 2
  if (p.splits == 1) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + g + 8 * (e >> 1), mm = 2 * c + (e & 1);
      if (row < p.n && mm < p.m_rows) static_cast<__half*>(p.y)[static_cast<int64_t>(mm) * p.n + row] = __float2half_rn(acc[e]);
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int row = row0 + g + 8 * (e >> 1), mm = 2 * c + (e & 1);
    if (row < p.n && mm < p.m_rows) p.partial[(static_cast<int64_t>(blockIdx.y) * p.m_rows + mm) * p.n + row] = acc[e];
  }
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(p.tickets + blockIdx.x, 1) == p.splits - 1;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  __threadfence();
  for (int item = lane; item < 16 * p.m_rows; item += 32) {
    const int mm = item / 16, row = row0 + item % 16;
    if (row >= p.n) continue;
    float t = 0.f;
    for (int sp = 0; sp < p.splits; ++sp) t += __ldcg(p.partial + (static_cast<int64_t>(sp) * p.m_rows + mm) * p.n + row);
    static_cast<__half*>(p.y)[static_cast<int64_t>(mm) * p.n + row] = __float2half_rn(t);
  }
  if (lane == 0) p.tickets[blockIdx.x] = 0;
}

}  // namespace onecat_qgemv
