// FP8 (E4M3, a scale per row) on the tensor cores: the decode of one run of 128 columns for mma_gemv.cuh.
//
// The decode: a byte formed in float32 by the FMA GEMV's decode (formats.cuh: e4m3 * 2^-120) times 2^112, so
// e4m3 * 2^-8, which fp16 and bf16 hold exactly for every E4M3 value ([2^-17, 1.75]); a pair rounded to the
// activation dtype. The row's scale and the 2^8 multiply its sum at the end.
//
// Which columns a register pair holds (engine/quant/fp8_layout.py: word w of a block of 16 columns holds
// columns w + 4j in byte j): a run is 32 words a row, and lane (g, c) loads words 8c .. 8c + 7 (blocks 2c and
// 2c + 1, two 16-byte loads) of rows g and g + 8. K-step s takes block 2c + s / 4, byte j = s % 4: its A pairs
// are byte j of words (0, 1) of the block, columns 32c + 16 (s / 4) + 4j and + 1, and of words (2, 3), + 2 and
// + 3: the activation pairs 2s and 2s + 1 of row g's columns 32c .. 32c + 31 (load_b_32cols).
#pragma once

#include "formats.cuh"
#include "mma_ops.cuh"

namespace onecat_qgemv {

// Byte j of words lo and hi as the pair (e4m3 * 2^-8, e4m3' * 2^-8) in T.
template <typename T>
__device__ __forceinline__ uint32_t fp8_pair(uint32_t lo, uint32_t hi, int j) {
  constexpr float kTwo112 = 5.192296858534828e33f;
  return pack_pair<T>(decode<kFp8>(lo, 0u, j) * kTwo112, decode<kFp8>(hi, 0u, j) * kTwo112);
}

// One run of one 16-row tile: w[2 h + v] is vector v (block 2c + v) of row g + 8 h; accumulated into acc (rows
// g, g, g + 8, g + 8; activation rows 2c, 2c + 1).
template <typename T>
__device__ __forceinline__ void fp8_run(const uint4* w, const uint32_t* xb, float* acc) {
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const int v = s / 4, j = s % 4;
    const uint32_t a[4] = {fp8_pair<T>(w[v].x, w[v].y, j), fp8_pair<T>(w[2 + v].x, w[2 + v].y, j),
                           fp8_pair<T>(w[v].z, w[v].w, j), fp8_pair<T>(w[2 + v].z, w[2 + v].w, j)};
    mma_16816<T>(acc, a, xb[2 * s], xb[2 * s + 1]);
  }
}

}  // namespace onecat_qgemv
