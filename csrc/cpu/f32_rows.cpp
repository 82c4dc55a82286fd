// Float32 matmul of a few rows (a decode step, a speculative verify step, a drafter's block) that streams the
// weights once for all rows, and gives each output the same bits whatever the row count.
//
// Layout (engine/kernels/f32_rows.py packs it once at load): output columns in tiles of 8, each tile's weights
// K-major, [tiles][K + pad][8] (the last tile's missing columns and the pad rows are zeros). Every output is one
// chain of fused multiply-adds over K in order, acc = fma(x[k], w[k], acc) from acc = 0: the vector width only
// decides how many columns advance together, so the AVX2 kernel, the portable loop (std::fma) and any row or
// thread split give the same bits.
// Register blocks: up to 4 rows x 3 tiles (12 accumulators, 3 weight loads and 4 broadcasts a step of K) and
// up to 2 rows x 6 tiles for one or two rows (more independent chains while the weights stream from memory).
// Weights whose values are all bfloat16 numbers (a bf16 checkpoint run in float32) may be packed as bfloat16: a
// weight widens to the same float32 exactly, so the bits are those of the float32 packing, at half the bytes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ONECAT_F32_AVX2 1
#include <immintrin.h>
#endif

namespace {

// columns a tile; tiles a thread's unit at most; rows a pass; rows one pass over K takes (past them, blocks of at most
// 4 rows and K in chunks of kKChunk)
constexpr int64_t kLanes = 8, kUnit = 12, kRowChunk = 64, kOnePassRows = 4, kKChunk = 256;

#ifdef ONECAT_F32_AVX2
bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// 8 weights of a tile row as float32: loaded, or widened from bfloat16 (its bits are a float32's top half)
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// RB rows x TB tiles of outputs over K steps [k0, k1); x rows at x + r * ldx, tile t's weights at w + t * wstride,
// out rows at ldo. The chains start at 0 for k0 = 0, else go on from the partial sums in out (a float32 store and
// load change nothing).
template <typename W, int RB, int TB>
__attribute__((target("avx2,fma"))) void block_avx2(const float* x, int64_t ldx, const W* w, int64_t wstride,
                                                    int64_t k0, int64_t k1, float* out, int64_t ldo) {
  __m256 acc[RB][TB];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 6
    for (int t = 0; t < TB; ++t)
      acc[r][t] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * ldo + t * kLanes);
  for (int64_t i = k0; i < k1; ++i) {
    __m256 wv[TB];
#pragma GCC unroll 6
    for (int t = 0; t < TB; ++t) wv[t] = load8(w + t * wstride + i * kLanes);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
#pragma GCC unroll 6
      for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_fmadd_ps(xv, wv[t], acc[r][t]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 6
    for (int t = 0; t < TB; ++t) _mm256_storeu_ps(out + r * ldo + t * kLanes, acc[r][t]);
}

template <typename W>
using BlockFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, int64_t, float*, int64_t);

template <typename W, int RB, int... TB>
constexpr void fill_row(BlockFn<W>* row, std::integer_sequence<int, TB...>) {
  ((row[TB] = &block_avx2<W, RB, TB + 1>), ...);
}

template <typename W>
struct BlockTable {  // fn[rows - 1][tiles - 1]
  BlockFn<W> fn[4][6];
  constexpr BlockTable() : fn{} {
    fill_row<W, 1>(fn[0], std::make_integer_sequence<int, 6>{});
    fill_row<W, 2>(fn[1], std::make_integer_sequence<int, 6>{});
    fill_row<W, 3>(fn[2], std::make_integer_sequence<int, 6>{});
    fill_row<W, 4>(fn[3], std::make_integer_sequence<int, 6>{});
  }
};
template <typename W>
constexpr BlockTable<W> kBlocks{};
#endif

inline float widen(float w) { return w; }
inline float widen(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The same chains one column at a time (std::fma rounds once, as the vector FMA does): CPUs without AVX2 + FMA,
// and the reference the kernel's bits are tested against.
template <typename W>
void block_portable(const float* x, int64_t ldx, const W* w, int64_t wstride, int64_t k0, int64_t k1,
                    int64_t rows, int64_t tiles, float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t c = 0; c < kLanes; ++c) {
        float acc = k0 == 0 ? 0.0f : out[r * ldo + t * kLanes + c];
        for (int64_t i = k0; i < k1; ++i) acc = std::fma(x[r * ldx + i], widen(w[t * wstride + i * kLanes + c]), acc);
        out[r * ldo + t * kLanes + c] = acc;
      }
}

// Rows [r0, r0 + rows) x tiles [t0, t1): 1-2 rows in one block on 6 tiles (more chains while the weights stream),
// 3-4 rows in one block on 3. Past kOnePassRows rows, blocks of at most 4 rows as even as the count allows (5 rows
// as 3 + 2, not 4 + 1, whose 1-row block of 3 chains waits on each FMA's latency) and K in chunks, so the later
// blocks find the weights in L1 (8 rows on one tile a block ran slower: its broadcasts outnumber the FMAs' weight
// loads; 5-6 rows in one pass on 2 tiles ran 1.4-1.6x slower). A 2-core AVX2 EPYC, one step's projections of the
// embedded model (benchmarks/cpu_f32_rows.py, one run each): 4 + 1 / 4 + 2 rows 17.0 / 18.6 ms, 3 + 2 / 3 + 3 rows
// 16.5 / 17.1 ms; 4 rows 12.7-13.1 ms (at four rows and more the FMAs, not the weights' bytes, set the time).
template <typename W>
void span(const float* x, int64_t ldx, const W* w, int64_t wstride, int64_t k, int64_t r0, int64_t rows,
          int64_t t0, int64_t t1, float* out, int64_t ldo, bool portable) {
  const bool one_pass = rows <= kOnePassRows;
  const int64_t tb_max = rows <= 2 ? 6 : 3;
  const int64_t blocks = (rows + 3) / 4;
  const int64_t k_step = one_pass ? k : kKChunk;
  for (int64_t t = t0; t < t1; t += tb_max) {
    const int64_t tb = std::min(tb_max, t1 - t);
    for (int64_t k0 = 0; k0 < k; k0 += k_step) {
      const int64_t k1 = std::min(k, k0 + k_step);
      for (int64_t b = 0, next = r0; b < blocks; ++b) {
        const int64_t rb = rows / blocks + (b < rows % blocks ? 1 : 0);  // the first rows % blocks get one more
        const int64_t r = next;
        next += rb;
        const float* xs = x + r * ldx;
        const W* ws = w + t * wstride;
        float* os = out + r * ldo + t * kLanes;
#ifdef ONECAT_F32_AVX2
        if (!portable) {
          kBlocks<W>.fn[rb - 1][tb - 1](xs, ldx, ws, wstride, k0, k1, os, ldo);
          continue;
        }
#endif
        block_portable(xs, ldx, ws, wstride, k0, k1, rb, tb, os, ldo);
      }
    }
  }
}

}  // namespace

namespace onecat_cpu {

std::string f32_rows_isa() {
#ifdef ONECAT_F32_AVX2
  static const bool avx2 = cpu_has_avx2_fma();
  if (avx2) return "avx2";
#endif
  return "";
}

// x [M, K] float32 times the packed weight [tiles, K + padding, 8] (float32, or bfloat16 widened exactly) ->
// [M, tiles * 8]; portable: the scalar loop.
at::Tensor f32_rows_matmul(const at::Tensor& x, const at::Tensor& packed, bool portable) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && (packed.scalar_type() == at::kFloat || bf16),
              "f32_rows_matmul: float32 x [M, K] and packed weight [tiles, K, 8] in float32 or bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes && packed.size(1) >= x.size(1) &&
                  packed.is_contiguous(),
              "f32_rows_matmul: the packed weight must be [tiles, K + padding, 8] contiguous with x's K");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), tiles = packed.size(0), n = tiles * kLanes;
  const int64_t wstride = packed.size(1) * kLanes;
  if (k == 0) return at::zeros({m, n}, x.options());
  at::Tensor out = at::empty({m, n}, x.options());
  const bool scalar = portable || f32_rows_isa().empty();
  const float* xp = xc.data_ptr<float>();
  const void* wp = packed.data_ptr();
  float* op = out.data_ptr<float>();
  // a thread's unit: kUnit tiles, fewer where that would leave threads idle (a 576-column layer is 72 tiles)
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t unit = std::max<int64_t>(1, std::min(kUnit, (tiles + threads - 1) / threads));
  const int64_t units = (tiles + unit - 1) / unit;
  for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, m - r0);
    at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
      const int64_t t0 = u0 * unit, t1 = std::min(tiles, u1 * unit);
      if (bf16)
        span(xp, k, static_cast<const uint16_t*>(wp), wstride, k, r0, rows, t0, t1, op, n, scalar);
      else
        span(xp, k, static_cast<const float*>(wp), wstride, k, r0, rows, t0, t1, op, n, scalar);
    });
  }
  return out;
}

}  // namespace onecat_cpu

TORCH_LIBRARY_FRAGMENT(onecat_cpu, m) {
  m.def("f32_rows_isa() -> str", &onecat_cpu::f32_rows_isa);
  m.def("f32_rows_matmul(Tensor x, Tensor packed, bool portable) -> Tensor");
}
TORCH_LIBRARY_IMPL(onecat_cpu, CPU, m) { m.impl("f32_rows_matmul", &onecat_cpu::f32_rows_matmul); }
