// Paged prefill attention on Volta tensor cores (HMMA.884 via mma.sync.m8n8k4).
//
// One CTA = 4 warps = one 64-query tile of one head of one sequence; each warp owns 16 query
// rows and walks the sequence's keys in tiles of BN (64/32/16 for D=64/128/256) with an FP32 online
// softmax, so the score matrix is never materialised. Handles causal and non-causal masks, GQA
// (kv_head = head / group), queries that continue a cached prefix (chunked prefill) and paged
// K/V in FP16 or FP8 (widened to FP16 while staging).
//
// Pipeline per key tile t (one shared buffer each for K and V, one register stage):
//   S = Q K_t^T                  | V_t loads (issued last iteration) in flight
//   sync; store V_t; issue K_{t+1} loads
//   sync; softmax(S) -> P (warp-private smem, FP16); O += P V_t | K_{t+1} loads in flight
//   store K_{t+1}; issue V_{t+1} loads; sync
// Warp tile mapping onto the four quad pairs: qp&1 picks rows 0-7 / 8-15 of the warp's 16,
// qp>>1 picks the left / right 8 columns of each 16-column group.
//
// Variants (template VARIANT; all stay buildable, docs/kernels.md has the sass-model figures):
//   0  the first kernel
//   1  page lookup by FastDiv (multiply-high) by every lane instead of an integer division by
//      the block size plus a shuffle: ~20 fewer integer instructions per K/V load
//   2  1, and for D=256 P shares the K tile (K is dead between the V store and the K_{t+1} store;
//      one more barrier per tile guards the reuse): 48 KB of shared memory, 2 CTAs per SM
//   3  2, and the V fragment addresses of O += P V split into a per-lane part computed once (the
//      swizzle of the 16-column group's low bits) and a per-k-step part shared by all D/16
//      column groups, instead of a swizzle per (k-step, column group)
#pragma once
#include "common.cuh"
#include "hmma.cuh"
#include "kv_load.cuh"

namespace fa_v100 {

template <int D, int VARIANT = 0>
struct PrefillCfg {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = 4;
  static constexpr int kBM = 64;                 // query rows per CTA (16 per warp)
  // Keys per tile: sized so that registers (O is D/2 FP32 per lane) and shared memory leave
  // two CTAs per V100 SM for D<=128, with no spills at D=256.
  static constexpr int kBN = D == 64 ? 64 : (D == 128 ? 32 : 16);
  static constexpr int kUnroll = 2;  // partial unroll of the k loops bounds fragment hoisting
  static constexpr int kChunks = D / 4;           // 8-byte chunks per FP16 row
  static constexpr int kPStride = kBN + 4;        // halfs per P row (padding: conflict-free A reads)
  static constexpr bool kPInK = VARIANT >= 2 && D == 256;  // P lives in the K tile
  static_assert(!kPInK || kWarps * 16 * kPStride <= kBN * D, "P must fit in the K tile");
  static constexpr int kSmemBytes = (kBM * D + 2 * kBN * D + (kPInK ? 0 : kWarps * 16 * kPStride)) * 2;
};

template <int D, int KV, int VARIANT = 0>
__global__ void __launch_bounds__(128) prefill_kernel(const AttnParams p) {
  using Cfg = PrefillCfg<D, VARIANT>;
  constexpr int BM = Cfg::kBM, BN = Cfg::kBN, CH = Cfg::kChunks, PS = Cfg::kPStride, NT = Cfg::kThreads;
  constexpr int NJ_S = BN / 16;  // 16-column groups of the score tile
  constexpr int NJ_O = D / 16;   // 16-column groups of the output tile

  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint2* q_s = reinterpret_cast<uint2*>(smem_raw);  // [BM, D] swizzled
  uint2* k_s = q_s + BM * CH;                        // [BN, D] swizzled
  uint2* v_s = k_s + BN * CH;                        // [BN, D] swizzled
  __half* p_all = reinterpret_cast<__half*>(Cfg::kPInK ? k_s : v_s + BN * CH);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x / p.q_tiles_per_seq;
  const int m0 = (blockIdx.x % p.q_tiles_per_seq) * BM;
  const int head = blockIdx.y;
  const int q_start = p.query_start_loc[b];
  const int q_len = p.query_start_loc[b + 1] - q_start;
  if (m0 >= q_len) return;
  const int seq_len = p.seq_lens[b];
  const int ctx = seq_len - q_len;  // keys cached before this step's queries
  const int kvh = head / (p.num_heads / p.kv.num_kv_heads);
  const int n_end = p.causal ? min(seq_len, ctx + min(q_len, m0 + BM)) : seq_len;
  const int n_tiles = (n_end + BN - 1) / BN;

  // Q tile -> shared (rows past the sequence's queries are zero).
  {
    constexpr int kPieces = BM * (D / 8) / NT;
#pragma unroll
    for (int l = 0; l < kPieces; ++l) {
      const int idx = tid + l * NT;
      const int r = idx / (D / 8), c = idx % (D / 8);
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (m0 + r < q_len)
        v = __ldg(reinterpret_cast<const uint4*>(p.q + ((long long)(q_start + m0 + r) * p.num_heads + head) * D + c * 8));
      q_s[swizzle8<CH>(r, 2 * c)] = make_uint2(v.x, v.y);
      q_s[swizzle8<CH>(r, 2 * c + 1)] = make_uint2(v.z, v.w);
    }
  }

  KvTileRegs<D, BN, NT, KV> stage;
  const FastDiv per_block(p.kv.block_size);
  const int* table = p.kv.block_tables + (long long)b * p.kv.block_table_stride;
  auto load_k = [&](int n0) {
    if constexpr (VARIANT >= 1) {
      stage.load_fast(p.kv.k, p.kv.k_scale, p.kv, table, per_block, kvh, n0, seq_len, tid);
    } else {
      stage.load(p.kv.k, p.kv.k_scale, p.kv, b, kvh, n0, seq_len, tid);
    }
  };
  auto load_v = [&](int n0) {
    if constexpr (VARIANT >= 1) {
      stage.load_fast(p.kv.v, p.kv.v_scale, p.kv, table, per_block, kvh, n0, seq_len, tid);
    } else {
      stage.load(p.kv.v, p.kv.v_scale, p.kv, b, kvh, n0, seq_len, tid);
    }
  };
  load_k(0);
  stage.store_swizzled(k_s, tid);
  load_v(0);
  __syncthreads();

  const QuadPairLane ql(lane);
  const int rb = ql.qp & 1, cb = ql.qp >> 1;
  int v_lane_off[4];  // variant 3: per-lane part of the swizzled V fragment offsets
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) v_lane_off[jj] = 4 * (jj ^ ql.low4);
  const int wrow = warp * 16;  // first row of this warp within the CTA tile
  __half* p_s = p_all + warp * 16 * PS;

  // The two query rows (within the warp tile) this lane accumulates: i&2 == 0 and == 2. Rows
  // past q_len compute on zero queries (finite scores) and are simply not stored.
  int q_pos[2];
  bool row_ok[2];
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int r = m0 + wrow + rb * 8 + acc_row(lane, 2 * ri);
    row_ok[ri] = r < q_len;
    q_pos[ri] = ctx + r;
  }

  float o[NJ_O][8];
#pragma unroll
  for (int j = 0; j < NJ_O; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[j][i] = 0.f;
  float m_run[2] = {neg_inf(), neg_inf()};
  float l_part[2] = {0.f, 0.f};  // this lane's share of the row sums

  for (int t = 0; t < n_tiles; ++t) {
    const int n0 = t * BN;

    // S = Q K^T for this warp's 16 rows x BN keys.
    float s[NJ_S][8];
#pragma unroll
    for (int j = 0; j < NJ_S; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) s[j][i] = 0.f;
#pragma unroll Cfg::kUnroll
    for (int kk = 0; kk < D / 4; ++kk) {
      const uint2 a = q_s[swizzle8<CH>(wrow + rb * 8 + ql.frag_row, kk)];
#pragma unroll
      for (int j = 0; j < NJ_S; ++j) {
        const uint2 bk = k_s[swizzle8<CH>(16 * j + 8 * cb + ql.frag_row, kk)];
        hmma884_row_col(s[j], a, bk);
      }
    }

    __syncthreads();  // every warp is done with k_s and with last tile's v_s
    stage.store_swizzled(v_s, tid);
    if (t + 1 < n_tiles) load_k(n0 + BN);
    __syncthreads();  // v_s ready

    // Online softmax in the exp2 domain, FP32. Only tiles that cross the sequence end or the
    // causal diagonal of this CTA's first query need the per-element mask.
    const bool need_mask = n0 + BN > seq_len || (p.causal && n0 + BN - 1 > ctx + m0);
    float m_new[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int j = 0; j < NJ_S; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int ri = (i >> 1) & 1;
        float x = s[j][i] * p.scale_log2;
        if (need_mask) {
          const int key = n0 + 16 * j + 8 * cb + acc_col(lane, i);
          if (key >= seq_len || (p.causal && key > q_pos[ri])) x = neg_inf();
        }
        s[j][i] = x;
        m_new[ri] = fmaxf(m_new[ri], x);
      }
    float ref[2], alpha[2];
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      m_new[ri] = fmaxf(m_new[ri], __shfl_xor_sync(0xffffffffu, m_new[ri], 2));
      m_new[ri] = fmaxf(m_new[ri], __shfl_xor_sync(0xffffffffu, m_new[ri], 8));
      ref[ri] = safe_ref(m_new[ri]);
      alpha[ri] = exp2f(m_run[ri] - ref[ri]);
      m_run[ri] = m_new[ri];
      l_part[ri] *= alpha[ri];
    }
#pragma unroll
    for (int j = 0; j < NJ_O; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) o[j][i] *= alpha[(i >> 1) & 1];
#pragma unroll
    for (int j = 0; j < NJ_S; ++j)
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const int ri = (i >> 1) & 1;
        const float p0 = exp2f(s[j][i] - ref[ri]);
        const float p1 = exp2f(s[j][i + 1] - ref[ri]);
        l_part[ri] += p0 + p1;
        const int r = rb * 8 + acc_row(lane, i);
        const int c = 16 * j + 8 * cb + acc_col(lane, i);
        *reinterpret_cast<__half2*>(p_s + r * PS + c) = __floats2half2_rn(p0, p1);
      }
    __syncwarp();

    // O += P V for this warp's 16 rows x D.
#pragma unroll Cfg::kUnroll
    for (int kk = 0; kk < BN / 4; ++kk) {
      const uint2 a = *reinterpret_cast<const uint2*>(p_s + (rb * 8 + ql.frag_row) * PS + 4 * kk);
      if constexpr (VARIANT >= 3) {
        // swizzle8(4kk + low4, 4j + c0) = (4kk + low4) * CH + 16 (j >> 2) + 4 ((j & 3) ^ low4) + (c0 ^ (kk & 3))
        const uint2* vrow = v_s + (4 * kk + ql.low4) * CH + ((2 * cb + ql.high) ^ (kk & 3));
#pragma unroll
        for (int j = 0; j < NJ_O; ++j) hmma884_row_row(o[j], a, vrow[16 * (j >> 2) + v_lane_off[j & 3]]);
      } else {
#pragma unroll
        for (int j = 0; j < NJ_O; ++j) {
          const uint2 bv = v_s[swizzle8<CH>(4 * kk + ql.low4, 4 * j + 2 * cb + ql.high)];
          hmma884_row_row(o[j], a, bv);
        }
      }
    }

    if (t + 1 < n_tiles) {
      if constexpr (Cfg::kPInK) __syncthreads();  // every warp is done reading its P from k_s
      stage.store_swizzled(k_s, tid);  // all warps passed the QK of this tile (first sync)
      load_v(n0 + BN);
    }
    __syncthreads();  // k_s ready for the next tile; p_s and v_s reads of this tile done
  }

  // Normalise and write FP16 output.
  float inv[2];
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    float l = l_part[ri];
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    l += __shfl_xor_sync(0xffffffffu, l, 8);
    inv[ri] = l > 0.f ? 1.f / l : 0.f;
  }
#pragma unroll
  for (int j = 0; j < NJ_O; ++j)
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const int ri = (i >> 1) & 1;
      if (!row_ok[ri]) continue;
      const int r = m0 + wrow + rb * 8 + acc_row(lane, i);
      const int d = 16 * j + 8 * cb + acc_col(lane, i);
      *reinterpret_cast<__half2*>(p.out + ((long long)(q_start + r) * p.num_heads + head) * D + d) =
          __floats2half2_rn(o[j][i] * inv[ri], o[j][i + 1] * inv[ri]);
    }
}

}  // namespace fa_v100
