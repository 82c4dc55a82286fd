// Paged decode / verify attention with split-KV and an FP32 merge.
//
// One CTA = (split of the key range, kv head, sequence). All query rows that read that kv head
// are packed together (GQA head packing): rows r = qi * group + g for the sequence's q_len new
// tokens (q_len = 1 for decode, k+1 for speculative verify, causal among them), so each K/V
// byte is fetched once per kv head. Keys stream in chunks of 32 through 128-bit loads
// (8 FP16 or 16 FP8 values), prefetched into registers one chunk ahead; FP8 is widened
// exactly to FP16 in shared memory and its per-(slot, head) scales are applied in FP32.
// Decode is bandwidth-bound, so the math runs on the FP32 pipes, not tensor cores.
//   phase 1: scores   lane = key, warp = row group, K row read from padded smem
//   phase 2: softmax  warp = row, lane = key; online max/sum in the exp2 domain
//   phase 3: P V      thread = output column(s), all packed rows in registers
// Each split writes a normalised partial output and its log2-sum-exp2; merge_kernel combines.
#pragma once
#include "common.cuh"
#include "kv_load.cuh"

namespace fa_v100 {

// Packed-row capacities: a small bucket for plain decode (q_len * group <= 8) that keeps shared
// memory and registers low for occupancy, and a large one for GQA-heavy or verify steps.
constexpr int kDecodeSmallRows = 8;
template <int D>
struct DecodeLargeRows {
  static constexpr int value = D == 256 ? 16 : 32;
};

template <int D, int ROWS>
struct DecodeCfg {
  static constexpr int kThreads = 128;
  static constexpr int kChunk = 32;     // keys per chunk (one per lane in phase 1)
  static constexpr int kMaxRows = ROWS;  // packed rows: q_len * group
  static constexpr int kKStride = D + 2;            // halfs; odd word stride -> no bank conflicts
  static constexpr int kColsPerThread = D >= 128 ? D / 128 : 1;
  static constexpr int kRowSplit = D >= 128 ? 1 : 128 / D;
  static constexpr int kRowsPerThread = kMaxRows / kRowSplit;
  static constexpr int kSmemBytes = kMaxRows * D * 4            // Q (FP32)
                                    + kChunk * kKStride * 2     // K chunk
                                    + kChunk * D * 2            // V chunk
                                    + kMaxRows * kChunk * 4     // scores / probabilities
                                    + 2 * kChunk * 4            // K and V scales
                                    + 3 * kMaxRows * 4;         // running max, sum, rescale
};

template <int D, int KV, int ROWS>
__global__ void __launch_bounds__(128) decode_kernel(const AttnParams p) {
  using Cfg = DecodeCfg<D, ROWS>;
  constexpr int NT = Cfg::kThreads, KC = Cfg::kChunk, RMAX = Cfg::kMaxRows, KS = Cfg::kKStride;
  constexpr int ROWS_P1 = RMAX / (NT / 32);  // rows per thread in phase 1

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* q_s = reinterpret_cast<float*>(smem_raw);  // [RMAX, D]
  __half* k_s = reinterpret_cast<__half*>(q_s + RMAX * D);  // [KC, KS]
  __half* v_s = k_s + KC * KS;                              // [KC, D]
  float* s_s = reinterpret_cast<float*>(v_s + KC * D);      // [RMAX, KC]
  float* ks_s = s_s + RMAX * KC;
  float* vs_s = ks_s + KC;
  float* m_s = vs_s + KC;
  float* l_s = m_s + RMAX;
  float* a_s = l_s + RMAX;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int group = p.num_heads / p.kv.num_kv_heads;
  const int q_start = p.query_start_loc[b];
  const int q_len = p.query_start_loc[b + 1] - q_start;
  const int rows = q_len * group;
  const int seq_len = p.seq_lens[b];
  const int ctx = seq_len - q_len;
  const int start = split * p.split_len;
  const int end = min(seq_len, start + p.split_len);

  auto part_index = [&](int r) -> long long {
    const int token = q_start + r / group, head = kvh * group + r % group;
    return ((long long)token * p.num_heads + head) * p.num_splits + split;
  };
  if (start >= end) {  // this split holds no keys of this sequence
    if (tid < rows) p.lse_part[part_index(tid)] = neg_inf();
    return;
  }

  for (int idx = tid; idx < RMAX * D / 2; idx += NT) {
    const int r = idx / (D / 2), d2 = idx % (D / 2);
    float2 qv = make_float2(0.f, 0.f);
    if (r < rows) {
      const int token = q_start + r / group, head = kvh * group + r % group;
      qv = __half22float2(reinterpret_cast<const __half2*>(p.q + ((long long)token * p.num_heads + head) * D)[d2]);
    }
    reinterpret_cast<float2*>(q_s)[idx] = qv;
  }
  if (tid < RMAX) {
    m_s[tid] = neg_inf();
    l_s[tid] = 0.f;
    a_s[tid] = 1.f;
  }

  KvChunkRegs<D, KC, NT, KV> stage;
  stage.load(p, b, kvh, start, end, tid);

  float acc[Cfg::kColsPerThread][Cfg::kRowsPerThread];
#pragma unroll
  for (int c = 0; c < Cfg::kColsPerThread; ++c)
#pragma unroll
    for (int rr = 0; rr < Cfg::kRowsPerThread; ++rr) acc[c][rr] = 0.f;
  const int col0 = D >= 128 ? tid : tid % D;
  const int row0 = D >= 128 ? 0 : tid / D;

  for (int n0 = start; n0 < end; n0 += KC) {
    __syncthreads();  // previous chunk fully consumed
    stage.store(k_s, KS, v_s, ks_s, vs_s, tid);
    if (n0 + KC < end) stage.load(p, b, kvh, n0 + KC, end, tid);  // prefetch next chunk
    __syncthreads();

    // Phase 1: scores of key `lane` against rows warp, warp+4, ...
    {
      float dot[ROWS_P1];
#pragma unroll
      for (int i = 0; i < ROWS_P1; ++i) dot[i] = 0.f;
      const __half2* krow = reinterpret_cast<const __half2*>(k_s + lane * KS);
#pragma unroll 8
      for (int d2 = 0; d2 < D / 2; ++d2) {
        const float2 kf = __half22float2(krow[d2]);
#pragma unroll
        for (int i = 0; i < ROWS_P1; ++i) {
          const float2 qf = reinterpret_cast<const float2*>(q_s + (warp + 4 * i) * D)[d2];
          dot[i] = fmaf(qf.x, kf.x, fmaf(qf.y, kf.y, dot[i]));
        }
      }
      const int key = n0 + lane;
      const float kscale = ks_s[lane] * p.scale_log2;
#pragma unroll
      for (int i = 0; i < ROWS_P1; ++i) {
        const int r = warp + 4 * i;
        if (r < rows) {
          const int pos = ctx + r / group;
          const bool ok = key < end && (!p.causal || key <= pos);
          s_s[r * KC + lane] = ok ? dot[i] * kscale : neg_inf();
        }
      }
    }
    __syncthreads();

    // Phase 2: online softmax per row; probabilities pre-multiplied by the V scales.
    for (int r = warp; r < rows; r += NT / 32) {
      const float x = s_s[r * KC + lane];
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, warp_max(x));
      const float ref = safe_ref(m_new);
      const float pr = exp2f(x - ref);
      const float sum = warp_sum(pr);
      const float alpha = exp2f(m_old - ref);
      s_s[r * KC + lane] = pr * vs_s[lane];
      __syncwarp();
      if (lane == 0) {
        m_s[r] = m_new;
        l_s[r] = l_s[r] * alpha + sum;
        a_s[r] = alpha;
      }
    }
    __syncthreads();

    // Phase 3: acc = acc * alpha + P V over this chunk.
#pragma unroll
    for (int rr = 0; rr < Cfg::kRowsPerThread; ++rr) {
      const int r = row0 + rr * Cfg::kRowSplit;
      if (r < rows) {
        const float alpha = a_s[r];
#pragma unroll
        for (int c = 0; c < Cfg::kColsPerThread; ++c) acc[c][rr] *= alpha;
      }
    }
#pragma unroll
    for (int k4 = 0; k4 < KC / 4; ++k4) {
      float vf[Cfg::kColsPerThread][4];
#pragma unroll
      for (int c = 0; c < Cfg::kColsPerThread; ++c)
#pragma unroll
        for (int u = 0; u < 4; ++u) vf[c][u] = __half2float(v_s[(4 * k4 + u) * D + col0 + 128 * c]);
#pragma unroll
      for (int rr = 0; rr < Cfg::kRowsPerThread; ++rr) {
        const int r = row0 + rr * Cfg::kRowSplit;
        if (r < rows) {
          const float4 pr = reinterpret_cast<const float4*>(s_s + r * KC)[k4];
#pragma unroll
          for (int c = 0; c < Cfg::kColsPerThread; ++c)
            acc[c][rr] = fmaf(pr.x, vf[c][0], fmaf(pr.y, vf[c][1], fmaf(pr.z, vf[c][2], fmaf(pr.w, vf[c][3], acc[c][rr]))));
        }
      }
    }
  }

  // Normalised partial output and its log2-sum-exp2.
#pragma unroll
  for (int rr = 0; rr < Cfg::kRowsPerThread; ++rr) {
    const int r = row0 + rr * Cfg::kRowSplit;
    if (r < rows) {
      const float l = l_s[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      float* dst = p.o_part + part_index(r) * D;
#pragma unroll
      for (int c = 0; c < Cfg::kColsPerThread; ++c) dst[col0 + 128 * c] = acc[c][rr] * inv;
    }
  }
  if (tid < rows) {
    const float l = l_s[tid];
    p.lse_part[part_index(tid)] = l > 0.f ? m_s[tid] + log2f(l) : neg_inf();
  }
}

// out[row] = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse); one CTA per (token, head).
template <int D>
__global__ void __launch_bounds__(128) merge_kernel(const AttnParams p) {
  const long long row = blockIdx.x;
  const int S = p.num_splits;
  const float* lse = p.lse_part + row * S;
  float mx = neg_inf();
  for (int s = 0; s < S; ++s) mx = fmaxf(mx, lse[s]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int s = 0; s < S; ++s) {
      const float ls = lse[s];
      if (ls == neg_inf()) continue;
      const float w = exp2f(ls - mx);
      num = fmaf(w, p.o_part[(row * S + s) * D + d], num);
      den += w;
    }
    p.out[row * D + d] = __float2half_rn(den > 0.f ? num / den : 0.f);
  }
}

}  // namespace fa_v100
