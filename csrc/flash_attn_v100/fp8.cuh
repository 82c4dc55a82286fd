// FP8 (E4M3 / E5M2) to FP16 conversion by bit manipulation: SM70 has no FP8 instructions.
// Every E4M3 and E5M2 value is exactly representable in FP16, so the raw conversion is exact;
// the per-(slot, head) scale is applied separately in FP32.
#pragma once
#include "common.cuh"

namespace fa_v100 {

// Bytes 0,1 of `x` (selector 0x1404) or 2,3 (0x3424) moved into the high byte of two halfs.
__device__ __forceinline__ unsigned bytes_to_high_halves(unsigned x, unsigned selector) {
  return __byte_perm(x, 0u, selector);
}

// Two fp8 values (already in the high byte of each 16-bit lane) -> half2 bits, exact.
template <int KV>
__device__ __forceinline__ unsigned fp8x2_to_half2_bits(unsigned hb) {
  if constexpr (KV == kKvE5M2) {
    return hb;  // E5M2 is the upper byte of FP16
  } else {
    // E4M3: keep the sign, shift exponent+mantissa right by one bit (bias 7 instead of 15,
    // read as FP16 this is value * 2^-8), then multiply by 2^8 exactly in FP16.
    const unsigned bits = (hb & 0x80008000u) | ((hb & 0x7F007F00u) >> 1);
    __half2 h = *reinterpret_cast<const __half2*>(&bits);
    h = __hmul2(h, __float2half2_rn(256.f));
    return *reinterpret_cast<const unsigned*>(&h);
  }
}

// Four fp8 values -> two half2 words without the E4M3 2^8 correction: E4M3 reads as value * 2^-8
// (exact; FP16 holds every E4M3 value times 2^-8), E5M2 as its value. For callers that fold the
// 2^8 into an FP32 scale.
template <int KV>
__device__ __forceinline__ void fp8x4_to_half4_raw(unsigned x, unsigned& lo, unsigned& hi) {
  const unsigned a = bytes_to_high_halves(x, 0x1404u), c = bytes_to_high_halves(x, 0x3424u);
  if constexpr (KV == kKvE5M2) {
    lo = a;
    hi = c;
  } else {
    lo = (a & 0x80008000u) | ((a & 0x7F007F00u) >> 1);
    hi = (c & 0x80008000u) | ((c & 0x7F007F00u) >> 1);
  }
}

// Four fp8 values in a 32-bit word -> two half2 words (raw, unscaled).
template <int KV>
__device__ __forceinline__ void fp8x4_to_half4(unsigned x, unsigned& lo, unsigned& hi) {
  lo = fp8x2_to_half2_bits<KV>(bytes_to_high_halves(x, 0x1404u));
  hi = fp8x2_to_half2_bits<KV>(bytes_to_high_halves(x, 0x3424u));
}

// A half2 word scaled by an FP32 factor and rounded back to half2.
__device__ __forceinline__ unsigned scale_half2(unsigned h2, float s) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
  __half2 r = __floats2half2_rn(f.x * s, f.y * s);
  return *reinterpret_cast<const unsigned*>(&r);
}

}  // namespace fa_v100
