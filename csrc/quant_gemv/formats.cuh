// Each packed format's codes and scales as float32 (the powers of two quant_gemv.cuh describes), shared by
// the packed-weight GEMV's staging and main loop.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "params.h"

namespace onecat_qgemv {


template <int FMT> struct Traits;
template <> struct Traits<kInt4H> { static constexpr int kCodes = 8; };
template <> struct Traits<kInt4B> { static constexpr int kCodes = 8; };
template <> struct Traits<kNvfp4> { static constexpr int kCodes = 8; static constexpr int kBlock = 16; };
template <> struct Traits<kMxfp4> { static constexpr int kCodes = 8; static constexpr int kBlock = 32; };
template <> struct Traits<kFp8> { static constexpr int kCodes = 4; static constexpr int kBlock = 16; };
template <> struct Traits<kDense> { static constexpr int kCodes = 2; };

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ uint32_t rotl(uint32_t w, int r) { return __funnelshift_l(w, w, r); }
__device__ __forceinline__ float bits(uint32_t v) { return __uint_as_float(v); }

// An E4M3 byte as float32 times 2^-120 (sign to bit 31, exponent and mantissa to bits 20-26).
__device__ __forceinline__ float e4m3(uint32_t b) { return bits(((b & 0x7Fu) << 20) | ((b & 0x80u) << 24)); }

// Code j of word w as float32 (see the header for the power of two each format carries).
template <int FMT>
__device__ __forceinline__ float decode(uint32_t w, uint32_t hi, int j) {
  if constexpr (FMT == kInt4H || FMT == kInt4B) {
    return j < 6 ? bits(w & (0xFu << (4 * j))) : bits(hi & (0xFu << (4 * j - 8)));
  } else if constexpr (FMT == kFp8) {
    // byte j: sign (bit 8j+7) to 31, magnitude (bits 8j..8j+6) to 20..26
    const uint32_t t = rotl(w, 24 - 8 * j);
    return bits((t & 0x80000000u) | ((t >> 4) & 0x07F00000u));
  } else {
    // engine/quant/fp4/layout.py SLOTS: rotate left and mask to sign bit 31, magnitude bits 22-24
    switch (j) {
      case 0: return bits(rotl(w, 22) & 0x81C00000u);
      case 1: return bits(rotl(w, 19) & 0x81C00000u);
      case 2: return bits(rotl(w, 16) & 0x81C00000u);
      case 3: return bits((rotl(w, 12) & 0x80C00000u) | (w & 0x01000000u));
      case 4: return bits((rotl(w, 9) & 0x00C00000u) | (rotl(w, 1) & 0x81000000u));
      case 5: return bits(rotl(w, 6) & 0x81C00000u);
      case 6: return bits(rotl(w, 2) & 0x81C00000u);
      default: return bits((rotl(w, 28) & 0x01C00000u) | (w & 0x80000000u));
    }
  }
}

// Columns per scale block.
template <int FMT>
__device__ __forceinline__ int block_cols(const Params& p) {
  if constexpr (FMT == kInt4H || FMT == kInt4B) {
    return p.group;
  } else {
    return Traits<FMT>::kBlock;
  }
}

// Shared memory of one block: float4 xs[M][codes][chunks] (+ float xsum[M][chunks] for W4A16).
template <int FMT, int M>
__host__ __device__ constexpr int smem_bytes(int chunks) {
  return M * Traits<FMT>::kCodes * chunks * 16 + ((FMT == kInt4H || FMT == kInt4B) ? M * chunks * 4 : 0);
}

// A row's scales, located once per row: the row's first scale element, and NVFP4's global scale * 2^26.
struct RowScales {
  const void* base;
  float global;
};

template <int FMT>
__device__ __forceinline__ RowScales row_scales(const Params& p, int64_t row) {
  if constexpr (FMT == kInt4H || FMT == kInt4B) {
    return {static_cast<const uint32_t*>(p.scales) + row * (p.k / p.group), 0.f};  // one (s, z) pair a group
  } else if constexpr (FMT == kNvfp4) {
    return {static_cast<const uint16_t*>(p.scales) + row * (p.k / 32), p.row_scale[row] * 67108864.f};
  } else if constexpr (FMT == kMxfp4) {
    return {static_cast<const uint8_t*>(p.scales) + row * (p.k / 32), 0.f};
  } else {
    return {nullptr, 0.f};
  }
}

// The scale factors of one chunk (32 columns) of one row: W4A16 (s * 2^49, z); NVFP4 (first block, second
// block) with the decode's 2^26 folded in; MXFP4 (2^(e-127), -); FP8 none (the row scale comes at the end).
// W4A16 groups are 32 << gshift columns.
template <int FMT>
__device__ __forceinline__ float2 chunk_scales(const RowScales& rs, int chunk, int gshift) {
  if constexpr (FMT == kInt4H) {
    const uint32_t v = __ldg(static_cast<const uint32_t*>(rs.base) + (chunk >> gshift));
    const __half2 sz = *reinterpret_cast<const __half2*>(&v);
    return make_float2(__low2float(sz) * 562949953421312.f, __high2float(sz));  // s * 2^49, z
  } else if constexpr (FMT == kInt4B) {
    const uint32_t v = __ldg(static_cast<const uint32_t*>(rs.base) + (chunk >> gshift));
    const __nv_bfloat162 sz = *reinterpret_cast<const __nv_bfloat162*>(&v);
    return make_float2(__low2float(sz) * 562949953421312.f, __high2float(sz));
  } else if constexpr (FMT == kNvfp4) {
    // two blocks of 16 per chunk; the E4M3 value formed exactly (times 2^120 back), then times the global
    const uint32_t b2 = __ldg(static_cast<const uint16_t*>(rs.base) + chunk);
    const float s0 = e4m3(b2 & 0xFF) * 1.329227995784916e36f;
    const float s1 = e4m3(b2 >> 8) * 1.329227995784916e36f;
    return make_float2(s0 * rs.global, s1 * rs.global);
  } else if constexpr (FMT == kMxfp4) {
    const uint32_t e = __ldg(static_cast<const uint8_t*>(rs.base) + chunk);
    const float s = e == 0 ? 5.877471754111438e-39f : (e == 255 ? __uint_as_float(0x7FC00000u) : bits(e << 23));
    return make_float2(s, 0.f);
  } else {
    return make_float2(1.f, 0.f);
  }
}

}  // namespace onecat_qgemv
