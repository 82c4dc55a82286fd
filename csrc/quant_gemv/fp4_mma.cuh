// NVFP4 and MXFP4 on the tensor cores: the decode of one run of 128 columns for mma_gemv.cuh, which holds the
// kernel.
//
// Why: the FMA GEMV spends about three instructions per weight and activation row, so at 8 rows it is bound by
// arithmetic (0.4x cuBLAS fp16 on an H200). Here a weight is decoded once for all 8 rows.
//
// The decode: each code is formed in float32 by the FMA GEMV's own decode (formats.cuh: e2m1 * 2^-126) and
// multiplied by its block's scale, then a pair is rounded to the activation dtype, exactly: NVFP4's
// e2m1 * e4m3 has at most 6 significant bits, and with the scale taken as e4m3 * 2^119 the product lies in
// [2^-17, 21], inside fp16's and bf16's range (the remaining 2^7 and the global scale multiply the row's sum
// at the end); MXFP4's e2m1 * 2^(e - 127) is kept as it is, which bf16 holds for every exponent the layout
// allows (fp16 does not: MXFP4 takes this kernel with bf16 activations only). Products on the tensor cores are
// exact, sums fp32.
//
// Which columns a register pair holds (engine/quant/fp4/layout.py: word w of a block of B columns holds
// columns w + j * B / 8 in code j): lane (g, c) loads words 4c .. 4c + 3 of a 16-word run for rows g and
// g + 8. At k-step j its A pairs are code j of words (4c, 4c + 1) and code j of words (4c + 2, 4c + 3): two
// neighbouring columns each. NVFP4 (B = 16): words 4c, 4c + 1 are block 2c, the pair is columns 32c + 2j, + 1,
// and words 4c + 2, 4c + 3 are block 2c + 1, columns 32c + 16 + 2j, + 1. MXFP4 (B = 32): words 4c .. 4c + 3
// are block c, the pairs are columns 32c + 4j, + 1 and 32c + 4j + 2, + 3. Either way the lane's B pairs are
// among activation row g's columns 32c .. 32c + 31 of the run, one 64-byte load (load_b_32cols, mma_ops.cuh).
//
// NVFP4 and MXFP4 have a second decode, on words in code slots (engine/quant/fp4/slots.py; the launcher takes it
// where Params.tiled is kTilesFp16Slots or kTilesBf16Slots): a code's magnitude bits and sign sit where one
// rotation and one mask (two of each for two slots of four) put them into the fp16 of code * 2^-14 (bits 9-11 and
// 15) or the bf16 of code * 2^-126 (bits 6-8 and 15), both halves at once, exactly, subnormal 0.5 included; one
// HMUL2 by the block scale gives the values the float32 decode forms, so the same output bits: NVFP4's e4m3 * 2^7
// (fp16: <= 61440) or * 2^119 (bf16), for e2m1 * e4m3 * 2^-7; MXFP4's 2^(e - 1) (bf16, e <= 128: the layer keeps
// plain words otherwise), for e2m1 * 2^(e - 127). About 1.9 instructions a weight against 4.
#pragma once

#include "formats.cuh"
#include "mma_ops.cuh"

namespace onecat_qgemv {

// The lane's scale bits of one run for one row: NVFP4 the E4M3 bytes of blocks 2c and 2c + 1 (one 16-bit
// load), MXFP4 the E8M0 byte of block c. `base` is the row's first scale byte.
template <int FMT>
__device__ __forceinline__ uint32_t fp4_run_scales(const uint8_t* base, int run, int c) {
  if constexpr (FMT == kNvfp4) return __ldg(reinterpret_cast<const uint16_t*>(base) + 4 * run + c);
  return __ldg(base + 4 * run + c);
}

// The multiplier of a code's float32 decode (e2m1 * 2^-126): NVFP4 e4m3 * 2^119 (see above), MXFP4 2^(e - 1)
// in two factors (2^126, then 2^(e - 127): one constant would overflow float32 for e > 128).
__device__ __forceinline__ float nvfp4_factor(uint32_t byte) {
  return e4m3(byte) * 1.329227995784916e36f * 6.646139978924579e35f;  // e4m3 * 2^-120 * 2^120 * 2^119
}
__device__ __forceinline__ float mxfp4_factor(uint32_t e) {
  return e == 0 ? 5.877471754111438e-39f : __uint_as_float(e << 23);  // 2^(e - 127)
}

// A pair of code j of words lo and hi, times the block's factor, rounded to T.
template <int FMT, typename T>
__device__ __forceinline__ uint32_t fp4_pair(uint32_t lo, uint32_t hi, int j, float f) {
  float a = decode<FMT>(lo, 0u, j), b = decode<FMT>(hi, 0u, j);
  if constexpr (FMT == kMxfp4) {
    a *= 8.507059173023462e37f;  // 2^126: the e2m1 value itself
    b *= 8.507059173023462e37f;
  }
  return pack_pair<T>(a * f, b * f);
}

// One run of one 16-row tile: rows g (w[0], scale bits sc[0]) and g + 8 (w[1], sc[1]) against the NB B operands
// xb[b] (activation rows 8 b ..), accumulated into acc[b] (rows g, g, g + 8, g + 8; activation rows 8 b + 2c,
// + 1) with the scales already in A: each A fragment decoded once for all NB.
template <int FMT, typename T, int NB>
__device__ __forceinline__ void fp4_run(const uint4* w, const uint32_t* sc, const uint32_t (*xb)[16],
                                        float (*acc)[4]) {
  float fp[2], fq[2];  // the factors of the P pairs (words 4c, 4c + 1) and Q pairs (4c + 2, 4c + 3) of each row
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (FMT == kNvfp4) {
      fp[h] = nvfp4_factor(sc[h] & 0xFFu);
      fq[h] = nvfp4_factor(sc[h] >> 8);
    } else {
      fp[h] = fq[h] = mxfp4_factor(sc[h]);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t a[4] = {fp4_pair<FMT, T>(w[0].x, w[0].y, j, fp[0]), fp4_pair<FMT, T>(w[1].x, w[1].y, j, fp[1]),
                           fp4_pair<FMT, T>(w[0].z, w[0].w, j, fq[0]), fp4_pair<FMT, T>(w[1].z, w[1].w, j, fq[1])};
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      if constexpr (FMT == kNvfp4) {
        mma_16816<T>(acc[b], a, xb[b][j], xb[b][8 + j]);
      } else {
        mma_16816<T>(acc[b], a, xb[b][2 * j], xb[b][2 * j + 1]);
      }
    }
  }
}

// Slot S of a word in T's code slots as the pair (code, code') * 2^-14 (fp16) or * 2^-126 (bf16) in T's bits:
// fp4/slots.py SLOTS[T].rotations, the magnitude bits rotated left by the first amount, the sign by the second.
template <typename T, int S>
__device__ __forceinline__ uint32_t slot_pair(uint32_t w) {
  if constexpr (Same<T, __half>::value) {
    if constexpr (S == 0) return w & 0x8E008E00u;
    if constexpr (S == 1) return (w << 3) & 0x8E008E00u;
    if constexpr (S == 2) return ((w << 6) & 0x0E000E00u) | ((w << 1) & 0x80008000u);
    return ((w << 9) & 0x0E000E00u) | ((w << 2) & 0x80008000u);
  } else {
    if constexpr (S == 0) return w & 0x81C081C0u;
    if constexpr (S == 1) return ((w << 3) & 0x01C001C0u) | ((w << 4) & 0x80008000u);
    if constexpr (S == 2) return (w << 6) & 0x81C081C0u;
    return (rotl(w, 10) & 0x01C001C0u) | ((w << 5) & 0x80008000u);
  }
}

// T's pair of a block scale's multiplier, both halves, exact: NVFP4 (byte) times 2^7 (fp16) or 2^119 (bf16),
// MXFP4 2^(e - 1) (bf16; e <= 128).
template <int FMT, typename T> __device__ __forceinline__ uint32_t slot_scale(uint32_t byte) {
  if constexpr (FMT == kMxfp4) {
    static_assert(Same<T, __nv_bfloat16>::value, "MXFP4 code slots are bf16's");
    const uint32_t bits = (byte + 126u) << 7;  // bf16 of 2^(e - 1)
    return bits | (bits << 16);
  } else if constexpr (Same<T, __half>::value) {
    return h2_bits(__float2half2_rn(e4m3(byte) * 1.7014118346046923e38f));  // e4m3 * 2^-120 * 2^127
  } else {
    __nv_bfloat162 v = __float2bfloat162_rn(nvfp4_factor(byte));
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// a * b in T, pairwise (exact for every value the slot decode forms).
template <typename T> __device__ __forceinline__ uint32_t mul_pair(uint32_t a, uint32_t b);
template <> __device__ __forceinline__ uint32_t mul_pair<__half>(uint32_t a, uint32_t b) {
  return h2_bits(__hmul2(bits_h2(a), bits_h2(b)));
}
template <> __device__ __forceinline__ uint32_t mul_pair<__nv_bfloat16>(uint32_t a, uint32_t b) {
  __nv_bfloat162 v = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&v);
}

// k-step j = 4 V + S of one run: slot S of word V of a lane's P words (w[h].x, .y) and Q words (w[h].z, .w) of rows
// g (h = 0) and g + 8, each pair times its block's scale. NVFP4: P is columns 32c + 2j, + 1, Q 32c + 16 + 2j, + 1;
// MXFP4 (fp4.slots.MXFP4_ORDER): P 32c + 4j, + 1, Q 32c + 4j + 2, + 3, the pairs fp4_run sums at k-step j.
template <int FMT, typename T, int NB, int V, int S>
__device__ __forceinline__ void slots_step(const uint4* w, const uint32_t* sp, const uint32_t* sq,
                                           const uint32_t (*xb)[16], float (*acc)[4]) {
  const uint32_t a[4] = {mul_pair<T>(slot_pair<T, S>(V ? w[0].y : w[0].x), sp[0]),
                         mul_pair<T>(slot_pair<T, S>(V ? w[1].y : w[1].x), sp[1]),
                         mul_pair<T>(slot_pair<T, S>(V ? w[0].w : w[0].z), sq[0]),
                         mul_pair<T>(slot_pair<T, S>(V ? w[1].w : w[1].z), sq[1])};
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if constexpr (FMT == kMxfp4) {
      mma_16816<T>(acc[b], a, xb[b][2 * (4 * V + S)], xb[b][2 * (4 * V + S) + 1]);
    } else {
      mma_16816<T>(acc[b], a, xb[b][4 * V + S], xb[b][8 + 4 * V + S]);
    }
  }
}

// One run of one 16-row tile, words in T's code slots: as fp4_run<FMT, T>, the same products in the same order (so
// the same output bits). NVFP4's P and Q words are two blocks (scale bytes sc[h] & 0xFF, sc[h] >> 8), MXFP4's one.
template <int FMT, typename T, int NB>
__device__ __forceinline__ void slots_run(const uint4* w, const uint32_t* sc, const uint32_t (*xb)[16],
                                          float (*acc)[4]) {
  uint32_t sp[2], sq[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    sp[h] = slot_scale<FMT, T>(sc[h] & 0xFFu);
    sq[h] = FMT == kMxfp4 ? sp[h] : slot_scale<FMT, T>(sc[h] >> 8);
  }
  slots_step<FMT, T, NB, 0, 0>(w, sp, sq, xb, acc);
  slots_step<FMT, T, NB, 0, 1>(w, sp, sq, xb, acc);
  slots_step<FMT, T, NB, 0, 2>(w, sp, sq, xb, acc);
  slots_step<FMT, T, NB, 0, 3>(w, sp, sq, xb, acc);
  slots_step<FMT, T, NB, 1, 0>(w, sp, sq, xb, acc);
  slots_step<FMT, T, NB, 1, 1>(w, sp, sq, xb, acc);
  slots_step<FMT, T, NB, 1, 2>(w, sp, sq, xb, acc);
  slots_step<FMT, T, NB, 1, 3>(w, sp, sq, xb, acc);
}

}  // namespace onecat_qgemv
