// Launch parameters of the Volta attention kernels: plain structs that host code (the torch
// binding) and device code share. No device functions here, so a host compiler can read it.
#pragma once
#include <cuda_fp16.h>

namespace fa_v100 {

// How the paged KV cache stores its values.
enum KvKind : int {
  kKvF16 = 0,   // float16 values
  kKvE4M3 = 1,  // uint8 bytes holding float8_e4m3fn, value = fp8 * per-(slot, kv_head) scale
  kKvE5M2 = 2,  // uint8 bytes holding float8_e5m2, value = fp8 * per-(slot, kv_head) scale
};

// A paged KV cache: K/V are [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
struct PagedKV {
  const void* k;
  const void* v;
  const float* k_scale;  // [num_blocks * block_size * num_kv_heads], fp8 kinds only
  const float* v_scale;
  const int* block_tables;  // [num_seqs, block_table_stride]
  int block_table_stride;
  int block_size;
  int num_kv_heads;
};

// One launch's view of a flattened variable-length batch (see AttentionMetadata).
struct AttnParams {
  const __half* q;  // [T, num_heads, head_dim]
  __half* out;      // [T, num_heads, head_dim]
  PagedKV kv;
  const int* query_start_loc;  // [B + 1]
  const int* seq_lens;         // [B], context length after this step (cached + new)
  int num_heads;
  int q_tiles_per_seq;  // prefill: query tiles launched per sequence
  float scale_log2;     // softmax scale * log2(e): scores live in the exp2 domain
  int causal;
  // split-KV decode: per-split partial outputs, merged in FP32 afterwards
  float* o_part;    // [T * num_heads * num_splits, head_dim]
  float* lse_part;  // [T * num_heads * num_splits], log2-sum-exp2 of each split
  int num_splits;
  int split_len;    // keys per split (multiple of the decode chunk)
};

}  // namespace fa_v100
