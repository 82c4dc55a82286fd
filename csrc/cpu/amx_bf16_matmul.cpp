// Prompt rows of the packed layers on AMX bfloat16 tiles (EngineArgs.cpu_prompt_matmul "bf16"): a prompt's
// hundreds of rows are compute-bound, where the int8 dot products (int8_matmul.cpp) reach a fraction of what
// the tile unit does in the same time.
//
// The weights are dequantized once at load (float32 s * q + c rounded to bfloat16) into the tiles' layout,
// [N / 16][K / 32][16 pairs of K][16 columns][2]: one 1 KiB B tile per 16 columns and 32 values of K. Each
// call rounds its rows to bfloat16 (ties to even) into a buffer padded to 32 rows, and every 32 x 32 block of
// the output is four C tiles summed over K in one fixed order (TDPBF16PS, 32 values of K at a time). Nothing
// in a row's sum reads another row, so a row's result depends only on that row: not on the row count, the
// other rows, its place in the call or the thread that computes it (batch-invariant by construction, as the
// tests check). Results go into a given output's rows in place (a run of a step's rows). A [gate | up] layer can
// pair each gate tile with its up tile and write SiLU(gate) * up from the C tiles (amx_bf16_silu_mul), so the
// [rows, 2 * width] product never leaves the cache; each block's SiLU runs inside the next block's K loop, on the
// vector units while the tile unit sums. 2 x 2 C tiles is the fewest tile loads per product the eight tiles
// allow (measured on a 2-vCPU Xeon, one core: 3.3 TFLOPS with every tile load from the same 4 KiB, 2.4 with a
// block's rows and weights in L1, 1.5-1.7 once they spill to L2; the embedded model's 2,048-row calls 1.3-1.8 on
// both cores, the float32 outputs' stores included). The tiles' permission and configuration: amx_tiles.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "amx_tiles.h"
#include "row_vectors.h"

namespace {

constexpr int64_t kTileCols = 16, kTileK = 32, kBlockRows = 32, kBlockCols = 32;
constexpr int64_t kRowChunk = 256;  // rows whose bf16 copy (K = 1536: 768 KiB) stays in L2 over a thread's columns

#ifdef ONECAT_AMX
using amx_tiles::kTileBytes;

// Rows rounded to bfloat16 (amx_tiles.h), or copied where they are bfloat16 already; k % 32 == 0.
template <typename T>
AMX_TARGET void round_rows(const T* x, int64_t rows, int64_t k, uint16_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (std::is_same_v<T, float>) {
      amx_tiles::round_to_bf16(x + r * k, k, out + r * k);
    } else {
      std::memcpy(out + r * k, x + r * k, k * sizeof(uint16_t));
    }
  }
}

// No work between a block's K steps.
struct Idle {
  void operator()() const {}
};

// out[32 rows][16 or 32 columns] from A (32 rows of bf16, stride k) and the column block's B tiles; `between()`
// runs after each K step (vector work the core can do while the tile unit sums: glu_block).
template <bool kPair, typename Between = Idle>
AMX_TARGET void block(const uint16_t* a, const uint8_t* b0, const uint8_t* b1, int64_t k, float* out,
                      int64_t out_stride, Between between = {}) {
  const int64_t a_stride = k * 2, blocks = k / kTileK;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kPair) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < blocks; ++kb) {
    _tile_loadd(4, a + kb * kTileK, a_stride);
    _tile_loadd(5, a + 16 * k + kb * kTileK, a_stride);
    _tile_loadd(6, b0 + kb * kTileBytes, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (kPair) {
      _tile_loadd(7, b1 + kb * kTileBytes, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    between();
  }
  const int64_t stride = out_stride * 4;
  _tile_stored(0, out, stride);
  _tile_stored(1, out + 16 * out_stride, stride);
  if constexpr (kPair) {
    _tile_stored(2, out + kTileCols, stride);
    _tile_stored(3, out + 16 * out_stride + kTileCols, stride);
  }
}

// Output rows [r0, r0 + 32) of a column block: stored straight into `out` where all 32 are rows of it, else
// (the last block) through a scratch block, of which only the rows that exist are copied.
template <bool kPair>
AMX_TARGET void output_block(const uint16_t* a, const uint8_t* b0, const uint8_t* b1, int64_t k, int64_t m,
                             int64_t r0, float* out, int64_t out_stride, int64_t c0) {
  if (r0 + kBlockRows <= m) {
    block<kPair>(a + r0 * k, b0, b1, k, out + r0 * out_stride + c0, out_stride);
    return;
  }
  alignas(64) float scratch[kBlockRows * kBlockCols];
  block<kPair>(a + r0 * k, b0, b1, k, scratch, kBlockCols);
  const int64_t cols = kPair ? kBlockCols : kTileCols;
  for (int64_t r = r0; r < m; ++r)
    std::memcpy(out + r * out_stride + c0, scratch + (r - r0) * kBlockCols, cols * sizeof(float));
}

// out[m][n] (row stride out_stride): column blocks of 32 (a last one of 16) over the threads; each thread walks
// the rows kRowChunk at a time (their bf16 copy stays in L2) and, per chunk, its column blocks (a block's B tiles,
// k * 64 bytes a tile column, stay in L2 over the chunk's 32-row blocks). `a` holds the rows padded to 32.
AMX_TARGET void column_blocks(const uint16_t* a, int64_t m, int64_t k, const uint8_t* packed, int64_t n,
                              float* out, int64_t out_stride, int64_t begin, int64_t end) {
  const int64_t tile_column = (k / kTileK) * kTileBytes;
  amx_tiles::configure();
  for (int64_t chunk = 0; chunk < m; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(m, chunk + kRowChunk);
    for (int64_t cb = begin; cb < end; ++cb) {
      const int64_t c0 = cb * kBlockCols;
      const uint8_t* b0 = packed + (c0 / kTileCols) * tile_column;
      const bool pair = c0 + kTileCols < n;
      for (int64_t r0 = chunk; r0 < chunk_end; r0 += kBlockRows) {
        if (pair)
          output_block<true>(a, b0, b0 + tile_column, k, m, r0, out, out_stride, c0);
        else
          output_block<false>(a, b0, nullptr, k, m, r0, out, out_stride, c0);
      }
    }
  }
  _tile_release();
}

// SiLU(gate) * up of a block's rows from its scratch ([gate 16 | up 16] a row), as silu_mul computes each
// value (row_vectors.h, built with the same flags: the same bits as silu_mul over the unfused output).
void glu_rows(const float* scratch, int64_t begin, int64_t end, float* out, int64_t out_stride) {
  for (int64_t r = begin; r < end; ++r)
    onecat_cpu::silu_mul_row(scratch + r * kBlockCols, out + r * out_stride, kTileCols);
}

// A block whose C tiles are stored and whose SiLU(gate) * up is still to be written: `done` of its `rows`.
struct PendingGlu {
  const float* scratch = nullptr;
  int64_t rows = 0, done = 0;
  float* out = nullptr;

  void advance(int64_t count, int64_t out_stride) {
    const int64_t end = std::min(rows, done + count);
    glu_rows(scratch, done, end, out, out_stride);
    done = end;
  }
};

// The 32 x 32 gate/up block of `block<true>`, with the previous block's epilogue spread over its K loop: the
// vector units compute SiLU(gate) * up of the block before while the tile unit sums this one (in the program's
// order the two are independent, so the core runs them at once). Each value is computed as in glu_rows.
AMX_TARGET void glu_block(const uint16_t* a, const uint8_t* b0, const uint8_t* b1, int64_t k, float* scratch,
                          PendingGlu& pending, int64_t out_stride) {
  const int64_t per_step = (pending.rows - pending.done + k / kTileK - 1) / (k / kTileK);
  block<true>(a, b0, b1, k, scratch, kBlockCols, [&] { pending.advance(per_step, out_stride); });
  pending.advance(pending.rows, out_stride);
}

// A gate/up layer's prompt rows with SiLU(gate) * up in the epilogue: output column block cb (16 columns) pairs
// gate tile cb with up tile cb + width / 16, so the [M, 2 * width] product never leaves the cache. Two scratch
// blocks alternate: one's epilogue runs inside the next one's K loop (glu_block).
AMX_TARGET void glu_column_blocks(const uint16_t* a, int64_t m, int64_t k, const uint8_t* packed, int64_t width,
                                  float* out, int64_t out_stride, int64_t begin, int64_t end) {
  const int64_t tile_column = (k / kTileK) * kTileBytes, up = (width / kTileCols) * tile_column;
  alignas(64) float scratch[2][kBlockRows * kBlockCols];
  PendingGlu pending;
  int next = 0;
  amx_tiles::configure();
  for (int64_t chunk = 0; chunk < m; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(m, chunk + kRowChunk);
    for (int64_t cb = begin; cb < end; ++cb) {
      const uint8_t* gate = packed + cb * tile_column;
      for (int64_t r0 = chunk; r0 < chunk_end; r0 += kBlockRows) {
        glu_block(a + r0 * k, gate, gate + up, k, scratch[next], pending, out_stride);
        pending = PendingGlu{scratch[next], std::min(kBlockRows, m - r0), 0, out + r0 * out_stride + cb * kTileCols};
        next ^= 1;
      }
    }
  }
  pending.advance(pending.rows, out_stride);
  _tile_release();
}

#endif

void check_operands(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "amx_bf16_matmul: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "amx_bf16_matmul: x must be float32 or bfloat16");
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 2,
              "amx_bf16_matmul: packed must be a contiguous [N / 16, K / 32, 16, 16, 2] bfloat16 tensor");
  TORCH_CHECK(x.size(1) == packed.size(1) * kTileK, "amx_bf16_matmul: x has ", x.size(1), " columns, the weights ",
              packed.size(1) * kTileK);
#ifdef ONECAT_AMX
  TORCH_CHECK(amx_tiles::permitted(), "amx_bf16_matmul: this CPU (or its kernel) grants no AMX-BF16 tiles");
#else
  TORCH_CHECK(false, "amx_bf16_matmul: built without AMX support (x86-64 Linux only)");
#endif
}

at::Tensor output(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& out) {
  at::Tensor y = out.has_value() ? *out : at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == n && y.stride(1) == 1 &&
                  y.scalar_type() == at::kFloat,
              "amx_bf16_matmul: out must be a float32 [M, ", n, "] matrix with unit column stride");
  return y;
}

#ifdef ONECAT_AMX
// The rows rounded to bf16 into a buffer padded with zero rows to a multiple of 32 (the tiles read 16 at once).
at::Tensor rounded_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), rows_padded = (m + kBlockRows - 1) / kBlockRows * kBlockRows;
  auto a = at::empty({rows_padded, k}, x.options().dtype(at::kBFloat16));
  auto* a_ptr = reinterpret_cast<uint16_t*>(a.data_ptr());
  std::memset(a_ptr + m * k, 0, (rows_padded - m) * k * sizeof(uint16_t));  // the padding rows only
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kFloat)
      round_rows(x.data_ptr<float>() + begin * k, end - begin, k, a_ptr + begin * k);
    else
      round_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()) + begin * k, end - begin, k, a_ptr + begin * k);
  });
  return a;
}

// The rows rounded once, then `columns(a, weights, out, out_stride, begin, end)` over `blocks` column blocks on
// the threads.
template <typename Columns>
void on_tiles(const at::Tensor& x, const at::Tensor& packed, at::Tensor& y, int64_t blocks, Columns columns) {
  if (x.size(0) == 0) return;
  const at::Tensor a = rounded_rows(x);
  const auto* a_ptr = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  float* o = y.data_ptr<float>();
  const int64_t stride = y.stride(0);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) { columns(a_ptr, w, o, stride, begin, end); });
}
#endif

}  // namespace

namespace onecat_cpu {

std::string amx_bf16_isa() {
#ifdef ONECAT_AMX
  return amx_tiles::permitted() ? "AMX-BF16" : "";
#else
  return "";
#endif
}

// x [M, K] float32 or bfloat16 (K % 32 == 0), packed [N / 16, K / 32, 16, 16, 2] bfloat16 (N % 16 == 0):
// x @ W.T in float32 [M, N], written into `out` where given ([M, N] float32, unit column stride, any row stride).
at::Tensor amx_bf16_matmul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& out) {
  check_operands(x, packed);
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * kTileCols;
  at::Tensor y = output(x, n, out);
#ifdef ONECAT_AMX
  on_tiles(x, packed, y, (n + kBlockCols - 1) / kBlockCols,
           [&](const uint16_t* a, const uint8_t* w, float* o, int64_t stride, int64_t begin, int64_t end) {
             column_blocks(a, m, k, w, n, o, stride, begin, end);
           });
#endif
  return y;
}

// A [gate | up] layer (packed as above, N = 2 * width, width % 16 == 0): SiLU(x @ gate.T) * (x @ up.T) in
// float32 [M, width], the same bits as silu_mul(amx_bf16_matmul(x, packed), false).
at::Tensor amx_bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& out) {
  check_operands(x, packed);
  TORCH_CHECK(packed.size(0) % 2 == 0, "amx_bf16_silu_mul: the gate and up halves must be whole 16-column tiles");
  const int64_t m = x.size(0), k = x.size(1), width = packed.size(0) / 2 * kTileCols;
  at::Tensor y = output(x, width, out);
#ifdef ONECAT_AMX
  on_tiles(x, packed, y, width / kTileCols,
           [&](const uint16_t* a, const uint8_t* w, float* o, int64_t stride, int64_t begin, int64_t end) {
             glu_column_blocks(a, m, k, w, width, o, stride, begin, end);
           });
#endif
  return y;
}

}  // namespace onecat_cpu

TORCH_LIBRARY_FRAGMENT(onecat_cpu, m) {
  m.def("amx_bf16_isa() -> str", &onecat_cpu::amx_bf16_isa);
  m.def("amx_bf16_matmul(Tensor x, Tensor packed, Tensor(a!)? out) -> Tensor");
  m.def("amx_bf16_silu_mul(Tensor x, Tensor packed, Tensor(a!)? out) -> Tensor");
}
TORCH_LIBRARY_IMPL(onecat_cpu, CPU, m) {
  m.impl("amx_bf16_matmul", &onecat_cpu::amx_bf16_matmul);
  m.impl("amx_bf16_silu_mul", &onecat_cpu::amx_bf16_silu_mul);
}
