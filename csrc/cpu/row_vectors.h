// Row pieces on ATen's Vectorized<float> shared by the CPU ops: two vectors from 2 * lanes values (bfloat16
// widened exactly) and back (bfloat16 rounded to nearest even, as a cast does), and one row's SiLU(gate) * up,
// used by silu_mul (fused_ops.cpp) and by the AMX prompt rows' gate/up epilogue (amx_bf16_matmul.cpp), which
// so give the same bits.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <tuple>

namespace onecat_cpu {

// Two Vectorized<float> from 2 * lanes values (bfloat16 widened exactly), and back (bfloat16 rounded to
// nearest even, as a cast does).
using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<at::BFloat16>;

inline std::tuple<Vec, Vec> load2(const float* p) { return {Vec::loadu(p), Vec::loadu(p + Vec::size())}; }
inline std::tuple<Vec, Vec> load2(const at::BFloat16* p) { return at::vec::convert_bfloat16_float(BVec::loadu(p)); }
inline void store2(float* p, const Vec& a, const Vec& b) { a.store(p); b.store(p + Vec::size()); }
inline void store2(at::BFloat16* p, const Vec& a, const Vec& b) { at::vec::convert_float_bfloat16(a, b).store(p); }

inline Vec silu_times(const Vec& x, const Vec& u) { return x / (Vec(1.0f) + x.neg().exp()) * u; }

// SiLU(gate) * up of one row, 2 * Vectorized<float> lanes at a time (SLEEF's exp where the build has AVX2),
// the row's last values one by one: every row takes the same path, whatever the row count.
template <typename In, typename Out>
void silu_mul_row(const In* g, Out* out, int64_t width) {
  constexpr int64_t step = 2 * Vec::size();
  int64_t i = 0;
  for (; i + step <= width; i += step) {
    auto [g0, g1] = load2(g + i);
    auto [u0, u1] = load2(g + width + i);
    store2(out + i, silu_times(g0, u0), silu_times(g1, u1));
  }
  for (; i < width; ++i) {
    const float x = static_cast<float>(g[i]), u = static_cast<float>(g[i + width]);
    out[i] = Out(x / (1.0f + std::exp(-x)) * u);
  }
}

}  // namespace onecat_cpu
