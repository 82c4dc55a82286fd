// Torch-free launch interface between the binding (flash_attn_v100.cpp) and the kernels.
#pragma once
#include <cuda_runtime.h>

#include "flash_attn_v100/params.h"

int fa_v100_prefill_tile_rows();
int fa_v100_decode_chunk();
// Largest q_len * (num_heads / num_kv_heads) one decode CTA packs, 0 for unsupported head dims.
int fa_v100_decode_max_rows(int head_dim);
// variant 0 = the first prefill kernel, 1 = FastDiv page lookup, 2 = 1 + P in the K tile at D=256.
cudaError_t fa_v100_launch_prefill(const fa_v100::AttnParams& p, int head_dim, int kv_kind, int num_seqs,
                                   int variant, cudaStream_t stream);
// packed_rows = max_query_len * group picks the decode kernel's row bucket; variant 0 = shared-memory
// K/V staging (decode.cuh), 1 = K/V in registers (decode_regs.cuh) for packed rows <= 8.
cudaError_t fa_v100_launch_decode(const fa_v100::AttnParams& p, int head_dim, int kv_kind, int num_seqs,
                                  int total_rows, int packed_rows, int variant, cudaStream_t stream);
