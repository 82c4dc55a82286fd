// Dense weights (fp16 or bf16, the activations' dtype) on the tensor cores: one run of 128 columns for
// mma_gemv.cuh, nothing to decode.
//
// Why: a verify step's 1 + k rows and a drafter's block of 16 read each weight once through mma_gemv.cuh's
// streaming loop (loads in flight while the previous run is multiplied), where the library GEMM tiles for many
// rows and reads a few-row call's weight at well under the copy rate (docs/speculative.md: the 16-row gate/up
// GEMMs of a drafter at about half of it). Each row's bits do not depend on how many rows share the call.
//
// Which columns a register pair holds: a run is 64 words (128 columns) a row, and lane (g, c) loads words
// 16c .. 16c + 15 (columns 32c .. 32c + 31, four 16-byte loads) of rows g and g + 8. K-step s takes words 2s and
// 2s + 1 of both rows as its A pairs (columns 32c + 4s, + 1 and 32c + 4s + 2, + 3), against activation pairs 2s and
// 2s + 1 of row g's columns 32c .. 32c + 31 (load_b_32cols): the same physical columns in A and B.
#pragma once

#include "formats.cuh"
#include "mma_ops.cuh"

namespace onecat_qgemv {

// Word i (0-15) of the 16 a lane holds of one row: w[i / 4]'s component i % 4.
__device__ __forceinline__ uint32_t dense_word(const uint4* w, int i) {
  const uint4 v = w[i >> 2];
  switch (i & 3) {
    case 0: return v.x;
    case 1: return v.y;
    case 2: return v.z;
    default: return v.w;
  }
}

// One run of one 16-row tile: w[0..3] are row g's four 16-byte vectors, w[4..7] row g + 8's; against the NB B
// operands xb[b], accumulated into acc[b] (rows g, g, g + 8, g + 8; activation rows 8 b + 2c, + 1).
template <typename T, int NB>
__device__ __forceinline__ void dense_run(const uint4* w, const uint32_t (*xb)[16], float (*acc)[4]) {
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const uint32_t a[4] = {dense_word(w, 2 * s), dense_word(w + 4, 2 * s), dense_word(w, 2 * s + 1),
                           dense_word(w + 4, 2 * s + 1)};
#pragma unroll
    for (int b = 0; b < NB; ++b) mma_16816<T>(acc[b], a, xb[b][2 * s], xb[b][2 * s + 1]);
  }
}

}  // namespace onecat_qgemv
