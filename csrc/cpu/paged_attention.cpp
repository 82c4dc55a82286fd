// Causal attention over the paged KV cache on the CPU, read in place through the block tables.
//
// Each (query token, KV head) is one job: the G query heads sharing that KV head walk the token's keys
// 0..position in chunks of kChunk keys at absolute multiples of kChunk, with an online softmax in float32.
// A job's arithmetic depends only on its query row and its keys, never on the other tokens of the step,
// the query length or the thread that runs it, so a token's result is the same whatever batch it is in
// and whether its prefix came from the prefix cache (the engine's CPU batch invariance), and keys past the
// position are never read (no mask, no padding, no gather copy).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fused_ops.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 16;  // keys per softmax step; a multiple of Vec::size()
constexpr int64_t kMaxRow = 4096;  // G * D of one job's query rows (floats kept on the stack)
constexpr int kFp8None = 0, kFp8E4M3 = 1, kFp8E5M2 = 2;  // engine/attention/cpu_paged.py FP8_KINDS

// One layer's K or V cache: [blocks, block_size, kv_heads, dim] in float32, bfloat16 or fp8 bytes with a
// float32 scale per stored token and head (value = fp8 * scale, as engine/kv_cache.py dequantize_fp8).
struct CacheView {
  const void* data;
  at::ScalarType dtype;
  int fp8_kind;
  const float* scale;
  int64_t block_size, kv_heads, dim;

  // Key j of KV head h of the sequence whose block-table row is `table`, as float32: a pointer into the
  // cache when it holds float32, else the row converted into `scratch`.
  const float* row(const int32_t* table, int64_t j, int64_t h, float* scratch) const {
    const int64_t index = (static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size) * kv_heads + h;
    if (dtype == at::kFloat) return static_cast<const float*>(data) + index * dim;
    if (dtype == at::kBFloat16) {
      const at::BFloat16* src = static_cast<const at::BFloat16*>(data) + index * dim;
      for (int64_t d = 0; d < dim; ++d) scratch[d] = static_cast<float>(src[d]);
      return scratch;
    }
    const uint8_t* src = static_cast<const uint8_t*>(data) + index * dim;
    const float s = scale[index];
    for (int64_t d = 0; d < dim; ++d) {
      const float x = fp8_kind == kFp8E4M3 ? static_cast<float>(c10::Float8_e4m3fn(src[d], c10::Float8_e4m3fn::from_bits()))
                                          : static_cast<float>(c10::Float8_e5m2(src[d], c10::Float8_e5m2::from_bits()));
      scratch[d] = x * s;
    }
    return scratch;
  }
};

// Dot product of two dim-long float rows: lane-wise fused multiply-adds, then the lanes summed in order.
inline float dot(const float* a, const float* b, int64_t dim) {
  Vec acc(0.0f);
  for (int64_t d = 0; d < dim; d += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float lanes[Vec::size()];
  acc.store(lanes);
  float sum = 0.0f;
  for (int64_t i = 0; i < Vec::size(); ++i) sum += lanes[i];
  return sum;
}

// acc[0:dim] += p * row, one fused multiply-add per value
inline void add_scaled(float* acc, float p, const float* row, int64_t dim) {
  const Vec pv(p);
  for (int64_t d = 0; d < dim; d += Vec::size()) at::vec::fmadd(pv, Vec::loadu(row + d), Vec::loadu(acc + d)).store(acc + d);
}

template <typename T>
void attend_one(const T* q, int64_t q_head_stride, T* out, int64_t out_head_stride, const CacheView& k,
                const CacheView& v, const int32_t* table, int64_t position, int64_t group, float scale) {
  const int64_t dim = k.dim;
  float qf[kMaxRow], acc[kMaxRow], kbuf[256], vbuf[256];
  float scores[16][kChunk], m[16], l[16];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(q[g * q_head_stride + d]);
    std::fill(acc + g * dim, acc + (g + 1) * dim, 0.0f);
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  for (int64_t c0 = 0; c0 <= position; c0 += kChunk) {
    const int64_t n = std::min(kChunk, position + 1 - c0);
    for (int64_t j = 0; j < n; ++j) {
      const float* key = k.row(table, c0 + j, 0, kbuf);
      for (int64_t g = 0; g < group; ++g) scores[g][j] = dot(qf + g * dim, key, dim) * scale;
    }
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t j = n; j < kChunk; ++j) scores[g][j] = -std::numeric_limits<float>::infinity();
      float top = m[g];
      for (int64_t j = 0; j < n; ++j) top = std::max(top, scores[g][j]);
      const float correction = m[g] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[g] - top);
      float total = 0.0f;
      for (int64_t j = 0; j < kChunk; j += Vec::size()) {
        const Vec p = (Vec::loadu(scores[g] + j) - Vec(top)).exp();
        p.store(scores[g] + j);
      }
      for (int64_t j = 0; j < n; ++j) total += scores[g][j];
      l[g] = l[g] * correction + total;
      m[g] = top;
      if (correction != 1.0f) {
        const Vec f(correction);
        for (int64_t d = 0; d < dim; d += Vec::size()) (Vec::loadu(acc + g * dim + d) * f).store(acc + g * dim + d);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* value = v.row(table, c0 + j, 0, vbuf);
      for (int64_t g = 0; g < group; ++g) add_scaled(acc + g * dim, scores[g][j], value, dim);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) out[g * out_head_stride + d] = static_cast<T>(acc[g * dim + d] / l[g]);
}

}  // namespace

namespace onecat_cpu {

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                           int64_t fp8_kind, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, q_heads, dim] with unit inner stride");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "the K and V caches must be contiguous [blocks, block_size, kv_heads, dim]");
  const int64_t tokens = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && dim % Vec::size() == 0 && dim <= 256, "head dim must match the cache, be a multiple of ",
              Vec::size(), " and at most 256");
  TORCH_CHECK(q_heads % kv_heads == 0 && q_heads / kv_heads <= 16 && q_heads / kv_heads * dim <= kMaxRow,
              "at most 16 query heads per KV head and ", kMaxRow, " values per group are supported");
  TORCH_CHECK((fp8_kind == kFp8None) == (k_cache.scalar_type() != at::kByte), "fp8 caches are uint8 bytes with scales");
  if (fp8_kind != kFp8None) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value() && k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->scalar_type() == at::kFloat, "an fp8 cache needs its float32 scales");
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
                "the cache must hold float32, bfloat16 or fp8 bytes");
  }
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  const at::Tensor starts = query_start_loc.to(at::kLong).contiguous(), lens = seq_lens.to(at::kLong).contiguous();
  const int64_t seqs = lens.numel();
  TORCH_CHECK(starts.numel() == seqs + 1 && starts[seqs].item<int64_t>() == tokens, "query_start_loc must end at the token count");
  std::vector<int64_t> seq_of(tokens), position(tokens);  // each token's sequence and absolute position
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < seqs; ++b) {
    const int64_t q_len = s[b + 1] - s[b];
    TORCH_CHECK(q_len <= len[b] && (len[b] + block_size - 1) / block_size <= tables.size(1), "sequence ", b,
                " has more tokens than its block table holds");
    for (int64_t i = 0; i < q_len; ++i) seq_of[s[b] + i] = b, position[s[b] + i] = len[b] - q_len + i;
  }
  const float* ks = fp8_kind != kFp8None ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = fp8_kind != kFp8None ? v_scale->data_ptr<float>() : nullptr;
  const CacheView kv[2] = {{k_cache.data_ptr(), k_cache.scalar_type(), static_cast<int>(fp8_kind), ks, block_size, kv_heads, dim},
                           {v_cache.data_ptr(), v_cache.scalar_type(), static_cast<int>(fp8_kind), vs, block_size, kv_heads, dim}};
  const int64_t group = q_heads / kv_heads;
  at::Tensor out = at::empty({tokens, q_heads, dim}, q.options());
  int64_t work = 0;  // key rows visited, for the grain: small steps stay on the calling thread
  for (int64_t t = 0; t < tokens; ++t) work += position[t] + 1;
  const int64_t jobs = tokens * kv_heads, grain = std::max<int64_t>(1, jobs * 2048 / std::max<int64_t>(1, work * kv_heads * group));
  const int32_t* table0 = tables.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, jobs, grain, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const int64_t t = job / kv_heads, h = job % kv_heads;
        CacheView k = kv[0], v = kv[1];
        // the head offset goes into the data pointer: row() then indexes head 0 of the token's slot
        const int64_t elem = k_cache.element_size();
        k.data = static_cast<const char*>(k.data) + h * dim * elem;
        v.data = static_cast<const char*>(v.data) + h * dim * elem;
        if (ks != nullptr) k.scale = ks + h, v.scale = vs + h;
        attend_one<scalar_t>(qp + t * q.stride(0) + h * group * q.stride(1), q.stride(1),
                             op + (t * q_heads + h * group) * dim, dim, k, v, table0 + seq_of[t] * tables.size(1),
                             position[t], group, static_cast<float>(scale));
      }
    });
  });
  return out;
}

}  // namespace onecat_cpu

TORCH_LIBRARY_FRAGMENT(onecat_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, int fp8_kind, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(onecat_cpu, CPU, m) { m.impl("paged_attention", &onecat_cpu::paged_attention); }
