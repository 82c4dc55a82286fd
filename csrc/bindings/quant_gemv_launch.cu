// Launchers of the packed-weight GEMV (csrc/quant_gemv/quant_gemv.cuh): one instantiation per format,
// activation-row template (1, 2, 4, 8) and activation dtype. Weight rows per warp R = 2 for one or two
// activation rows, else 4 (more rows share each staged activation); chunks per lane and step U = 2, 2, 1, 1
// (loads in flight within the registers that let MinBlocks blocks share an SM). One activation row also has
// the variant with the residual add + RMSNorm and SiLU * mul folded in.
#include "quant_gemv_launch.h"

#include "quant_gemv/quant_gemv.cuh"
#include "quant_gemv/mma_gemv.cuh"

namespace onecat_qgemv {
namespace {

template <int FMT, int M, int R, int U, typename T, bool FOLD = false>
cudaError_t launch(const Params& p, int smem, cudaStream_t stream) {
  auto kernel = quant_gemv_kernel<FMT, M, R, U, T, FOLD>;
  static int configured = 48 * 1024;  // the dynamic shared memory this instantiation may use so far
  if (smem > configured) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    configured = smem;
  }
  const dim3 grid((p.n + kWarps * R - 1) / (kWarps * R), p.splits);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// The folded norm / glu (p.residual, p.glu) are compiled into the one-row kernels only.
template <int FMT, typename T>
cudaError_t by_rows(int m_tmpl, const Params& p, int smem, cudaStream_t stream) {
  const bool fold = p.residual != nullptr || p.glu;
  if (fold && m_tmpl != 1) return cudaErrorInvalidValue;
  switch (m_tmpl) {
    case 1: return fold ? launch<FMT, 1, 2, 2, T, true>(p, smem, stream) : launch<FMT, 1, 2, 2, T>(p, smem, stream);
    case 2: return launch<FMT, 2, 2, 2, T>(p, smem, stream);
    case 4: return launch<FMT, 4, 4, 1, T>(p, smem, stream);
    default: return launch<FMT, 8, 4, 1, T>(p, smem, stream);
  }
}

template <typename T>
cudaError_t by_format(int fmt, int m_tmpl, const Params& p, int smem, cudaStream_t stream) {
  switch (fmt) {
    case kInt4H: return by_rows<kInt4H, T>(m_tmpl, p, smem, stream);
    case kInt4B: return by_rows<kInt4B, T>(m_tmpl, p, smem, stream);
    case kNvfp4: return by_rows<kNvfp4, T>(m_tmpl, p, smem, stream);
    case kMxfp4: return by_rows<kMxfp4, T>(m_tmpl, p, smem, stream);
    default: return by_rows<kFp8, T>(m_tmpl, p, smem, stream);
  }
}

template <int FMT, typename T, bool SLOTS = false>
cudaError_t launch_mma_as(const Params& p, cudaStream_t stream, bool pdl) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(p.glu ? p.n_out / 16 : (p.n + kMmaRows - 1) / kMmaRows, p.splits);  // glu: a gate and an up tile a block
  config.blockDim = dim3(p.warps * 32);
  config.stream = stream;
  cudaLaunchAttribute overlap[1];  // programmatic dependent launch (SM90+): may start while the previous kernel ends
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = overlap;
  config.numAttrs = pdl ? 1 : 0;
  // one run a batch (2 to 4 128-bit loads in flight a lane), two 16-row tiles a warp, Params.warps warps a block;
  // one B operand for up to 8 activation rows, two for 9-16
  constexpr int kT = kMmaRows / 16;
  const bool two = p.m_rows > 8;
  switch (p.warps) {
    case 2: return two ? cudaLaunchKernelEx(&config, mma_gemv_kernel<FMT, T, 1, kT, 2, SLOTS, 2>, p)
                       : cudaLaunchKernelEx(&config, mma_gemv_kernel<FMT, T, 1, kT, 2, SLOTS, 1>, p);
    case 4: return two ? cudaLaunchKernelEx(&config, mma_gemv_kernel<FMT, T, 1, kT, 4, SLOTS, 2>, p)
                       : cudaLaunchKernelEx(&config, mma_gemv_kernel<FMT, T, 1, kT, 4, SLOTS, 1>, p);
    case 8: return two ? cudaLaunchKernelEx(&config, mma_gemv_kernel<FMT, T, 1, kT, 8, SLOTS, 2>, p)
                       : cudaLaunchKernelEx(&config, mma_gemv_kernel<FMT, T, 1, kT, 8, SLOTS, 1>, p);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_mma(int fmt, bool is_bf16, const Params& p, cudaStream_t stream, bool pdl) {
  if (fmt == kInt4H && !is_bf16) return launch_mma_as<kInt4H, __half>(p, stream, pdl);
  if (fmt == kNvfp4 && !is_bf16 && p.tiled == kTilesFp16Slots) return launch_mma_as<kNvfp4, __half, true>(p, stream, pdl);
  if (fmt == kNvfp4 && is_bf16 && p.tiled == kTilesBf16Slots) {
    return launch_mma_as<kNvfp4, __nv_bfloat16, true>(p, stream, pdl);
  }
  if (fmt == kNvfp4) {
    return is_bf16 ? launch_mma_as<kNvfp4, __nv_bfloat16>(p, stream, pdl) : launch_mma_as<kNvfp4, __half>(p, stream, pdl);
  }
  if (fmt == kMxfp4 && is_bf16 && p.tiled == kTilesBf16Slots) {
    return launch_mma_as<kMxfp4, __nv_bfloat16, true>(p, stream, pdl);
  }
  if (fmt == kMxfp4 && is_bf16) return launch_mma_as<kMxfp4, __nv_bfloat16>(p, stream, pdl);
  if (fmt == kFp8) {
    return is_bf16 ? launch_mma_as<kFp8, __nv_bfloat16>(p, stream, pdl) : launch_mma_as<kFp8, __half>(p, stream, pdl);
  }
  if (fmt == kDense) {
    return is_bf16 ? launch_mma_as<kDense, __nv_bfloat16>(p, stream, pdl) : launch_mma_as<kDense, __half>(p, stream, pdl);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_gemv(int fmt, int m_tmpl, bool is_bf16, const Params& p, int smem, cudaStream_t stream) {
  return is_bf16 ? by_format<__nv_bfloat16>(fmt, m_tmpl, p, smem, stream)
                 : by_format<__half>(fmt, m_tmpl, p, smem, stream);
}

}  // namespace onecat_qgemv
