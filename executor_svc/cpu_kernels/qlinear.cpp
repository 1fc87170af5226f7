// Matmuls that read GGUF weights as stored: y[M, N] = x[M, K] · W[N, K]ᵀ.
//
// W is a uint8 tensor [N, row_bytes]: each row is that row's GGUF blocks, byte for
// byte (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; F32, F16 and BF16 rows are "blocks" of
// one element). A block of weight rows is dequantized into a small float32 buffer
// (L1/L2-resident) with exactly the arithmetic of gguf-py's `quants.dequantize`
// (same roundings, no fused multiply-add: compiled with -ffp-contract=off), then
// dotted with every activation row.
//
// Batch invariance by construction: the dot of activation row m with weight row n
// is always the same sequence of float32 operations (see "dot products" below),
// whatever M is, whichever tile the row falls in, whether the weight block was
// dequantized into registers or a buffer, and however rows are split over threads.
// So a row's bits never depend on its batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <tuple>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd16.h"

namespace {

// ggml type ids (ggml.h / gguf-py GGMLQuantizationType).
enum GGMLType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

constexpr int64_t QK_K = 256;

struct TypeInfo {
  int64_t block_elems;
  int64_t block_bytes;
};

TypeInfo type_info(int64_t type) {
  switch (type) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case BF16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {QK_K, 144};
    case Q5_K: return {QK_K, 176};
    case Q6_K: return {QK_K, 210};
    default: TORCH_CHECK(false, "GGML tensor type ", type, " has no CPU matmul kernel");
  }
  return {0, 0};
}

inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; exp--; }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline float bf16_to_fp32(uint16_t b) {
  const uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K / Q5_K 6-bit scale and min of sub-block j (gguf-py Q4_K.get_scale_min).
inline void scale_min_k4(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

#if !SS_SIMD16
// Portable block dequantization (SIMD builds dequantize through for_each_block32).

// One 32-element block of nibbles (low nibbles are elements 0..15, high 16..31)
// → d * q + m (m = 0 for none), or d * (q - 8) for Q4_0.
inline void dequant_nibbles32(const uint8_t* qs, float d, float m, float offset, bool has_min, float* out) {
  for (int i = 0; i < 16; i++) {
    float a = d * ((float)(qs[i] & 0x0F) - offset), b = d * ((float)(qs[i] >> 4) - offset);
    out[i] = has_min ? a + m : a;
    out[i + 16] = has_min ? b + m : b;
  }
}

// 32 codes given as bytes (already combined) → ds * q - dm  (K-quants), one rounding each.
inline void dequant_k32(const uint8_t* q, float ds, float dm, float* out) {
  for (int i = 0; i < 32; i++) out[i] = ds * (float)q[i] - dm;
}

// Q4_K (4-bit codes) and Q5_K (plus a fifth bit from qh): the same 8 sub-blocks of 32.
void dequant_q45_k(const uint8_t* blk, bool is_q5, float* out) {
  const float d = fp16_to_fp32(load_u16(blk)), dmin = fp16_to_fp32(load_u16(blk + 2));
  const uint8_t* scales = blk + 4;
  const uint8_t* qh = blk + 16;  // Q5_K only
  const uint8_t* qs = blk + (is_q5 ? 48 : 16);
  alignas(64) uint8_t codes[32];
  for (int s = 0; s < 8; s++) {
    uint8_t sc, m;
    scale_min_k4(scales, s, &sc, &m);
    const uint8_t* src = qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int l = 0; l < 32; l++) codes[l] = ((src[l] >> shift) & 0x0F) | (is_q5 ? ((qh[l] >> s) & 1) << 4 : 0);
    dequant_k32(codes, d * (float)sc, dmin * (float)m, out + 32 * s);
  }
}

void dequant_q6_k(const uint8_t* blk, float* out) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  const int8_t* scales = (const int8_t*)(blk + 192);
  const float d = fp16_to_fp32(load_u16(blk + 208));
  alignas(64) int32_t codes[32];
  // Element e = 128 h + j: low 4 bits from nibble j / 64 of ql[64 h + j % 64],
  // high 2 bits from bits 2 (j / 32) of qh[32 h + j % 32]; scale e / 16.
  for (int h = 0; h < 2; h++) {
    for (int part = 0; part < 4; part++) {  // 32 elements j = 32 part + l
      const int j0 = 32 * part;
      for (int l = 0; l < 32; l++) {
        const int j = j0 + l;
        const int low = (ql[64 * h + j % 64] >> (4 * (j / 64))) & 0x0F;
        const int high = (qh[32 * h + j % 32] >> (2 * (j / 32))) & 0x03;
        codes[l] = (low | (high << 4)) - 32;
      }
      float* dst = out + 128 * h + j0;
      const int e0 = 128 * h + j0;
      const float ds0 = d * (float)scales[e0 / 16], ds1 = d * (float)scales[e0 / 16 + 1];
      for (int l = 0; l < 16; l++) dst[l] = ds0 * (float)codes[l];
      for (int l = 16; l < 32; l++) dst[l] = ds1 * (float)codes[l];
    }
  }
}

#endif

// ------------------------------------------------------------------ dot products
//
// The dot of one activation row with one weight row, in 32-value steps: values
// 0..15 of each step feed chain 0, values 16..31 chain 1 (16 float32 lanes each,
// one FMA per step), and the result is reduce_add(chain0 + chain1). Two ways run
// that identical sequence: `fused` dequantizes each 32-value block straight into
// registers (few activation rows: decode, verify), `tiled` dequantizes a few weight
// rows once into an L1 buffer and reuses them for every row tile of a long batch.
// Tile shapes follow the register file (32 zmm or 16 ymm); they never change a result.

#if SS_SIMD16
using simd16::V16;

struct W32 {
  V16 lo, hi;  // values 0..15 and 16..31 of a 32-value block
};

SS_INLINE W32 nibbles32(const uint8_t* qs, V16 d, V16 offset) {  // d * (q - offset), low nibbles first
  const __m128i bytes = _mm_loadu_si128((const __m128i*)qs);
  const __m128i mask = _mm_set1_epi8(0x0F);
  return {simd16::mul(d, simd16::sub(simd16::u8x16(_mm_and_si128(bytes, mask)), offset)),
          simd16::mul(d, simd16::sub(simd16::u8x16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)), offset))};
}

SS_INLINE W32 kquant32(__m256i codes, float ds, float dm) {  // ds * q - dm over 32 unsigned codes
  const V16 vd = simd16::set1(ds), vm = simd16::set1(dm);
  return {simd16::sub(simd16::mul(vd, simd16::u8x16(_mm256_castsi256_si128(codes))), vm),
          simd16::sub(simd16::mul(vd, simd16::u8x16(_mm256_extracti128_si256(codes, 1))), vm)};
}

// Calls f(k, W32) for every 32-value block of a quantized row, in order.
template <class F>
SS_INLINE void for_each_block32(int64_t type, const uint8_t* row, int64_t K, F&& f) {
  switch (type) {
    case Q4_0:
      for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t* blk = row + 18 * b;
        f(32 * b, nibbles32(blk + 2, simd16::set1(fp16_to_fp32(load_u16(blk))), simd16::set1(8.f)));
      }
      return;
    case Q4_1:
      for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t* blk = row + 20 * b;
        const V16 m = simd16::set1(fp16_to_fp32(load_u16(blk + 2)));
        const W32 w = nibbles32(blk + 4, simd16::set1(fp16_to_fp32(load_u16(blk))), simd16::zero());
        f(32 * b, W32{simd16::add(w.lo, m), simd16::add(w.hi, m)});
      }
      return;
    case Q8_0:
      for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t* blk = row + 34 * b;
        const V16 d = simd16::set1(fp16_to_fp32(load_u16(blk)));
        f(32 * b, W32{simd16::mul(d, simd16::i8x16(_mm_loadu_si128((const __m128i*)(blk + 2)))),
                      simd16::mul(d, simd16::i8x16(_mm_loadu_si128((const __m128i*)(blk + 18))))});
      }
      return;
    case Q4_K:
    case Q5_K: {
      const int64_t block_bytes = type == Q4_K ? 144 : 176;
      const __m256i mask = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
      for (int64_t b = 0; b < K / QK_K; b++) {
        const uint8_t* blk = row + block_bytes * b;
        const float d = fp16_to_fp32(load_u16(blk)), dmin = fp16_to_fp32(load_u16(blk + 2));
        const uint8_t* qs = blk + (type == Q4_K ? 16 : 48);
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));  // Q5_K only
        for (int s = 0; s < 8; s++) {
          uint8_t sc, m;
          scale_min_k4(blk + 4, s, &sc, &m);
          const __m256i bytes = _mm256_loadu_si256((const __m256i*)(qs + 32 * (s / 2)));
          __m256i codes = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, mask);
          if (type == Q5_K)
            codes = _mm256_or_si256(codes, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), one), 4));
          f(QK_K * b + 32 * s, kquant32(codes, d * (float)sc, dmin * (float)m));
        }
      }
      return;
    }
    case Q6_K: {
      const __m256i mask4 = _mm256_set1_epi8(0x0F), mask2 = _mm256_set1_epi8(0x03);
      const V16 bias = simd16::set1(32.f);
      for (int64_t b = 0; b < K / QK_K; b++) {
        const uint8_t* blk = row + 210 * b;
        const int8_t* scales = (const int8_t*)(blk + 192);
        const float d = fp16_to_fp32(load_u16(blk + 208));
        for (int h = 0; h < 2; h++) {
          const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
          for (int part = 0; part < 4; part++) {
            const __m256i ql = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32 * (part % 2)));
            const __m256i low = _mm256_and_si256(part / 2 ? _mm256_srli_epi16(ql, 4) : ql, mask4);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * part), mask2);
            const __m256i codes = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));  // 0..63; value = code - 32
            const int e0 = 128 * h + 32 * part;
            const V16 lo = simd16::sub(simd16::u8x16(_mm256_castsi256_si128(codes)), bias);
            const V16 hi = simd16::sub(simd16::u8x16(_mm256_extracti128_si256(codes, 1)), bias);
            f(QK_K * b + e0, W32{simd16::mul(simd16::set1(d * (float)scales[e0 / 16]), lo),
                                 simd16::mul(simd16::set1(d * (float)scales[e0 / 16 + 1]), hi)});
          }
        }
      }
      return;
    }
    default:
      TORCH_CHECK(false, "GGML tensor type ", type, " has no fused CPU kernel");
  }
}

struct Chains {
  V16 c0, c1;  // values 0..15 / 16..31 of each 32-value step
};

SS_INLINE void step(Chains& acc, V16 w_lo, V16 w_hi, const float* x) {
  acc.c0 = simd16::fmadd(w_lo, simd16::load(x), acc.c0);
  acc.c1 = simd16::fmadd(w_hi, simd16::load(x + 16), acc.c1);
}

SS_INLINE float finish(const Chains& acc) { return simd16::reduce_add(simd16::add(acc.c0, acc.c1)); }

// NR activation rows (stride K) against one quantized weight row, dequantized in registers.
template <int NR>
void dot_fused(int64_t type, const uint8_t* wrow, int64_t K, const float* x, float* out, int64_t out_stride) {
  Chains acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = {simd16::zero(), simd16::zero()};
  for_each_block32(type, wrow, K, [&](int64_t k, W32 w) __attribute__((always_inline)) {
    for (int r = 0; r < NR; r++) step(acc[r], w.lo, w.hi, x + r * K + k);
  });
  for (int r = 0; r < NR; r++) out[r * out_stride] = finish(acc[r]);
}

// NW dequantized weight rows (stride K) × NR activation rows (stride K) → out[r * out_stride + j].
template <int NW, int NR>
void dot_tile(const float* w, int64_t K, const float* x, float* out, int64_t out_stride) {
  Chains acc[NW][NR];
  for (int j = 0; j < NW; j++)
    for (int r = 0; r < NR; r++) acc[j][r] = {simd16::zero(), simd16::zero()};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int r = 0; r < NR; r++) {
      const V16 x_lo = simd16::load(x + r * K + k), x_hi = simd16::load(x + r * K + k + 16);
      for (int j = 0; j < NW; j++) {
        acc[j][r].c0 = simd16::fmadd(simd16::load(w + j * K + k), x_lo, acc[j][r].c0);
        acc[j][r].c1 = simd16::fmadd(simd16::load(w + j * K + k + 16), x_hi, acc[j][r].c1);
      }
    }
  }
  if (k < K) {  // F32/F16/BF16 rows only: a zero-padded last step
    const int64_t n = K - k;
    for (int r = 0; r < NR; r++) {
      const V16 x_lo = simd16::load_first(x + r * K + k, n), x_hi = simd16::load_first(x + r * K + k + 16, n - 16);
      for (int j = 0; j < NW; j++) {
        acc[j][r].c0 = simd16::fmadd(simd16::load_first(w + j * K + k, n), x_lo, acc[j][r].c0);
        acc[j][r].c1 = simd16::fmadd(simd16::load_first(w + j * K + k + 16, n - 16), x_hi, acc[j][r].c1);
      }
    }
  }
  for (int j = 0; j < NW; j++)
    for (int r = 0; r < NR; r++) out[r * out_stride + j] = finish(acc[j][r]);
}

constexpr bool HAS_FUSED = true;
// Register tiles: accumulators are 2 vectors per (weight row, activation row) pair.
constexpr int FUSED_ROWS = simd16::kAvx512 ? 4 : 2;  // activation rows per fused pass
constexpr int TILE_NW = simd16::kAvx512 ? 2 : 1;      // weight rows per tile
constexpr int TILE_NR = simd16::kAvx512 ? 4 : 3;      // activation rows per tile
#else
// Portable fallback: the same two-chain, 16-lane structure, written out.
template <int NW, int NR>
void dot_tile(const float* w, int64_t K, const float* x, float* out, int64_t out_stride) {
  for (int j = 0; j < NW; j++)
    for (int r = 0; r < NR; r++) {
      float chain[2][16] = {{0}};
      for (int64_t k = 0; k < K; k++)
        chain[(k / 16) % 2][k % 16] = std::fma(w[j * K + k], x[r * K + k], chain[(k / 16) % 2][k % 16]);
      float sum[16];
      for (int l = 0; l < 16; l++) sum[l] = chain[0][l] + chain[1][l];
      for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) sum[l] = sum[l] + sum[l + width];
      out[r * out_stride + j] = sum[0];
    }
}
template <int NR>
void dot_fused(int64_t, const uint8_t*, int64_t, const float*, float*, int64_t) {}
constexpr bool HAS_FUSED = false;
constexpr int FUSED_ROWS = 1;
constexpr int TILE_NW = 1;
constexpr int TILE_NR = 1;
#endif

// One weight row (K elements, row bytes as stored) → float32.
void dequant_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
  switch (type) {
    case F32:
      std::memcpy(out, row, K * sizeof(float));
      return;
    case F16:
      for (int64_t k = 0; k < K; k++) out[k] = fp16_to_fp32(load_u16(row + 2 * k));
      return;
    case BF16:
      for (int64_t k = 0; k < K; k++) out[k] = bf16_to_fp32(load_u16(row + 2 * k));
      return;
    default:
      break;
  }
#if SS_SIMD16
  // The very values the fused path computes in registers, stored.
  for_each_block32(type, row, K, [&](int64_t k, W32 w) __attribute__((always_inline)) {
    simd16::store(out + k, w.lo);
    simd16::store(out + k + 16, w.hi);
  });
#else
  switch (type) {
    case Q4_0:
      for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t* blk = row + 18 * b;
        dequant_nibbles32(blk + 2, fp16_to_fp32(load_u16(blk)), 0.f, 8.f, false, out + 32 * b);
      }
      return;
    case Q4_1:
      for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t* blk = row + 20 * b;
        dequant_nibbles32(blk + 4, fp16_to_fp32(load_u16(blk)), fp16_to_fp32(load_u16(blk + 2)), 0.f, true, out + 32 * b);
      }
      return;
    case Q8_0:
      for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t* blk = row + 34 * b;
        const float d = fp16_to_fp32(load_u16(blk));
        for (int i = 0; i < 32; i++) out[32 * b + i] = d * (float)(int8_t)blk[2 + i];
      }
      return;
    case Q4_K:
    case Q5_K: {
      const int64_t block_bytes = type == Q4_K ? 144 : 176;
      for (int64_t b = 0; b < K / QK_K; b++) dequant_q45_k(row + block_bytes * b, type == Q5_K, out + QK_K * b);
      return;
    }
    case Q6_K:
      for (int64_t b = 0; b < K / QK_K; b++) dequant_q6_k(row + 210 * b, out + QK_K * b);
      return;
    default:
      TORCH_CHECK(false, "GGML tensor type ", type, " has no CPU dequantize kernel");
  }
#endif
}

constexpr int64_t ROWS_PER_TASK = 16;   // weight rows per parallel task
constexpr int64_t FUSED_MAX_ROWS = 4;  // up to this many activation rows, dequantize in registers
constexpr int64_t ROW_PANEL = 64;      // activation rows per pass over a task's weight rows (x panel stays in L2)

// Tasks [0, num_tasks) pulled one at a time by the pool's threads (`run(task)`), not split in
// equal shares up front: a thread slowed by another process on its core (the scheduler, on a
// small machine) takes fewer tasks instead of holding the others up at the join. A task's
// result never depends on the thread that runs it.
template <class F>
void parallel_tasks(int64_t num_tasks, const F& run) {
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
  if (workers <= 1 || at::in_parallel_region()) {
    for (int64_t task = 0; task < num_tasks; task++) run(task);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) run(task);
  });
}

bool is_block_quantized(int64_t type) { return type != F32 && type != F16 && type != BF16; }

// All M activation rows (≤ FUSED_MAX_ROWS) against weight row wrow, dequantized in registers,
// FUSED_ROWS rows per pass.
void rows_fused(int64_t type, const uint8_t* wrow, int64_t K, const float* x, int64_t M, float* y, int64_t N) {
  for (int64_t m = 0; m < M; m += FUSED_ROWS) {
    switch (std::min<int64_t>(FUSED_ROWS, M - m)) {
      case 1: dot_fused<1>(type, wrow, K, x + m * K, y + m * N, N); break;
      case 2: dot_fused<2>(type, wrow, K, x + m * K, y + m * N, N); break;
      case 3: dot_fused<3>(type, wrow, K, x + m * K, y + m * N, N); break;
      default: dot_fused<4>(type, wrow, K, x + m * K, y + m * N, N); break;
    }
  }
}

// M activation rows against NW dequantized weight rows (stride K): outputs y[:, 0..NW).
template <int NW>
void rows_tiled(const float* w, int64_t K, const float* x, int64_t M, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + TILE_NR <= M; m += TILE_NR) dot_tile<NW, TILE_NR>(w, K, x + m * K, y + m * N, N);
  for (; m < M; m++) dot_tile<NW, 1>(w, K, x + m * K, y + m * N, N);
}

void check_weight(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous uint8 [N, row_bytes] tensor");
  const TypeInfo info = type_info(type);
  TORCH_CHECK(K % info.block_elems == 0, "K=", K, " is not a multiple of the type's block of ", info.block_elems);
  TORCH_CHECK(w.size(1) == K / info.block_elems * info.block_bytes, "weight rows have ", w.size(1), " bytes, expected ",
              K / info.block_elems * info.block_bytes, " for K=", K);
}


// ------------------------------------------------------------------ the integer matmul's weight layout
//
// Weights of the integer matmul are repacked once at load, four rows interleaved by
// block (as llama.cpp's q4_0x4 repacks): group g holds rows 4g .. 4g + 3, and block b of
// the group, at g · 4 · row_bytes + b · 4 · block_bytes, is the four rows' fp16 scales d,
// then (Q4_1) their fp16 mins m, then each row's codes (16 bytes of nibbles, or Q8_0's 32
// signed bytes). The same bytes as the rows (rows past N in the last group are zero), but
// one sequential stream for the kernel, whose four rows' scales are one conversion.
struct X4Layout {
  int64_t block_bytes, header_bytes, code_bytes, code_offset;  // code_offset: where codes start in a GGUF block
};

X4Layout x4_layout(int64_t type) {
  switch (type) {
    case Q4_0: return {18, 8, 16, 2};
    case Q4_1: return {20, 16, 16, 4};
    case Q8_0: return {34, 8, 32, 2};
    default: TORCH_CHECK(false, "the integer matmul runs Q4_0, Q4_1 and Q8_0 weights, not GGML type ", type);
  }
  return {0, 0, 0, 0};
}

// Row j of a group's block ↔ its GGUF block: `to_x4` copies blk into the group, else back.
void x4_block_copy(const X4Layout& l, uint8_t* group_block, int j, uint8_t* blk, bool to_x4) {
  auto copy = [&](uint8_t* x4, uint8_t* gguf, int64_t n) { to_x4 ? std::memcpy(x4, gguf, n) : std::memcpy(gguf, x4, n); };
  copy(group_block + 2 * j, blk, 2);                                     // d
  if (l.code_offset == 4) copy(group_block + 8 + 2 * j, blk + 2, 2);      // Q4_1's m
  copy(group_block + l.header_bytes + j * l.code_bytes, blk + l.code_offset, l.code_bytes);
}

// W [N, row_bytes] in GGUF rows → [ceil(N / 4), 4 · row_bytes] interleaved.
at::Tensor repack_x4(const at::Tensor& w, int64_t type, int64_t K) {
  check_weight(w, type, K);
  const X4Layout l = x4_layout(type);
  const int64_t N = w.size(0), row_bytes = w.size(1), nb = K / 32, groups = (N + 3) / 4;
  at::Tensor out = at::zeros({groups, 4 * row_bytes}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; n++)
    for (int64_t b = 0; b < nb; b++)
      x4_block_copy(l, op + (n / 4) * 4 * row_bytes + b * 4 * l.block_bytes, n % 4,
                    const_cast<uint8_t*>(wp + n * row_bytes + b * l.block_bytes), true);
  return out;
}

// Row n of an interleaved weight back in GGUF layout (row_bytes bytes into `row`).
void x4_row(const uint8_t* wp, const X4Layout& l, int64_t row_bytes, int64_t nb, int64_t n, uint8_t* row) {
  for (int64_t b = 0; b < nb; b++)
    x4_block_copy(l, const_cast<uint8_t*>(wp + (n / 4) * 4 * row_bytes + b * 4 * l.block_bytes), n % 4,
                  row + b * l.block_bytes, false);
}


// ------------------------------------------------------------------ integer dot products
//
// The fast path of `--matmul auto` on the CPU: each activation row is quantized per
// 32-value block to int16 (xq = round-to-even(x / dx), dx = max|x| / 32767), and the
// integer codes of Q4_0 / Q4_1 / Q8_0 weight blocks are dotted with it in integers
// (pmaddwd: 16-bit pairs into 32-bit lanes; AVX512-VNNI's vpdpwssd where present); each
// block's integer sum is then scaled by d_w and dx in float32:
//
//   y = Σ_b (Σ_i q_i · xq_i) · d_b · dx_b  +  Σ_b m_b · (dx_b · Σ_i xq_i)
//
// (Q4_1: q = nibble, m = its min; Q4_0: q = nibble, m = −8 · d; Q8_0: q signed, no m).
// 16-bit activations keep ~4.5 significant digits per block (llama.cpp's int8 keeps ~2
// and measured 97.9% top-1 agreement with the exact path here; this measures 100%), at
// the same count of multiply instructions per block. Integer sums are exact, and a
// (row, weight row)'s float operations never depend on M, the tile or the thread: one
// float32 accumulator, and per block, in block order, acc = fma(float(S) · d_w, dx, acc)
// then (Q4_0 / Q4_1) acc = fma(m_w, dx · Σ xq, acc), where S is the block's whole integer
// sum. Batch-invariant like the exact path, but not bit-equal to it (`--matmul exact`
// keeps that one). The block's two terms meet in the accumulator every block, so their
// cancellation (Q4's m_w is about −8 · d_w) costs no precision at the end, and a block
// costs each output 4 float operations: the prompt kernel's epilogue, against 16-32
// integer dot products.

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool HAS_INT16_DOT = true;


// Activation rows [M, K] quantized per 32-value block.
struct QuantizedRows {
  int64_t M = 0, K = 0, nb = 0;
  std::vector<int16_t> q;  // [M, K]
  std::vector<float> d;    // [M, nb] dx
  std::vector<float> s;    // [M, nb] dx · Σ xq (the min term's activation factor)
};

SS_INLINE int32_t hsum8_epi32(__m256i v) {
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
}

void quantize_block32(const float* x, int16_t* q, float* d_out, float* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float max_abs = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float d = max_abs / 32767.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i qi[4];
  for (int i = 0; i < 4; i++)  // |x · id| ≤ 32767 (+ rounding): packs saturates the rare 32768
    qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // int32 → int16 in element order (packs interleaves 128-bit lanes; the permute undoes it).
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8);
  _mm256_storeu_si256((__m256i*)q, lo);
  _mm256_storeu_si256((__m256i*)(q + 16), hi);
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t sum = hsum8_epi32(_mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)));
  *d_out = d;
  *s_out = d * (float)sum;
}

void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows& out) {
  out.M = M, out.K = K, out.nb = K / 32;
  out.q.resize(M * K);
  out.d.resize(M * out.nb);
  out.s.resize(M * out.nb);
  at::parallel_for(0, M * out.nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const int64_t m = i / out.nb, b = i % out.nb;
      quantize_block32(x + m * K + 32 * b, out.q.data() + m * K + 32 * b, &out.d[i], &out.s[i]);
    }
  });
}

// 8 int32 lanes: lane l = w_lo[2l]·x_lo[2l] + w_lo[2l+1]·x_lo[2l+1] + the same of the hi halves. Exact.
SS_INLINE __m256i dot_s16(__m256i w_lo, __m256i w_hi, __m256i x_lo, __m256i x_hi) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), w_lo, x_lo), w_hi, x_hi);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo), _mm256_madd_epi16(w_hi, x_hi));
#endif
}

// A weight block's 32 integer codes as int16: elements 0..15 and 16..31.
template <int TYPE>
SS_INLINE void block_codes(const uint8_t* codes, __m256i& lo, __m256i& hi) {
  const __m128i a = _mm_loadu_si128((const __m128i*)codes);
  if constexpr (TYPE == Q8_0) {
    lo = _mm256_cvtepi8_epi16(a);
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(codes + 16)));
  } else {  // low nibbles are elements 0..15, high nibbles 16..31: widen the bytes once, then split
    const __m256i bytes = _mm256_cvtepu8_epi16(a);
    lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(bytes, 4);
  }
}

// Weight rows per task of the integer matmul: 64 rows (~23 KiB of Q4_1 at K = 576) keep each
// thread on one sequential stream long enough for the hardware prefetchers, which stop at
// 4 KiB pages; with 16-row tasks two threads streaming a decode step's weights from DRAM were
// slower than one (M = 1, all 121 matmuls of the embedded model: 11.7 ms on 2 threads vs
// 8.9 ms on 1; 7.3 ms with 64-row tasks).
constexpr int64_t INT_ROWS_PER_TASK = 64;

// One interleaved group (four weight rows) × activation rows [r0, r1). A row's arithmetic,
// whatever the rows beside it (see "integer dot products"): per block, the exact integer
// sum S over its 32 elements (dot_s16's 8 lanes, reduced by three hadds and one add of the
// halves), then acc = fma(float(S) · d_w, dx, acc) and the min term acc = fma(m_w, s_x,
// acc). One 4-lane vector carries the four weight rows, so the float work is shared four
// ways; a block's codes are widened once for all the rows. The accumulators live in `acc`
// (registers for a few rows; with more, L1 memory — the same values either way).
// NR > 0: exactly NR rows (r1 = r0 + NR), known at compile time; 0: any number.
template <int TYPE, int NR>
SS_INLINE void dot_int_rows(const uint8_t* group, int64_t num_valid, const QuantizedRows& xq, int64_t r0, int64_t r1,
                            float* out, int64_t out_stride, __m128* acc) {
  constexpr int64_t group_block_bytes = 4 * (TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : 34);
  constexpr int64_t header_bytes = TYPE == Q4_1 ? 16 : 8, code_bytes = TYPE == Q8_0 ? 32 : 16;
  constexpr bool has_min = TYPE != Q8_0;
  const int64_t nb = xq.nb, rows = NR > 0 ? NR : r1 - r0;
  for (int64_t r = 0; r < rows; r++) acc[r] = _mm_setzero_ps();
  __m256i codes[4][2];
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = group + group_block_bytes * b;
    __m128 d;  // d_w of rows 0..3
    __m128 m;  // the min term's m_w of rows 0..3 (Q4_1: m; Q4_0: −8 · d)
    if constexpr (TYPE == Q4_1) {
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));  // [d0 d1 d2 d3 m0 m1 m2 m3]
      d = _mm256_castps256_ps128(dm);
      m = _mm256_extractf128_ps(dm, 1);
    } else {
      d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)blk));
      m = _mm_mul_ps(d, _mm_set1_ps(-8.f));
    }
    for (int j = 0; j < 4; j++) block_codes<TYPE>(blk + header_bytes + j * code_bytes, codes[j][0], codes[j][1]);
    for (int64_t r = 0; r < rows; r++) {
      const int64_t xb = (r0 + r) * nb + b;
      const int16_t* x = xq.q.data() + xb * 32;
      const __m256i x_lo = _mm256_loadu_si256((const __m256i*)x), x_hi = _mm256_loadu_si256((const __m256i*)(x + 16));
      const __m256i p01 = _mm256_hadd_epi32(dot_s16(codes[0][0], codes[0][1], x_lo, x_hi),
                                            dot_s16(codes[1][0], codes[1][1], x_lo, x_hi));
      const __m256i p23 = _mm256_hadd_epi32(dot_s16(codes[2][0], codes[2][1], x_lo, x_hi),
                                            dot_s16(codes[3][0], codes[3][1], x_lo, x_hi));
      const __m256i halves = _mm256_hadd_epi32(p01, p23);  // rows 0..3 over lanes 0..3 and 4..7
      const __m128 sums = _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1)));
      acc[r] = _mm_fmadd_ps(_mm_mul_ps(sums, d), _mm_broadcast_ss(&xq.d[xb]), acc[r]);
      if constexpr (has_min) acc[r] = _mm_fmadd_ps(m, _mm_broadcast_ss(&xq.s[xb]), acc[r]);
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, acc[r]);
    for (int j = 0; j < num_valid; j++) out[r * out_stride + j] = lanes[j];
  }
}

constexpr int INT_TILE_NR = simd16::kAvx512 ? 4 : 2;  // rows whose accumulators stay in registers
constexpr int64_t INT_PANEL = 32;                      // rows per pass over a group (their x blocks stay in L2)

// Groups [g0, g1) (weight rows 4 · g0 .. min(N, 4 · g1)) against every activation row.
template <int TYPE>
void groups_int(const uint8_t* wp, int64_t group_bytes, int64_t g0, int64_t g1, int64_t N, const QuantizedRows& xq,
                float* y) {
  for (int64_t g = g0; g < g1; g++) {
    const uint8_t* group = wp + g * group_bytes;
    const int64_t n = 4 * g, num_valid = std::min<int64_t>(4, N - n);
    if (xq.M == 1) {
      __m128 acc[1];
      dot_int_rows<TYPE, 1>(group, num_valid, xq, 0, 1, y + n, N, acc);
      continue;
    }
    if (xq.M == INT_TILE_NR) {
      __m128 acc[INT_TILE_NR];
      dot_int_rows<TYPE, INT_TILE_NR>(group, num_valid, xq, 0, INT_TILE_NR, y + n, N, acc);
      continue;
    }
    alignas(16) __m128 acc[INT_PANEL];
    for (int64_t r0 = 0; r0 < xq.M; r0 += INT_PANEL) {
      const int64_t r1 = std::min(xq.M, r0 + INT_PANEL);
      dot_int_rows<TYPE, 0>(group, num_valid, xq, r0, r1, y + r0 * N + n, N, acc);
    }
  }
}

// ------------------------------------------------------------------ the integer matmul for many rows
//
// A prompt's rows (a prefill chunk: tens to thousands of them) through the same arithmetic as
// dot_int_rows, organised as a matrix product instead of a dot product per (row, weight row):
// the weight codes of 16 weight rows are widened once into int16 pairs, lane = weight row
// (`unpack_panel16`), and each activation row's int16 pair is broadcast against them, so one
// pmaddwd serves 8 weight rows (a 512-bit vpdpwssd 16) and the weights stay in L1 for every
// activation row of the call. Per (row, weight row, block) it computes the very same exact
// integer sum S and then the very same float32 operations in the same order: acc =
// fma(float(S) · d_w, dx, acc), acc = fma(m_w, s_x, acc). So its results are bit-identical
// to the row kernel's (tested), and which of the two runs a matmul is only a question of
// speed: a prompt token's bits never depend on the chunk, the batch or the path.
//
// The per-row kernel re-reads every weight block for each group of up to 32 activation rows
// and reduces across lanes (hadd) per block; here there is no reduction (a lane is a weight
// row) and the widened codes are reused across all rows. 256-bit register tile: 6 activation
// rows × 16 weight rows (12 integer accumulators, 2 weight vectors, one broadcast); the float
// accumulators live in memory (a row's 64 bytes), touched once per block.

constexpr int PANEL_ROWS = 16;  // weight rows per unpacked panel (two 8-lane vectors)
constexpr int PANEL_PAIRS = 16;  // int16 pairs per 32-value block
constexpr int PANEL_MR = 6;      // activation rows per register tile
// From this many activation rows the panels are faster (measured: Zen 3, Q4_1 576×1536; on Zen 4,
// one layer's four matmuls on 2 threads, the panels took 1.03-1.48x the rows' time at M = 2-6 and
// 0.57-0.79x at M = 8-16; below it the per-row kernel reads each weight block once for all rows anyway).
constexpr int64_t PANEL_MIN_ROWS = 8;
constexpr int64_t PANEL_SLICE_BLOCKS = 12;  // blocks of K per pass over the rows (12 KB of unpacked panel)

// acc + the pairwise products of w and x summed into 8 int32 lanes (exact).
SS_INLINE __m256i add_dot_pairs(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

// The 8 weight rows of groups blk0, blk1 (blk1 may be null: zero rows) for one block: out[p] holds,
// at lanes 0..7 of a 32-int16 row of `out`, each weight row's elements 2p and 2p + 1; d[8], m[8]
// their scale and min term (m = −8 · d for Q4_0, as dot_int_rows computes it).
template <int TYPE>
void unpack_block8(const uint8_t* blk0, const uint8_t* blk1, int16_t* out, float* d, float* m) {
  constexpr int64_t header_bytes = TYPE == Q4_1 ? 16 : 8, code_bytes = TYPE == Q8_0 ? 32 : 16;
  static const uint8_t zeros[32] = {0};
  const __m128 d0 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)blk0));
  const __m128 d1 = blk1 ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)blk1)) : _mm_setzero_ps();
  _mm_storeu_ps(d, d0);
  _mm_storeu_ps(d + 4, d1);
  if constexpr (TYPE == Q4_1) {
    _mm_storeu_ps(m, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(blk0 + 8))));
    _mm_storeu_ps(m + 4, blk1 ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(blk1 + 8))) : _mm_setzero_ps());
  } else if constexpr (TYPE == Q4_0) {
    _mm_storeu_ps(m, _mm_mul_ps(d0, _mm_set1_ps(-8.f)));
    _mm_storeu_ps(m + 4, _mm_mul_ps(d1, _mm_set1_ps(-8.f)));
  }
  const uint8_t* rows[8];
  for (int j = 0; j < 4; j++) {
    rows[j] = blk0 + header_bytes + j * code_bytes;
    rows[4 + j] = blk1 ? blk1 + header_bytes + j * code_bytes : zeros;
  }
  // Each row's code bytes as 8 uint16 (byte pairs); an 8×8 transpose gives T[q] = the 8 rows'
  // bytes 2q, 2q + 1: Q4 elements 2q, 2q + 1 in the low nibbles and 16 + 2q, 17 + 2q in the high
  // ones; Q8_0 elements 2q, 2q + 1 (and, from its second 16 bytes, 16 + 2q, 17 + 2q).
  for (int half = 0; half < (TYPE == Q8_0 ? 2 : 1); half++) {
    __m128i r[8];
    for (int j = 0; j < 8; j++) r[j] = _mm_loadu_si128((const __m128i*)(rows[j] + 16 * half));
    const __m128i t0 = _mm_unpacklo_epi16(r[0], r[1]), t1 = _mm_unpackhi_epi16(r[0], r[1]);
    const __m128i t2 = _mm_unpacklo_epi16(r[2], r[3]), t3 = _mm_unpackhi_epi16(r[2], r[3]);
    const __m128i t4 = _mm_unpacklo_epi16(r[4], r[5]), t5 = _mm_unpackhi_epi16(r[4], r[5]);
    const __m128i t6 = _mm_unpacklo_epi16(r[6], r[7]), t7 = _mm_unpackhi_epi16(r[6], r[7]);
    const __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2);
    const __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3);
    const __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6);
    const __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
    const __m128i T[8] = {_mm_unpacklo_epi64(u0, u4), _mm_unpackhi_epi64(u0, u4), _mm_unpacklo_epi64(u1, u5),
                          _mm_unpackhi_epi64(u1, u5), _mm_unpacklo_epi64(u2, u6), _mm_unpackhi_epi64(u2, u6),
                          _mm_unpacklo_epi64(u3, u7), _mm_unpackhi_epi64(u3, u7)};
    for (int q = 0; q < 8; q++) {
      if constexpr (TYPE == Q8_0) {
        _mm256_storeu_si256((__m256i*)(out + (8 * half + q) * 2 * PANEL_ROWS), _mm256_cvtepi8_epi16(T[q]));
      } else {
        const __m256i bytes = _mm256_cvtepu8_epi16(T[q]);
        _mm256_storeu_si256((__m256i*)(out + q * 2 * PANEL_ROWS), _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)));
        _mm256_storeu_si256((__m256i*)(out + (q + 8) * 2 * PANEL_ROWS), _mm256_srli_epi16(bytes, 4));
      }
    }
  }
}

// Groups [g, g + 4) (weight rows 4g .. 4g + 15; groups past the last are zero rows), all nb blocks:
// pairs [nb][PANEL_PAIRS][2 · PANEL_ROWS] int16, d and m [nb][PANEL_ROWS] float.
struct Panel {
  std::vector<int16_t> pairs;
  std::vector<float> d, m;
};

// A panel's arrays as plain pointers: what the tiles read (a thread_local Panel behind a
// reference costs a TLS lookup on every access in the inner loops).
struct PanelView {
  const int16_t* pairs;
  const float* d;
  const float* m;
};

template <int TYPE>
void unpack_panel16(const uint8_t* wp, int64_t group_bytes, int64_t groups, int64_t g, int64_t nb, Panel& panel) {
  constexpr int64_t group_block_bytes = 4 * (TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : 34);
  constexpr int64_t block_pairs = PANEL_PAIRS * 2 * PANEL_ROWS;
  // Every value is written below (weight rows past the last group as zeros): no fill first.
  panel.pairs.resize(nb * block_pairs);
  panel.d.resize(nb * PANEL_ROWS);
  panel.m.resize(nb * PANEL_ROWS);
  static const uint8_t zero_block[4 * 34] = {0};  // a group's block of zero rows, any type
  for (int64_t b = 0; b < nb; b++)
    for (int h = 0; h < 2; h++) {  // weight rows 8h .. 8h + 7: groups g + 2h, g + 2h + 1
      const int64_t g0 = g + 2 * h;
      const uint8_t* blk0 = g0 < groups ? wp + g0 * group_bytes + b * group_block_bytes : zero_block;
      const uint8_t* blk1 = g0 + 1 < groups ? blk0 + group_bytes : nullptr;
      unpack_block8<TYPE>(blk0, blk1, panel.pairs.data() + b * block_pairs + 8 * h * 2,
                          panel.d.data() + b * PANEL_ROWS + 8 * h, panel.m.data() + b * PANEL_ROWS + 8 * h);
    }
}

// Activation rows [r0, r0 + MR) × a panel's 16 weight rows over blocks [b0, b1): the float
// accumulators acc[MR][PANEL_ROWS] carry on from the blocks before b0.
template <int MR, bool HAS_MIN>
SS_INLINE void panel_tile(PanelView panel, const QuantizedRows& xq, int64_t r0, int64_t b0, int64_t b1, float* acc) {
  constexpr int64_t block_pairs = PANEL_PAIRS * 2 * PANEL_ROWS;
  const int64_t K = xq.K, nb = xq.nb;
  const int16_t* xq_q = xq.q.data();
  const float *xq_d = xq.d.data(), *xq_s = xq.s.data();
  for (int64_t b = b0; b < b1; b++) {
    __m256i S[MR][2];
    for (int r = 0; r < MR; r++) S[r][0] = S[r][1] = _mm256_setzero_si256();
    const int16_t* pb = panel.pairs + b * block_pairs;
    const int16_t* xb = xq_q + r0 * K + 32 * b;
#pragma GCC unroll 16
    for (int p = 0; p < PANEL_PAIRS; p++) {
      __m256i w0 = _mm256_loadu_si256((const __m256i*)(pb + p * 2 * PANEL_ROWS));
      __m256i w1 = _mm256_loadu_si256((const __m256i*)(pb + p * 2 * PANEL_ROWS + PANEL_ROWS));
      asm("" : "+x"(w0), "+x"(w1));  // one load for the MR rows (GCC would fold one into each multiply)
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) {
        const __m256i xv = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(xb + r * K + 2 * p)));
        S[r][0] = add_dot_pairs(S[r][0], w0, xv);
        S[r][1] = add_dot_pairs(S[r][1], w1, xv);
        asm("" : "+x"(S[r][0]), "+x"(S[r][1]));  // keep the running sums (GCC would reassociate them into 16 live products)
      }
    }
    for (int h = 0; h < 2; h++) {
      const __m256 d = _mm256_loadu_ps(panel.d + b * PANEL_ROWS + 8 * h);
      const __m256 m = HAS_MIN ? _mm256_loadu_ps(panel.m + b * PANEL_ROWS + 8 * h) : _mm256_setzero_ps();
      for (int r = 0; r < MR; r++) {
        const int64_t xb_index = (r0 + r) * nb + b;
        float* a = acc + r * PANEL_ROWS + 8 * h;
        __m256 sum = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S[r][h]), d), _mm256_broadcast_ss(xq_d + xb_index),
                                     _mm256_loadu_ps(a));
        if constexpr (HAS_MIN) sum = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xq_s + xb_index), sum);
        _mm256_storeu_ps(a, sum);
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// panel_tile on 512-bit vectors: a panel's 16 weight rows fill one vector's 16 int32 lanes, so a
// block takes half the instructions of the 256-bit tile (one weight load, one dot product per row
// and pair, one float epilogue per row), and registers hold the float accumulators of MR rows
// across the whole slice instead of reloading them from memory every block. Lane j computes what
// lane j mod 8 of vector j / 8 computes in panel_tile, operation for operation: the same bits.
// Measured on Zen 4 (one thread, thread CPU time, best of 7 in each of 3 alternating processes,
// the embedded model's four layer shapes at M = 64..1024): 76-88 GMAC/s, 65-75% of the thread's
// int16 peak, against 67-78 for the two-sum arithmetic before it (1.08-1.15x); MR = 8 rows beat
// MR = 4 by 3-6%. The 256-bit tile, built for Zen 3 (-march=znver3) and run on the same machine:
// 55-67 GMAC/s against the two-sum tile's 34-52.
constexpr int PANEL_MR_512 = 8;

SS_INLINE __m512i add_dot_pairs_512(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// The float accumulators of the MR rows start from `in` (rows in_stride apart; null: zeros) and end
// in `out` (rows out_stride apart, the lanes of out_mask): a slice's partial sums, or y itself.
template <int MR, bool HAS_MIN>
SS_INLINE void panel_tile_512(PanelView panel, const QuantizedRows& xq, int64_t r0, int64_t b0, int64_t b1,
                              const float* in, int64_t in_stride, float* out, int64_t out_stride, __mmask16 out_mask) {
  constexpr int64_t block_pairs = PANEL_PAIRS * 2 * PANEL_ROWS;
  const int64_t K = xq.K, nb = xq.nb;
  const int16_t* xq_q = xq.q.data();
  const float *xq_d = xq.d.data(), *xq_s = xq.s.data();
  __m512 sum[MR];
  for (int r = 0; r < MR; r++) sum[r] = in ? _mm512_loadu_ps(in + r * in_stride) : _mm512_setzero_ps();
  for (int64_t b = b0; b < b1; b++) {
    __m512i S[MR];
    for (int r = 0; r < MR; r++) S[r] = _mm512_setzero_si512();
    const int16_t* pb = panel.pairs + b * block_pairs;
    const int16_t* xb = xq_q + r0 * K + 32 * b;
#pragma GCC unroll 16
    for (int p = 0; p < PANEL_PAIRS; p++) {
      __m512i w = _mm512_loadu_si512(pb + p * 2 * PANEL_ROWS);
      asm("" : "+v"(w));  // one load for the MR rows
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) {
        const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + r * K + 2 * p));
        S[r] = add_dot_pairs_512(S[r], w, xv);
        asm("" : "+v"(S[r]));  // keep the running sums in order (as panel_tile does)
      }
    }
    const __m512 d = _mm512_loadu_ps(panel.d + b * PANEL_ROWS);
    const __m512 m = HAS_MIN ? _mm512_loadu_ps(panel.m + b * PANEL_ROWS) : _mm512_setzero_ps();  // Q8_0: never written
    for (int r = 0; r < MR; r++) {
      const int64_t xb_index = (r0 + r) * nb + b;
      sum[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S[r]), d), _mm512_set1_ps(xq_d[xb_index]), sum[r]);
      if constexpr (HAS_MIN) sum[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq_s[xb_index]), sum[r]);
    }
  }
  for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(out + r * out_stride, out_mask, sum[r]);
}
#endif

// Panel p (weight rows 16p .. 16p + 15) against every activation row, a slice of K at a time:
// a slice of the unpacked panel (1 KB a block) stays in L1 while every row passes it, where the
// whole panel (32 bytes per value of K) would not at K = 1536. Each (row, weight row) still
// sees its blocks in order, so the float sums are the same.
template <int TYPE>
void panel_int(const uint8_t* wp, int64_t group_bytes, int64_t p, int64_t N, const QuantizedRows& xq, float* y) {
  constexpr bool has_min = TYPE != Q8_0;
  constexpr int64_t acc_per_row = PANEL_ROWS;
  thread_local Panel panel;
  thread_local std::vector<float> acc;
  unpack_panel16<TYPE>(wp, group_bytes, (N + 3) / 4, 4 * p, xq.nb, panel);
  const PanelView view{panel.pairs.data(), panel.d.data(), panel.m.data()};
  const int64_t num_slices = (xq.nb + PANEL_SLICE_BLOCKS - 1) / PANEL_SLICE_BLOCKS;
  const int64_t slice = (xq.nb + num_slices - 1) / num_slices;  // even slices
  const int64_t n0 = PANEL_ROWS * p, num_valid = std::min<int64_t>(PANEL_ROWS, N - n0);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // A slice's partial sums go to `acc` and the next slice starts from them; the first starts from
  // zeros and the last writes y's num_valid columns directly.
  if (num_slices > 1) acc.resize(xq.M * acc_per_row);
  const __mmask16 y_mask = (__mmask16)((1u << num_valid) - 1);
  for (int64_t b0 = 0; b0 < xq.nb; b0 += slice) {
    const int64_t b1 = std::min(xq.nb, b0 + slice);
    const bool first = b0 == 0, last = b1 == xq.nb;
    auto tile = [&](auto mr, int64_t r) {
      const float* in = first ? nullptr : acc.data() + r * acc_per_row;
      float* out = last ? y + r * N + n0 : acc.data() + r * acc_per_row;
      panel_tile_512<decltype(mr)::value, has_min>(view, xq, r, b0, b1, in, acc_per_row, out, last ? N : acc_per_row,
                                                   last ? y_mask : (__mmask16)0xFFFF);
    };
    int64_t r = 0;
    for (; r + PANEL_MR_512 <= xq.M; r += PANEL_MR_512) tile(std::integral_constant<int, PANEL_MR_512>{}, r);
    for (; r < xq.M; r++) tile(std::integral_constant<int, 1>{}, r);
  }
#else
  acc.assign(xq.M * acc_per_row, 0.f);
  float* acc_rows = acc.data();
  for (int64_t b0 = 0; b0 < xq.nb; b0 += slice) {
    const int64_t b1 = std::min(xq.nb, b0 + slice);
    int64_t r = 0;
    for (; r + PANEL_MR <= xq.M; r += PANEL_MR) panel_tile<PANEL_MR, has_min>(view, xq, r, b0, b1, acc_rows + r * acc_per_row);
    for (; r < xq.M; r++) panel_tile<1, has_min>(view, xq, r, b0, b1, acc_rows + r * acc_per_row);
  }
  for (int64_t r = 0; r < xq.M; r++) std::memcpy(y + r * N + n0, acc_rows + r * acc_per_row, num_valid * sizeof(float));
#endif
}
#else
constexpr bool HAS_INT16_DOT = false;
#endif

}  // namespace

// y[M, N] = x[M, K] · dequant(W)[N, K]ᵀ in float32; y has x's dtype (float32 or bfloat16).
at::Tensor qlinear(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t K) {
  check_weight(w, type, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.to(x_in.scalar_type());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const bool fused = HAS_FUSED && is_block_quantized(type) && M <= FUSED_MAX_ROWS;
  const int64_t num_tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  parallel_tasks(num_tasks, [&](int64_t task) {
    const int64_t n0 = task * ROWS_PER_TASK, n1 = std::min(N, n0 + ROWS_PER_TASK);
    if (fused) {
      for (int64_t n = n0; n < n1; n++) rows_fused(type, wp + n * row_bytes, K, xp, M, yp + n, N);
      return;
    }
    thread_local std::vector<float> wbuf;
    wbuf.resize(TILE_NW * K);
    for (int64_t m0 = 0; m0 < M; m0 += ROW_PANEL) {
      const int64_t rows = std::min(ROW_PANEL, M - m0);
      int64_t n = n0;
      for (; n + TILE_NW <= n1; n += TILE_NW) {
        for (int j = 0; j < TILE_NW; j++) dequant_row(type, wp + (n + j) * row_bytes, K, wbuf.data() + j * K);
        rows_tiled<TILE_NW>(wbuf.data(), K, xp + m0 * K, rows, yp + m0 * N + n, N);
      }
      for (; n < n1; n++) {
        dequant_row(type, wp + n * row_bytes, K, wbuf.data());
        rows_tiled<1>(wbuf.data(), K, xp + m0 * K, rows, yp + m0 * N + n, N);
      }
    }
  });
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// y[M, N] = x[M, K] · W[N, K]ᵀ with x quantized to int16 per 32-value block (see "integer
// dot products"); W is Q4_0, Q4_1 or Q8_0, interleaved by repack_x4. y has x's dtype.
// `path`: which of the two bit-identical kernels runs it: INT16_AUTO takes the panels ("the
// integer matmul for many rows") from PANEL_MIN_ROWS rows and the per-row kernel below that;
// INT16_ROWS and INT16_PANELS force one (the tests compare them).
at::Tensor qlinear_int16(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t K, int64_t N, int64_t path) {
  TORCH_CHECK(HAS_INT16_DOT, "the integer matmul needs AVX2 and FMA");
  TORCH_CHECK(path >= INT16_AUTO && path <= INT16_PANELS, "path must be 0 (auto), 1 (rows) or 2 (panels), got ", path);
  const X4Layout l = x4_layout(type);
  TORCH_CHECK(K % 32 == 0, "K=", K, " is not a multiple of 32");
  const int64_t groups = (N + 3) / 4, group_bytes = 4 * (K / 32) * l.block_bytes;
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) == groups && w.size(1) == group_bytes,
              "weight must be a contiguous uint8 [", groups, ", ", group_bytes, "] tensor (repack_x4 of [", N, ", ", K, "])");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.to(x_in.scalar_type());
#if defined(__AVX2__) && defined(__FMA__)
  QuantizedRows xq;
  quantize_rows(x.data_ptr<float>(), M, K, xq);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (path == INT16_PANELS || (path == INT16_AUTO && M >= PANEL_MIN_ROWS)) {
    parallel_tasks((N + PANEL_ROWS - 1) / PANEL_ROWS, [&](int64_t p) {
      switch (type) {
        case Q4_0: panel_int<Q4_0>(wp, group_bytes, p, N, xq, yp); break;
        case Q4_1: panel_int<Q4_1>(wp, group_bytes, p, N, xq, yp); break;
        default: panel_int<Q8_0>(wp, group_bytes, p, N, xq, yp); break;
      }
    });
    return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
  }
  constexpr int64_t groups_per_task = INT_ROWS_PER_TASK / 4;
  const int64_t num_tasks = (groups + groups_per_task - 1) / groups_per_task;
  parallel_tasks(num_tasks, [&](int64_t task) {
    const int64_t g0 = task * groups_per_task, g1 = std::min(groups, g0 + groups_per_task);
    switch (type) {
      case Q4_0: groups_int<Q4_0>(wp, group_bytes, g0, g1, N, xq, yp); break;
      case Q4_1: groups_int<Q4_1>(wp, group_bytes, g0, g1, N, xq, yp); break;
      default: groups_int<Q8_0>(wp, group_bytes, g0, g1, N, xq, yp); break;
    }
  });
#endif
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

bool has_int16_dot() { return HAS_INT16_DOT; }

// This machine's peak multiply-accumulate rates on the calling thread, measured: 10 independent
// chains of int16-pair dot products (the prompt kernel's instruction at its vector width: 512-bit
// in the AVX-512 build, else 256-bit; pmaddwd + paddd, or vpdpwssd with VNNI) and of float32 FMAs
// at the same width, `iterations` rounds each. MACs per second, (int16, float32); the benchmarks
// report the kernels' throughput as a fraction of these.
#if defined(__AVX2__) && defined(__FMA__)
namespace {
#if defined(__AVX512F__) && defined(__AVX512BW__)
using PeakInt = __m512i;
using PeakFloat = __m512;
SS_INLINE PeakInt peak_int_set1(int16_t v) { return _mm512_set1_epi16(v); }
SS_INLINE PeakFloat peak_float_set1(float v) { return _mm512_set1_ps(v); }
SS_INLINE PeakInt peak_dot(PeakInt a, PeakInt w, PeakInt x) { return add_dot_pairs_512(a, w, x); }
SS_INLINE PeakFloat peak_fma(PeakFloat a, PeakFloat w, PeakFloat x) { return _mm512_fmadd_ps(a, w, x); }
#define SS_PEAK_REG "+v"
#else
using PeakInt = __m256i;
using PeakFloat = __m256;
SS_INLINE PeakInt peak_int_set1(int16_t v) { return _mm256_set1_epi16(v); }
SS_INLINE PeakFloat peak_float_set1(float v) { return _mm256_set1_ps(v); }
SS_INLINE PeakInt peak_dot(PeakInt a, PeakInt w, PeakInt x) { return add_dot_pairs(a, w, x); }
SS_INLINE PeakFloat peak_fma(PeakFloat a, PeakFloat w, PeakFloat x) { return _mm256_fmadd_ps(a, w, x); }
#define SS_PEAK_REG "+x"
#endif
}  // namespace
#endif

std::tuple<double, double> measure_peak_macs(int64_t iterations) {
#if defined(__AVX2__) && defined(__FMA__)
  // Ten independent chains (more than latency x pipes on every target), the accumulators pinned
  // in registers and the operands hidden from the compiler: otherwise GCC folds the constant
  // product and keeps the chains on the stack, and the loop measures store forwarding.
  using clock = std::chrono::steady_clock;
  constexpr int CHAINS = 10;
  constexpr double int_lanes = sizeof(PeakInt) / 2, float_lanes = sizeof(PeakFloat) / 4;
  PeakInt ia[CHAINS];
  PeakFloat fa[CHAINS];
  PeakInt iw = peak_int_set1(1), ix = peak_int_set1(-1);
  PeakFloat fw = peak_float_set1(0.999f), fx = peak_float_set1(1e-6f);
  asm volatile("" : SS_PEAK_REG(iw), SS_PEAK_REG(ix), SS_PEAK_REG(fw), SS_PEAK_REG(fx));
#pragma GCC unroll 16
  for (int i = 0; i < CHAINS; i++) ia[i] = peak_int_set1(1), fa[i] = peak_float_set1(1e-3f * i);
  auto t0 = clock::now();
  for (int64_t n = 0; n < iterations; n++) {
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; i++) ia[i] = peak_dot(ia[i], iw, ix);
    asm volatile("" : SS_PEAK_REG(ia[0]), SS_PEAK_REG(ia[1]), SS_PEAK_REG(ia[2]), SS_PEAK_REG(ia[3]), SS_PEAK_REG(ia[4]),
                 SS_PEAK_REG(ia[5]), SS_PEAK_REG(ia[6]), SS_PEAK_REG(ia[7]), SS_PEAK_REG(ia[8]), SS_PEAK_REG(ia[9]));
  }
  auto t1 = clock::now();
  for (int64_t n = 0; n < iterations; n++) {
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; i++) fa[i] = peak_fma(fa[i], fw, fx);
    asm volatile("" : SS_PEAK_REG(fa[0]), SS_PEAK_REG(fa[1]), SS_PEAK_REG(fa[2]), SS_PEAK_REG(fa[3]), SS_PEAK_REG(fa[4]),
                 SS_PEAK_REG(fa[5]), SS_PEAK_REG(fa[6]), SS_PEAK_REG(fa[7]), SS_PEAK_REG(fa[8]), SS_PEAK_REG(fa[9]));
  }
  auto t2 = clock::now();
  const double macs = double(CHAINS) * iterations * int_lanes, fmacs = double(CHAINS) * iterations * float_lanes;
  return {macs / std::chrono::duration<double>(t1 - t0).count(), fmacs / std::chrono::duration<double>(t2 - t1).count()};
#else
  return {0.0, 0.0};
#endif
}

// Rows `ids` of W dequantized: [len(ids), K] float32 (an embedding lookup). `N` > 0: W is
// interleaved by repack_x4 and holds N rows.
at::Tensor dequant_rows(const at::Tensor& w, int64_t type, int64_t K, const at::Tensor& ids_in, int64_t interleaved_rows) {
  const bool interleaved = interleaved_rows > 0;
  const TypeInfo info = type_info(type);
  const int64_t row_bytes = K / info.block_elems * info.block_bytes;
  const int64_t N = interleaved ? interleaved_rows : w.size(0);
  if (interleaved) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == (N + 3) / 4 && w.size(1) == 4 * row_bytes, "not an interleaved [", N, ", ", K, "] weight");
  } else {
    check_weight(w, type, K);
  }
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++) TORCH_CHECK(idp[i] >= 0 && idp[i] < N, "row id ", idp[i], " outside [0, ", N, ")");
  at::Tensor out = at::empty({n, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(interleaved ? row_bytes : 0);
    for (int64_t i = begin; i < end; i++) {
      if (!interleaved) {
        dequant_row(type, wp + idp[i] * row_bytes, K, op + i * K);
        continue;
      }
      x4_row(wp, x4_layout(type), row_bytes, K / 32, idp[i], row.data());
      dequant_row(type, row.data(), K, op + i * K);
    }
  });
  return out;
}

void register_qlinear(pybind11::module_& m) {
  m.def("qlinear", &qlinear, "y = x · dequant(W)ᵀ for a GGUF-typed weight (float32 accumulation, batch-invariant)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("k"));
  m.def("qlinear_int16", &qlinear_int16,
        "y = x · Wᵀ in integers: x quantized to int16 per 32-value block (Q4_0/Q4_1/Q8_0 weights; batch-invariant)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("k"), py::arg("n"), py::arg("path") = 0);
  m.def("repack_x4", &repack_x4, "a Q4_0/Q4_1/Q8_0 weight's rows interleaved four by four for the integer matmul",
        py::arg("w"), py::arg("type"), py::arg("k"));
  m.def("measure_peak_macs", &measure_peak_macs,
        "this thread's measured peak MACs/s: (int16 pairs as the integer matmul issues them, float32 FMA)",
        py::arg("iterations") = 20000000);
  m.def("has_int16_dot", &has_int16_dot, "whether this build has the integer matmul (AVX2 + FMA)");
  m.def("dequant_rows", &dequant_rows, "rows of a GGUF-typed weight as float32", py::arg("w"), py::arg("type"),
        py::arg("k"), py::arg("ids"), py::arg("interleaved_rows") = 0);
}
