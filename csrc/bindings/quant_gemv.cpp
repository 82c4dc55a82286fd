// Torch binding of the packed-weight GEMVs (csrc/quant_gemv/quant_gemv.cuh, and mma_gemv.cuh on the tensor cores
// of SM80+ for W4A16 fp16 g128, NVFP4, FP8, MXFP4 bf16 and dense fp16 / bf16 weights): argument checks, the choice of kernel, the split of K and the launch
// (quant_gemv_launch.cu). Activation rows are rounded up to 1, 2, 4 or 8 (the kernel's template).
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "quant_gemv_launch.h"

namespace {

using namespace onecat_qgemv;

// Staged activations per block: at most a third of an SM's shared memory (three blocks resident: 32 KB on a
// V100, whose SM has 96 KB) and at most 64 KB (an H200 SM, 228 KB).
int smem_budget(int device) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  return std::min(64 * 1024, per_sm / 3 / 1024 * 1024);
}

int codes_per_word(int fmt) { return fmt == kFp8 ? 4 : (fmt == kDense ? 2 : 8); }

int smem_for(int fmt, int m_tmpl, int chunks) {
  const bool int4 = fmt == kInt4H || fmt == kInt4B;
  return m_tmpl * codes_per_word(fmt) * chunks * 16 + (int4 ? m_tmpl * chunks * 4 : 0);
}

// The fewest splits of K (dividing the row's chunks) whose staged activations fit the budget and that give
// at least one block per SM, where the runs stay at least one chunk per lane.
int auto_splits(int fmt, int m_tmpl, int chunks, int tiles, int sms, int budget) {
  int fallback = 0;
  for (int s = 1; s <= chunks; ++s) {
    if (chunks % s || smem_for(fmt, m_tmpl, chunks / s) > budget) continue;
    if (!fallback) fallback = s;
    if (tiles * s >= sms || chunks / s < 64) return s;
  }
  return fallback;
}

// The tensor-core W4A16 GEMV's splits (it stages nothing): the fewest dividing the row's 128-column runs that
// leave each warp of a block at most 8 runs and give at least a block per two SMs. Splitting costs a partial
// write and a second pass, more so at 8 rows, so it is only for long rows or few row tiles (measured on the
// H200: down_proj of Llama-3-8B at 4 splits, its other projections at 1).
int auto_splits_mma(int runs, int tiles, int sms) {
  for (int s = 1; s <= runs; ++s)
    if (runs % s == 0 && runs / s <= 8 * kMmaWarps && 2 * tiles * s >= sms) return s;
  return 1;
}

// Warps a block of the tensor-core GEMV, by the blocks (row tiles x splits) each SM gets: under 2 (Llama-3-8B's
// qkv and o on an H200: 192 and 128 blocks on 132 SMs) 8 warps, so each warp has half the runs and a SM twice the
// loads in flight; 6 and more (its gate_up, 896 blocks) 2; else 4. FP8, whose runs are twice the bytes: 8 under 1
// block a SM, else 4 (dense weights, four times FP4's bytes a run, likewise). Measured per projection and format on
// an H200 (benchmarks/results/quant_h200.json "warps_by_grid"). It depends on the shape alone, never on the row
// count, so a row's bits are the same alone or in a batch.
int mma_warps(int blocks, int sms, bool wide_runs) {
  if (wide_runs) return blocks < sms ? 8 : kMmaWarps;
  if (blocks < 2 * sms) return 8;
  if (blocks >= 6 * sms) return 2;
  return kMmaWarps;
}

enum Kernel : int { kAuto = 0, kFma = 1, kMma = 2 };

// With residual (and norm_weight): the folded RMSNorm; returns (y, x + residual), else (y, undefined).
// kernel: kAuto (the tensor-core GEMV where it applies), kFma (quant_gemv.cuh), kMma (mma_gemv.cuh).
// pdl: the tensor-core GEMV is launched with programmatic dependent launch (SM90+; engine/kernels/pdl.py).
// tiled: a Layout (params.h): qweight in the tensor-core GEMV's tiles (mma_tiles in engine/kernels/quant_gemv.py), which
// only it reads; kTilesFp16Slots / kTilesBf16Slots: FP4 codes in the fp16 / bf16 activations' slots too
// (engine/quant/fp4/slots.py).
std::tuple<at::Tensor, at::Tensor> gemv_checked(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const c10::optional<at::Tensor>& row_scale, at::Tensor& tickets, int64_t fmt, int64_t group,
                int64_t splits, const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& norm_weight,
                double eps, bool glu, int64_t kernel, bool pdl, int64_t tiled) {
  TORCH_CHECK(fmt >= kInt4H && fmt <= kDense,
              "fmt must be 0..5 (int4 fp16 pairs, int4 bf16 pairs, nvfp4, mxfp4, fp8, dense in x's dtype)");
  TORCH_CHECK(x.is_cuda() && (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "x must be a contiguous CUDA float16 or bfloat16 tensor");
  TORCH_CHECK(qweight.is_cuda() && qweight.scalar_type() == at::kInt && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be a contiguous CUDA int32 [N, K / codes-per-word] tensor");
  const int J = codes_per_word(static_cast<int>(fmt));
  const int64_t n = qweight.size(0), k = qweight.size(1) * J;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0, "x must be 8-byte aligned (a copy is)");
  TORCH_CHECK(x.size(-1) == k, "x has ", x.size(-1), " features; the packed weight takes ", k);
  const int64_t m = x.numel() / k;
  TORCH_CHECK(m >= 1 && m <= 16, "the GEMV takes 1 to 8 rows (16 on the tensor cores), got ", m);
  TORCH_CHECK(k % (4 * J) == 0, "in_features must be a multiple of ", 4 * J);
  TORCH_CHECK(scales.is_cuda() && scales.is_contiguous(), "scales must be a contiguous CUDA tensor");
  if (fmt == kInt4H || fmt == kInt4B) {
    TORCH_CHECK(group >= 32 && (group & (group - 1)) == 0 && k % group == 0,
                "W4A16 group must be 32, 64, 128 ... (a power of two) dividing K");
    TORCH_CHECK(scales.scalar_type() == (fmt == kInt4H ? at::kHalf : at::kBFloat16) && scales.numel() == n * (k / group) * 2,
                "W4A16 scales must be (scale, zero) pairs [N, K/G, 2] in float16 (fmt 0) or bfloat16 (fmt 1)");
  } else {
    const int64_t block = fmt == kMxfp4 ? 32 : 16;
    TORCH_CHECK(fmt == kFp8 || fmt == kDense || (scales.scalar_type() == at::kByte && scales.numel() == n * (k / block)),
                "FP4 block scales must be uint8 [N, K/", block, "]");
  }
  if (fmt == kNvfp4 || fmt == kFp8) {
    TORCH_CHECK(row_scale.has_value() && row_scale->is_cuda() && row_scale->scalar_type() == at::kFloat &&
                    row_scale->numel() == n && row_scale->is_contiguous(),
                "NVFP4 and FP8 need a contiguous CUDA float32 scale per output row");
  }
  TORCH_CHECK(residual.has_value() == norm_weight.has_value(), "the folded norm needs both residual and norm_weight");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() && residual->is_contiguous() &&
                    reinterpret_cast<uintptr_t>(residual->data_ptr()) % 8 == 0,
                "residual must be a contiguous, 8-byte aligned tensor of x's shape and dtype");
    TORCH_CHECK(norm_weight->numel() == k && norm_weight->scalar_type() == x.scalar_type() && norm_weight->is_contiguous() &&
                    reinterpret_cast<uintptr_t>(norm_weight->data_ptr()) % 8 == 0,
                "norm_weight must be a contiguous, 8-byte aligned [K] tensor of x's dtype");
  }
  TORCH_CHECK(!glu || n % 2 == 0, "glu needs a [gate | up] weight of an even number of rows");
  const int64_t n_out = glu ? n / 2 : n;
  TORCH_CHECK(kernel >= kAuto && kernel <= kMma, "kernel must be 0 (auto), 1 (FMA) or 2 (tensor cores)");
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = x.device().index();
  int sms = 0, major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  // the tensor-core GEMV (mma_gemv.cuh): W4A16 fp16 with fp16 scale pairs and groups of 128, NVFP4, FP8 and dense
  // weights fp16 or bf16, MXFP4 bf16 (its scaled codes leave fp16's range); K a multiple of 128, no folded norm, SM80 or newer
  const bool half = x.scalar_type() == at::kHalf;
  const bool mma_format = (fmt == kInt4H && half && group == 128) || fmt == kNvfp4 || fmt == kFp8 ||
                          fmt == kDense || (fmt == kMxfp4 && !half);
  // with glu: 1-16 rows, the gate and up halves multiples of 16 rows
  const bool mma_fits = mma_format && k % kMmaRun == 0 && !residual.has_value() && (!glu || n_out % 16 == 0) &&
                        major >= 8;
  TORCH_CHECK(kernel != kMma || mma_fits, "the tensor-core GEMV takes W4A16 (fp16 activations and scale pairs, groups "
              "of 128), NVFP4, FP8 or dense weights (fp16 or bf16) or MXFP4 (bf16), K a multiple of 128, no folded "
              "norm, glu only with gate and up halves of a multiple of 16 rows, on SM80 or newer");
  const bool mma = kernel == kMma || (kernel == kAuto && mma_fits);
  TORCH_CHECK(fmt != kDense || mma, "dense weights take the tensor-core GEMV only: SM80 or newer, K a multiple of 128, "
              "no folded norm");
  TORCH_CHECK(m <= 8 || mma, "9-16 rows take the tensor-core GEMV only (two B operands); the FMA GEMV takes 1 to 8 "
              "rows, got ", m);
  TORCH_CHECK(m == 1 || !(residual.has_value() || (glu && !mma)),
              "the folded norm takes one activation row, and glu more than one only on the tensor-core GEMV; got ", m);
  TORCH_CHECK(tiled >= kRowMajor && tiled <= kTilesBf16Slots, "tiled must be 0 (row-major), 1 (tiles), 2 or 3 (tiles, "
              "FP4 codes in fp16 or bf16 slots)");
  TORCH_CHECK(!tiled || (mma && n % 16 == 0), "tiled weights (mma_tiles) are read by the tensor-core GEMV only, "
              "with N a multiple of 16");
  TORCH_CHECK(tiled < kTilesFp16Slots || ((fmt == kNvfp4 || fmt == kMxfp4) && half == (tiled == kTilesFp16Slots)),
              "FP4 codes in fp16 (bf16) slots take fp16 (bf16) activations");
  const int budget = smem_budget(dev);
  const int m_tmpl = m == 1 ? 1 : (m == 2 ? 2 : (m <= 4 ? 4 : 8));
  const int outs = rows_per_warp(m_tmpl) / (glu ? 2 : 1);
  const int units = static_cast<int>(mma ? k / kMmaRun : k / (4 * J));  // runs of 128 columns, or chunks
  const int tiles = static_cast<int>(mma ? (n + kMmaRows - 1) / kMmaRows : (n_out + kWarps * outs - 1) / (kWarps * outs));
  TORCH_CHECK(tickets.is_cuda() && tickets.scalar_type() == at::kInt && tickets.numel() >= tiles,
              "tickets must be a zeroed CUDA int32 tensor of at least ", tiles, " elements");
  // the FMA kernel's split is the 8-row template's at every row count (it fits the fewer rows' staging too):
  // a row's sums then run in the same order alone or in a batch
  const int tiles8 = static_cast<int>((n_out + kWarps * rows_per_warp(8) - 1) / (kWarps * rows_per_warp(8)));
  const int s = splits > 0 ? static_cast<int>(splits)
                : mma ? auto_splits_mma(units, tiles, sms)
                      : auto_splits(static_cast<int>(fmt), 8, units, tiles8, sms, budget);
  TORCH_CHECK(s >= 1 && units % s == 0, "splits must divide the row's ", units, mma ? " runs of " : " chunks of ",
              mma ? kMmaRun : 4 * J, " columns");
  const int smem = mma ? 0 : smem_for(static_cast<int>(fmt), m_tmpl, units / s);
  TORCH_CHECK(smem <= budget, "splits ", s, " leave ", smem, " bytes of staged activations; at most ", budget);

  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n_out;
  at::Tensor y = at::empty(out_sizes, x.options());
  at::Tensor rout;
  if (residual.has_value()) rout = at::empty_like(x);
  at::Tensor partial;
  Params p{};
  p.x = x.data_ptr();
  p.w = reinterpret_cast<const uint32_t*>(qweight.data_ptr());
  p.scales = scales.data_ptr();
  p.row_scale = row_scale.has_value() ? row_scale->data_ptr<float>() : nullptr;
  p.y = y.data_ptr();
  if (s > 1) {
    partial = at::empty({s, m, n}, x.options().dtype(at::kFloat));
    p.partial = partial.data_ptr<float>();
  }
  p.tickets = tickets.data_ptr<int>();
  p.residual = residual.has_value() ? residual->data_ptr() : nullptr;
  p.norm_w = norm_weight.has_value() ? norm_weight->data_ptr() : nullptr;
  p.rout = residual.has_value() ? rout.data_ptr() : nullptr;
  p.eps = static_cast<float>(eps);
  p.glu = glu ? 1 : 0;
  p.n = static_cast<int>(n);
  p.n_out = static_cast<int>(n_out);
  p.k = static_cast<int>(k);
  p.group = static_cast<int>(group);
  p.gshift = 0;
  while ((32 << p.gshift) < group) ++p.gshift;
  p.m_rows = static_cast<int>(m);
  p.splits = s;
  p.tiled = static_cast<int>(tiled);
  p.warps = mma ? mma_warps(tiles * s, sms, fmt == kFp8 || fmt == kDense) : 0;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(mma ? launch_mma(static_cast<int>(fmt), x.scalar_type() == at::kBFloat16, p, stream, pdl)
                     : launch_gemv(static_cast<int>(fmt), m_tmpl, x.scalar_type() == at::kBFloat16, p, smem, stream));
  return {y, rout};
}

// (y, x + residual or undefined, "") or (undefined, undefined, what went wrong): errors come back as text,
// never as a C++ exception into Python.
std::tuple<at::Tensor, at::Tensor, std::string> gemv(
    const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& row_scale,
    at::Tensor& tickets, int64_t fmt, int64_t group, int64_t splits, const c10::optional<at::Tensor>& residual,
    const c10::optional<at::Tensor>& norm_weight, double eps, bool glu, int64_t kernel, bool pdl, int64_t tiled) {
  try {
    auto [y, rout] = gemv_checked(x, qweight, scales, row_scale, tickets, fmt, group, splits, residual, norm_weight,
                                  eps, glu, kernel, pdl, tiled);
    return {y, rout, std::string()};
  } catch (const c10::Error& e) {
    return {at::Tensor(), at::Tensor(), e.what_without_backtrace()};
  } catch (const std::exception& e) {
    return {at::Tensor(), at::Tensor(), e.what()};
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv,
        "packed-weight GEMV for 1-8 rows, 1-16 on the tensor cores (W4A16, NVFP4, MXFP4, FP8), optionally with the "
        "residual add + RMSNorm before it and SiLU(gate) * up after it: (y, x + residual, error text)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("row_scale"), py::arg("tickets"), py::arg("fmt"),
        py::arg("group"), py::arg("splits") = 0, py::arg("residual") = py::none(), py::arg("norm_weight") = py::none(),
        py::arg("eps") = 0.0, py::arg("glu") = false, py::arg("kernel") = 0,
        py::arg("pdl") = false, py::arg("tiled") = 0);
}
