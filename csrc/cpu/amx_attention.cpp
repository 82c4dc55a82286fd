// The prompt rows' attention on AMX bfloat16 tiles (EngineArgs.cpu_prompt_matmul "bf16" with a bfloat16 KV
// cache), for paged_attention.cpp's runs of up to 16 consecutive prompt tokens of one sequence.
//
// A run's queries are rounded to bfloat16 (ties to even) as the rows of an A tile; the keys come in chunks of 32
// at absolute positions (0-31, 32-63, ...), each chunk's K rows transposed into B tiles once for the run's G
// query heads. Per head: the chunk's scores (two C tiles, summed over the head dim by TDPBF16PS), scaled and
// masked per token (keys past its position), an online-softmax step in float32, the weights rounded to
// bfloat16 as the next A tile, the chunk's values (interleaved by key pairs into B tiles) summed by it into
// C tiles, and the running sum rescaled and added to in float32. A token's row in every tile product is summed
// on its own, and the chunks it walks are fixed by its position, so its result depends on its query and its keys
// alone: not on the run, the batch or the chunk of the prompt that computes it (prefix cache hits and chunked
// prefill give the same bits). It is not the bits of the float32 kernel (paged_attention.cpp), which decoded and
// verified rows keep: the exception cpu_prompt_matmul "bf16" opts into.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "fused_ops.h"

namespace {

constexpr int64_t kRows = 16;  // tokens of a run: the rows of an A tile
constexpr int64_t kKeys = 32;  // keys of a chunk: one K step of TDPBF16PS over the weights
constexpr int64_t kMaxDim = 256;

#ifdef ONECAT_AMX
using amx_tiles::kTileBytes;

// SLEEF's 16-lane exp (1-ulp), which torch's CPU library carries; sleef.h declares it only in AVX512 builds.
extern "C" __m512 Sleef_expf16_u10(__m512);
using Vec = at::vec::Vectorized<float>;

// One KV head's chunk of keys as B tiles: for the scores, [dim / 32][2 halves of 16 keys][16 pairs of dims]
// [16 keys][2] (a key's dims 2i, 2i + 1 side by side: the tile's row i, the key's column); for the values,
// [dim / 16][16 pairs of keys][16 dims][2] (keys 2i, 2i + 1 side by side). Keys past the run's last position
// are zeros (the cache holds anything there; a zero value times a zero weight keeps the sums finite).
struct ChunkTiles {
  alignas(64) uint16_t k[kMaxDim / 32][2][kTileBytes / 2];
  alignas(64) uint16_t v[kMaxDim / 16][kTileBytes / 2];
};

// Sixteen rows of 16 dwords (rows[n] + offset) transposed into a tile: its row i holds dword i of each row.
AMX_TARGET void transpose_dwords(const uint32_t* const* rows, int64_t offset, uint32_t* tile) {
  __m512i r[16], t[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(rows[n] + offset);
  for (int n = 0; n < 16; n += 2) {
    t[n] = _mm512_unpacklo_epi32(r[n], r[n + 1]);
    t[n + 1] = _mm512_unpackhi_epi32(r[n], r[n + 1]);
  }
  // r[4a + b]: in each 128-bit lane L, dword 4L + b of rows 4a .. 4a + 3
  for (int a = 0; a < 16; a += 4) {
    r[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    r[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    r[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    r[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int b = 0; b < 4; ++b) {  // the 4 x 4 lanes of r[b], r[4 + b], r[8 + b], r[12 + b] transposed
    const __m512i x0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x44), x1 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xEE);
    _mm512_store_si512(tile + (0 + b) * 16, _mm512_shuffle_i32x4(x0, y0, 0x88));
    _mm512_store_si512(tile + (4 + b) * 16, _mm512_shuffle_i32x4(x0, y0, 0xDD));
    _mm512_store_si512(tile + (8 + b) * 16, _mm512_shuffle_i32x4(x1, y1, 0x88));
    _mm512_store_si512(tile + (12 + b) * 16, _mm512_shuffle_i32x4(x1, y1, 0xDD));
  }
}

AMX_TARGET void load_chunk(const uint16_t* const* k_rows, const uint16_t* const* v_rows, int64_t dim, ChunkTiles& t) {
  const auto* keys = reinterpret_cast<const uint32_t* const*>(k_rows);
  for (int64_t dc = 0; dc < dim / 32; ++dc)
    for (int half = 0; half < 2; ++half)
      transpose_dwords(keys + half * 16, dc * 16, reinterpret_cast<uint32_t*>(t.k[dc][half]));
  // a value tile's row i: the 16 dims of keys 2i and 2i + 1, interleaved
  const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i even = _mm512_loadu_si512(v_rows[2 * i] + d), odd = _mm512_loadu_si512(v_rows[2 * i + 1] + d);
      _mm512_store_si512(t.v[d / 16] + i * 32, _mm512_permutex2var_epi16(even, first, odd));
      _mm512_store_si512(t.v[d / 16 + 1] + i * 32, _mm512_permutex2var_epi16(even, second, odd));
    }
}

// scores[16][32] = q (16 rows of `dim` bf16) x the chunk's keys, on C tiles 0 and 1.
AMX_TARGET void chunk_scores(const uint16_t* q, int64_t dim, const ChunkTiles& t, float* scores) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t dc = 0; dc < dim / 32; ++dc) {
    _tile_loadd(4, q + dc * 32, dim * 2);
    _tile_loadd(6, t.k[dc][0], 64);
    _tile_loadd(7, t.k[dc][1], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, scores, kKeys * 4);
  _tile_stored(1, scores + 16, kKeys * 4);
}

// out[16][dim] = weights (16 rows of 32 bf16) x the chunk's values, four 16-dim C tiles at a time.
AMX_TARGET void chunk_values(const uint16_t* weights, int64_t dim, const ChunkTiles& t, float* out) {
  _tile_loadd(4, weights, 64);
  for (int64_t d0 = 0; d0 < dim / 16; d0 += 4) {
    const int64_t blocks = std::min<int64_t>(4, dim / 16 - d0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(6, t.v[d0], 64);
    _tile_dpbf16ps(0, 4, 6);
    if (blocks > 1) {
      _tile_loadd(7, t.v[d0 + 1], 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (blocks > 2) {
      _tile_loadd(6, t.v[d0 + 2], 64);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (blocks > 3) {
      _tile_loadd(7, t.v[d0 + 3], 64);
      _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, out + d0 * 16, dim * 4);
    if (blocks > 1) _tile_stored(1, out + (d0 + 1) * 16, dim * 4);
    if (blocks > 2) _tile_stored(2, out + (d0 + 2) * 16, dim * 4);
    if (blocks > 3) _tile_stored(3, out + (d0 + 3) * 16, dim * 4);
  }
}

// One token's online-softmax step over the chunk's first n keys (1 <= n <= 32): its scores scaled, its running
// maximum and total updated, its weights (zeros past n) rounded into `weights`; returns the factor its sum is
// rescaled by. Sixteen keys a register, SLEEF's exp (1-ulp), the total summed over the 32 lanes in a fixed tree.
AMX_TARGET float softmax_row(const float* scores, int64_t n, float scale, float& m, float& l, uint16_t* weights) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const __mmask16 low = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 high = n >= 32 ? 0xFFFF : n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0;
  const __m512 scale_v = _mm512_set1_ps(scale), none = _mm512_set1_ps(kNegInf);
  const __m512 x0 = _mm512_mask_mul_ps(none, low, _mm512_loadu_ps(scores), scale_v);
  const __m512 x1 = _mm512_mask_mul_ps(none, high, _mm512_loadu_ps(scores + 16), scale_v);
  const float top = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
  const float factor = m == kNegInf ? 0.0f : std::exp(m - top);
  const __m512 top_v = _mm512_set1_ps(top);
  const __m512 p0 = _mm512_maskz_mov_ps(low, Sleef_expf16_u10(_mm512_sub_ps(x0, top_v)));
  const __m512 p1 = _mm512_maskz_mov_ps(high, Sleef_expf16_u10(_mm512_sub_ps(x1, top_v)));
  l = l * factor + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
  m = top;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights), (__m256i)_mm512_cvtneps_pbh(p0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + 16), (__m256i)_mm512_cvtneps_pbh(p1));
  return factor;
}
#endif

}  // namespace

namespace onecat_cpu {

bool amx_attention_available() {
#ifdef ONECAT_AMX
  return amx_tiles::permitted();
#else
  return false;
#endif
}

template <typename T>
void amx_attend_run(const T* q, int64_t q_token_stride, int64_t q_head_stride, T* out, int64_t out_token_stride,
                    int64_t out_head_stride, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                    int64_t block_size, int64_t kv_heads, int64_t dim, const int32_t* table, int64_t p0,
                    int64_t count, int64_t group, int64_t h0, int64_t h1, float scale) {
  TORCH_CHECK(count >= 1 && count <= kRows && dim % 32 == 0 && dim <= kMaxDim,
              "amx_attend_run: runs of 1-16 tokens, head dim a multiple of 32 up to 256");
#ifdef ONECAT_AMX
  TORCH_CHECK(amx_tiles::permitted(), "amx_attend_run: this CPU (or its kernel) grants no AMX-BF16 tiles");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t lanes = group * kRows;
  std::vector<uint16_t> qb(group * kRows * dim, 0);  // [g][token][dim], rows past the run zero
  std::vector<float> acc(group * kRows * dim, 0.0f), m(lanes, kNegInf), l(lanes, 0.0f);
  alignas(64) float scores[kRows * kKeys], values[kRows * kMaxDim], row[kMaxDim];
  alignas(64) uint16_t weights[kRows * kKeys];
  static const uint16_t zeros[kMaxDim] = {};
  const uint16_t* k_rows[kKeys];
  const uint16_t* v_rows[kKeys];
  ChunkTiles tiles;
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache);
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache);
  const int64_t last = p0 + count - 1;
  amx_tiles::configure();
  for (int64_t h = h0; h < h1; ++h) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.0f);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t t = 0; t < count; ++t) {
        const T* src = q + t * q_token_stride + (h * group + g) * q_head_stride;
        for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(src[d]);
        amx_tiles::round_to_bf16(row, dim, qb.data() + (g * kRows + t) * dim);
      }
    for (int64_t c0 = 0; c0 <= last; c0 += kKeys) {
      for (int64_t j = 0; j < kKeys; ++j) {
        const int64_t p = c0 + j;
        const int64_t index = p <= last ? (table[p / block_size] * block_size + p % block_size) * kv_heads + h : -1;
        k_rows[j] = index < 0 ? zeros : kc + index * dim;
        v_rows[j] = index < 0 ? zeros : vc + index * dim;
      }
      load_chunk(k_rows, v_rows, dim, tiles);
      for (int64_t g = 0; g < group; ++g) {
        chunk_scores(qb.data() + g * kRows * dim, dim, tiles, scores);
        float factor[kRows];
        for (int64_t t = 0; t < kRows; ++t) {
          const int64_t n = t < count ? std::min(kKeys, p0 + t + 1 - c0) : 0;  // the keys this token sees
          if (n <= 0) {  // before its first key: no weight, its sums unchanged
            std::memset(weights + t * kKeys, 0, kKeys * sizeof(uint16_t));
            factor[t] = 1.0f;
            continue;
          }
          const int64_t i = g * kRows + t;
          factor[t] = softmax_row(scores + t * kKeys, n, scale, m[i], l[i], weights + t * kKeys);
        }
        chunk_values(weights, dim, tiles, values);
        for (int64_t t = 0; t < count; ++t) {
          float* a = acc.data() + (g * kRows + t) * dim;
          const float* o = values + t * dim;
          for (int64_t d = 0; d < dim; d += Vec::size())
            (Vec::loadu(a + d) * Vec(factor[t]) + Vec::loadu(o + d)).store(a + d);
        }
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t t = 0; t < count; ++t) {
        const int64_t i = g * kRows + t;
        T* dst = out + t * out_token_stride + (h * group + g) * out_head_stride;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[i * dim + d] / l[i]);
      }
  }
  amx_tiles::release();
#endif
}

template void amx_attend_run<float>(const float*, int64_t, int64_t, float*, int64_t, int64_t, const at::BFloat16*,
                                    const at::BFloat16*, int64_t, int64_t, int64_t, const int32_t*, int64_t, int64_t,
                                    int64_t, int64_t, int64_t, float);
template void amx_attend_run<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, at::BFloat16*, int64_t, int64_t,
                                           const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, int64_t,
                                           const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float);

}  // namespace onecat_cpu
