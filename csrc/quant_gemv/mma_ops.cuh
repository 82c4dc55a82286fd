// The tensor-core pieces the packed-weight GEMVs for 1-8 activation rows share (mma_gemv.cuh): fp16 and bf16
// pair bits and one mma.sync.m16n8k16 with fp32 accumulators (SM80 and newer; builds for older GPUs trap, and
// the launcher never starts these kernels there).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "formats.cuh"
#include "params.h"

namespace onecat_qgemv {

// std::is_same without <type_traits> (NVRTC, which the offline sm_70 check uses, has no standard library)
template <typename A, typename B> struct Same { static constexpr bool value = false; };
template <typename A> struct Same<A, A> { static constexpr bool value = true; };

__device__ __forceinline__ uint32_t h2_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __half2 bits_h2(uint32_t v) { return *reinterpret_cast<__half2*>(&v); }

// The pair (lo, hi) rounded to T (exact for every value the FP4 decode forms).
template <typename T> __device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  return h2_bits(__floats2half2_rn(lo, hi));
}
template <> __device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Programmatic dependent launch (engine/kernels/pdl.py has the rule): wait until the previous kernel has completed
// and its writes are visible, then let the next kernel start. Only loads of weights may come before it. A no-op
// when the kernel was launched without PDL; not compiled below SM90, which has no griddepcontrol.
__device__ __forceinline__ void wait_previous_kernel_then_release_next() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// SiLU(gate) * up of two fp32 sums, each first rounded to X as a projection's output is, with the operations of
// the separate kernel (engine/kernels/triton_fused.py silu_mul, as Triton lowers it: 0 - g, times log2(e),
// ex2.approx, + 1, div.full, rounded to X, times up in X), so the folded and the separate paths give the same bits.
template <typename X>
__device__ __forceinline__ X silu_mul(float gate, float up) {
  const float g = to_float(from_float<X>(gate));
  float s;
  asm("{\n\t.reg .f32 t;\n\t"
      "sub.f32 t, 0f00000000, %1;\n\t"
      "mul.f32 t, t, 0f3FB8AA3B;\n\t"
      "ex2.approx.f32 t, t;\n\t"
      "add.f32 t, t, 0f3F800000;\n\t"
      "div.full.f32 %0, %1, t;\n\t}"
      : "=f"(s)
      : "f"(g));
  return __hmul(from_float<X>(s), from_float<X>(up));
}

// d += a (16 x 16, row-major) * b (16 x 8), T = fp16 or bf16 inputs, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Same<T, __half>::value) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();
#endif
}

// The B operand of the FP4 and FP8 decodes: activation row g's columns 32c .. 32c + 31 of the run as 16 pairs.
template <typename T>
__device__ __forceinline__ void load_b_32cols(const T* xm, int col0, int c, uint32_t* xb) {
  const uint4* src = reinterpret_cast<const uint4*>(xm + col0 + 32 * c);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = __ldg(src + i);
    xb[4 * i] = v.x;
    xb[4 * i + 1] = v.y;
    xb[4 * i + 2] = v.z;
    xb[4 * i + 3] = v.w;
  }
}

}  // namespace onecat_qgemv
