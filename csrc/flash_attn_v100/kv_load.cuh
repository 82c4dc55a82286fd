// Paged K/V loaders: global -> registers (issued early, so the load latency hides behind the
// current tile's math) -> shared memory as FP16. FP8 caches are widened here.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

namespace fa_v100 {

// Eight consecutive head-dim elements of one cached row, as stored.
template <int KV>
struct KvPiece8;

template <>
struct KvPiece8<kKvF16> {
  uint4 raw;  // 8 halfs: one 128-bit load
  __device__ __forceinline__ void load(const void* base, const float*, long long row, long long elem) {
    raw = __ldg(reinterpret_cast<const uint4*>(static_cast<const __half*>(base) + elem));
  }
  __device__ __forceinline__ void zero() { raw = make_uint4(0u, 0u, 0u, 0u); }
  __device__ __forceinline__ uint4 to_half8() const { return raw; }
};

template <int KV>
struct KvPiece8Fp8 {
  uint2 raw;  // 8 fp8 bytes: one 64-bit load
  float scale;
  __device__ __forceinline__ void load(const void* base, const float* scales, long long row, long long elem) {
    raw = __ldg(reinterpret_cast<const uint2*>(static_cast<const unsigned char*>(base) + elem));
    scale = __ldg(scales + row);
  }
  __device__ __forceinline__ void zero() {
    raw = make_uint2(0u, 0u);
    scale = 0.f;
  }
  // Dequantised value fp8 * scale, rounded once to FP16.
  __device__ __forceinline__ uint4 to_half8() const {
    uint4 h;
    fp8x4_to_half4<KV>(raw.x, h.x, h.y);
    fp8x4_to_half4<KV>(raw.y, h.z, h.w);
    h.x = scale_half2(h.x, scale);
    h.y = scale_half2(h.y, scale);
    h.z = scale_half2(h.z, scale);
    h.w = scale_half2(h.w, scale);
    return h;
  }
};

template <>
struct KvPiece8<kKvE4M3> : KvPiece8Fp8<kKvE4M3> {};
template <>
struct KvPiece8<kKvE5M2> : KvPiece8Fp8<kKvE5M2> {};

// A [ROWS, D] tile of keys (or values) held in registers between its global load and its
// shared-memory store, spread over THREADS threads; rows past `n_valid` become zeros so that
// masked positions can never inject NaN/Inf from unused cache slots.
template <int D, int ROWS, int THREADS, int KV>
struct KvTileRegs {
  static constexpr int kPiecesPerRow = D / 8;
  static constexpr int kLoads = ROWS * kPiecesPerRow / THREADS;
  static_assert(ROWS * kPiecesPerRow % THREADS == 0, "tile must split evenly over the threads");
  KvPiece8<KV> piece[kLoads];

  __device__ __forceinline__ void load(const void* base, const float* scales, const PagedKV& kv, int b,
                                       int kvh, int n0, int n_valid, int tid) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = tid + l * THREADS;
      const int r = idx / kPiecesPerRow, c = idx % kPiecesPerRow;
      const int key = n0 + r;
      const long long row = kv_row_grouped<kPiecesPerRow>(kv, b, key, kvh, key < n_valid);
      if (key < n_valid) {
        piece[l].load(base, scales, row, row * D + c * 8);
      } else {
        piece[l].zero();
      }
    }
  }

  // As load(), with the page lookup by FastDiv and done by every lane (prefill variants >= 1).
  __device__ __forceinline__ void load_fast(const void* base, const float* scales, const PagedKV& kv,
                                            const int* table, const FastDiv& per_block, int kvh, int n0,
                                            int n_valid, int tid) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = tid + l * THREADS;
      const int r = idx / kPiecesPerRow, c = idx % kPiecesPerRow;
      const int key = n0 + r;
      if (key < n_valid) {
        const long long row = kv_row_fast(kv, table, per_block, key, kvh);
        piece[l].load(base, scales, row, row * D + c * 8);
      } else {
        piece[l].zero();
      }
    }
  }

  // Store into a swizzled [ROWS, D] FP16 tile addressed in 8-byte chunks.
  __device__ __forceinline__ void store_swizzled(uint2* tile, int tid) const {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = tid + l * THREADS;
      const int r = idx / kPiecesPerRow, c = idx % kPiecesPerRow;
      const uint4 h = piece[l].to_half8();
      tile[swizzle8<D / 4>(r, 2 * c)] = make_uint2(h.x, h.y);
      tile[swizzle8<D / 4>(r, 2 * c + 1)] = make_uint2(h.z, h.w);
    }
  }
};

// 16 bytes of a cached row for the decode kernels: 8 FP16 or 16 FP8 elements, always one
// 128-bit load. Kept raw (unscaled); decode applies the per-slot scales in FP32.
template <int D, int ROWS, int THREADS, int KV>
struct KvChunkRegs {
  static constexpr int kElemBytes = KV == kKvF16 ? 2 : 1;
  static constexpr int kElemsPerVec = 16 / kElemBytes;
  static constexpr int kVecsPerRow = D / kElemsPerVec;
  static constexpr int kLoads = ROWS * kVecsPerRow / THREADS;
  static_assert(ROWS * kVecsPerRow % THREADS == 0, "chunk must split evenly over the threads");
  uint4 k[kLoads];
  uint4 v[kLoads];
  float k_scale, v_scale;  // for row `tid` (tid < ROWS), fp8 kinds only

  __device__ __forceinline__ void load(const AttnParams& p, int b, int kvh, int n0, int n_valid, int tid) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = tid + l * THREADS;
      const int r = idx / kVecsPerRow, c = idx % kVecsPerRow;
      const int key = n0 + r;
      const long long row = kv_row_grouped<kVecsPerRow>(p.kv, b, key, kvh, key < n_valid);
      if (key < n_valid) {
        const long long off = (row * D + (long long)c * kElemsPerVec) * kElemBytes;
        k[l] = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(p.kv.k) + off));
        v[l] = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(p.kv.v) + off));
      } else {
        k[l] = make_uint4(0u, 0u, 0u, 0u);
        v[l] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    k_scale = 1.f;
    v_scale = 1.f;
    if constexpr (KV != kKvF16) {
      if (tid < ROWS) {
        const int key = n0 + tid;
        if (key < n_valid) {
          const long long row = kv_row(p.kv, b, key, kvh);
          k_scale = __ldg(p.kv.k_scale + row);
          v_scale = __ldg(p.kv.v_scale + row);
        } else {
          k_scale = 0.f;
          v_scale = 0.f;
        }
      }
    }
  }

  // K goes to a row-padded tile (stride D + 2 halfs) read one row per lane; V to a dense
  // [ROWS, D] tile read one column per thread.
  __device__ __forceinline__ void store(__half* k_tile, int k_stride, __half* v_tile, float* k_scales,
                                        float* v_scales, int tid) const {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = tid + l * THREADS;
      const int r = idx / kVecsPerRow, c = idx % kVecsPerRow;
      unsigned kw[kElemsPerVec / 2], vw[kElemsPerVec / 2];
      if constexpr (KV == kKvF16) {
        kw[0] = k[l].x; kw[1] = k[l].y; kw[2] = k[l].z; kw[3] = k[l].w;
        vw[0] = v[l].x; vw[1] = v[l].y; vw[2] = v[l].z; vw[3] = v[l].w;
      } else {
        const unsigned kin[4] = {k[l].x, k[l].y, k[l].z, k[l].w};
        const unsigned vin[4] = {v[l].x, v[l].y, v[l].z, v[l].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          fp8x4_to_half4<KV>(kin[w], kw[2 * w], kw[2 * w + 1]);
          fp8x4_to_half4<KV>(vin[w], vw[2 * w], vw[2 * w + 1]);
        }
      }
      unsigned* kdst = reinterpret_cast<unsigned*>(k_tile + r * k_stride + c * kElemsPerVec);
#pragma unroll
      for (int w = 0; w < kElemsPerVec / 2; ++w) kdst[w] = kw[w];
      uint4* vdst = reinterpret_cast<uint4*>(v_tile + r * D + c * kElemsPerVec);
#pragma unroll
      for (int w = 0; w < kElemsPerVec / 8; ++w)
        vdst[w] = make_uint4(vw[4 * w], vw[4 * w + 1], vw[4 * w + 2], vw[4 * w + 3]);
    }
    if (tid < ROWS) {
      k_scales[tid] = k_scale;
      v_scales[tid] = v_scale;
    }
  }
};

}  // namespace fa_v100
