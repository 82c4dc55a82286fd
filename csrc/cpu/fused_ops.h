// Row-wise fused CPU ops (fused_ops.cpp) and the paged attention (paged_attention.cpp, its prompt runs on AMX tiles
// in amx_attention.cpp), also called by the one-call decode step (decode_layers.cpp).
#pragma once
#include <ATen/ATen.h>

#include <string>

namespace onecat_cpu {

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps, bool bf16_out);
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t q_heads, int64_t kv_heads, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots);
at::Tensor silu_mul(const at::Tensor& gate_up, bool bf16_out);
void qk_norm_rope(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t q_heads, int64_t kv_heads, const at::Tensor& q_weight, const at::Tensor& k_weight,
                  double eps);
// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                           int64_t fp8_kind, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale,
                           const c10::optional<at::Tensor>& tile_rows = c10::nullopt);
// amx_attention.cpp: a run of 1-16 prompt tokens of one sequence on AMX tiles (a bfloat16 cache), KV heads
// [h0, h1); paged_attention's runs whose rows it is given as tile rows
bool amx_attention_available();
template <typename T>
void amx_attend_run(const T* q, int64_t q_token_stride, int64_t q_head_stride, T* out, int64_t out_token_stride,
                    int64_t out_head_stride, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                    int64_t block_size, int64_t kv_heads, int64_t dim, const int32_t* table, int64_t p0,
                    int64_t count, int64_t group, int64_t h0, int64_t h1, float scale);
// int8_matmul.cpp: a packed layer's rows on int8 dot products (the layout of `scales` picks the kernel; `kernel`
// "avx2" runs the compact layout on the AVX2 kernel where the CPU has a faster one, to compare their bits)
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t n, const std::string& kernel = "");

}  // namespace onecat_cpu
