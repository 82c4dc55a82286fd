// FP8 (E4M3, a scale per row) on the tensor cores: the decode of one run of 128 columns for mma_gemv.cuh.
//
// The decode: byte j of two words placed by one byte permute into the high bytes of a pair's halves, then its sign
// and its exponent and mantissa bits moved into the activation dtype's fields by one shift and one masked merge:
// fp16 bits of e4m3 * 2^-8 (exponent field E, subnormals included), bf16 bits of e4m3 * 2^-120 then one HMUL2 by
// 2^112. Both hold every E4M3 value exactly ([2^-17, 1.75]), the values a float32 decode rounded to the dtype
// gives, so the sums are the same. The row's scale and the 2^8 multiply its sum at the end.
//
// Which columns a register pair holds (engine/quant/fp8/layout.py: word w of a block of 16 columns holds
// columns w + 4j in byte j): a run is 32 words a row, and lane (g, c) loads words 8c .. 8c + 7 (blocks 2c and
// 2c + 1, two 16-byte loads) of rows g and g + 8. K-step s takes block 2c + s / 4, byte j = s % 4: its A pairs
// are byte j of words (0, 1) of the block, columns 32c + 16 (s / 4) + 4j and + 1, and of words (2, 3), + 2 and
// + 3: the activation pairs 2s and 2s + 1 of row g's columns 32c .. 32c + 31 (load_b_32cols).
#pragma once

#include "formats.cuh"
#include "mma_ops.cuh"

namespace onecat_qgemv {

// Byte j of words lo and hi as the pair (e4m3 * 2^-8, e4m3' * 2^-8) in T: 3 instructions (bf16: 4).
template <typename T>
__device__ __forceinline__ uint32_t fp8_pair(uint32_t lo, uint32_t hi, int j) {
  // bytes (lo_j, lo_j, hi_j, hi_j): each half holds its code in its high byte (its low byte is masked off below)
  const uint32_t t = __byte_perm(lo, hi, j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12));
  if constexpr (Same<T, __half>::value) {
    return (t & 0x80008000u) | ((t >> 1) & 0x3F803F80u);  // sign to bit 15, EEEEMMM to bits 7-13
  } else {
    const uint32_t v = (t & 0x80008000u) | ((t >> 4) & 0x07F007F0u);  // sign to bit 15, EEEEMMM to bits 4-10
    const __nv_bfloat162 two112 = __floats2bfloat162_rn(5.192296858534828e33f, 5.192296858534828e33f);
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v), two112);
    return *reinterpret_cast<const uint32_t*>(&r);
  }
}

// One run of one 16-row tile: w[2 h + v] is vector v (block 2c + v) of row g + 8 h; against the NB B operands
// xb[b], accumulated into acc[b] (rows g, g, g + 8, g + 8; activation rows 8 b + 2c, + 1).
template <typename T, int NB>
__device__ __forceinline__ void fp8_run(const uint4* w, const uint32_t (*xb)[16], float (*acc)[4]) {
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const int v = s / 4, j = s % 4;
    const uint32_t a[4] = {fp8_pair<T>(w[v].x, w[v].y, j), fp8_pair<T>(w[2 + v].x, w[2 + v].y, j),
                           fp8_pair<T>(w[v].z, w[v].w, j), fp8_pair<T>(w[2 + v].z, w[2 + v].w, j)};
#pragma unroll
    for (int b = 0; b < NB; ++b) mma_16816<T>(acc[b], a, xb[b][2 * s], xb[b][2 * s + 1]);
  }
}

}  // namespace onecat_qgemv
