// The packed-weight GEMV's formats and arguments, shared by the kernels (quant_gemv.cuh) and the host code
// that launches them (csrc/bindings/quant_gemv.cpp, compiled without nvcc).
#pragma once

#ifndef __CUDACC_RTC__
#include <stdint.h>
#endif

namespace onecat_qgemv {

#ifdef __CUDACC_RTC__  // NVRTC (the offline sm_70 check) has no <stdint.h>
using uint8_t = unsigned char;
using uint16_t = unsigned short;
using uint32_t = unsigned int;
using int64_t = long long;
#endif

// kDense: not packed, the weight in the activation dtype (fp16 or bf16) read as words of two; only the
// tensor-core GEMV takes it (dense_mma.cuh)
enum Format : int { kInt4H = 0, kInt4B = 1, kNvfp4 = 2, kMxfp4 = 3, kFp8 = 4, kDense = 5 };

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMmaRows = 32;  // mma_gemv.cuh: output rows of a block (two tiles of one mma's M)
constexpr int kMmaWarps = 4;  // mma_gemv.cuh: warps of a block by default (Params.warps: 2, 4 or 8)
constexpr int kMmaRun = 128;  // mma_gemv.cuh: columns of K a warp takes at once (a run)

// Params.tiled: how mma_gemv.cuh finds the words (engine/kernels/quant_gemv.py LAYOUTS)
enum Layout : int { kRowMajor = 0, kTiles = 1, kTilesFp16Slots = 2, kTilesBf16Slots = 3 };

struct Params {
  const void* x;          // [m_rows, K] activations (T)
  const uint32_t* w;      // [N, K / codes-per-word] packed words
  const void* scales;     // format's scales (see above)
  const float* row_scale; // kNvfp4: global scale per row; kFp8: scale per row; else unused
  void* y;                // [m_rows, N] output (T)
  float* partial;         // [splits, m_rows, N] when splits > 1
  int* tickets;           // one per row tile, zero between calls (the last block resets its own)
  // folded norm (residual != nullptr): the input is RMSNorm(x + residual) * norm_w, and x + residual is
  // written to rout [m_rows, K] (the new residual stream)
  const void* residual;   // [m_rows, K] (T) or nullptr
  const void* norm_w;     // [K] (T)
  void* rout;             // [m_rows, K] (T)
  float eps;
  int glu;                // weight rows are [gate | up] (N = 2 * n_out): y = SiLU(gate) * up
  int n, n_out, k, group, m_rows, splits;  // n: weight rows; n_out: output features (n, or n / 2 with glu)
  int gshift;  // W4A16: group = 32 << gshift
  int tiled;   // mma_gemv.cuh only, a Layout: the words in tiles of 16 rows a run (mma_tiles in
               // engine/kernels/quant_gemv.py), NVFP4's also with its codes in the activation dtype's slots
  int warps;   // mma_gemv.cuh only: warps a block, by the grid's blocks per SM (mma_warps in
               // csrc/bindings/quant_gemv.cpp)
};

}  // namespace onecat_qgemv
