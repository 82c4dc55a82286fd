// Row-wise fused CPU ops for the float32 decoder layer: residual add + RMSNorm, RoPE + K/V cache write,
// SiLU(gate) * up, q/k norm + RoPE (a DFlash drafter's block). In eager torch each of these is 3-10 small ops
// whose per-call cost (~1-3 us each on a small CPU) outweighs their arithmetic at decode batch sizes; here each
// is one call. And each row's argmax (greedy sampling's), which torch's generic reduction walks a value at a time.
//
// Every output row is computed by the same scalar loop whatever the number of rows, so results do not
// depend on the batch (the engine's CPU batch-invariance holds). Products and sums are written out in
// the reference order (no fused multiply-add contraction is requested), so they match the torch
// reference ops to rounding of the reductions.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "fused_ops.h"
#include "row_vectors.h"

namespace {

// Rows per parallel task: enough values that a task outweighs its scheduling (~32K), so a 16-row decode step
// of a wide op (SiLU * up over 1536 columns) spreads over the threads instead of running on one. A row is
// computed the same way whichever task takes it.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with unit inner stride");
}

}  // namespace

namespace onecat_cpu {



// One row of add_rms_norm: s = x + residual (x read as float: a bfloat16 x converts exactly), then
// weight * s / sqrt(mean(s^2) + eps).
template <typename In, typename Out>
void norm_row(const In* x, const float* res, const float* w, float* sum_out, Out* out, int64_t width, float eps) {
  constexpr int64_t step = 2 * Vec::size();
  const int64_t body = width - width % step;  // the same split for every row
  const float* s;
  if (res != nullptr) {
    for (int64_t i = 0; i < body; i += step) {
      auto [x0, x1] = load2(x + i);
      store2(sum_out + i, x0 + Vec::loadu(res + i), x1 + Vec::loadu(res + i + Vec::size()));
    }
    for (int64_t i = body; i < width; ++i) sum_out[i] = static_cast<float>(x[i]) + res[i];
    s = sum_out;
  } else {
    s = reinterpret_cast<const float*>(x);  // float32 x without a residual (checked by the caller)
  }
  Vec acc0(0.0f), acc1(0.0f);  // squares summed in lanes, then the lanes in order, in double
  for (int64_t i = 0; i < body; i += step) {
    const Vec a = Vec::loadu(s + i), b = Vec::loadu(s + i + Vec::size());
    acc0 = acc0 + a * a;
    acc1 = acc1 + b * b;
  }
  float lanes[step];
  acc0.store(lanes);
  acc1.store(lanes + Vec::size());
  double squares = 0.0;
  for (int64_t j = 0; j < step; ++j) squares += lanes[j];
  for (int64_t i = body; i < width; ++i) squares += static_cast<double>(s[i]) * s[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(squares / width) + eps);
  const Vec vinv(inv);
  for (int64_t i = 0; i < body; i += step) {
    const Vec a = Vec::loadu(w + i) * (Vec::loadu(s + i) * vinv);
    const Vec b = Vec::loadu(w + i + Vec::size()) * (Vec::loadu(s + i + Vec::size()) * vinv);
    store2(out + i, a, b);
  }
  for (int64_t i = body; i < width; ++i) out[i] = Out(w[i] * (s[i] * inv));
}

// (weight * RMSNorm(x + residual), x + residual); without residual the second item is x itself. x may be
// bfloat16 when a residual is given (a packed matmul's output: the sum is the same as after a cast).
// bf16_out: the normed rows in bfloat16 (what a packed 4-bit matmul takes), rounded to nearest even.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps, bool bf16_out) {
  const bool bf16_in = x.scalar_type() == at::kBFloat16 && residual.has_value();
  if (!bf16_in) check_rows(x, "x");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be [rows, width] on the CPU");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == width,
              "weight must be a contiguous float32 vector of the row width");
  at::Tensor sum = x;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual and x shapes differ");
    sum = at::empty({rows, width}, residual->options());
  }
  at::Tensor out = at::empty({rows, width}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* res = residual.has_value() ? residual->data_ptr<float>() + r * residual->stride(0) : nullptr;
      float* sr = residual.has_value() ? sum.data_ptr<float>() + r * width : nullptr;
      if (bf16_in) {
        const at::BFloat16* xr = x.data_ptr<at::BFloat16>() + r * x.stride(0);
        if (bf16_out) norm_row(xr, res, w, sr, out.data_ptr<at::BFloat16>() + r * width, width, e);
        else norm_row(xr, res, w, sr, out.data_ptr<float>() + r * width, width, e);
      } else {
        const float* xr = x.data_ptr<float>() + r * x.stride(0);
        if (bf16_out) norm_row(xr, res, w, sr, out.data_ptr<at::BFloat16>() + r * width, width, e);
        else norm_row(xr, res, w, sr, out.data_ptr<float>() + r * width, width, e);
      }
    }
  });
  return {out, sum};
}

// One head of head_dim = 2 * half values rotated in place by the half-split (NeoX/HF) rotation with the
// position's cos / sin rows.
static inline void rotate_head(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    const float a = x1 * c[i], b = (-x2) * s[i];  // x * cos + rotate_half(x) * sin, first half
    const float p = x2 * c[i + half], q = x1 * s[i + half];  // second half
    x[i] = a + b;
    x[i + half] = p + q;
  }
}

static void check_rope_tables(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions, int64_t rows) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.dim() == 2 && cos.sizes() == sin.sizes(),
              "cos/sin must be contiguous float32 [positions, head_dim] tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == rows,
              "positions must be a contiguous int64 vector, one per row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position ", pos[r], " is outside the rotary table [0, ",
                cos.size(0), ")");
}

// In place on qkv rows [q heads | k heads | v heads] of head_dim each: every q head RMSNormed with q_weight and
// every k head with k_weight (head_dim each), then both rotated at the row's position (a Qwen3-style attention's
// q/k norm and RoPE, with no cache to write: a DFlash drafter's block).
void qk_norm_rope(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t q_heads, int64_t kv_heads, const at::Tensor& q_weight, const at::Tensor& k_weight,
                  double eps) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0), dim = cos.size(1);
  check_rope_tables(cos, sin, positions, rows);
  TORCH_CHECK(qkv.size(1) == (q_heads + 2 * kv_heads) * dim, "qkv width is not (q_heads + 2 kv_heads) * head_dim");
  for (const at::Tensor* w : {&q_weight, &k_weight})
    TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == dim,
                "q/k norm weights must be contiguous float32 vectors of head_dim");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, row_grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = qkv.data_ptr<float>() + r * qkv.stride(0);
      const float* c = cos.data_ptr<float>() + pos[r] * dim;
      const float* s = sin.data_ptr<float>() + pos[r] * dim;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
        float* x = row + h * dim;
        norm_row(x, nullptr, (h < q_heads ? q_weight : k_weight).data_ptr<float>(), nullptr, x, dim, e);
        rotate_head(x, c, s, dim / 2);
      }
    }
  });
}

// In place on qkv rows [q heads | k heads | v heads] of head_dim each: rotate the q and k heads by the
// half-split (NeoX/HF) rotation at each row's position, then store the rotated k and the v heads at
// the row's cache slot (caches [blocks, block_size, kv_heads, head_dim] of float32 or bfloat16, slot =
// block * block_size + i).
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t q_heads, int64_t kv_heads, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slots) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0);
  check_rope_tables(cos, sin, positions, rows);
  const int64_t dim = cos.size(1), half = dim / 2;
  TORCH_CHECK(qkv.size(1) == (q_heads + 2 * kv_heads) * dim, "qkv width is not (q_heads + 2 kv_heads) * head_dim");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
              "slots must be a contiguous int64 vector, one per row");
  const bool bf16_cache = k_cache.scalar_type() == at::kBFloat16;
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->scalar_type() == k_cache.scalar_type() && (c->scalar_type() == at::kFloat || bf16_cache) &&
                c->is_contiguous() && c->dim() == 4 && c->size(2) == kv_heads && c->size(3) == dim,
                "caches must be contiguous float32 or bfloat16 [blocks, block_size, kv_heads, head_dim]");
  }
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), row_kv = kv_heads * dim;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slot[r] >= 0 && slot[r] < num_slots, "cache slot ", slot[r], " is outside the cache");
  at::parallel_for(0, rows, row_grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = qkv.data_ptr<float>() + r * qkv.stride(0);
      const float* c = cos.data_ptr<float>() + pos[r] * dim;
      const float* s = sin.data_ptr<float>() + pos[r] * dim;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) rotate_head(row + h * dim, c, s, half);
      const float* k_row = row + q_heads * dim;
      const float* v_row = row + (q_heads + kv_heads) * dim;
      if (bf16_cache) {  // rounded to nearest even, as a cast does
        at::BFloat16* kc = k_cache.data_ptr<at::BFloat16>() + slot[r] * row_kv;
        at::BFloat16* vc = v_cache.data_ptr<at::BFloat16>() + slot[r] * row_kv;
        for (int64_t i = 0; i < row_kv; ++i) kc[i] = at::BFloat16(k_row[i]), vc[i] = at::BFloat16(v_row[i]);
      } else {
        std::memcpy(k_cache.data_ptr<float>() + slot[r] * row_kv, k_row, row_kv * sizeof(float));
        std::memcpy(v_cache.data_ptr<float>() + slot[r] * row_kv, v_row, row_kv * sizeof(float));
      }
    }
  });
}

// SiLU(gate) * up for rows [gate | up] (float32, or bfloat16: a packed matmul's output, read exactly);
// bf16_out as in add_rms_norm.
at::Tensor silu_mul(const at::Tensor& gate_up, bool bf16_out) {
  const bool bf16_in = gate_up.scalar_type() == at::kBFloat16;
  if (!bf16_in) check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * width] on the CPU");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  at::parallel_for(0, rows, row_grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (bf16_in) {
        const at::BFloat16* g = gate_up.data_ptr<at::BFloat16>() + r * gate_up.stride(0);
        if (bf16_out) silu_mul_row(g, out.data_ptr<at::BFloat16>() + r * width, width);
        else silu_mul_row(g, out.data_ptr<float>() + r * width, width);
      } else {
        const float* g = gate_up.data_ptr<float>() + r * gate_up.stride(0);
        if (bf16_out) silu_mul_row(g, out.data_ptr<at::BFloat16>() + r * width, width);
        else silu_mul_row(g, out.data_ptr<float>() + r * width, width);
      }
    }
  });
  return out;
}

// The first index of a float32 row's largest value, as torch.argmax gives it: the first NaN where the row has
// one (NaN counts as the largest), else the first index holding the maximum. A vector pass finds the maximum
// (and whether a NaN is there), a second the first index holding it.
int64_t argmax_row(const float* x, int64_t n) {
  constexpr int64_t L = Vec::size();
  Vec top(-std::numeric_limits<float>::infinity());
  bool nan = false;
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const Vec v = Vec::loadu(x + i);
    nan = nan || v.isnan().zero_mask() != (1 << L) - 1;  // zero_mask: the lanes that are not NaN
    top = at::vec::maximum(top, v);
  }
  float lanes[L];
  top.store(lanes);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; ++j) m = std::max(m, lanes[j]);
  for (; i < n; ++i) nan = nan || std::isnan(x[i]), m = std::max(m, x[i]);
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const Vec want(m);
  for (i = 0; i + L <= n; i += L) {
    const int mask = (Vec::loadu(x + i) == want).zero_mask() ^ ((1 << L) - 1);  // lanes equal to the maximum
    if (mask != 0) return i + __builtin_ctz(mask);
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // an empty row
}

// Each row's argmax [rows] int64 of float32 rows [rows, n], rows in parallel.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x.data_ptr<float>() + r * x.stride(0), n);
  });
  return out;
}

}  // namespace onecat_cpu

TORCH_LIBRARY(onecat_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, bool bf16_out) -> (Tensor, Tensor)");
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int q_heads, int kv_heads, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots) -> ()");
  m.def("silu_mul(Tensor gate_up, bool bf16_out) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("qk_norm_rope(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int q_heads, int kv_heads, "
        "Tensor q_weight, Tensor k_weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(onecat_cpu, CPU, m) {
  m.impl("add_rms_norm", &onecat_cpu::add_rms_norm);
  m.impl("rope_write_kv", &onecat_cpu::rope_write_kv);
  m.impl("silu_mul", &onecat_cpu::silu_mul);
  m.impl("argmax_rows", &onecat_cpu::argmax_rows);
  m.impl("qk_norm_rope", &onecat_cpu::qk_norm_rope);
}
