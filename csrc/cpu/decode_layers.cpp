// One decode step (one new token for each of its sequences) through every decoder layer of a Llama-family
// model whose linears are packed 4-bit (one int4 term each, no bias), in one call. It makes exactly the calls
// the Python layers make (the same kernels on the same inputs, in the same order: engine/models/llama.py,
// engine/layers/, engine/attention/cpu_paged.py), so its result is the Python path's to the bit; what it saves
// is the ~40 Python-level calls per layer around them, which cost more than the arithmetic of a one-token step
// on a small CPU. Anything else (other batch shapes, other weights) stays in Python. Where the packed layers run
// on int8 dot products (engine/quant/int4/int8_matmul.py: CPUs with AVX512-VNNI or AVX2), the step calls that
// kernel as they do, on float32 rows, and a step of several sequences runs here too (every op it makes is row by
// row: a 16-sequence step of the embedded model 12% faster on a 2-core Xeon); else one sequence's.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "fused_ops.h"

namespace {

using onecat_cpu::add_rms_norm;
using onecat_cpu::int8_matmul;
using onecat_cpu::paged_attention;
using onecat_cpu::rope_write_kv;
using onecat_cpu::silu_mul;

constexpr int64_t kGroup = 32;   // engine/quant/int4/layout.py GROUP
constexpr int64_t kTile = 16;  // output columns per tile of the int8 layout (int8_matmul.cpp)
constexpr int64_t kPerLayer = 16;  // tensors per layer in `layers`, in the order below

// Int4PackedLinear.forward for one term, no padding rows, no bias: bf16 in, the kernel's bf16 out (the
// fused ops after o/gate_up/down read it as it is), or float32 for the qkv projection (RoPE works in place).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zero, bool to_float) {
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), packed, kGroup, scale_zero);
  return to_float ? y.to(at::kFloat) : y;
}

// One packed linear (three tensors of `layers`) as the Python layer runs it: the 4-bit kernel (packed,
// scale_zero, an unused third) or, with `int8`, the int8 dot products (its layout's three) on float32 rows,
// which return float32.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor* t, bool int8, bool to_float) {
  if (int8) return int8_matmul(x.contiguous(), t[0], t[1], t[2], t[0].size(0) * kTile);
  return int4_linear(x, t[0], t[1], to_float);
}

// layers: per layer [input_norm, qkv (3), o (3), post_norm, gate_up (3), down (3), k cache, v cache].
// Returns (h, residual, taps): the last layer's MLP output, the residual stream before it, and the outputs of the
// layers in `taps` (a feature-conditioned drafter's: llama.py tapped_layers), each the sum the next layer's input
// norm forms, in layer order; the last layer's output, formed by the final norm, is the caller's to add.
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> decode_layers_int4(
    at::Tensor h, const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList layers, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, int64_t q_heads, int64_t kv_heads, double eps, double scale, bool int8,
    at::IntArrayRef taps) {
  TORCH_CHECK(h.dim() == 2 && (h.size(0) == 1 || int8) && h.scalar_type() == at::kFloat,
              "h must be float32 rows, one unless the linears run on int8");
  const int64_t rows = h.size(0);
  // Returns (h, residual) with h in bfloat16 (the 4-bit kernel's output) or float32 (int8), as the Python layers.
  TORCH_CHECK(layers.size() % kPerLayer == 0, "layers must hold ", kPerLayer, " tensors per layer");
  const int64_t dim = cos.size(1), q_size = q_heads * dim;
  const bool bf16_inputs = !int8;  // the 4-bit kernel reads bf16 rows; the int8 one rounds float32 rows itself
  c10::optional<at::Tensor> residual;
  std::vector<at::Tensor> tapped;
  for (size_t l = 0; l < layers.size(); l += kPerLayer) {
    const at::Tensor* w = &layers[l];
    at::Tensor x;
    if (!residual.has_value()) {  // first layer: residual = h, qkv_proj(input_layernorm(h))
      x = std::get<0>(add_rms_norm(h, c10::nullopt, w[0], eps, false));
      residual = h;
    } else {
      auto normed = add_rms_norm(h, residual, w[0], eps, bf16_inputs);
      x = std::get<0>(normed);
      residual = std::get<1>(normed);  // the previous layer's output (a new tensor: kept as it is)
      const int64_t previous = static_cast<int64_t>(l / kPerLayer) - 1;
      if (std::find(taps.begin(), taps.end(), previous) != taps.end()) tapped.push_back(*residual);
    }
    at::Tensor qkv = packed_linear(x, &w[1], int8, true);
    rope_write_kv(qkv, positions, cos, sin, q_heads, kv_heads, w[14], w[15], slots);
    at::Tensor q = qkv.slice(1, 0, q_size).view({rows, q_heads, dim});
    at::Tensor attn = paged_attention(q, w[14], w[15], c10::nullopt, c10::nullopt, 0, block_tables, query_start_loc,
                                      seq_lens, scale);
    at::Tensor o = packed_linear(attn.reshape({rows, q_size}), &w[4], int8, false);
    auto normed = add_rms_norm(o, residual, w[7], eps, bf16_inputs);
    residual = std::get<1>(normed);
    at::Tensor act = silu_mul(packed_linear(std::get<0>(normed), &w[8], int8, false), bf16_inputs);
    h = packed_linear(act, &w[11], int8, false);
  }
  return {h, *residual, tapped};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(onecat_cpu, m) {
  m.def("decode_layers_int4(Tensor h, Tensor positions, Tensor slots, Tensor cos, Tensor sin, Tensor[] layers, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, int q_heads, int kv_heads, float eps, "
        "float scale, bool int8=False, int[] taps=[]) -> (Tensor, Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(onecat_cpu, CPU, m) { m.impl("decode_layers_int4", &decode_layers_int4); }
