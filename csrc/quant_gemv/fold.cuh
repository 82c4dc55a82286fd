// The packed-weight GEMV's activation loads and output rows, with the folded ops (quant_gemv.cuh header):
// x, or RMSNorm(x + residual) * norm_w, in; y, or SiLU(gate) * up, out.
#pragma once

#include "formats.cuh"

namespace onecat_qgemv {

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

}  // namespace onecat_qgemv
