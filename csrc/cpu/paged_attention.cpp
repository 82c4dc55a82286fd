// Causal attention over the paged KV cache on the CPU, read through the block tables.
//
// For each query token and KV head, the G query heads sharing that KV head walk the token's keys
// 0..position in chunks of kChunk keys at absolute multiples of kChunk, with an online softmax in float32.
// A job's arithmetic depends only on its query row and its keys, never on the other tokens of the step,
// the query length or the thread that runs it, so a token's result is the same whatever batch it is in
// and whether its prefix came from the prefix cache (the engine's CPU batch invariance), and keys past the
// position are never read (no mask, no padding, no gathered copy of the sequence).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "attention_heads.h"
#include "fused_ops.h"

namespace {

using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<at::BFloat16>;  // 2 * Vec::size() lanes
constexpr int64_t kChunk = attention_heads::kChunk;  // keys per softmax step; a multiple of Vec::size()
constexpr int kFp8None = 0, kFp8E4M3 = 1, kFp8E5M2 = 2;  // engine/attention/cpu_paged.py FP8_KINDS

// The float value of every byte of an fp8 format (exact: the same as converting each one), looked up per
// stored value instead of decoding its bits.
const float* fp8_table(int kind) {
  using E4M3 = c10::Float8_e4m3fn;
  using E5M2 = c10::Float8_e5m2;
  static const std::array<float, 256> e4m3 = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(E4M3(static_cast<uint8_t>(i), E4M3::from_bits()));
    return t;
  }();
  static const std::array<float, 256> e5m2 = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(E5M2(static_cast<uint8_t>(i), E5M2::from_bits()));
    return t;
  }();
  return kind == kFp8E4M3 ? e4m3.data() : kind == kFp8E5M2 ? e5m2.data() : nullptr;
}

// One layer's K or V cache: [blocks, block_size, kv_heads, dim] in float32, bfloat16 or fp8 bytes with a
// float32 scale per stored token and head (value = fp8 * scale, as engine/cache/kv.py dequantize_fp8).
struct CacheView {
  const void* data;
  at::ScalarType dtype;
  const float* fp8_values;  // the float of each fp8 byte (fp8 caches)
  const float* scale;
  int64_t block_size, kv_heads, dim;
  int64_t head = 0;  // the KV head this view reads

  // The row at `offset` of cache block `block` as float32: a pointer into the cache when it holds float32,
  // else the row converted into `scratch`.
  const float* row(int64_t block, int64_t offset, float* scratch) const {
    const int64_t index = (block * block_size + offset) * kv_heads + head;
    if (dtype == at::kFloat) return static_cast<const float*>(data) + index * dim;
    if (dtype == at::kBFloat16) {  // widened exactly, a Vectorized<BFloat16> at a time
      const at::BFloat16* src = static_cast<const at::BFloat16*>(data) + index * dim;
      int64_t d = 0;
      for (; d + BVec::size() <= dim; d += BVec::size()) {
        auto [lo, hi] = at::vec::convert_bfloat16_float(BVec::loadu(src + d));
        lo.store(scratch + d);
        hi.store(scratch + d + Vec::size());
      }
      for (; d < dim; ++d) scratch[d] = static_cast<float>(src[d]);
      return scratch;
    }
    const uint8_t* src = static_cast<const uint8_t*>(data) + index * dim;
    const float s = scale[index];
    for (int64_t d = 0; d < dim; ++d) scratch[d] = fp8_values[src[d]] * s;
    return scratch;
  }

  // The row at `offset` of cache block `block` as stored (a bfloat16 cache: read and widened where it is used).
  const at::BFloat16* row(int64_t block, int64_t offset, at::BFloat16*) const {
    return static_cast<const at::BFloat16*>(data) + ((block * block_size + offset) * kv_heads + head) * dim;
  }
};

// Eight values of a row as float32: loaded, or bfloat16 widened exactly (the same values either way).
#if defined(CPU_CAPABILITY_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif
inline Vec load_vec(const float* p) { return Vec::loadu(p); }
#if defined(CPU_CAPABILITY_AVX2)
inline Vec load_vec(const at::BFloat16* p) { return Vec(load8(p)); }  // Vec::size() is 8 in an AVX2 build
#endif

// Dot product of two dim-long float rows (dim a multiple of Vec::size()): four independent lane-wise
// fused multiply-add chains (values d, d + 4 * lanes, ... in chain d / lanes % 4), the chains added in a
// fixed tree, then the lanes in order.
inline float dot(const float* a, const float* b, int64_t dim) {
  constexpr int64_t L = Vec::size();
  Vec acc[4] = {Vec(0.0f), Vec(0.0f), Vec(0.0f), Vec(0.0f)};
  int64_t d = 0;
  for (; d + 4 * L <= dim; d += 4 * L)
    for (int c = 0; c < 4; ++c) acc[c] = at::vec::fmadd(Vec::loadu(a + d + c * L), Vec::loadu(b + d + c * L), acc[c]);
  for (int c = 0; d < dim; d += L, ++c) acc[c] = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc[c]);
  float lanes[L];
  ((acc[0] + acc[1]) + (acc[2] + acc[3])).store(lanes);
  float sum = 0.0f;
  for (int64_t i = 0; i < L; ++i) sum += lanes[i];
  return sum;
}

// scores[j] = scale * dot(q, rows[j]) for the chunk's kChunk rows (rows past the chunk's keys point at
// zeros). With AVX2, eight keys at a time: one fused multiply-add chain per key over the head dim, then
// the eight lane sums reduced together by horizontal adds (a fixed tree); elsewhere one dot per key.
template <typename R>
inline void chunk_scores(const float* q, const R* const* rows, int64_t dim, float scale, float* scores) {
#if defined(CPU_CAPABILITY_AVX2)
  if (dim % 8 == 0) {
    for (int64_t j0 = 0; j0 < kChunk; j0 += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(x, load8(rows[j0 + j] + d), acc[j]);
      }
      const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
      // a = [k0 k1 k2 k3 | k0 k1 k2 k3] partial sums of the low and high 128-bit halves; likewise b for k4..k7
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
      _mm256_storeu_ps(scores + j0, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<R, float>) {
    for (int64_t j = 0; j < kChunk; ++j) scores[j] = dot(q, rows[j], dim) * scale;
  } else {
    TORCH_CHECK(false, "bfloat16 rows are read as stored only in the AVX2 build, head dim a multiple of 8");
  }
}

// Attention of a run of `count` consecutive query tokens of one sequence (positions p0, p0 + 1, ...) for KV
// heads [h0, h1). Every (token, head) keeps its own running softmax (queries in float32, the weighted sum of
// values, each query head's running maximum and total) and walks the keys chunk by chunk exactly as it would
// alone: a chunk's keys past the token's position are zeros, scored and masked. So a token's bits do not
// depend on the run or the heads that share its job. What the run shares is each chunk's rows: an fp8 cache's
// rows are converted to float32 once per chunk for all the run's tokens (a prefill's tokens would otherwise
// convert every key again), read key by key over the job's heads, which for all heads is one front-to-back pass
// over the cache block: a decode step's reads stream from memory (measured on a 2-core AMD EPYC, 16 sequences x
// 176 keys, caches of 30 layers: 247-263 against 367-407 us a call in bfloat16). R = at::BFloat16 (AVX2 builds):
// a bfloat16 cache's rows are read as stored and widened in registers where they are used, exactly, so the bits
// are those of the converted copies (checked against them: decode and prefill runs, head dims 32-128), without
// writing and reading the copies (2-core Xeon, 16 sequences x 160 keys: 122-134 against 145-153 us a call,
// alternated; no change a whole 16-sequence decode step could show, 18.7-18.9 ms either way). The G query heads of
// a KV head are scored and summed together where the build has AVX2 (attention_heads.h: each row widened once for
// all G, each head's chains unchanged, in 512-bit registers on AVX512 CPUs; the same bits. 2-core Xeon, the same
// call: 129 us head by head, 110-115 with the rows shared, 95-102 in 512-bit registers). In a prefill run, four
// tokens that all see a whole chunk share its rows too (attention_heads.h kTile; each token's and head's
// operations unchanged, so the same bits, tested against each token alone). 2-core Xeon with AMX, the 30 layers'
// attention of a prefill step: 8 x 256 tokens 227-238 -> 193-197 ms, 16 x 128 127-129 -> 112-116 ms (alternated;
// eight tokens at a time, G <= 3: 196-204 and 119-121 ms, not kept).
template <typename T, typename R>
void attend_run(const T* q, int64_t q_token_stride, int64_t q_head_stride, T* out, int64_t out_token_stride,
                int64_t out_head_stride, CacheView k, CacheView v, const int32_t* table, int64_t p0, int64_t count,
                int64_t group, int64_t h0, int64_t h1, float scale) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t dim = k.dim, heads = h1 - h0, lanes = heads * group;  // lanes: one token's query heads here
#if defined(CPU_CAPABILITY_AVX2)
  const auto* heads_kernels = attention_heads::for_group<R>(group, dim);  // the G heads' shared loops, or none
  const bool shared = heads_kernels != nullptr;
#else
  constexpr bool shared = false;
#endif
  std::vector<float> state(count * lanes * (2 * dim + 2));
  float* const qf = state.data();  // [token][head][g][dim]
  float* const acc = qf + count * lanes * dim;
  float* const m = acc + count * lanes * dim;  // [token][head][g]
  float* const l = m + count * lanes;
  // rows read through float32 copies, once per chunk, unless they are float32 or read as stored (R bfloat16)
  const bool convert = std::is_same_v<R, float> && k.dtype != at::kFloat;
  std::vector<float> converted(convert ? 2 * kChunk * heads * dim : 0);
  const R* krows[kChunk][16];  // [key][head - h0]: a row in the cache or in `converted`
  const R* vrows[kChunk][16];
  float scores[16][kChunk], factor[16];  // factor: the chunk's rescaling of acc
  const R* rows[kChunk];
  static const R zeros[256] = {};
  for (int64_t t = 0; t < count; ++t)
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = (t * heads + h - h0) * group + g;
        for (int64_t d = 0; d < dim; ++d) qf[i * dim + d] = static_cast<float>(q[t * q_token_stride + (h * group + g) * q_head_stride + d]);
        std::fill(acc + i * dim, acc + (i + 1) * dim, 0.0f);
        m[i] = kNegInf;
        l[i] = 0.0f;
      }
#if defined(CPU_CAPABILITY_AVX2)
  // kTile tokens that all see a whole chunk, at once (attention_heads.h: the same operations per token and head)
  const bool tiled = shared && heads_kernels->scores_tile != nullptr;
  const auto attend_tile = [&](int64_t t0) {
    constexpr int kT = attention_heads::kTile;
    float tile_scores[kT][attention_heads::kMaxGroup][kChunk], tile_factor[kT][attention_heads::kMaxGroup];
    const float* q_rows[kT];
    float* acc_rows[kT];
    const R* tile_rows[kChunk];
    for (int64_t h = h0; h < h1; ++h) {
      for (int i = 0; i < kT; ++i) {
        const int64_t base = ((t0 + i) * heads + h - h0) * group;
        q_rows[i] = qf + base * dim;
        acc_rows[i] = acc + base * dim;
      }
      for (int64_t j = 0; j < kChunk; ++j) tile_rows[j] = krows[j][h - h0];
      heads_kernels->scores_tile(q_rows, tile_rows, dim, scale, tile_scores);
      for (int i = 0; i < kT; ++i) {
        const int64_t base = ((t0 + i) * heads + h - h0) * group;
        heads_kernels->softmax(tile_scores[i], kChunk, m + base, l + base, tile_factor[i]);
      }
      for (int64_t j = 0; j < kChunk; ++j) tile_rows[j] = vrows[j][h - h0];
      heads_kernels->values_tile(acc_rows, tile_rows, dim, tile_scores, tile_factor);
    }
  };
#endif
  const int64_t last = p0 + count - 1;
  for (int64_t c0 = 0; c0 <= last; c0 += kChunk) {
    const int64_t n_all = std::min(kChunk, last + 1 - c0);  // keys of this chunk any token of the run reads
    for (int64_t j = 0, b = c0 / k.block_size, o = c0 % k.block_size; j < n_all; ++j) {  // key by key, its heads
      for (int64_t h = h0; h < h1; ++h) {
        k.head = v.head = h;
        R* kbuf = nullptr;
        if constexpr (std::is_same_v<R, float>)
          if (convert) kbuf = converted.data() + (j * heads + h - h0) * dim;
        krows[j][h - h0] = k.row(table[b], o, kbuf);
        vrows[j][h - h0] = v.row(table[b], o, kbuf != nullptr ? kbuf + kChunk * heads * dim : nullptr);
      }
      if (++o == k.block_size) o = 0, ++b;
    }
    const int64_t full = std::max<int64_t>(0, c0 + kChunk - 1 - p0);  // the first token that sees the whole chunk
    for (int64_t t = std::max<int64_t>(0, c0 - p0); t < count; ++t) {  // the tokens whose keys reach this chunk
#if defined(CPU_CAPABILITY_AVX2)
      if (tiled && t >= full && t + attention_heads::kTile <= count) {
        attend_tile(t);
        t += attention_heads::kTile - 1;
        continue;
      }
#endif
      const int64_t n = std::min(kChunk, p0 + t + 1 - c0);
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t base = (t * heads + h - h0) * group;
        for (int64_t j = 0; j < n; ++j) rows[j] = krows[j][h - h0];
        for (int64_t j = n; j < kChunk; ++j) rows[j] = zeros;  // scored, then masked to -inf
#if defined(CPU_CAPABILITY_AVX2)
        if (shared) {
          heads_kernels->scores(qf + base * dim, rows, dim, scale, scores);
          heads_kernels->softmax(scores, n, m + base, l + base, factor);
        }
#endif
        for (int64_t g = 0; g < (shared ? 0 : group); ++g) {
          const int64_t i = base + g;
          chunk_scores(qf + i * dim, rows, dim, scale, scores[g]);
          for (int64_t j = n; j < kChunk; ++j) scores[g][j] = kNegInf;
          float top = m[i];
          for (int64_t j = 0; j < n; ++j) top = std::max(top, scores[g][j]);
          const float correction = m[i] == kNegInf ? 0.0f : std::exp(m[i] - top);
          for (int64_t j = 0; j < kChunk; j += Vec::size()) (Vec::loadu(scores[g] + j) - Vec(top)).exp().store(scores[g] + j);
          float total = 0.0f;
          for (int64_t j = 0; j < n; ++j) total += scores[g][j];
          l[i] = l[i] * correction + total;
          m[i] = top;
          factor[g] = correction;
        }
        for (int64_t j = 0; j < n; ++j) rows[j] = vrows[j][h - h0];
#if defined(CPU_CAPABILITY_AVX2)
        if (shared) {
          heads_kernels->values(acc + base * dim, rows, n, dim, scores, factor);
          continue;
        }
#endif
        for (int64_t g = 0; g < group; ++g) {
          float* a = acc + (base + g) * dim;
          for (int64_t d = 0; d < dim; d += Vec::size()) {
            Vec x = Vec::loadu(a + d) * Vec(factor[g]);
            for (int64_t j = 0; j < n; ++j) x = at::vec::fmadd(Vec(scores[g][j]), load_vec(rows[j] + d), x);
            x.store(a + d);
          }
        }
      }
    }
  }
  for (int64_t t = 0; t < count; ++t)
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = (t * heads + h - h0) * group + g;
        for (int64_t d = 0; d < dim; ++d)
          out[t * out_token_stride + (h * group + g) * out_head_stride + d] = static_cast<T>(acc[i * dim + d] / l[i]);
      }
}

// The values of a small int32 or int64 CPU tensor (the step's query starts and sequence lengths).
std::vector<int64_t> int_values(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1, "query_start_loc and seq_lens must be 1-d CPU tensors");
  const at::Tensor c = t.contiguous();
  std::vector<int64_t> out(c.numel());
  if (c.scalar_type() == at::kInt) {
    std::copy(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel(), out.begin());
  } else {
    TORCH_CHECK(c.scalar_type() == at::kLong, "query_start_loc and seq_lens must be int32 or int64");
    std::copy(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel(), out.begin());
  }
  return out;
}

}  // namespace

namespace onecat_cpu {

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                           int64_t fp8_kind, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, const c10::optional<at::Tensor>& tile_rows) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, q_heads, dim] with unit inner stride");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "the K and V caches must be contiguous [blocks, block_size, kv_heads, dim]");
  const int64_t tokens = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && dim % Vec::size() == 0 && dim <= 256, "head dim must match the cache, be a multiple of ",
              Vec::size(), " and at most 256");
  TORCH_CHECK(q_heads % kv_heads == 0 && q_heads / kv_heads <= 16, "at most 16 query heads per KV head are supported");
  TORCH_CHECK(fp8_kind == kFp8None || fp8_kind == kFp8E4M3 || fp8_kind == kFp8E5M2, "fp8_kind must be 0, 1 or 2");
  TORCH_CHECK((fp8_kind == kFp8None) == (k_cache.scalar_type() != at::kByte), "fp8 caches are uint8 bytes with scales");
  if (fp8_kind != kFp8None) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value() && k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->scalar_type() == at::kFloat, "an fp8 cache needs its float32 scales");
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
                "the cache must hold float32, bfloat16 or fp8 bytes");
  }
  const at::Tensor tables = block_tables.scalar_type() == at::kInt ? block_tables.contiguous()
                                                                    : block_tables.to(at::kInt).contiguous();
  const std::vector<int64_t> s = int_values(query_start_loc), len = int_values(seq_lens);
  const int64_t seqs = static_cast<int64_t>(len.size());
  TORCH_CHECK(static_cast<int64_t>(s.size()) == seqs + 1 && s[seqs] == tokens, "query_start_loc must end at the token count");
  // Jobs: runs of up to kRun consecutive query tokens of one sequence (a decode token is a run of one) times
  // KV heads, all of a token's heads (up to 16: attend_run's row tables) a job when there are enough runs to
  // keep every thread busy. A sequence's first tile_rows[b] query rows (its prompt rows, where the caller asks)
  // run on AMX tiles (amx_attention.cpp), in runs of their own.
  constexpr int64_t kRun = 16;
  struct Run { int64_t first, count, seq, position; bool tiles; };
  const std::vector<int64_t> tiled = tile_rows.has_value() ? int_values(*tile_rows) : std::vector<int64_t>(seqs, 0);
  TORCH_CHECK(static_cast<int64_t>(tiled.size()) == seqs, "tile_rows must hold one count per sequence");
  if (tile_rows.has_value())
    TORCH_CHECK(amx_attention_available() && k_cache.scalar_type() == at::kBFloat16 && dim % 32 == 0,
                "tile_rows (prompt rows on AMX tiles) need AMX-BF16, a bfloat16 cache and a head dim a multiple of 32");
  std::vector<Run> runs;
  for (int64_t b = 0; b < seqs; ++b) {
    const int64_t q_len = s[b + 1] - s[b];
    TORCH_CHECK(q_len <= len[b] && (len[b] + block_size - 1) / block_size <= tables.size(1), "sequence ", b,
                " has more tokens than its block table holds");
    TORCH_CHECK(tiled[b] >= 0 && tiled[b] <= q_len, "tile_rows[", b, "] must be within the sequence's query rows");
    for (int64_t i = 0; i < q_len;) {
      const bool tiles = i < tiled[b];
      const int64_t n = std::min(kRun, (tiles ? tiled[b] : q_len) - i);
      runs.push_back({s[b] + i, n, b, len[b] - q_len + i, tiles});
      i += n;
    }
  }
  const float* ks = fp8_kind != kFp8None ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = fp8_kind != kFp8None ? v_scale->data_ptr<float>() : nullptr;
  const float* fp8_values = fp8_table(static_cast<int>(fp8_kind));
  const CacheView kv[2] = {{k_cache.data_ptr(), k_cache.scalar_type(), fp8_values, ks, block_size, kv_heads, dim},
                           {v_cache.data_ptr(), v_cache.scalar_type(), fp8_values, vs, block_size, kv_heads, dim}};
  const int64_t group = q_heads / kv_heads;
  at::Tensor out = at::empty({tokens, q_heads, dim}, q.options());
  const int64_t nruns = static_cast<int64_t>(runs.size());
  const int64_t heads_per_job = nruns >= 2 * at::get_num_threads() && kv_heads <= 16 ? kv_heads : 1;
  const int64_t splits = kv_heads / heads_per_job, jobs = nruns * splits;
  // key rows visited, for the grain: a job's worth of ~256 query-head x key rows (a one-token step over a few dozen
  // keys stays on the calling thread). A one-token decode over 130 keys runs its 3 KV heads on both threads:
  // measured on a 2-vCPU Xeon, the embedded model's 30 attention calls 644-674 -> 449-477 us a step at 2,048 rows
  // a job (then serial) against 256, and its layers 3.8-4.2 -> 3.4-3.7 ms, more than the attention's own share.
  int64_t work = 0;
  for (const Run& r : runs) work += r.count * (r.position + (r.count + 1) / 2);
  const int64_t grain = std::max<int64_t>(1, jobs * 256 / std::max<int64_t>(1, work * kv_heads * group));
  const int32_t* table0 = tables.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, jobs, grain, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const Run& r = runs[job / splits];
        const int64_t h0 = job % splits * heads_per_job;
        if constexpr (!std::is_same_v<scalar_t, double>) {  // (q is never double: checked above)
          if (r.tiles) {
            amx_attend_run<scalar_t>(qp + r.first * q.stride(0), q.stride(0), q.stride(1),
                                     op + r.first * q_heads * dim, q_heads * dim, dim, k_cache.data_ptr<at::BFloat16>(),
                                     v_cache.data_ptr<at::BFloat16>(), block_size, kv_heads, dim,
                                     table0 + r.seq * tables.size(1), r.position, r.count, group, h0,
                                     h0 + heads_per_job, static_cast<float>(scale));
            continue;
          }
        }
        const auto attend = [&](auto row_type) {
          attend_run<scalar_t, decltype(row_type)>(
              qp + r.first * q.stride(0), q.stride(0), q.stride(1), op + r.first * q_heads * dim, q_heads * dim, dim,
              kv[0], kv[1], table0 + r.seq * tables.size(1), r.position, r.count, group, h0, h0 + heads_per_job,
              static_cast<float>(scale));
        };
#if defined(CPU_CAPABILITY_AVX2)
        if (k_cache.scalar_type() == at::kBFloat16 && dim % 8 == 0) {
          attend(at::BFloat16());
          continue;
        }
#endif
        attend(0.0f);
      }
    });
  });
  return out;
}

}  // namespace onecat_cpu

TORCH_LIBRARY_FRAGMENT(onecat_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, int fp8_kind, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, Tensor? tile_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(onecat_cpu, CPU, m) { m.impl("paged_attention", &onecat_cpu::paged_attention); }
