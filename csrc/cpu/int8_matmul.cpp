// Many-row matmuls of the packed 4-bit layers on int8 dot products (AVX512-VNNI, or AVX2 where the CPU has no
// VNNI), as llama.cpp multiplies its 4-bit blocks by 8-bit activation blocks.
//
// The weights are the layer's own: per 32-value block of K, 4-bit codes q in [0, 15] with a float scale s
// and offset c (w = s * q + c, engine/quant/int4/layout.py). Each row of activations is rounded to int8 per
// 32-value block (d = max|a| / 127, a ~ d * qa, ties to even), so
//   sum_k w_k a_k ~ sum_blocks [ s * d * sum(q * qa) + c * d * sum(qa) ],
// the inner sums exact in int32 (VPDPBUSD: unsigned codes x signed activations), the outer ones float
// fused multiply-adds over blocks in one fixed order. A row's result depends only on that row: not on the
// row count, the other rows or the thread that computes it (batch-invariant by construction).
//
// Layout (engine/quant/int4/int8_matmul.py packs it once at load): output columns in tiles of 16 (one int32
// lane per column); codes [tiles][K / 4][16 columns][4 values], scales and offsets [tiles][K / 32][16].
// AVX512-VNNI: tiles go two at a time over 4 rows (each broadcast activation word feeds both: 5-10% faster
// than one tile over 8 rows on a 2-core AMD EPYC, the same bits), an odd last tile alone.
// AVX2 (no VNNI), on a compact layout (two codes a byte, scale and zero in bfloat16: 0.625 bytes a weight
// against the byte layout's 1.25, since a one-row call streams its weights from memory): half a tile (8
// columns, one 256-bit register) over 4 rows; VPMADDUBSW multiplies code and
// activation pairs into int16 (at most 2 * 15 * 127 = 3810, so a block's 8 words sum to at most 30480: no
// saturation, no overflow) and VPMADDWD adds each column's two int16 into its int32 lane: the block's
// integer sums are VPDPBUSD's exactly, and the float part runs the same operations per column in the same
// order, so both kernels give the same bits.
// Built on x86-64 only; elsewhere, and on CPUs with neither, int8_matmul_isa() is "".
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "fused_ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ONECAT_VNNI 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32, kTile = 16, kRowGroup = 8, kRowChunk = 128, kHalf = 8, kAvx2Rows = 4;

#ifdef ONECAT_VNNI
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

#define AVX2_TARGET __attribute__((target("avx2,fma")))

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

template <typename T>  // 16 floats from float32 or bfloat16 (the upper half of a float: widened exactly)
VNNI_TARGET inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// One row rounded to int8 per 32-value block: qa (4 per int32 word, as VPDPBUSD broadcasts them), each
// block's scale d and d * sum(qa).
template <typename T>
VNNI_TARGET void quantize_row(const T* a, int64_t k, int32_t* words, float* scale, float* total) {
  for (int64_t b = 0; b < k / kGroup; ++b) {
    const __m512 x0 = load16(a + b * kGroup), x1 = load16(a + b * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));  // to nearest, ties to even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(words + b * 8), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(words + b * 8 + 4), _mm512_cvtsepi32_epi8(q1));
    scale[b] = amax / 127.0f;
    total[b] = scale[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// A block's 16 offsets: the byte layout's own (float32 scales), or those of Q8_0's codes q + 128 (bfloat16 scales,
// no offsets stored: c = -128 s, exact), whose 2 bytes of scale a block column against 8 are 15% fewer bytes for
// the LM head that a one-row step streams.
template <typename S>
VNNI_TARGET inline __m512 block_offsets(__m512 s, const float* offsets, int64_t at) {
  if constexpr (std::is_same_v<S, float>) return _mm512_loadu_ps(offsets + at);
  return _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
}

// out[r][one tile's 16 columns] for R rows: per block, R x 8 VPDPBUSD into int32 lanes, then each lane's
// float sum += int * (s * d) + c * (d * sum qa).
template <int R, typename S>
VNNI_TARGET void tile_rows(int64_t blocks, const uint8_t* codes, const S* scales, const float* offsets,
                           const int32_t* words, const float* d, const float* total, float* out, int64_t out_stride,
                           int64_t columns) {
  const int64_t row_words = blocks * 8;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm512_setzero_si512();
    for (int64_t quad = 0; quad < 8; ++quad) {
      const __m512i w = _mm512_loadu_si512(codes + (b * 8 + quad) * 64);
      for (int r = 0; r < R; ++r)
        dots[r] = _mm512_dpbusd_epi32(dots[r], w, _mm512_set1_epi32(words[r * row_words + b * 8 + quad]));
    }
    const __m512 s = load16(scales + b * kTile), c = block_offsets<S>(s, offsets, b * kTile);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_mul_ps(s, _mm512_set1_ps(d[r * blocks + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(total[r * blocks + b]), acc[r]);
    }
  }
  const __mmask16 mask = columns >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << columns) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * out_stride, mask, acc[r]);
}

// Two adjacent tiles (32 columns) for R <= 4 rows: each broadcast activation word feeds two VPDPBUSD.
template <int R, typename S>
VNNI_TARGET void tile_pair_rows(int64_t blocks, const uint8_t* codes, const S* scales, const float* offsets,
                                const int32_t* words, const float* d, const float* total, float* out,
                                int64_t out_stride, int64_t columns, int64_t tile_codes, int64_t tile_scales) {
  const int64_t row_words = blocks * 8;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dots[R][2];
    for (int r = 0; r < R; ++r) dots[r][0] = dots[r][1] = _mm512_setzero_si512();
    for (int64_t quad = 0; quad < 8; ++quad) {
      const __m512i w0 = _mm512_loadu_si512(codes + (b * 8 + quad) * 64);
      const __m512i w1 = _mm512_loadu_si512(codes + tile_codes + (b * 8 + quad) * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i a = _mm512_set1_epi32(words[r * row_words + b * 8 + quad]);
        dots[r][0] = _mm512_dpbusd_epi32(dots[r][0], w0, a);
        dots[r][1] = _mm512_dpbusd_epi32(dots[r][1], w1, a);
      }
    }
    for (int t = 0; t < 2; ++t) {
      const __m512 s = load16(scales + t * tile_scales + b * kTile);
      const __m512 c = block_offsets<S>(s, offsets, t * tile_scales + b * kTile);
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][t]), _mm512_mul_ps(s, _mm512_set1_ps(d[r * blocks + b])), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(c, _mm512_set1_ps(total[r * blocks + b]), acc[r][t]);
      }
    }
  }
  for (int t = 0; t < 2; ++t) {
    const int64_t cols = std::min<int64_t>(kTile, columns - t * kTile);
    const __mmask16 mask = cols >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * out_stride + t * kTile, mask, acc[r][t]);
  }
}

template <typename S>
using TilePairRows = void (*)(int64_t, const uint8_t*, const S*, const float*, const int32_t*, const float*,
                              const float*, float*, int64_t, int64_t, int64_t, int64_t);
template <typename S>
constexpr TilePairRows<S> kTilePairRows[5] = {nullptr, tile_pair_rows<1, S>, tile_pair_rows<2, S>,
                                              tile_pair_rows<3, S>, tile_pair_rows<4, S>};

template <typename S>
using TileRows = void (*)(int64_t, const uint8_t*, const S*, const float*, const int32_t*, const float*,
                          const float*, float*, int64_t, int64_t);
template <typename S>
constexpr TileRows<S> kTileRows[kRowGroup + 1] = {nullptr, tile_rows<1, S>, tile_rows<2, S>, tile_rows<3, S>,
                                                  tile_rows<4, S>, tile_rows<5, S>, tile_rows<6, S>,
                                                  tile_rows<7, S>, tile_rows<8, S>};

// The rows a chunk at a time (its int8 rows stay in cache): each row rounded to int8 by `quantize_row` (for the
// input's dtype), then `tiles_fn(r0, rows, words, d, total)` computes the chunk's outputs.
template <typename QuantizeFloat, typename QuantizeBf16, typename Tiles>
void row_chunks(const at::Tensor& x, QuantizeFloat quantize_float, QuantizeBf16 quantize_bf16, Tiles tiles_fn) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kGroup;
  const int64_t chunk = std::min(m, kRowChunk);
  std::vector<int32_t> words(chunk * (k / 4));
  std::vector<float> d(chunk * blocks), total(chunk * blocks);
  for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, m - r0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        int32_t* w = words.data() + r * (k / 4);
        if (x.scalar_type() == at::kFloat)
          quantize_float(x.data_ptr<float>() + (r0 + r) * k, k, w, d.data() + r * blocks, total.data() + r * blocks);
        else
          quantize_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + (r0 + r) * k, k, w,
                        d.data() + r * blocks, total.data() + r * blocks);
      }
    });
    tiles_fn(r0, rows, words.data(), d.data(), total.data());
  }
}

// The chunks' outputs on VNNI kernels: tiles two at a time (an odd last one alone) over the threads, rows 4 at a
// time for a pair and kRowGroup for a lone tile; group(tile, two, g, count, r0, words, d, total) runs one group.
template <typename Group>
void pairs_of_tiles(const at::Tensor& x, int64_t tiles, Group group) {
  const int64_t k = x.size(1);
  row_chunks(x, quantize_row<float>, quantize_row<uint16_t>,
             [&](int64_t r0, int64_t rows, const int32_t* words, const float* d, const float* total) {
    const int64_t tile_work = rows * k * kTile;  // multiply-adds of one tile
    const int64_t pairs = (tiles + 1) / 2;
    at::parallel_for(0, pairs, std::max<int64_t>(1, (1 << 17) / tile_work), [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t tile = 2 * pair, step = tile + 1 < tiles ? 4 : kRowGroup;
        for (int64_t g = 0; g < rows; g += step)
          group(tile, tile + 1 < tiles, g, std::min(step, rows - g), r0, words, d, total);
      }
    });
  });
}

// The byte layout: S float (scales and offsets float32) or uint16_t (Q8_0's: bfloat16 scales, offsets formed).
template <typename S>
void matmul_vnni(const at::Tensor& x, const uint8_t* codes, const S* scales, const float* offsets,
                 int64_t tiles, float* out, int64_t n) {
  const int64_t k = x.size(1), blocks = k / kGroup;
  pairs_of_tiles(x, tiles, [&](int64_t tile, bool two, int64_t g, int64_t count, int64_t r0, const int32_t* words,
                               const float* d, const float* total) {
    const int64_t columns = std::min(2 * kTile, n - tile * kTile);
    const uint8_t* c = codes + tile * (k / 4) * 64;
    const S* s = scales + tile * blocks * kTile;
    const float* o = offsets == nullptr ? nullptr : offsets + tile * blocks * kTile;  // none: Q8_0's
    float* y = out + (r0 + g) * n + tile * kTile;
    if (two)
      kTilePairRows<S>[count](blocks, c, s, o, words + g * (k / 4), d + g * blocks, total + g * blocks, y, n, columns,
                              (k / 4) * 64, blocks * kTile);
    else
      kTileRows<S>[count](blocks, c, s, o, words + g * (k / 4), d + g * blocks, total + g * blocks, y, n,
                          std::min(kTile, columns));
  });
}

// ---- AVX512-VNNI on the compact layout -----------------------------------------------------------------

// out[r][16 columns of each of T tiles] for R rows from the compact layout (two words' codes a byte, scale and
// zero in bfloat16): per block 4 loads of 64 bytes a tile, each split into its two words' codes (low nibble: the
// even word) and fed to R x 2 VPDPBUSD; then each lane's float sum += int * (s * d) + c * (d * sum qa) with
// c = z - 8 * s, as tile_rows and half_tile_rows do: the same bits as both, half the bytes of the byte layout
// (a one-row call streams its weights).
template <int T, int R>
VNNI_TARGET void compact_tiles_rows(int64_t blocks, const uint8_t* codes, const uint16_t* scales,
                                    const uint16_t* zeros, const int32_t* words, const float* d, const float* total,
                                    float* out, int64_t out_stride, int64_t columns, int64_t tile_codes,
                                    int64_t tile_scales) {
  const int64_t row_words = blocks * 8;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dots[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) dots[r][t] = _mm512_setzero_si512();
    for (int64_t pair = 0; pair < 4; ++pair) {
      __m512i w0[T], w1[T];
      for (int t = 0; t < T; ++t) {
        const __m512i both = _mm512_loadu_si512(codes + t * tile_codes + (b * 4 + pair) * 64);
        w0[t] = _mm512_and_si512(both, nibble);
        w1[t] = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
      }
      for (int r = 0; r < R; ++r) {
        const int32_t* a = words + r * row_words + b * 8 + 2 * pair;
        const __m512i a0 = _mm512_set1_epi32(a[0]), a1 = _mm512_set1_epi32(a[1]);
        for (int t = 0; t < T; ++t) {
          dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], w0[t], a0);
          dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], w1[t], a1);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 s = load16(scales + t * tile_scales + b * kTile), z = load16(zeros + t * tile_scales + b * kTile);
      const __m512 c = _mm512_sub_ps(z, _mm512_mul_ps(_mm512_set1_ps(8.0f), s));
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][t]), _mm512_mul_ps(s, _mm512_set1_ps(d[r * blocks + b])),
                                    acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(c, _mm512_set1_ps(total[r * blocks + b]), acc[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t cols = std::min<int64_t>(kTile, columns - t * kTile);
    const __mmask16 mask = cols >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * out_stride + t * kTile, mask, acc[r][t]);
  }
}

using CompactTilesRows = void (*)(int64_t, const uint8_t*, const uint16_t*, const uint16_t*, const int32_t*,
                                  const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr CompactTilesRows kCompactPairRows[5] = {nullptr, compact_tiles_rows<2, 1>, compact_tiles_rows<2, 2>,
                                                  compact_tiles_rows<2, 3>, compact_tiles_rows<2, 4>};
constexpr CompactTilesRows kCompactTileRows[kRowGroup + 1] = {
    nullptr, compact_tiles_rows<1, 1>, compact_tiles_rows<1, 2>, compact_tiles_rows<1, 3>, compact_tiles_rows<1, 4>,
    compact_tiles_rows<1, 5>, compact_tiles_rows<1, 6>, compact_tiles_rows<1, 7>, compact_tiles_rows<1, 8>};

void matmul_vnni_compact(const at::Tensor& x, const uint8_t* codes, const uint16_t* scales, const uint16_t* zeros,
                         int64_t tiles, float* out, int64_t n) {
  const int64_t k = x.size(1), blocks = k / kGroup;
  pairs_of_tiles(x, tiles, [&](int64_t tile, bool two, int64_t g, int64_t count, int64_t r0, const int32_t* words,
                               const float* d, const float* total) {
    const CompactTilesRows fn = two ? kCompactPairRows[count] : kCompactTileRows[count];
    fn(blocks, codes + tile * (k / 8) * 64, scales + tile * blocks * kTile, zeros + tile * blocks * kTile,
       words + g * (k / 4), d + g * blocks, total + g * blocks, out + (r0 + g) * n + tile * kTile, n,
       std::min(2 * kTile, n - tile * kTile), (k / 8) * 64, blocks * kTile);
  });
}

// ---- AVX2 (no VNNI) -----------------------------------------------------------------------------------

template <typename T>  // 8 floats from float32 or bfloat16
AVX2_TARGET inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// quantize_row's arithmetic on 256-bit registers: the same max, reciprocal, rounding and sums.
template <typename T>
AVX2_TARGET void quantize_row_avx2(const T* a, int64_t k, int32_t* words, float* scale, float* total) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < k / kGroup; ++b) {
    __m256 x[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      x[i] = load8(a + b * kGroup + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(x[i], magnitude));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    const float amax = *std::max_element(lanes, lanes + 8);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t* qa = reinterpret_cast<int8_t*>(words + b * 8);
    int32_t sum = 0;
    for (int i = 0; i < 4; ++i) {
      alignas(32) int32_t q[8];  // to nearest, ties to even
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(inv))));
      for (int j = 0; j < 8; ++j) {
        qa[8 * i + j] = static_cast<int8_t>(std::clamp(q[j], -128, 127));
        sum += q[j];
      }
    }
    scale[b] = amax / 127.0f;
    total[b] = scale[b] * static_cast<float>(sum);
  }
}

// out[r][8 columns of a tile] for R rows from the compact layout: per block, 4 bytes-pairs of two words' codes
// (low and high nibble), 8 VPMADDUBSW summed in int16, one VPMADDWD into int32 lanes, then each lane's float sum
// += int * (s * d) + c * (d * sum qa) with c = z - 8 * s (exact times 8, one rounding: the byte layout's offset),
// as tile_rows does.
template <int R>
AVX2_TARGET void half_tile_rows(int64_t blocks, const uint8_t* codes, const uint16_t* scales, const uint16_t* zeros,
                                const int32_t* words, const float* d, const float* total, float* out,
                                int64_t out_stride, int64_t columns) {
  const int64_t row_words = blocks * 8;
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    for (int64_t pair = 0; pair < 4; ++pair) {
      const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (b * 4 + pair) * 64));
      const __m256i w0 = _mm256_and_si256(both, nibble);
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const int32_t* a = words + r * row_words + b * 8 + 2 * pair;
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(w0, _mm256_set1_epi32(a[0])));
        sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(w1, _mm256_set1_epi32(a[1])));
      }
    }
    const __m256 s = load8(scales + b * kTile), z = load8(zeros + b * kTile);
    const __m256 c = _mm256_sub_ps(z, _mm256_mul_ps(_mm256_set1_ps(8.0f), s));
    for (int r = 0; r < R; ++r) {
      const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));
      acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(s, _mm256_set1_ps(d[r * blocks + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(total[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (columns >= kHalf) {
      _mm256_storeu_ps(out + r * out_stride, acc[r]);
    } else {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r]);
      std::memcpy(out + r * out_stride, lanes, columns * sizeof(float));
    }
  }
}

using HalfTileRows = void (*)(int64_t, const uint8_t*, const uint16_t*, const uint16_t*, const int32_t*, const float*,
                              const float*, float*, int64_t, int64_t);
constexpr HalfTileRows kHalfTileRows[kAvx2Rows + 1] = {nullptr, half_tile_rows<1>, half_tile_rows<2>,
                                                       half_tile_rows<3>, half_tile_rows<4>};

void matmul_avx2(const at::Tensor& x, const uint8_t* codes, const uint16_t* scales, const uint16_t* zeros,
                 int64_t tiles, float* out, int64_t n) {
  const int64_t k = x.size(1), blocks = k / kGroup;
  row_chunks(x, quantize_row_avx2<float>, quantize_row_avx2<uint16_t>,
             [&](int64_t r0, int64_t rows, const int32_t* words, const float* d, const float* total) {
    const int64_t half_work = rows * k * kHalf;  // multiply-adds of half a tile
    at::parallel_for(0, 2 * tiles, std::max<int64_t>(1, (1 << 17) / half_work), [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t tile = unit / 2, half = unit % 2, first = tile * kTile + half * kHalf;
        if (first >= n) continue;  // a padding half
        const int64_t columns = std::min(kHalf, n - first);
        for (int64_t g = 0; g < rows; g += kAvx2Rows) {
          kHalfTileRows[std::min(kAvx2Rows, rows - g)](
              blocks, codes + tile * (k / 8) * 64 + half * 32, scales + tile * blocks * kTile + half * kHalf,
              zeros + tile * blocks * kTile + half * kHalf, words + g * (k / 4), d + g * blocks, total + g * blocks,
              out + (r0 + g) * n + first, n, columns);
        }
      }
    });
  });
}
#endif  // ONECAT_VNNI

}  // namespace

namespace onecat_cpu {

// "avx512vnni" or "avx2": the kernel this CPU runs; "" where neither can.
std::string int8_matmul_isa() {
#ifdef ONECAT_VNNI
  static const std::string isa = cpu_has_vnni() ? "avx512vnni" : cpu_has_avx2() ? "avx2" : "";
  return isa;
#else
  return "";
#endif
}

// x [M, K] float32 or bfloat16; n: the output columns (<= tiles * 16). Three layouts (int8_matmul.py packs them):
// bytes (the AVX512-VNNI kernel): codes uint8 [tiles, K / 4, 64], scales and offsets float32 [tiles, K / 32, 16];
// q8 (the AVX512-VNNI kernel, Q8_0's codes q + 128): codes as bytes, scales bfloat16, offsets empty (-128 s);
// compact (both kernels): codes uint8 [tiles, K / 8, 64] (two words' codes a byte, low nibble first), scales
// and zeros bfloat16 [tiles, K / 32, 16]. `kernel`: "" this CPU's, "avx2" the AVX2 one (compact layout only; the
// same bits).
// Returns float32 [M, n].
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t n, const std::string& kernel) {
  TORCH_CHECK(kernel.empty() || kernel == "avx2", "kernel must be \"\" (this CPU's) or \"avx2\"");
  const std::string have = kernel.empty() || int8_matmul_isa().empty() ? int8_matmul_isa() : kernel;
  const bool q8 = scales.scalar_type() == at::kBFloat16 && offsets.numel() == 0;
  const bool compact = scales.scalar_type() == at::kBFloat16 && !q8;
  TORCH_CHECK(compact ? !have.empty() : have == "avx512vnni",
              compact ? "int8_matmul's compact layout needs an x86-64 CPU with AVX2+FMA"
                      : "int8_matmul's byte and q8 layouts need an x86-64 CPU with AVX512-VNNI");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous float32 or bfloat16 CPU matrix");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of ", kGroup);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 &&
                  codes.size(1) == k / (compact ? 8 : 4) && codes.size(2) == 64,
              "codes must be uint8 [tiles, K / 4, 64] (bytes, q8) or [tiles, K / 8, 64] (compact)");
  const int64_t tiles = codes.size(0);
  for (const at::Tensor* t : {&scales, &offsets}) {
    if (q8 && t == &offsets) continue;
    TORCH_CHECK(t->scalar_type() == scales.scalar_type() && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == tiles && t->size(1) == k / kGroup && t->size(2) == kTile,
                "scales and offsets (zeros) must be [tiles, K / 32, 16], float32 (bytes) or bfloat16 (compact); "
                "q8: bfloat16 scales and an empty offsets tensor");
  }
  TORCH_CHECK(compact || q8 || scales.scalar_type() == at::kFloat, "the byte layout's scales are float32");
  TORCH_CHECK(n > 0 && n <= tiles * kTile, "n must be within the packed columns");
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
#ifdef ONECAT_VNNI
  if (x.size(0) > 0 && compact && have == "avx512vnni")
    matmul_vnni_compact(x, codes.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()),
                        reinterpret_cast<const uint16_t*>(offsets.data_ptr<at::BFloat16>()), tiles,
                        out.data_ptr<float>(), n);
  else if (x.size(0) > 0 && compact)
    matmul_avx2(x, codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(offsets.data_ptr<at::BFloat16>()), tiles, out.data_ptr<float>(), n);
  else if (x.size(0) > 0 && q8)
    matmul_vnni<uint16_t>(x, codes.data_ptr<uint8_t>(),
                          reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()), nullptr, tiles,
                          out.data_ptr<float>(), n);
  else if (x.size(0) > 0)
    matmul_vnni<float>(x, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(), tiles,
                       out.data_ptr<float>(), n);
#endif
  return out;
}

}  // namespace onecat_cpu

TORCH_LIBRARY_FRAGMENT(onecat_cpu, m) {
  m.def("int8_matmul_isa() -> str", &onecat_cpu::int8_matmul_isa);
  m.def("int8_matmul(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n, str kernel=\"\") -> Tensor");
}

TORCH_LIBRARY_IMPL(onecat_cpu, CPU, m) { m.impl("int8_matmul", &onecat_cpu::int8_matmul); }
