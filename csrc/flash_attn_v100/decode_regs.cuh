// Paged decode / verify attention, register variant: K and V never pass through shared memory.
//
// The shared-memory variant (decode.cuh) stages every K/V chunk in shared memory and has each
// lane read a whole K row there plus, per head-dim pair, every packed query row (broadcast), so
// its shared-memory traffic is ~20x its HBM traffic and bounds it (sass-model v1). Here each
// thread owns E consecutive head-dim elements ("piece") of one key (E = 8; 16 for FP8 at <= 4
// rows): G = D/E lanes cover a key, 128/G keys are loaded per round, a 32-key chunk takes
// 32*G/128 rounds. The page lookup divides by the block size with FastDiv (multiply-high).
//   scores : the thread's E query elements of every packed row live in FP32 registers; the
//            G partial dot products are combined by a reduce-scatter butterfly (each step halves
//            the rows a lane carries, so ROWS rows cost ~ROWS shuffles, not ROWS*log2(G)).
//   softmax: as in decode.cuh (warp = row, lane = key, online max/sum in the exp2 domain).
//   P V    : the thread multiplies its own V piece (still in registers) by p[row][key] for every
//            row into an FP32 accumulator acc[ROWS][E]; the key slots are summed once per split.
// Shared memory holds only scores, softmax state and the end-of-split reduction. FP8 is widened
// exactly; the per-(slot, head) scales are applied in FP32 as in decode.cuh. Same split-KV
// contract (o_part / lse_part, merge_kernel) as the shared variant.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

namespace fa_v100 {

template <int D, int KV, int ROWS>
struct DecodeRegsCfg {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = 4;
  static constexpr int kChunk = 32;  // keys per chunk, as the shared variant (split sizes match)
  // head-dim elements per thread piece: 8 (16 bytes of FP16, 8 of FP8); 16 FP8 bytes where the
  // query slice and accumulator (2 x ROWS x 16 FP32 registers) still fit, halving per-load work
  static constexpr int kElems = KV != kKvF16 && ROWS <= 4 ? 16 : 8;
  static constexpr int kGroup = D / kElems;                // lanes per key
  static constexpr int kKeysPerRound = kThreads / kGroup;  // keys per round of loads
  static constexpr int kRounds = kChunk / kKeysPerRound;
  static_assert(kGroup <= 32 && 32 % kGroup == 0, "a key's lanes must sit in one warp");
  static constexpr int kSmemBytes = (ROWS * kChunk          // probabilities
                                     + 3 * ROWS              // running max, sum, rescale
                                     + kWarps * ROWS * D)    // end-of-split reduction
                                    * 4;
};

// One thread's piece of a cached row: E elements as stored, one 64- or 128-bit load. FP8 is
// widened exactly, but E4M3 comes out as value * 2^-8 (kRawScale = 2^8 is folded into the FP32
// scales, exact too, so results equal an FP16 multiply by 2^8 here).
template <int KV, int E>
struct RegPiece {
  static constexpr int kElemBytes = KV == kKvF16 ? 2 : 1;
  static constexpr int kWords = E * kElemBytes / 4;
  static_assert(kWords == 2 || kWords == 4, "a piece is one 64- or 128-bit load");
  static constexpr float kRawScale = KV == kKvE4M3 ? 256.f : 1.f;
  unsigned w[kWords];

  __device__ __forceinline__ void load(const void* base, long long elem) {
    const unsigned char* ptr = static_cast<const unsigned char*>(base) + elem * kElemBytes;
    if constexpr (kWords == 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(ptr));
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(ptr));
      w[0] = v.x, w[1] = v.y;
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0u;
  }
  __device__ __forceinline__ void to_float(float (&f)[E]) const {
    unsigned h[E / 2];
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      if constexpr (KV == kKvF16) {
        h[i] = w[i];
      } else {
        fp8x4_to_half4_raw<KV>(w[i], h[2 * i], h[2 * i + 1]);
      }
    }
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
};

// The first packed row whose full sum `reduce_scatter` leaves in this lane, and whether this lane
// is the one (of the copies made once a lane carries a single row) that writes it. Lane bits only.
template <int G, int R>
__device__ __forceinline__ int scatter_first_row(int lane, bool& writer) {
  int first = 0, n = R;
  writer = true;
#pragma unroll
  for (int o = G / 2; o >= 1; o >>= 1) {
    const bool upper = (lane & o) != 0;
    if (n > 1) {
      n /= 2;
      if (upper) first += n;
    } else if (upper) {
      writer = false;
    }
  }
  return first;
}

// x[r] holds this lane's partial sum of row r; afterwards x[i], i < max(1, R/G), holds the full
// sum over the G lanes of row scatter_first_row + i. Each halving step trades half the rows with
// the partner lane, so R rows cost about R shuffles instead of R * log2(G).
template <int G, int R>
__device__ __forceinline__ void reduce_scatter(float (&x)[R], int lane) {
  int n = R;
#pragma unroll
  for (int o = G / 2; o >= 1; o >>= 1) {
    const bool upper = (lane & o) != 0;
    if (n > 1) {
      const int h = n / 2;
#pragma unroll
      for (int i = 0; i < h; ++i) {
        const float send = upper ? x[i] : x[i + h];
        const float keep = upper ? x[i + h] : x[i];
        x[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
      n = h;
    } else {
      x[0] += __shfl_xor_sync(0xffffffffu, x[0], o);
    }
  }
}

template <int D, int KV, int ROWS>
__global__ void __launch_bounds__(128) decode_regs_kernel(const AttnParams p) {
  using Cfg = DecodeRegsCfg<D, KV, ROWS>;
  constexpr int NT = Cfg::kThreads, KC = Cfg::kChunk, G = Cfg::kGroup, KPR = Cfg::kKeysPerRound;
  constexpr int NR = Cfg::kRounds, E = Cfg::kElems, HELD = ROWS > G ? ROWS / G : 1;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* s_s = reinterpret_cast<float*>(smem_raw);  // [ROWS, KC]
  float* m_s = s_s + ROWS * KC;
  float* l_s = m_s + ROWS;
  float* a_s = l_s + ROWS;
  float* red = a_s + ROWS;  // [kWarps, ROWS, D]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gi = tid % G;     // which E-element piece of the row
  const int slot = tid / G;   // which key of the round
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
  if (start >= end) {
    if (tid < rows) p.lse_part[part_index(tid)] = neg_inf();
    return;
  }

  float q[ROWS][E];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int h = 0; h < E / 8; ++h) {
      RegPiece<kKvF16, 8> piece;
      piece.zero();
      if (r < rows) {
        const int token = q_start + r / group, head = kvh * group + r % group;
        piece.load(p.q, ((long long)token * p.num_heads + head) * D + gi * E + 8 * h);
      }
      float f[8];
      piece.to_float(f);
#pragma unroll
      for (int e = 0; e < 8; ++e) q[r][8 * h + e] = f[e];
    }
  }
  if (tid < ROWS) {
    m_s[tid] = neg_inf();
    l_s[tid] = 0.f;
    a_s[tid] = 1.f;
  }
  float acc[ROWS][E];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[r][e] = 0.f;

  // Rows this lane's scores land in, and the last key each may see (causal among new tokens).
  bool writer;
  const int my_row = scatter_first_row<G, ROWS>(lane, writer);
  int key_limit[HELD];
#pragma unroll
  for (int i = 0; i < HELD; ++i) key_limit[i] = p.causal ? ctx + (my_row + i) / group : 0x7fffffff;

  const FastDiv per_block(p.kv.block_size);
  const int* table = p.kv.block_tables + (long long)b * p.kv.block_table_stride;
  RegPiece<KV, E> kp[NR], vp[NR];
  float ksc[NR], vsc[NR];
  // Loads of one chunk's K (or V) pieces; keys past `end` read as zeros with scale 0.
  auto load = [&](RegPiece<KV, E>(&dst)[NR], float(&sc)[NR], const void* base, const float* scales, int n0) {
#pragma unroll
    for (int l = 0; l < NR; ++l) {
      const int key = n0 + l * KPR + slot;
      const bool valid = key < end;
      const long long row = valid ? kv_row_fast(p.kv, table, per_block, key, kvh) : 0;
      sc[l] = 1.f;
      if (valid) {
        dst[l].load(base, row * D + gi * E);
        if constexpr (KV != kKvF16) sc[l] = __ldg(scales + row);
      } else {
        dst[l].zero();
        if constexpr (KV != kKvF16) sc[l] = 0.f;
      }
    }
  };
  load(kp, ksc, p.kv.k, p.kv.k_scale, start);

  for (int n0 = start; n0 < end; n0 += KC) {
    load(vp, vsc, p.kv.v, p.kv.v_scale, n0);  // consumed after the softmax
    __syncthreads();  // previous chunk's probabilities fully read

    // Scores: partial dot products over this thread's E elements, reduce-scattered over G lanes.
#pragma unroll
    for (int l = 0; l < NR; ++l) {
      float kf[E];
      kp[l].to_float(kf);
      float x[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) d = fmaf(q[r][e], kf[e], d);
        x[r] = d;
      }
      reduce_scatter<G, ROWS>(x, lane);
      const int kl = l * KPR + slot, key = n0 + kl;
      const float kscale = ksc[l] * (RegPiece<KV, E>::kRawScale * p.scale_log2);
#pragma unroll
      for (int i = 0; i < HELD; ++i) {
        const int r = my_row + i;
        const bool ok = key < end && key <= key_limit[i];
        const float s = r < rows ? (ok ? x[i] * kscale : neg_inf()) : 0.f;
        if (writer) s_s[r * KC + kl] = s;
      }
    }
    if (n0 + KC < end) load(kp, ksc, p.kv.k, p.kv.k_scale, n0 + KC);  // prefetch the next chunk's K
    __syncthreads();

    // Online softmax per row (rows past `rows` keep probability 0).
    for (int r = warp; r < rows; r += NT / 32) {
      const float x = s_s[r * KC + lane];
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, warp_max(x));
      const float ref = safe_ref(m_new);
      const float pr = exp2f(x - ref);
      const float sum = warp_sum(pr);
      const float alpha = exp2f(m_old - ref);
      s_s[r * KC + lane] = pr;
      __syncwarp();
      if (lane == 0) {
        m_s[r] = m_new;
        l_s[r] = l_s[r] * alpha + sum;
        a_s[r] = alpha;
      }
    }
    __syncthreads();

    // acc = acc * alpha + P V over this thread's keys of the chunk.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float alpha = a_s[r];
#pragma unroll
      for (int e = 0; e < E; ++e) acc[r][e] *= alpha;
    }
#pragma unroll
    for (int l = 0; l < NR; ++l) {
      float vf[E];
      vp[l].to_float(vf);
      const int kl = l * KPR + slot;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float pr = s_s[r * KC + kl] * (vsc[l] * RegPiece<KV, E>::kRawScale);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[r][e] = fmaf(pr, vf[e], acc[r][e]);
      }
    }
  }

  // Sum the key slots: lanes of a warp by shuffle, the four warps through shared memory.
#pragma unroll
  for (int o = G; o < 32; o <<= 1)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int e = 0; e < E; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], o);
  if (lane < G) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float4* dst = reinterpret_cast<float4*>(red + (warp * ROWS + r) * D + gi * E);
#pragma unroll
      for (int v = 0; v < E / 4; ++v)
        dst[v] = make_float4(acc[r][4 * v], acc[r][4 * v + 1], acc[r][4 * v + 2], acc[r][4 * v + 3]);
    }
  }
  __syncthreads();
  for (int idx = tid; idx < ROWS * D; idx += NT) {
    const int r = idx / D, d = idx % D;
    if (r < rows) {
      const float l = l_s[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float o = red[idx] + red[ROWS * D + idx] + red[2 * ROWS * D + idx] + red[3 * ROWS * D + idx];
      p.o_part[part_index(r) * D + d] = o * inv;
    }
  }
  if (tid < rows) {
    const float l = l_s[tid];
    p.lse_part[part_index(tid)] = l > 0.f ? m_s[tid] + log2f(l) : neg_inf();
  }
}

}  // namespace fa_v100
