// Kernel launchers for the Volta attention kernels: plain CUDA runtime, no torch headers, so
// this translation unit compiles quickly and independently of the framework.
#include "flash_attn_v100_launch.h"

#include "flash_attn_v100/decode.cuh"
#include "flash_attn_v100/decode_regs.cuh"
#include "flash_attn_v100/prefill.cuh"

namespace {

using fa_v100::AttnParams;

template <int D, int KV, int VARIANT>
cudaError_t launch_prefill_variant(const AttnParams& p, int num_seqs, cudaStream_t stream) {
  using Cfg = fa_v100::PrefillCfg<D, VARIANT>;
  auto kernel = fa_v100::prefill_kernel<D, KV, VARIANT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(num_seqs * p.q_tiles_per_seq, p.num_heads), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// variant: 0 the first kernel, 1 FastDiv page lookup, 2 also P in the K tile at D=256 (prefill.cuh)
template <int D, int KV>
cudaError_t launch_prefill(const AttnParams& p, int num_seqs, int variant, cudaStream_t stream) {
  switch (variant) {
    case 0: return launch_prefill_variant<D, KV, 0>(p, num_seqs, stream);
    case 1: return launch_prefill_variant<D, KV, 1>(p, num_seqs, stream);
    case 2: return launch_prefill_variant<D, KV, 2>(p, num_seqs, stream);
    case 3: return launch_prefill_variant<D, KV, 3>(p, num_seqs, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <int D, int KV, int ROWS>
cudaError_t launch_decode_rows(const AttnParams& p, int num_seqs, cudaStream_t stream) {
  using Cfg = fa_v100::DecodeCfg<D, ROWS>;
  auto kernel = fa_v100::decode_kernel<D, KV, ROWS>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(p.num_splits, p.kv.num_kv_heads, num_seqs), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <int D, int KV, int ROWS>
cudaError_t launch_decode_regs_rows(const AttnParams& p, int num_seqs, cudaStream_t stream) {
  using Cfg = fa_v100::DecodeRegsCfg<D, KV, ROWS>;
  auto kernel = fa_v100::decode_regs_kernel<D, KV, ROWS>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(p.num_splits, p.kv.num_kv_heads, num_seqs), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// variant 1 (registers, decode_regs.cuh) serves packed rows <= 8; larger packs and variant 0
// use the shared-memory kernel (decode.cuh).
template <int D, int KV>
cudaError_t launch_decode(const AttnParams& p, int num_seqs, int total_rows, int packed_rows, int variant,
                          cudaStream_t stream) {
  cudaError_t err;
  if (variant == 1 && packed_rows <= 4) {
    err = launch_decode_regs_rows<D, KV, 4>(p, num_seqs, stream);
  } else if (variant == 1 && packed_rows <= 8) {
    err = launch_decode_regs_rows<D, KV, 8>(p, num_seqs, stream);
  } else {
    err = packed_rows <= fa_v100::kDecodeSmallRows
              ? launch_decode_rows<D, KV, fa_v100::kDecodeSmallRows>(p, num_seqs, stream)
              : launch_decode_rows<D, KV, fa_v100::DecodeLargeRows<D>::value>(p, num_seqs, stream);
  }
  if (err != cudaSuccess) return err;
  fa_v100::merge_kernel<D><<<total_rows, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

#define FA_DISPATCH(D_VAR, KV_VAR, FN, ...)                    \
  switch (D_VAR * 4 + KV_VAR) {                                \
    case 64 * 4 + 0: return FN<64, 0>(__VA_ARGS__);            \
    case 64 * 4 + 1: return FN<64, 1>(__VA_ARGS__);            \
    case 64 * 4 + 2: return FN<64, 2>(__VA_ARGS__);            \
    case 128 * 4 + 0: return FN<128, 0>(__VA_ARGS__);          \
    case 128 * 4 + 1: return FN<128, 1>(__VA_ARGS__);          \
    case 128 * 4 + 2: return FN<128, 2>(__VA_ARGS__);          \
    case 256 * 4 + 0: return FN<256, 0>(__VA_ARGS__);          \
    case 256 * 4 + 1: return FN<256, 1>(__VA_ARGS__);          \
    case 256 * 4 + 2: return FN<256, 2>(__VA_ARGS__);          \
    default: return cudaErrorInvalidValue;                     \
  }

}  // namespace

int fa_v100_prefill_tile_rows() { return fa_v100::PrefillCfg<64>::kBM; }
int fa_v100_decode_chunk() { return fa_v100::DecodeCfg<64, fa_v100::kDecodeSmallRows>::kChunk; }

int fa_v100_decode_max_rows(int head_dim) {
  switch (head_dim) {
    case 64: return fa_v100::DecodeLargeRows<64>::value;
    case 128: return fa_v100::DecodeLargeRows<128>::value;
    case 256: return fa_v100::DecodeLargeRows<256>::value;
    default: return 0;
  }
}

cudaError_t fa_v100_launch_prefill(const fa_v100::AttnParams& p, int head_dim, int kv_kind, int num_seqs,
                                   int variant, cudaStream_t stream) {
  FA_DISPATCH(head_dim, kv_kind, launch_prefill, p, num_seqs, variant, stream);
}

cudaError_t fa_v100_launch_decode(const fa_v100::AttnParams& p, int head_dim, int kv_kind, int num_seqs,
                                  int total_rows, int packed_rows, int variant, cudaStream_t stream) {
  FA_DISPATCH(head_dim, kv_kind, launch_decode, p, num_seqs, total_rows, packed_rows, variant, stream);
}
