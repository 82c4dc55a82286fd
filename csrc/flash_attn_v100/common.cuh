// Device helpers shared by the Volta (SM70) attention kernels: paged-KV addressing, warp
// reductions and the shared-memory swizzle. Plain CUDA, no framework headers, so the same
// text compiles under NVRTC (for the sm_70 resource check) and under nvcc (torch binding).
#pragma once
#include <cuda_fp16.h>

#include "params.h"

namespace fa_v100 {

__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

// Row index (slot * num_kv_heads + kv_head) of key `key` of sequence `b` in the paged cache.
__device__ __forceinline__ long long kv_row(const PagedKV& kv, int b, int key, int kvh) {
  const int blk = __ldg(kv.block_tables + (long long)b * kv.block_table_stride + key / kv.block_size);
  const long long slot = (long long)blk * kv.block_size + key % kv.block_size;
  return slot * kv.num_kv_heads + kvh;
}

// kv_row for lanes that work on one cached row in aligned groups of GROUP lanes: the group's
// first lane reads the block table and the others take the result by shuffle, so each page
// lookup (an L1 request plus 64-bit index math) is done once per row, not once per 16 bytes.
// Must be reached by the whole warp; `valid` must agree within a group.
template <int GROUP>
__device__ __forceinline__ long long kv_row_grouped(const PagedKV& kv, int b, int key, int kvh, bool valid) {
  static_assert(GROUP >= 1 && GROUP <= 32 && 32 % GROUP == 0, "groups must tile the warp");
  const int lane = threadIdx.x & 31;
  long long row = 0;
  if (valid && (lane & (GROUP - 1)) == 0) row = kv_row(kv, b, key, kvh);
  return __shfl_sync(0xffffffffu, row, lane & ~(GROUP - 1));
}

// n / d for 0 <= n < 2^31 by multiply-high and shift (d fixed per launch): the paged-KV block
// lookup divides every key by the block size, and a run-time integer division is ~20 instructions.
struct FastDiv {
  unsigned mul;
  int shift, d;
  __device__ __forceinline__ explicit FastDiv(int divisor) : d(divisor) {
    shift = 32 - __clz(divisor - 1);
    mul = static_cast<unsigned>((((1ull << 32) * ((1ull << shift) - divisor)) / divisor) + 1);
  }
  __device__ __forceinline__ int div(int n) const { return static_cast<int>((__umulhi(n, mul) + n) >> shift); }
};

// kv_row with the block-table division done by a FastDiv of the block size and `table` already
// pointing at the sequence's row of the block table; every lane computes its own row (no shuffle).
__device__ __forceinline__ long long kv_row_fast(const PagedKV& kv, const int* table, const FastDiv& per_block,
                                                 int key, int kvh) {
  const int blk_i = per_block.div(key);
  const long long slot = (long long)__ldg(table + blk_i) * per_block.d + (key - blk_i * per_block.d);
  return slot * kv.num_kv_heads + kvh;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// exp2 that maps the "no key seen yet" reference -inf to 0 instead of NaN.
__device__ __forceinline__ float safe_ref(float m) { return m == neg_inf() ? 0.f : m; }

// Shared-memory tiles of fp16 rows are addressed in 8-byte chunks (4 halfs, one HMMA k-step).
// Chunk c of row r lives at r * CHUNKS + (c ^ g(r)), g a bijection of the row's low 4 bits.
// g keeps both fragment reads conflict-free: 16 consecutive rows at one chunk (Q, K as the
// col-major B operand) and 4 consecutive rows x 4 consecutive chunks (V as row-major B).
template <int CHUNKS>
__device__ __forceinline__ int swizzle8(int row, int chunk) {
  static_assert(CHUNKS >= 16 && CHUNKS % 16 == 0, "swizzle needs >= 16 chunks per row");
  const int g = ((row & 3) << 2) | ((row >> 2) & 3);
  return row * CHUNKS + (chunk ^ g);
}

}  // namespace fa_v100
