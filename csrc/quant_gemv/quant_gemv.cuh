// Packed-weight GEMV for decode (1-8 activation rows): y = x @ dequant(W)^T, W kept packed in GPU memory.
//
// Formats (the layouts of engine/quant/*_layout.py, read without change):
//   kInt4H / kInt4B  W4A16: int32 words [N, K/8], within a group of G columns word w holds columns
//                    w + j*G/8 in nibble j; (scale, zero) pairs [N, K/G, 2] in fp16 (kInt4H) or bf16 (kInt4B).
//   kNvfp4           E2M1 codes in pack_fp4's rotated slots, blocks of 16; E4M3 block scales [N, K/16] and a
//                    float32 global scale per row.
//   kMxfp4           as kNvfp4 with blocks of 32 and E8M0 block scales [N, K/32].
//   kFp8             E4M3 bytes, words [N, K/4], within a block of 16 columns word w holds columns w + 4j in
//                    byte j; a float32 scale per row.
//
// Why it is fast: at 4 bits a weight an H200 SM must retire ~33 weights per clock to keep up with memory, so
// the instructions per weight decide the speed. Every format decodes a code into a float32 whose bits are the
// code's value times a fixed power of two, with one mask (and for FP4/FP8 a rotate), never an int->float
// conversion: a 4-bit integer q masked in place at bit 4j IS the float q * 2^(4j-149) (a denormal; GPUs
// multiply denormals at full rate), an E2M1 code rotated into bits 22-24 and 31 is e2m1 * 2^-126, an E4M3
// byte moved to bits 20-26 and 31 is e4m3 * 2^-120. The activations are staged once per block in shared
// memory as float32 pre-multiplied by the matching power of two (2^(100 - 4j) for W4A16, 2^100 otherwise),
// so every product lands at one known scale and the decode-and-multiply is one LOP3 + one FFMA per weight.
// W4A16's zero point is applied per 32-column chunk from the chunk's activation sum:
// sum((q - z) x) = sum(q x) - z sum(x). Products are exact, sums float32, no tensor-core instruction:
// the same code runs on SM70 (V100) and newer.
//
// Work split: a block of 8 warps owns 8*R output rows and one of `splits` equal runs of K; a lane reads
// 4 consecutive words (one 128-bit load, a "chunk") of each of its R rows for U chunks per step, so a warp
// streams 512 contiguous bytes per row and load, with U * R loads in flight per lane (the first step's issued
// before the activations are staged). With splits > 1 each block writes float32 partials and the last block of a row tile (an
// atomic ticket) adds them in split order: the same order on every call.
//
// Folded ops (as the fp16 GEMV of engine/kernels/triton_gemv.py): with a residual, the input is RMSNorm(x +
// residual) * norm_w: staging forms h = x + residual (rounded to T; the first row tile's blocks also store it,
// the new residual stream) and h * norm_w, and 1/RMS(h), a scalar per row, multiplies the row sums at the end.
// With glu the weight is [gate | up]: a warp takes gate and up rows of the same outputs and stores
// SiLU(gate) * up.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "params.h"

namespace onecat_qgemv {


template <int FMT> struct Traits;
template <> struct Traits<kInt4H> { static constexpr int kCodes = 8; };
template <> struct Traits<kInt4B> { static constexpr int kCodes = 8; };
template <> struct Traits<kNvfp4> { static constexpr int kCodes = 8; static constexpr int kBlock = 16; };
template <> struct Traits<kMxfp4> { static constexpr int kCodes = 8; static constexpr int kBlock = 32; };
template <> struct Traits<kFp8> { static constexpr int kCodes = 4; static constexpr int kBlock = 16; };

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ uint32_t rotl(uint32_t w, int r) { return __funnelshift_l(w, w, r); }
__device__ __forceinline__ float bits(uint32_t v) { return __uint_as_float(v); }

// An E4M3 byte as float32 times 2^-120 (sign to bit 31, exponent and mantissa to bits 20-26).
__device__ __forceinline__ float e4m3(uint32_t b) { return bits(((b & 0x7Fu) << 20) | ((b & 0x80u) << 24)); }

// Code j of word w as float32 (see the header for the power of two each format carries).
template <int FMT>
__device__ __forceinline__ float decode(uint32_t w, uint32_t hi, int j) {
  if constexpr (FMT == kInt4H || FMT == kInt4B) {
    return j < 6 ? bits(w & (0xFu << (4 * j))) : bits(hi & (0xFu << (4 * j - 8)));
  } else if constexpr (FMT == kFp8) {
    // byte j: sign (bit 8j+7) to 31, magnitude (bits 8j..8j+6) to 20..26
    const uint32_t t = rotl(w, 24 - 8 * j);
    return bits((t & 0x80000000u) | ((t >> 4) & 0x07F00000u));
  } else {
    // engine/quant/fp4_layout.py SLOTS: rotate left and mask to sign bit 31, magnitude bits 22-24
    switch (j) {
      case 0: return bits(rotl(w, 22) & 0x81C00000u);
      case 1: return bits(rotl(w, 19) & 0x81C00000u);
      case 2: return bits(rotl(w, 16) & 0x81C00000u);
      case 3: return bits((rotl(w, 12) & 0x80C00000u) | (w & 0x01000000u));
      case 4: return bits((rotl(w, 9) & 0x00C00000u) | (rotl(w, 1) & 0x81000000u));
      case 5: return bits(rotl(w, 6) & 0x81C00000u);
      case 6: return bits(rotl(w, 2) & 0x81C00000u);
      default: return bits((rotl(w, 28) & 0x01C00000u) | (w & 0x80000000u));
    }
  }
}

// Columns per scale block.
template <int FMT>
__device__ __forceinline__ int block_cols(const Params& p) {
  if constexpr (FMT == kInt4H || FMT == kInt4B) {
    return p.group;
  } else {
    return Traits<FMT>::kBlock;
  }
}

// Shared memory of one block: float4 xs[M][codes][chunks] (+ float xsum[M][chunks] for W4A16).
template <int FMT, int M>
__host__ __device__ constexpr int smem_bytes(int chunks) {
  return M * Traits<FMT>::kCodes * chunks * 16 + ((FMT == kInt4H || FMT == kInt4B) ? M * chunks * 4 : 0);
}

// Four values of one row: columns col..col+3 (gw >= 4), or col, col+1 and the next block's col+bcols,
// col+bcols+1 (NVFP4: two words a block). Columns of a pair are 4-byte aligned, of a run 8-byte.
template <typename T>
__device__ __forceinline__ void load_four(const T* xm, int col, int gw, int bcols, T* v) {
  if (gw >= 4) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(xm + col));
    const T* h = reinterpret_cast<const T*>(&raw);
    v[0] = h[0]; v[1] = h[1]; v[2] = h[2]; v[3] = h[3];
  } else {
    const uint32_t a = __ldg(reinterpret_cast<const uint32_t*>(xm + col));
    const uint32_t b = __ldg(reinterpret_cast<const uint32_t*>(xm + col + bcols));
    const T* ha = reinterpret_cast<const T*>(&a);
    const T* hb = reinterpret_cast<const T*>(&b);
    v[0] = ha[0]; v[1] = ha[1]; v[2] = hb[0]; v[3] = hb[1];
  }
}

template <typename T>
__device__ __forceinline__ void store_four(T* xm, int col, int gw, int bcols, const T* v) {
  if (gw >= 4) {
    uint2 raw;
    T* h = reinterpret_cast<T*>(&raw);
    h[0] = v[0]; h[1] = v[1]; h[2] = v[2]; h[3] = v[3];
    *reinterpret_cast<uint2*>(xm + col) = raw;
  } else {
    uint32_t a, b;
    T* ha = reinterpret_cast<T*>(&a);
    T* hb = reinterpret_cast<T*>(&b);
    ha[0] = v[0]; ha[1] = v[1]; hb[0] = v[2]; hb[1] = v[3];
    *reinterpret_cast<uint32_t*>(xm + col) = a;
    *reinterpret_cast<uint32_t*>(xm + col + bcols) = b;
  }
}

// The four inputs of row m at those columns as float32: x, or with the folded norm h * norm_w where
// h = x + residual rounded to T (the RMS statistic is applied to the row sums at the end, see block_rstd);
// write_h: this block also stores h, the new residual stream.
template <typename T, bool FOLD>
__device__ __forceinline__ void load_input(const Params& p, int m, int col, int gw, int bcols, bool write_h,
                                           float* v) {
  const int64_t base = static_cast<int64_t>(m) * p.k;
  T xv[4];
  load_four<T>(static_cast<const T*>(p.x) + base, col, gw, bcols, xv);
  if (!FOLD || p.residual == nullptr) {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = to_float(xv[e]);
    return;
  }
  T rv[4], wv[4], h[4];
  load_four<T>(static_cast<const T*>(p.residual) + base, col, gw, bcols, rv);
  load_four<T>(static_cast<const T*>(p.norm_w), col, gw, bcols, wv);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    h[e] = __hadd(xv[e], rv[e]);
    v[e] = to_float(h[e]) * to_float(wv[e]);
  }
  if (write_h) store_four<T>(static_cast<T*>(p.rout) + base, col, gw, bcols, h);
}

// P items per thread and pass: their loads are issued together.
template <int FMT, int M, int P, typename T, bool FOLD>
__device__ __forceinline__ void stage_items(const Params& p, int c0, int chunks, float4* xs, float* xsum) {
  constexpr int J = Traits<FMT>::kCodes;
  const int bcols = block_cols<FMT>(p);
  const int gw = bcols / J;  // words per scale block
  const int total = M * chunks * J;  // a multiple of 8 (J = 8) or 4: code groups never straddle a pass
  for (int base = 0; base < total; base += kThreads * P) {  // every thread takes every pass (shuffles below)
    float v[P][4];
    int dst[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int item = base + i * kThreads + threadIdx.x;
      const int j = item % J;
      const int mc = item / J;
      const int m = mc / chunks;
      const int c = mc - m * chunks;
      const int word = 4 * (c0 + c);
      const int col = (word / gw) * bcols + word % gw + j * gw;
      v[i][0] = v[i][1] = v[i][2] = v[i][3] = 0.f;
      dst[i] = item < total ? (m * J + j) * chunks + c : -1;
      if (item < total && m < p.m_rows) load_input<T, FOLD>(p, m, col, gw, bcols, blockIdx.x == 0, v[i]);
    }
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int item = base + i * kThreads + threadIdx.x;
      const int j = item % J;
      float s;
      if constexpr (FMT == kInt4H || FMT == kInt4B) {
        s = __uint_as_float(static_cast<uint32_t>(227 - (j < 6 ? 4 * j : 4 * j - 8)) << 23);  // 2^(100 - pos)
      } else {
        s = 1.2676506002282294e30f;  // 2^100
      }
      if (dst[i] >= 0) xs[dst[i]] = make_float4(v[i][0] * s, v[i][1] * s, v[i][2] * s, v[i][3] * s);
      if constexpr (FMT == kInt4H || FMT == kInt4B) {
        // the chunk's 8 codes are 8 neighbouring threads of one warp
        float sum = (v[i][0] + v[i][1]) + (v[i][2] + v[i][3]);
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o, 8);
        if (j == 0 && dst[i] >= 0) xsum[item / J] = sum;  // row m, chunk c: m * chunks + c
      }
    }
  }
}

// One block's run of K: the activations of chunks [c0, c0 + chunks) staged as described above, one
// (row, chunk, code) per thread and step; W4A16 also sums each chunk's 32 activations (over the 8 threads
// of one chunk, a fixed butterfly).
// The folded norm loads three values per input (x, residual, norm weight): one item a pass keeps the
// registers within the one-row kernels' budget.
template <int FMT, int M, typename T, bool FOLD>
__device__ __forceinline__ void stage_x(const Params& p, int c0, int chunks, float4* xs, float* xsum) {
  if (!FOLD || p.residual == nullptr) {
    stage_items<FMT, M, 4, T, FOLD>(p, c0, chunks, xs, xsum);
  } else {
    stage_items<FMT, M, 1, T, FOLD>(p, c0, chunks, xs, xsum);
  }
}

// A row's scales, located once per row: the row's first scale element, and NVFP4's global scale * 2^26.
struct RowScales {
  const void* base;
  float global;
};

template <int FMT>
__device__ __forceinline__ RowScales row_scales(const Params& p, int64_t row) {
  if constexpr (FMT == kInt4H || FMT == kInt4B) {
    return {static_cast<const uint32_t*>(p.scales) + row * (p.k / p.group), 0.f};  // one (s, z) pair a group
  } else if constexpr (FMT == kNvfp4) {
    return {static_cast<const uint16_t*>(p.scales) + row * (p.k / 32), p.row_scale[row] * 67108864.f};
  } else if constexpr (FMT == kMxfp4) {
    return {static_cast<const uint8_t*>(p.scales) + row * (p.k / 32), 0.f};
  } else {
    return {nullptr, 0.f};
  }
}

// The scale factors of one chunk (32 columns) of one row: W4A16 (s * 2^49, z); NVFP4 (first block, second
// block) with the decode's 2^26 folded in; MXFP4 (2^(e-127), -); FP8 none (the row scale comes at the end).
// W4A16 groups are 32 << gshift columns.
template <int FMT>
__device__ __forceinline__ float2 chunk_scales(const RowScales& rs, int chunk, int gshift) {
  if constexpr (FMT == kInt4H) {
    const uint32_t v = __ldg(static_cast<const uint32_t*>(rs.base) + (chunk >> gshift));
    const __half2 sz = *reinterpret_cast<const __half2*>(&v);
    return make_float2(__low2float(sz) * 562949953421312.f, __high2float(sz));  // s * 2^49, z
  } else if constexpr (FMT == kInt4B) {
    const uint32_t v = __ldg(static_cast<const uint32_t*>(rs.base) + (chunk >> gshift));
    const __nv_bfloat162 sz = *reinterpret_cast<const __nv_bfloat162*>(&v);
    return make_float2(__low2float(sz) * 562949953421312.f, __high2float(sz));
  } else if constexpr (FMT == kNvfp4) {
    // two blocks of 16 per chunk; the E4M3 value formed exactly (times 2^120 back), then times the global
    const uint32_t b2 = __ldg(static_cast<const uint16_t*>(rs.base) + chunk);
    const float s0 = e4m3(b2 & 0xFF) * 1.329227995784916e36f;
    const float s1 = e4m3(b2 >> 8) * 1.329227995784916e36f;
    return make_float2(s0 * rs.global, s1 * rs.global);
  } else if constexpr (FMT == kMxfp4) {
    const uint32_t e = __ldg(static_cast<const uint8_t*>(rs.base) + chunk);
    const float s = e == 0 ? 5.877471754111438e-39f : (e == 255 ? __uint_as_float(0x7FC00000u) : bits(e << 23));
    return make_float2(s, 0.f);
  } else {
    return make_float2(1.f, 0.f);
  }
}

// Output rows: a warp owns R weight rows; with glu, R / 2 gate rows and the matching R / 2 up rows (the
// weight's second half), i.e. R / 2 outputs. The output of the warp's r-th weight row, and that weight row
// (rows past the end re-read the last one and are not stored).
template <int R, bool FOLD>
__device__ __forceinline__ int out_of(const Params& p, int out0, int r) {
  return out0 + (FOLD && p.glu && r >= R / 2 ? r - R / 2 : r);
}

template <int R, bool FOLD>
__device__ __forceinline__ int64_t weight_row(const Params& p, int out0, int r) {
  const int o = min(out_of<R, FOLD>(p, out0, r), p.n_out - 1);
  return FOLD && p.glu && r >= R / 2 ? static_cast<int64_t>(o) + p.n_out : o;
}

// 1 / RMS(x + residual) of each activation row into rstd[m] (1 without the folded norm), from the whole row
// (a block stages only its run of K): h rounded to T as staged, squares summed per thread, then over the
// warps in a fixed order. Every thread of the block must call it.
template <int M, typename T, bool FOLD>
__device__ void block_rstd(const Params& p, float* rstd) {
  if (!FOLD || p.residual == nullptr) {
    if (threadIdx.x < M) rstd[threadIdx.x] = 1.f;
    __syncthreads();
    return;
  }
  __shared__ float red[M][kWarps];
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    ss[m] = 0.f;
    if (m >= p.m_rows) continue;
    const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(m) * p.k;
    const T* r = static_cast<const T*>(p.residual) + static_cast<int64_t>(m) * p.k;
    for (int c = 4 * threadIdx.x; c < p.k; c += 4 * kThreads) {
      T xv[4], rv[4];
      load_four<T>(x, c, 4, 0, xv);
      load_four<T>(r, c, 4, 0, rv);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float h = to_float(__hadd(xv[e], rv[e]));
        ss[m] = fmaf(h, h, ss[m]);
      }
    }
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], o);
    if (lane == 0) red[m][warp] = ss[m];
  }
  __syncthreads();
  if (threadIdx.x < M) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t += red[threadIdx.x][w];
    rstd[threadIdx.x] = rsqrtf(t / p.k + p.eps);
  }
  __syncthreads();
}

// y[m, out] from the row sum g (and with glu the up row's sum u), each times rstd; glu rounds as the separate
// kernels would: the projection outputs to T, SiLU(gate) to T, then the product.
template <typename T, bool FOLD>
__device__ __forceinline__ void store_out(const Params& p, int m, int out, float g, float u, float rstd) {
  float v = g * rstd;
  if (FOLD && p.glu) {
    const float gate = to_float(from_float<T>(v));
    const float act = to_float(from_float<T>(gate / (1.f + expf(-gate))));
    v = act * to_float(from_float<T>(u * rstd));
  }
  static_cast<T*>(p.y)[static_cast<int64_t>(m) * p.n_out + out] = from_float<T>(v);
}

// Blocks an SM should hold at once (the registers each thread may use follow): a block's work is short, so
// its latencies (staging, the first loads) are hidden by the other blocks of the SM.
template <int M> struct MinBlocks { static constexpr int value = M == 1 ? 4 : (M == 2 ? 3 : (M == 4 ? 2 : 1)); };

// R rows per warp, U chunks per lane and step; M activation rows (p.m_rows <= M are live).
// FOLD: the folded norm and glu are compiled in (p.residual, p.glu honoured; else they must be unset); it
// holds three blocks an SM (the shared memory already limits a V100 SM to three) for their registers.
template <int FMT, int M, int R, int U, typename T, bool FOLD>
__global__ void __launch_bounds__(kThreads, FOLD ? 3 : MinBlocks<M>::value) quant_gemv_kernel(const Params p) {
  constexpr int J = Traits<FMT>::kCodes;
  extern __shared__ float4 smem[];
  const int chunks = (p.k / (4 * J)) / p.splits;  // chunks of 4 words in this block's run of K
  const int c0 = blockIdx.y * chunks;
  float4* xs = smem;
  float* xsum = reinterpret_cast<float*>(smem + M * J * chunks);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int outs = FOLD && p.glu ? R / 2 : R;  // outputs per warp
  int out0 = blockIdx.x * (kWarps * outs) + warp * outs;
  const int kw4 = p.k / (4 * J);  // chunks per row
  const uint4* wrow[R];
  RowScales rs[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = weight_row<R, FOLD>(p, out0, r);
    wrow[r] = reinterpret_cast<const uint4*>(p.w) + row * kw4 + c0;
    rs[r] = row_scales<FMT>(p, row);
  }
  // each lane takes U of its chunks per step, R rows each: U * R 128-bit loads in flight; the first step's
  // are issued before the activations are staged
  uint4 wb[U][R];
  auto load_batch = [&](int cb) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        wb[u][r] = cb + 32 * u < chunks ? __ldcs(wrow[r] + cb + 32 * u) : make_uint4(0, 0, 0, 0);
  };
  load_batch(lane);
  stage_x<FMT, M, T, FOLD>(p, c0, chunks, xs, xsum);
  __syncthreads();

  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;

  for (int cb = lane; cb < chunks; cb += 32 * U) {
    if (cb != lane) load_batch(cb);
    float2 sc[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        sc[u][r] = cb + 32 * u < chunks ? chunk_scales<FMT>(rs[r], c0 + cb + 32 * u, p.gshift) : make_float2(0.f, 0.f);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = cb + 32 * u;
      if (c >= chunks) break;
      const float4* xc = xs + c;
      // part[m][r][h]: h = 0 the chunk's (first block's) sum, h = 1 the second block's (NVFP4)
      float part[M][R][2];
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) part[m][r][0] = part[m][r][1] = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        float f[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t wv[4] = {wb[u][r].x, wb[u][r].y, wb[u][r].z, wb[u][r].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) f[r][e] = decode<FMT>(wv[e], wv[e] >> 8, j);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float4 xv = xc[(m * J + j) * chunks];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            part[m][r][0] = fmaf(f[r][0], xv.x, part[m][r][0]);
            part[m][r][0] = fmaf(f[r][1], xv.y, part[m][r][0]);
            if constexpr (FMT == kNvfp4) {
              part[m][r][1] = fmaf(f[r][2], xv.z, part[m][r][1]);
              part[m][r][1] = fmaf(f[r][3], xv.w, part[m][r][1]);
            } else {
              part[m][r][0] = fmaf(f[r][2], xv.z, part[m][r][0]);
              part[m][r][0] = fmaf(f[r][3], xv.w, part[m][r][0]);
            }
          }
        }
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float2 s = sc[u][r];
          if constexpr (FMT == kInt4H || FMT == kInt4B) {
            acc[m][r] = fmaf(s.x, part[m][r][0] - s.y * (xsum[m * chunks + c] * 1.7763568394002505e-15f),
                             acc[m][r]);  // s 2^49 (sum q x 2^-49 - z sum x 2^-49)
          } else if constexpr (FMT == kNvfp4) {
            acc[m][r] = fmaf(s.x, part[m][r][0], fmaf(s.y, part[m][r][1], acc[m][r]));
          } else if constexpr (FMT == kMxfp4) {
            acc[m][r] = fmaf(part[m][r][0] * 67108864.f, s.x, acc[m][r]);  // 2^26 then the E8M0 scale
          } else {
            acc[m][r] += part[m][r][0];
          }
        }
      }
    }
  }

  // lanes' sums: a fixed butterfly, the same order on every call
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[m][r] += __shfl_xor_sync(0xffffffffu, acc[m][r], o);
  {
    // the first output again, read afresh rather than kept live through the loop (registers of the one-row
    // kernels: see MinBlocks)
    unsigned bx, tx;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bx));
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx));
    out0 = (bx * kWarps + (tx >> 5)) * (FOLD && p.glu ? R / 2 : R);
  }
  if constexpr (FMT == kFp8) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = p.row_scale[weight_row<R, FOLD>(p, out0, r)] * 1048576.f;  // * 2^20
#pragma unroll
      for (int m = 0; m < M; ++m) acc[m][r] *= s;
    }
  }
  __shared__ float rstd[M];

  if (p.splits == 1) {
    if constexpr (FOLD) block_rstd<M, T, FOLD>(p, rstd);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r < outs && out0 + r < p.n_out)
#pragma unroll
          for (int m = 0; m < M; ++m)
            if (m < p.m_rows) store_out<T, FOLD>(p, m, out0 + r, acc[m][r], FOLD && p.glu ? acc[m][(r + R / 2) % R] : 0.f, FOLD ? rstd[m] : 1.f);
    }
    return;
  }
  // split K: partials by weight row, then the last block of this row tile sums them in split order
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (out_of<R, FOLD>(p, out0, r) < p.n_out)
#pragma unroll
        for (int m = 0; m < M; ++m)
          if (m < p.m_rows)
            p.partial[(static_cast<int64_t>(blockIdx.y) * p.m_rows + m) * p.n + weight_row<R, FOLD>(p, out0, r)] = acc[m][r];
  }
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) last = atomicAdd(p.tickets + blockIdx.x, 1) == p.splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if constexpr (FOLD) block_rstd<M, T, FOLD>(p, rstd);
  const int tile = kWarps * outs;
  for (int item = threadIdx.x; item < tile * p.m_rows; item += kThreads) {
    const int m = item / tile;
    const int out = blockIdx.x * tile + item % tile;
    if (out >= p.n_out) continue;
    float g = 0.f, u = 0.f;
    for (int sp = 0; sp < p.splits; ++sp) {
      const float* part = p.partial + (static_cast<int64_t>(sp) * p.m_rows + m) * p.n;
      g += __ldcg(part + out);
      if (FOLD && p.glu) u += __ldcg(part + p.n_out + out);
    }
    store_out<T, FOLD>(p, m, out, g, u, FOLD ? rstd[m] : 1.f);
  }
  if (threadIdx.x == 0) p.tickets[blockIdx.x] = 0;
}

}  // namespace onecat_qgemv
