// W4A16 (fp16 scale pairs, groups of 128) on the tensor cores: the decode of one run of 128 columns for
// mma_gemv.cuh, which holds the kernel.
//
// Why: the FMA GEMV (quant_gemv.cuh) spends about three instructions per weight and row, so at one row an H200
// SM is busy for most of the time its share of the weight takes to arrive, and at eight rows it is bound by
// arithmetic. Here one mma.sync.m16n8k16 multiplies 16 weight rows by 16 columns of all 8 activation rows
// (the activations are the 8-wide B operand: rows past m_rows are never stored), so the arithmetic per
// weight is the decode alone, and 8 rows cost what one does.
//
// The decode: two words' nibble j, gathered by one PRMT into the low bits of the two halves and masked by one
// LOP3 into the mantissas of the fp16 pair (1024, 1024), is the pair (1024 + q, 1024 + q'); one HSUB2 of
// (1024 + z) gives (q - z) exactly (whole numbers -15..15). An odd nibble, masked in place, is 1024 + 16 q: one
// HFMA2 by 1/16 minus (64 + z), also exact. About 1.3 instructions a weight. Products on the tensor cores are
// exact and summed in fp32; each 128-column run (one group: groups are 128 here) is scaled once, as the FMA
// GEMV does.
//
// Which columns a register pair holds: the weight layout (engine/quant/w4a16/layout.py) puts column
// w + 16 j of a group of 128 in nibble j of the group's word w. Lane l (quad position c = l % 4) loads words
// 4c .. 4c + 3 of a 16-word run for rows g = l / 4 and g + 8. At k-step j its A pairs are nibble j of words
// (4c, 4c + 1), columns 16 j + 4c and + 1 (the k pair 2c, 2c + 1), and of words (4c + 2, 4c + 3), columns
// 16 j + 4c + 2 and + 3 (the k pair 2c + 8, 2c + 9). The sum over k does not care which physical column a k
// is, as long as B holds the same one: lane (g, c)'s B pairs at k-step j are activation row g's columns
// 16 j + 4c .. + 3, one 8-byte load (w4_load_b), from global memory (the activations are a few KB, read through
// L1), with no staging, permutation or block barrier.
#pragma once

#include "mma_ops.cuh"

namespace onecat_qgemv {

// (a & MASK) | 0x64006400 in one LOP3 (the compiler's own lowering takes two: both constants are immediates).
template <uint32_t MASK>
__device__ __forceinline__ uint32_t mask_into_1024(uint32_t a) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(a), "n"(MASK), "r"(0x64006400u));
  return r;
}

// Byte B of lo in byte 0 and byte B of hi in byte 2 (bytes 1 and 3 are masked off by the decode).
template <int B>
__device__ __forceinline__ uint32_t gather_byte(uint32_t lo, uint32_t hi) {
  return __byte_perm(lo, hi, B | ((4 + B) << 8));
}

// The low (ODD false) or high nibble of the gathered bytes as the fp16 pair (q_lo - z, q_hi - z).
template <bool ODD>
__device__ __forceinline__ uint32_t decode_pair(uint32_t gathered, __half2 z1024, __half2 z64) {
  if (!ODD) return h2_bits(__hsub2(bits_h2(mask_into_1024<0x000F000Fu>(gathered)), z1024));
  return h2_bits(__hfma2(bits_h2(mask_into_1024<0x00F000F0u>(gathered)), __float2half2_rn(0.0625f), __hneg2(z64)));
}

// The B operand of one run for this lane: activation row g's columns 16 j + 4c .. + 3 for j = 0..7 (k-step j
// takes xb[2j]: columns 16 j + 4c, + 1, and xb[2j + 1]: columns 16 j + 4c + 2, + 3).
__device__ __forceinline__ void w4_load_b(const __half* xm, int col0, int c, uint32_t* xb) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(xm + col0 + 16 * j + 4 * c));
    xb[2 * j] = v.x;
    xb[2 * j + 1] = v.y;
  }
}

// k-step j = 2 B + ODD of one run: nibble j of the lane's word pairs of rows g (w[0]) and g + 8 (w[1]).
template <int NB, int B, bool ODD>
__device__ __forceinline__ void mma_step(float (*part)[4], const uint4* w, const __half2* z1024, const __half2* z64,
                                         const uint32_t (*xb)[16]) {
  const uint32_t a[4] = {decode_pair<ODD>(gather_byte<B>(w[0].x, w[0].y), z1024[0], z64[0]),
                         decode_pair<ODD>(gather_byte<B>(w[1].x, w[1].y), z1024[1], z64[1]),
                         decode_pair<ODD>(gather_byte<B>(w[0].z, w[0].w), z1024[0], z64[0]),
                         decode_pair<ODD>(gather_byte<B>(w[1].z, w[1].w), z1024[1], z64[1])};
#pragma unroll
  for (int b = 0; b < NB; ++b) mma_16816<__half>(part[b], a, xb[b][2 * (2 * B + ODD)], xb[b][2 * (2 * B + ODD) + 1]);
}

// One run of one 16-row tile: the two rows' words (w[h]: row g + 8 h) and (scale, zero) pairs against the NB B
// operands xb[b]; each row's run sum is scaled once into acc[b] (rows g, g, g + 8, g + 8; activation rows 8 b + 2c,
// + 1).
template <int NB>
__device__ __forceinline__ void w4_run(const uint4* w, const uint32_t* sz, const uint32_t (*xb)[16], float (*acc)[4]) {
  __half2 z1024[2], z64[2];
  float s[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __half2 pair = bits_h2(sz[h]);  // (scale, zero)
    const __half z = __high2half(pair);
    s[h] = __low2float(pair);
    z1024[h] = __half2half2(__hadd(z, __float2half(1024.f)));
    z64[h] = __half2half2(__hadd(z, __float2half(64.f)));
  }
  float part[NB][4] = {};
  mma_step<NB, 0, false>(part, w, z1024, z64, xb);
  mma_step<NB, 0, true>(part, w, z1024, z64, xb);
  mma_step<NB, 1, false>(part, w, z1024, z64, xb);
  mma_step<NB, 1, true>(part, w, z1024, z64, xb);
  mma_step<NB, 2, false>(part, w, z1024, z64, xb);
  mma_step<NB, 2, true>(part, w, z1024, z64, xb);
  mma_step<NB, 3, false>(part, w, z1024, z64, xb);
  mma_step<NB, 3, true>(part, w, z1024, z64, xb);
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    acc[b][0] = fmaf(s[0], part[b][0], acc[b][0]);
    acc[b][1] = fmaf(s[0], part[b][1], acc[b][1]);
    acc[b][2] = fmaf(s[1], part[b][2], acc[b][2]);
    acc[b][3] = fmaf(s[1], part[b][3], acc[b][3]);
  }
}

}  // namespace onecat_qgemv
