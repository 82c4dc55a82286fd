// Torch binding of the Volta attention kernels: argument checks and launch configuration.
// Kernel bodies live in csrc/flash_attn_v100/, their launchers in flash_attn_v100_launch.cu.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "flash_attn_v100_launch.h"

namespace {

using fa_v100::AttnParams;

void check_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale, int64_t kv_kind,
                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kHalf && q.dim() == 3 && q.is_contiguous(),
              "q must be a contiguous CUDA float16 tensor [T, num_heads, head_dim]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kHalf && out.is_contiguous(),
              "out must be a contiguous float16 tensor shaped like q");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous(),
              "k/v caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(k.size(3) == q.size(2), "cache head_dim ", k.size(3), " != q head_dim ", q.size(2));
  TORCH_CHECK(q.size(1) % k.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(kv_kind >= 0 && kv_kind <= 2, "kv_kind must be 0 (f16), 1 (e4m3) or 2 (e5m2)");
  if (kv_kind == fa_v100::kKvF16) {
    TORCH_CHECK(k.scalar_type() == at::kHalf && v.scalar_type() == at::kHalf, "f16 caches must be float16");
  } else {
    TORCH_CHECK(k.scalar_type() == at::kByte && v.scalar_type() == at::kByte, "fp8 caches must be uint8 bytes");
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "fp8 caches need k_scale and v_scale");
    const int64_t slots = k.size(0) * k.size(1) * k.size(2);
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                    k_scale->is_contiguous() && v_scale->is_contiguous() && k_scale->numel() == slots &&
                    v_scale->numel() == slots,
                "fp8 scales must be contiguous float32 [num_blocks, block_size, num_kv_heads]");
  }
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_tables})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kInt && t->is_contiguous(),
                "query_start_loc, seq_lens and block_tables must be contiguous CUDA int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0) &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1,
              "block_tables [B, max_blocks], seq_lens [B] and query_start_loc [B+1] disagree");
}

AttnParams make_params(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                       int64_t kv_kind, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const at::Tensor& block_tables, double scale, bool causal) {
  AttnParams p{};
  p.q = reinterpret_cast<const __half*>(q.data_ptr());
  p.out = reinterpret_cast<__half*>(out.data_ptr());
  p.kv.k = k.data_ptr();
  p.kv.v = v.data_ptr();
  p.kv.k_scale = kv_kind == fa_v100::kKvF16 ? nullptr : k_scale->data_ptr<float>();
  p.kv.v_scale = kv_kind == fa_v100::kKvF16 ? nullptr : v_scale->data_ptr<float>();
  p.kv.block_tables = block_tables.data_ptr<int>();
  p.kv.block_table_stride = static_cast<int>(block_tables.size(1));
  p.kv.block_size = static_cast<int>(k.size(1));
  p.kv.num_kv_heads = static_cast<int>(k.size(2));
  p.query_start_loc = query_start_loc.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.num_heads = static_cast<int>(q.size(1));
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.causal = causal ? 1 : 0;
  return p;
}

// Largest q_len * (num_heads / num_kv_heads) the decode kernel packs into one CTA.
int64_t decode_max_rows(int64_t head_dim) { return fa_v100_decode_max_rows(static_cast<int>(head_dim)); }

void prefill(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale, int64_t kv_kind,
             const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
             int64_t max_query_len, double scale, bool causal, int64_t variant) {
  TORCH_CHECK(variant >= 0 && variant <= 3, "prefill variant must be 0, 1, 2 or 3");
  check_inputs(out, q, k, v, k_scale, v_scale, kv_kind, query_start_loc, seq_lens, block_tables);
  const c10::cuda::CUDAGuard guard(q.device());
  AttnParams p = make_params(out, q, k, v, k_scale, v_scale, kv_kind, query_start_loc, seq_lens, block_tables,
                             scale, causal);
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  if (num_seqs == 0 || q.size(0) == 0 || max_query_len <= 0) return;
  const int d = static_cast<int>(q.size(2));
  const int BM = fa_v100_prefill_tile_rows();
  p.q_tiles_per_seq = static_cast<int>((max_query_len + BM - 1) / BM);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "head_dim ", d, " unsupported: use 64, 128 or 256");
  C10_CUDA_CHECK(fa_v100_launch_prefill(p, d, static_cast<int>(kv_kind), num_seqs, static_cast<int>(variant), stream));
}

void decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale, int64_t kv_kind,
            const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
            int64_t max_query_len, int64_t max_seq_len, double scale, int64_t num_splits, int64_t variant) {
  check_inputs(out, q, k, v, k_scale, v_scale, kv_kind, query_start_loc, seq_lens, block_tables);
  const c10::cuda::CUDAGuard guard(q.device());
  const int d = static_cast<int>(q.size(2));
  const int64_t group = q.size(1) / k.size(2);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "head_dim ", d, " unsupported: use 64, 128 or 256");
  TORCH_CHECK(variant == 0 || variant == 1, "decode variant must be 0 (shared memory) or 1 (registers)");
  TORCH_CHECK(max_query_len * group <= decode_max_rows(d), "decode packs at most ", decode_max_rows(d),
              " rows (q_len * group) for head_dim ", d, "; use prefill for longer queries");
  AttnParams p = make_params(out, q, k, v, k_scale, v_scale, kv_kind, query_start_loc, seq_lens, block_tables,
                             scale, /*causal=*/true);
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  if (num_seqs == 0 || q.size(0) == 0 || max_seq_len <= 0) return;
  const int KC = fa_v100_decode_chunk();
  if (num_splits <= 0) {  // enough CTAs to fill the GPU twice, but >= 4 chunks of keys per split
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.get_device()));
    const int64_t base = static_cast<int64_t>(num_seqs) * k.size(2);
    const int64_t want = (2 * sms + base - 1) / base;
    const int64_t most = std::max<int64_t>(1, (max_seq_len + 4 * KC - 1) / (4 * KC));
    num_splits = std::min(want, most);
  }
  int64_t split_len = (max_seq_len + num_splits - 1) / num_splits;
  split_len = (split_len + KC - 1) / KC * KC;
  num_splits = (max_seq_len + split_len - 1) / split_len;
  p.num_splits = static_cast<int>(num_splits);
  p.split_len = static_cast<int>(split_len);
  const int64_t rows = q.size(0) * q.size(1);
  auto o_part = at::empty({rows * num_splits, d}, q.options().dtype(at::kFloat));
  auto lse_part = at::empty({rows * num_splits}, q.options().dtype(at::kFloat));
  p.o_part = o_part.data_ptr<float>();
  p.lse_part = lse_part.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  // The register variant serves plain decode (q_len 1); verify steps (q_len > 1) stay on the shared
  // variant until its causal verify rows have been checked on a GPU.
  const int kernel_variant = max_query_len == 1 ? static_cast<int>(variant) : 0;
  C10_CUDA_CHECK(fa_v100_launch_decode(p, d, static_cast<int>(kv_kind), num_seqs, static_cast<int>(rows),
                                       static_cast<int>(max_query_len * group), kernel_variant, stream));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Volta (SM70) paged attention: HMMA.884 prefill, split-KV decode/verify";
  m.def("prefill", &prefill, "paged prefill attention (writes out); variant 0 the first kernel, 1 FastDiv page "
        "lookup, 2 also P in the K tile at head_dim 256",
        py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("kv_kind"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"),
        py::arg("max_query_len"), py::arg("scale"), py::arg("causal"), py::arg("variant") = 2);
  m.def("decode", &decode, "paged split-KV decode / verify attention (writes out); variant 0 stages K/V in "
        "shared memory, 1 keeps them in registers (q_len 1 and packed rows <= 8; else variant 0)",
        py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("kv_kind"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"),
        py::arg("max_query_len"), py::arg("max_seq_len"), py::arg("scale"), py::arg("num_splits"),
        py::arg("variant") = 1);
  m.def("decode_max_rows", &decode_max_rows, "rows (q_len * group) one decode CTA packs");
}
