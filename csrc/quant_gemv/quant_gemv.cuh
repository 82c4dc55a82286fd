// Packed-weight GEMV for decode (1-8 activation rows): y = x @ dequant(W)^T, W kept packed in GPU memory.
//
// Formats (the layouts of engine/quant/*_layout.py, read without change; decoded in formats.cuh):
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

#include "fold.cuh"

namespace onecat_qgemv {

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