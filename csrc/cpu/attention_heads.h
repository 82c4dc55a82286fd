// The paged attention's inner loops (paged_attention.cpp) for the G query heads that share a KV head: one chunk of
// kChunk keys scored for all G, their online-softmax step (the G heads' dependent chains interleaved), and the
// chunk's values summed into all G. Each head's arithmetic is exactly what it would be alone (one fused
// multiply-add chain per key over the head dim, eight lanes, then a fixed horizontal-add tree; one chain per value
// lane, key by key): the heads share the rows, read and widened once for all G instead of once per head, so a
// head's bits never depend on its neighbours.
//
// Two builds of each, the same bits: 256-bit registers (AVX2), and 512-bit ones where the CPU has AVX512 (F, BW,
// DQ, VL), which carry two keys' eight-lane chains side by side for the scores and sixteen value lanes for the
// values: the same operations on every lane, twice as many a register.
#pragma once

#include <cstdint>

namespace attention_heads {
constexpr int64_t kChunk = 16;  // keys per softmax step
}  // namespace attention_heads

#if defined(CPU_CAPABILITY_AVX2)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>

namespace attention_heads {

constexpr int kMaxGroup = 8;  // query heads per KV head these loops take; more go head by head

#define ONECAT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // widened exactly
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
ONECAT_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
ONECAT_AVX512 inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// eight values of row a (low half) and of row b (high half)
ONECAT_AVX512 inline __m512 load8x2(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
ONECAT_AVX512 inline __m512 load8x2(const at::BFloat16* a, const at::BFloat16* b) {
  const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Asks for every row of the chunk at once (a decode step's rows come from memory: one row at a time would wait
// for each in turn).
template <typename R>
inline void prefetch_rows(const R* const* rows, int64_t n, int64_t dim) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(R)); byte += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + byte, _MM_HINT_T0);
}

// scores[g][j] = scale * (the tree of chains[g][j]) for the chunk's keys, eight at a time.
template <int G>
inline void reduce_chains(const float (*chains)[kChunk][8], float scale, float (*scores)[kChunk]) {
  for (int g = 0; g < G; ++g)
    for (int64_t j0 = 0; j0 < kChunk; j0 += 8) {
      const auto c = [&](int j) { return _mm256_load_ps(chains[g][j0 + j]); };
      const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(c(0), c(1)), _mm256_hadd_ps(c(2), c(3)));
      const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(c(4), c(5)), _mm256_hadd_ps(c(6), c(7)));
      // a = [k0 k1 k2 k3 | k0 k1 k2 k3] partial sums of the low and high 128-bit halves; likewise b for k4..k7
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
      _mm256_storeu_ps(scores[g] + j0, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }
}

// The chunk's scores for G heads (q: their G float32 rows, dim apart), key by key.
template <int G, typename R>
void scores_avx2(const float* q, const R* const* rows, int64_t dim, float scale, float (*scores)[kChunk]) {
  prefetch_rows(rows, kChunk, dim);
  alignas(32) float chains[G][kChunk][8];
  for (int64_t j = 0; j < kChunk; ++j) {
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 key = load8(rows[j] + d);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + d), key, acc[g]);
    }
    for (int g = 0; g < G; ++g) _mm256_store_ps(chains[g][j], acc[g]);
  }
  reduce_chains<G>(chains, scale, scores);
}

// The same, two keys a register: keys j and j + 1's chains in its halves, each query segment in both.
template <int G, typename R>
ONECAT_AVX512 void scores_avx512(const float* q, const R* const* rows, int64_t dim, float scale,
                                 float (*scores)[kChunk]) {
  prefetch_rows(rows, kChunk, dim);
  alignas(64) float chains[G][kChunk][8];
  for (int64_t j = 0; j < kChunk; j += 2) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m512 keys = load8x2(rows[j] + d, rows[j + 1] + d);
      for (int g = 0; g < G; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * dim + d)), keys, acc[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_store_ps(chains[g][j], acc[g]);
  }
  reduce_chains<G>(chains, scale, scores);
}

// acc[g][d, d + 8) = acc[g] * factor[g] + sum_j scores[g][j] * rows[j] over the chunk's n keys, lane by lane, key
// by key.
template <int G, typename R>
inline void values_eight(float* acc, const R* const* rows, int64_t n, int64_t dim, const float (*scores)[kChunk],
                         const float* factor, int64_t d) {
  __m256 x[G];
  for (int g = 0; g < G; ++g) x[g] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * dim + d), _mm256_set1_ps(factor[g]));
  for (int64_t j = 0; j < n; ++j) {
    const __m256 value = load8(rows[j] + d);
    for (int g = 0; g < G; ++g) x[g] = _mm256_fmadd_ps(_mm256_set1_ps(scores[g][j]), value, x[g]);
  }
  for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * dim + d, x[g]);
}

// The chunk's value pass for the G heads over the whole head dim, eight lanes at a time.
template <int G, typename R>
void values_avx2(float* acc, const R* const* rows, int64_t n, int64_t dim, const float (*scores)[kChunk],
                 const float* factor) {
  prefetch_rows(rows, n, dim);
  for (int64_t d = 0; d < dim; d += 8) values_eight<G>(acc, rows, n, dim, scores, factor, d);
}

// The same, sixteen lanes a register (a head dim that is an odd multiple of 8 ends on eight).
template <int G, typename R>
ONECAT_AVX512 void values_avx512(float* acc, const R* const* rows, int64_t n, int64_t dim,
                                 const float (*scores)[kChunk], const float* factor) {
  prefetch_rows(rows, n, dim);
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    __m512 x[G];
    for (int g = 0; g < G; ++g) x[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * dim + d), _mm512_set1_ps(factor[g]));
    for (int64_t j = 0; j < n; ++j) {
      const __m512 value = load16(rows[j] + d);
      for (int g = 0; g < G; ++g) x[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g][j]), value, x[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc + g * dim + d, x[g]);
  }
  if (d < dim) values_eight<G>(acc, rows, n, dim, scores, factor, d);
}

// Prefill runs: kTile query tokens whose keys fill a whole chunk share its rows, read and widened once for all of
// them (and their G heads); each token's and head's operations are exactly the one-token kernels' above, so the
// bits are the same. AVX512 CPUs and G <= kTileMaxGroup (the accumulators must fit the registers).
constexpr int kTile = 4, kTileMaxGroup = 4;

// scores[t][g][j] for the tile's tokens (q[t]: token t's G rows, dim apart): scores_avx512's chains.
template <int G, typename R>
ONECAT_AVX512 void scores_tile_avx512(const float* const* q, const R* const* rows, int64_t dim, float scale,
                                      float (*scores)[kMaxGroup][kChunk]) {
  prefetch_rows(rows, kChunk, dim);
  alignas(64) float chains[kTile][G][kChunk][8];
  for (int64_t j = 0; j < kChunk; j += 2) {
    __m512 acc[kTile][G];
    for (int t = 0; t < kTile; ++t)
      for (int g = 0; g < G; ++g) acc[t][g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m512 keys = load8x2(rows[j] + d, rows[j + 1] + d);
      for (int t = 0; t < kTile; ++t)
        for (int g = 0; g < G; ++g)
          acc[t][g] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(q[t] + g * dim + d)), keys, acc[t][g]);
    }
    for (int t = 0; t < kTile; ++t)
      for (int g = 0; g < G; ++g) _mm512_store_ps(chains[t][g][j], acc[t][g]);
  }
  for (int t = 0; t < kTile; ++t) reduce_chains<G>(chains[t], scale, scores[t]);
}

// acc[t] (token t's G rows) rescaled by factor[t] plus the chunk's kChunk values weighted by scores[t]:
// values_avx512's operations per token and head.
template <int G, typename R>
ONECAT_AVX512 void values_tile_avx512(float* const* acc, const R* const* rows, int64_t dim,
                                      const float (*scores)[kMaxGroup][kChunk], const float (*factor)[kMaxGroup]) {
  prefetch_rows(rows, kChunk, dim);
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    __m512 x[kTile][G];
    for (int t = 0; t < kTile; ++t)
      for (int g = 0; g < G; ++g)
        x[t][g] = _mm512_mul_ps(_mm512_loadu_ps(acc[t] + g * dim + d), _mm512_set1_ps(factor[t][g]));
    for (int64_t j = 0; j < kChunk; ++j) {
      const __m512 value = load16(rows[j] + d);
      for (int t = 0; t < kTile; ++t)
        for (int g = 0; g < G; ++g) x[t][g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[t][g][j]), value, x[t][g]);
    }
    for (int t = 0; t < kTile; ++t)
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc[t] + g * dim + d, x[t][g]);
  }
  if (d < dim)
    for (int t = 0; t < kTile; ++t) values_eight<G>(acc[t], rows, kChunk, dim, scores[t], factor[t], d);
}

// The chunk's online-softmax step for the G heads (m, l: their running maxima and sums; factor: what their value
// sums are rescaled by), each head's operations exactly as attend_run makes them for one head (its maximum over
// the chunk's n keys, the same exponentials, its sum in key order), the G heads' dependent chains interleaved.
template <int G>
void softmax_heads(float (*scores)[kChunk], int64_t n, float* m, float* l, float* factor) {
  using Vec = at::vec::Vectorized<float>;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float top[G], total[G];
  for (int g = 0; g < G; ++g) {
    for (int64_t j = n; j < kChunk; ++j) scores[g][j] = kNegInf;
    top[g] = m[g];
  }
  for (int64_t j = 0; j < n; ++j)
    for (int g = 0; g < G; ++g) top[g] = std::max(top[g], scores[g][j]);
  for (int g = 0; g < G; ++g) {
    factor[g] = m[g] == kNegInf ? 0.0f : std::exp(m[g] - top[g]);
    for (int64_t j = 0; j < kChunk; j += Vec::size())
      (Vec::loadu(scores[g] + j) - Vec(top[g])).exp().store(scores[g] + j);
    total[g] = 0.0f;
  }
  for (int64_t j = 0; j < n; ++j)
    for (int g = 0; g < G; ++g) total[g] += scores[g][j];
  for (int g = 0; g < G; ++g) {
    l[g] = l[g] * factor[g] + total[g];
    m[g] = top[g];
  }
}

template <typename R>
struct Kernels {
  void (*scores)(const float*, const R* const*, int64_t, float, float (*)[kChunk]);
  void (*softmax)(float (*)[kChunk], int64_t, float*, float*, float*);
  void (*values)(float*, const R* const*, int64_t, int64_t, const float (*)[kChunk], const float*);
  // kTile tokens at once over a whole chunk; nullptr where not built (AVX2, G > kTileMaxGroup)
  void (*scores_tile)(const float* const*, const R* const*, int64_t, float, float (*)[kMaxGroup][kChunk]);
  void (*values_tile)(float* const*, const R* const*, int64_t, const float (*)[kMaxGroup][kChunk],
                      const float (*)[kMaxGroup]);
};

template <int G, typename R>
constexpr Kernels<R> wide_kernels() {
  if constexpr (G <= kTileMaxGroup)
    return {scores_avx512<G, R>, softmax_heads<G>, values_avx512<G, R>, scores_tile_avx512<G, R>,
            values_tile_avx512<G, R>};
  else
    return {scores_avx512<G, R>, softmax_heads<G>, values_avx512<G, R>, nullptr, nullptr};
}

template <typename R, int... G>
constexpr auto table(std::integer_sequence<int, G...>, bool wide) {
  using K = Kernels<R>;
  using Table = std::array<K, sizeof...(G)>;
  if (wide) return Table{wide_kernels<G + 1, R>()...};
  return Table{K{scores_avx2<G + 1, R>, softmax_heads<G + 1>, values_avx2<G + 1, R>, nullptr, nullptr}...};
}

inline bool cpu_has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return ok;
}

// This CPU's loops for G query heads a KV head and head dim `dim`; nullptr where they do not apply (G > 8, or a
// head dim that is not a multiple of 8): the caller then takes one head at a time.
template <typename R>
const Kernels<R>* for_group(int64_t group, int64_t dim) {
  static const auto narrow = table<R>(std::make_integer_sequence<int, kMaxGroup>(), false);
  static const auto wide = table<R>(std::make_integer_sequence<int, kMaxGroup>(), true);
  if (group < 1 || group > kMaxGroup || dim % 8 != 0) return nullptr;
  return &(cpu_has_avx512() ? wide : narrow)[group - 1];
}

#undef ONECAT_AVX512

}  // namespace attention_heads

#endif  // CPU_CAPABILITY_AVX2
