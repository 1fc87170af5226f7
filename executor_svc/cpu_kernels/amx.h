// What the kernels that run on the AMX tile unit share (qlinear.cpp's matmuls, layer_ops.cpp's
// attention): whether this build has the tiles, the OS's permission to use them, the one tile
// configuration every kernel loads, and cache-line-aligned buffers for what the tiles load.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

// Whether this build has the AMX tiles (-march=native on an AMX-BF16 CPU).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SS_AMX_TILES 1
#else
#define SS_AMX_TILES 0
#endif

// Whether this build has AVX512-BF16's dot products (VDPBF16PS: Zen 4, and every AMX build): the
// bf16 matmul's vector kernel, and attention's bf16 products off the tiles.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define SS_BF16_DOT 1
#else
#define SS_BF16_DOT 0
#endif

namespace amx {

constexpr int64_t ROWS = 16;      // rows of every tile (activation rows of an A tile, of a C tile)
constexpr int TILES_USED = 8;     // every tile register: the bf16 matmul uses tmm0 .. tmm7

#if SS_AMX_TILES
// Linux hands a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA), once for all its threads; without it the first tile instruction faults.
inline bool request_permission() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

// Palette 1, every tile used as 16 rows of 64 bytes. Loaded at the start of each task: other code
// on the thread (oneDNN, through torch) may configure the tiles its own way.
inline void configure_tiles() {
  struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < TILES_USED; t++) config.colsb[t] = 64, config.rows[t] = ROWS;
  _tile_loadconfig(&config);
}
#endif

// Cache-line-aligned storage for what the tile unit loads: a tile row that straddles two cache
// lines costs two, and from malloc's 16-byte alignment the tile loads ran at half speed.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const CacheLineAllocator&) const { return true; }
};
template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

#if SS_BF16_DOT
// The 32-bit pair of bf16 values at p (p[0], p[1]) in every lane: one VDPBF16PS operand that
// multiplies a row's pair by 16 columns' pairs (the bf16 matmul's activations, attention's q and p).
inline __attribute__((always_inline)) __m512bh broadcast_pair(const void* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}
#endif

}  // namespace amx
