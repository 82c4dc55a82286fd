// Volta tensor-core primitive: mma.sync.aligned.m8n8k4 (SASS HMMA.884), FP16 in, FP32 accumulate.
//
// A warp issues four independent 8x8x4 products, one per "quad pair": lanes 4q..4q+3 (low
// group) with lanes 4q+16..4q+19 (high group), q = 0..3. Fragment ownership per lane
// (PTX ISA, "Matrix Fragments for mma.m8n8k4 with .f16"):
//   A row-major  : row  = lane%4 + 4*(lane>=16), elements k = 0..3 (one 8-byte chunk)
//   B col-major  : col  = lane%4 + 4*(lane>=16), elements k = 0..3 (one 8-byte chunk)
//   B row-major  : row k = lane%4, cols 0..3 (+4 for the high group)
//   C/D (f32) i  : row = (lane&1) + (i&2) + 4*(lane>=16), col = (i&4) + (lane&2) + (i&1)
#pragma once
#include "common.cuh"

namespace fa_v100 {

// d += a(8x4, row-major) * b(4x8, col-major)
__device__ __forceinline__ void hmma884_row_col(float (&d)[8], const uint2 a, const uint2 b) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a.x), "r"(a.y), "r"(b.x), "r"(b.y));
}

// d += a(8x4, row-major) * b(4x8, row-major)
__device__ __forceinline__ void hmma884_row_row(float (&d)[8], const uint2 a, const uint2 b) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a.x), "r"(a.y), "r"(b.x), "r"(b.y));
}

// Which rows/cols of its quad pair's 8x8 tile a lane holds.
struct QuadPairLane {
  int frag_row;  // A/B(col-major) operand row or column held by this lane: lane%4 + 4*high
  int low4;      // lane % 4: B(row-major) k row
  int high;      // 1 for lanes 16..31
  int qp;        // quad pair 0..3

  __device__ __forceinline__ explicit QuadPairLane(int lane)
      : frag_row((lane & 3) + ((lane >> 4) << 2)), low4(lane & 3), high(lane >> 4), qp((lane >> 2) & 3) {}
};

__device__ __forceinline__ int acc_row(int lane, int i) { return (lane & 1) + (i & 2) + ((lane >> 4) << 2); }
__device__ __forceinline__ int acc_col(int lane, int i) { return (i & 4) + (lane & 2) + (i & 1); }

}  // namespace fa_v100
