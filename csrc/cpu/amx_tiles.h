// What the AMX kernels share (amx_bf16_matmul.cpp, amx_attention.cpp): whether this process may use the tiles,
// and the one tile configuration they all run under (eight tiles of 16 rows x 64 bytes: a 16 x 16 float32 C
// tile, a 16 x 32 bfloat16 A tile, a B tile of 16 pairs of K x 16 columns).
//
// Linux grants a process the tile registers' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM), once.
// The tile configuration is written field by field and passed through a compiler barrier before LDTILECFG:
// some GCC versions otherwise treat the instruction as reading 8 of its 64 bytes and drop the other stores.
// AMX intrinsics need GCC 11 or clang 12 on x86-64 Linux; elsewhere ONECAT_AMX stays undefined and the kernels
// are not built.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define ONECAT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

namespace amx_tiles {

constexpr int64_t kTileBytes = 1024;  // 16 rows x 64 bytes

// Whether the CPU has AMX-BF16 (and AVX512-BF16 for the row rounding) and Linux granted this process the tiles.
inline bool permitted() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) return false;
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool tile = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;  // AMX-TILE, AMX-BF16
    return tile && bf16 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// Every one of the eight tiles 16 rows x 64 bytes (palette 1), on the calling thread.
AMX_TARGET inline void configure() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.bytes_per_row[t] = 64;
    cfg.rows[t] = 16;
  }
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// n float32 values rounded to bfloat16 (to nearest, ties to even) for a tile's rows, 16 at a time (n % 16 == 0).
AMX_TARGET inline void round_to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)h);
  }
}

// The tiles handed back (their state is large: the kernel saves it on a context switch while it is in use).
AMX_TARGET inline void release() { _tile_release(); }

}  // namespace amx_tiles

#endif
