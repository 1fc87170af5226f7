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


#include "amx.h"
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
// Weights of the integer matmul are repacked once at load into panels of 16 rows, the
// shape the kernel multiplies: panel p holds rows 16p .. 16p + 15 (rows past N are zero),
// and its block b, at p · 16 · row_bytes + b · 16 · block_bytes, is
//   - the 16 rows' fp16 scales d (32 bytes), then (Q4_1) their fp16 mins m (32 bytes),
//   - then the 16 rows' codes transposed in 16-bit units: unit u (a row's code bytes 2u and
//     2u + 1) of rows 0 .. 15, 32 bytes per unit (8 units of Q4 nibbles, 16 of Q8_0 bytes).
// One unit widened to int16 is the pair vector the kernel multiplies: lane 2j + e holds row j's
// code byte 2u + e; for Q4 its low nibble is element 2u + e and its high nibble element
// 16 + 2u + e (GGUF packs element i and 16 + i in byte i), for Q8_0 it is element 2u + e.
// So no step of the matmul rearranges weights: a block is read once, sequentially, by every
// row count, where the four-row interleave before it had to be transposed into 16-row panels
// for every prompt matmul (about a third of a verify step's matmul time at 17 rows).
// The same bytes as the rows (plus zero rows up to a multiple of 16).
constexpr int64_t PANEL_ROWS = 16;  // weight rows per panel: one 512-bit vector of int32 sums

struct PanelLayout {
  int64_t block_bytes;  // a GGUF block
  int64_t header_bytes;  // a panel block's scales (and mins): 16 fp16 each
  int64_t code_bytes;  // one row's codes in a block
  int64_t code_offset;  // where the codes start in a GGUF block
};

// The layout of a type the integer matmul runs; all zeros for any other (panel_layout refuses those).
constexpr PanelLayout known_panel_layout(int64_t type) {
  switch (type) {
    case Q4_0: return {18, 2 * PANEL_ROWS, 16, 2};
    case Q4_1: return {20, 4 * PANEL_ROWS, 16, 4};
    case Q8_0: return {34, 2 * PANEL_ROWS, 32, 2};
    default: return {0, 0, 0, 0};
  }
}

PanelLayout panel_layout(int64_t type) {
  const PanelLayout l = known_panel_layout(type);
  TORCH_CHECK(l.block_bytes > 0, "the integer matmul runs Q4_0, Q4_1 and Q8_0 weights, not GGML type ", type);
  return l;
}

// Row j of a panel's block ↔ its GGUF block: `to_panel` copies blk into the panel, else back.
void panel_block_copy(const PanelLayout& l, uint8_t* panel_block, int j, uint8_t* blk, bool to_panel) {
  auto copy = [&](uint8_t* panel, uint8_t* gguf) { to_panel ? std::memcpy(panel, gguf, 2) : std::memcpy(gguf, panel, 2); };
  copy(panel_block + 2 * j, blk);                                      // d
  if (l.code_offset == 4) copy(panel_block + 2 * PANEL_ROWS + 2 * j, blk + 2);  // Q4_1's m
  for (int64_t u = 0; u < l.code_bytes / 2; u++)
    copy(panel_block + l.header_bytes + 2 * PANEL_ROWS * u + 2 * j, blk + l.code_offset + 2 * u);
}

// W [N, row_bytes] in GGUF rows → [ceil(N / 16), 16 · row_bytes] panels.
at::Tensor repack_panels(const at::Tensor& w, int64_t type, int64_t K) {
  check_weight(w, type, K);
  const PanelLayout l = panel_layout(type);
  const int64_t N = w.size(0), row_bytes = w.size(1), nb = K / 32, panels = (N + PANEL_ROWS - 1) / PANEL_ROWS;
  at::Tensor out = at::zeros({panels, PANEL_ROWS * row_bytes}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++)
      for (int64_t b = 0; b < nb; b++)
        panel_block_copy(l, op + (n / PANEL_ROWS) * PANEL_ROWS * row_bytes + b * PANEL_ROWS * l.block_bytes,
                         n % PANEL_ROWS, const_cast<uint8_t*>(wp + n * row_bytes + b * l.block_bytes), true);
  });
  return out;
}

// Row n of a repacked weight back in GGUF layout (row_bytes bytes into `row`).
void panel_row(const uint8_t* wp, const PanelLayout& l, int64_t row_bytes, int64_t nb, int64_t n, uint8_t* row) {
  for (int64_t b = 0; b < nb; b++)
    panel_block_copy(l, const_cast<uint8_t*>(wp + (n / PANEL_ROWS) * PANEL_ROWS * row_bytes + b * PANEL_ROWS * l.block_bytes),
                     n % PANEL_ROWS, row + b * l.block_bytes, false);
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
// sum (exact, so the order its products are added in, and how many partial sums carry them,
// changes no bit). Batch-invariant like the exact path, but not bit-equal to it (`--matmul
// exact` keeps that one). The block's two terms meet in the accumulator every block, so
// their cancellation (Q4's m_w is about −8 · d_w) costs no precision at the end.
//
// One kernel serves every row count, as a matrix product over a panel: a unit of 16 weight
// rows' codes is widened once into int16 pairs, lane = weight row, and each activation row's
// int16 pair is broadcast against it, so one 512-bit vpdpwssd (two 256-bit ones) serves the
// 16 weight rows. A register tile is MR activation rows × the panel's 16 weight rows over a
// block: MR · units dot products against units widenings, then per row one float epilogue of
// four operations. A decode step is the 1-row tile; a verify run or a batch of decodes a few
// 8-row tiles and one of the rest; a prompt chunk many 8-row tiles, K sliced so that the
// panel's slice stays in L1 while every tile passes it.

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool HAS_INT16_DOT = true;


// Activation rows [M, K] quantized per 32-value block.
struct QuantizedRows {
  using Wide = int16_t;  // a widened panel's element (panel_int)
  static constexpr bool on_tile_unit = false;  // whether the AMX tiles multiply these rows (amx_matmul)
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

// A panel block's sizes by type, at compile time: the layout above, as the kernels read it.
template <int TYPE>
struct PanelBlock {
  static constexpr PanelLayout layout = known_panel_layout(TYPE);
  static constexpr int64_t bytes = PANEL_ROWS * layout.block_bytes;
  static constexpr int64_t header = layout.header_bytes;
  static constexpr int units = layout.code_bytes / 2;  // 32-byte code units
  static constexpr bool has_min = TYPE != Q8_0;        // Q4_1's m, or Q4_0's −8 · d
};
constexpr int BLOCK_PAIRS = 16;                              // int16 pairs in a 32-value block
constexpr int64_t WIDE_BLOCK = BLOCK_PAIRS * 2 * PANEL_ROWS;  // int16 values of a widened panel block
inline int64_t wide_block_size(const QuantizedRows&) { return WIDE_BLOCK; }

// The activation pair (elements 2p, 2p + 1 of a row's block) as one int32, for broadcasting.
SS_INLINE int32_t x_pair(const int16_t* xb, int p) { return *reinterpret_cast<const int32_t*>(xb + 2 * p); }

// Integer partial sums per row: a few rows are too few independent chains to hide the dot
// product's latency, so they split each block's sum in two (added at the end: exact).
template <int MR>
constexpr int partial_sums() { return MR < 4 ? 2 : 1; }

// Many rows take a panel widened once to int16 pairs (`wide`: WIDE_BLOCK values a block, pair p
// of the 16 weight rows at p · 32, lane 2j + e = row j's element 2p + e) and then one load per
// pair for every tile; few rows widen each code unit in registers as they go (one widening
// serves one tile). Both compute the same exact integer sums. Measured on Zen 4, one thread,
// Q4_1 960×576, best of 2 s: widening in registers ran 1.45x the transposed panels before this
// layout at 8-9 rows but 0.92x at 256; a widened panel ran as fast at 256 and within noise of
// widening in registers at 17-33 rows.
constexpr int64_t WIDEN_PANEL_MIN_ROWS = 32;

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int TILE_MR = 8;  // activation rows per register tile (MR = 8 beat 4 by 3-6% on Zen 4)

SS_INLINE __m512i add_dot_pairs_512(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// A panel block's 16 weight scales d_w and min terms m_w (Q4_1: m; Q4_0: −8 · d; Q8_0: 0).
template <int TYPE>
SS_INLINE void load_block_scales(const uint8_t* pb, __m512& d, __m512& m) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)pb));
  m = _mm512_setzero_ps();
  if constexpr (TYPE == Q4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(pb + 2 * PANEL_ROWS)));
  if constexpr (TYPE == Q4_0) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
}

// One block of a row into its float sums, the same operations in every 512-bit tile (vector,
// int8, AMX): acc = fma(S · d_w, dx, acc), then (Q4_0 / Q4_1) acc = fma(m_w, dx · Σ xq, acc).
// S is the block's integer sum as float32 (rounded once).
template <int TYPE>
SS_INLINE __m512 add_block(__m512 acc, __m512 S, __m512 d, __m512 m, float dx, float dx_sum) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(S, d), _mm512_set1_ps(dx), acc);
  if constexpr (PanelBlock<TYPE>::has_min) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(dx_sum), acc);
  return acc;
}

// The panel's blocks [b0, b1) widened into wide (WIDE_BLOCK values each, from block b0).
template <int TYPE>
void widen_panel(const uint8_t* panel, int64_t b0, int64_t b1, int16_t* wide) {
  using B = PanelBlock<TYPE>;
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* codes = panel + b * B::bytes + B::header;
    int16_t* out = wide + (b - b0) * WIDE_BLOCK;
    for (int u = 0; u < B::units; u++) {
      const __m256i unit = _mm256_loadu_si256((const __m256i*)(codes + 2 * PANEL_ROWS * u));
      if constexpr (TYPE == Q8_0) {
        _mm512_storeu_si512(out + 2 * PANEL_ROWS * u, _mm512_cvtepi8_epi16(unit));
      } else {
        const __m512i bytes = _mm512_cvtepu8_epi16(unit);
        _mm512_storeu_si512(out + 2 * PANEL_ROWS * u, _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F)));
        _mm512_storeu_si512(out + 2 * PANEL_ROWS * (8 + u), _mm512_srli_epi16(bytes, 4));
      }
    }
  }
}

// Activation rows [r0, r0 + MR) × one panel's 16 weight rows over blocks [b0, b1) (WIDE: read
// from `wide`, which holds them from b0). The float accumulators start from `in` (rows in_stride
// apart; null: zeros) and end in `out` (rows out_stride apart, the lanes of out_mask): a K
// slice's partial sums, or y itself.
template <int TYPE, int MR, bool WIDE>
SS_INLINE void panel_tile(const uint8_t* panel, const int16_t* wide, const QuantizedRows& xq, int64_t r0, int64_t b0,
                          int64_t b1, const float* in, int64_t in_stride, float* out, int64_t out_stride,
                          __mmask16 out_mask) {
  using B = PanelBlock<TYPE>;
  constexpr int P = partial_sums<MR>();
  const int64_t K = xq.K, nb = xq.nb;
  const int16_t* xq_q = xq.q.data();
  const float *xq_d = xq.d.data(), *xq_s = xq.s.data();
  __m512 sum[MR];
  for (int r = 0; r < MR; r++) sum[r] = in ? _mm512_loadu_ps(in + r * in_stride) : _mm512_setzero_ps();
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* pb = panel + b * B::bytes;
    const int16_t* xb = xq_q + r0 * K + 32 * b;
    __m512i S[MR][P];
    for (int r = 0; r < MR; r++)
      for (int i = 0; i < P; i++) S[r][i] = _mm512_setzero_si512();
    // acc[r] += w · (row r's pair p), one asm operand per sum: GCC would otherwise reassociate
    // the running sums into many live products (and naming one variable twice makes it copy).
    auto dot_rows = [&](__m512i w, int p, int i) SS_INLINE_LAMBDA {
      asm("" : "+v"(w));  // one load or widening for the MR rows
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) {
        S[r][i] = add_dot_pairs_512(S[r][i], w, _mm512_set1_epi32(x_pair(xb + r * K, p)));
        asm("" : "+v"(S[r][i]));
      }
    };
    if constexpr (WIDE) {
      const int16_t* wb = wide + (b - b0) * WIDE_BLOCK;
#pragma GCC unroll 16
      for (int p = 0; p < BLOCK_PAIRS; p++) dot_rows(_mm512_loadu_si512(wb + 2 * PANEL_ROWS * p), p, p % P);
    } else {
      const uint8_t* codes = pb + B::header;
#pragma GCC unroll 16
      for (int u = 0; u < B::units; u++) {
        const __m256i unit = _mm256_loadu_si256((const __m256i*)(codes + 2 * PANEL_ROWS * u));
        if constexpr (TYPE == Q8_0) {
          dot_rows(_mm512_cvtepi8_epi16(unit), u, u % P);
        } else {
          const __m512i bytes = _mm512_cvtepu8_epi16(unit);
          dot_rows(_mm512_and_si512(bytes, _mm512_set1_epi16(0x0F)), u, 0);
          dot_rows(_mm512_srli_epi16(bytes, 4), 8 + u, P - 1);
        }
      }
    }
    __m512 d, m;
    load_block_scales<TYPE>(pb, d, m);
    for (int r = 0; r < MR; r++) {
      const int64_t xb_index = (r0 + r) * nb + b;
      const __m512i block_sum = P == 2 ? _mm512_add_epi32(S[r][0], S[r][P - 1]) : S[r][0];
      sum[r] = add_block<TYPE>(sum[r], _mm512_cvtepi32_ps(block_sum), d, m, xq_d[xb_index], xq_s[xb_index]);
    }
  }
  for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(out + r * out_stride, out_mask, sum[r]);
}
using TileMask = __mmask16;
#else
constexpr int TILE_MR = 4;  // 16 ymm registers: 4 rows × 2 partial sums at most, the float sums in memory

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

// widen_panel in 128-bit halves of each unit (weight rows 0..7, then 8..15).
template <int TYPE>
void widen_panel(const uint8_t* panel, int64_t b0, int64_t b1, int16_t* wide) {
  using B = PanelBlock<TYPE>;
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* codes = panel + b * B::bytes + B::header;
    int16_t* out = wide + (b - b0) * WIDE_BLOCK;
    for (int u = 0; u < B::units; u++)
      for (int h = 0; h < 2; h++) {
        const __m128i unit = _mm_loadu_si128((const __m128i*)(codes + 2 * PANEL_ROWS * u + 16 * h));
        if constexpr (TYPE == Q8_0) {
          _mm256_storeu_si256((__m256i*)(out + 2 * PANEL_ROWS * u + 16 * h), _mm256_cvtepi8_epi16(unit));
        } else {
          const __m256i bytes = _mm256_cvtepu8_epi16(unit);
          _mm256_storeu_si256((__m256i*)(out + 2 * PANEL_ROWS * u + 16 * h), _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)));
          _mm256_storeu_si256((__m256i*)(out + 2 * PANEL_ROWS * (8 + u) + 16 * h), _mm256_srli_epi16(bytes, 4));
        }
      }
  }
}

// panel_tile on 256-bit vectors, one half of the panel (8 weight rows, lanes j: weight row 8h + j)
// at a time: the same integer sums and the same float operations per weight row, so the same
// bits. The float accumulators live in memory (16 per row; `in`/`out` as above).
template <int TYPE, int MR, bool WIDE>
SS_INLINE void panel_tile(const uint8_t* panel, const int16_t* wide, const QuantizedRows& xq, int64_t r0, int64_t b0,
                          int64_t b1, const float* in, int64_t in_stride, float* out, int64_t out_stride,
                          uint32_t out_mask) {
  using B = PanelBlock<TYPE>;
  constexpr int P = partial_sums<MR>();
  const int64_t K = xq.K, nb = xq.nb;
  const int16_t* xq_q = xq.q.data();
  const float *xq_d = xq.d.data(), *xq_s = xq.s.data();
  alignas(32) float acc[MR][PANEL_ROWS];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < PANEL_ROWS; j++) acc[r][j] = in ? in[r * in_stride + j] : 0.f;
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* pb = panel + b * B::bytes;
    const int16_t* xb = xq_q + r0 * K + 32 * b;
    for (int h = 0; h < 2; h++) {
      __m256i S[MR][P];
      for (int r = 0; r < MR; r++)
        for (int i = 0; i < P; i++) S[r][i] = _mm256_setzero_si256();
      auto dot_rows = [&](__m256i w, int p, int i) SS_INLINE_LAMBDA {
        asm("" : "+x"(w));
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
          S[r][i] = add_dot_pairs(S[r][i], w, _mm256_set1_epi32(x_pair(xb + r * K, p)));
          asm("" : "+x"(S[r][i]));
        }
      };
      if constexpr (WIDE) {
        const int16_t* wb = wide + (b - b0) * WIDE_BLOCK + 16 * h;
#pragma GCC unroll 16
        for (int p = 0; p < BLOCK_PAIRS; p++) dot_rows(_mm256_loadu_si256((const __m256i*)(wb + 2 * PANEL_ROWS * p)), p, p % P);
      } else {
        const uint8_t* codes = pb + B::header + 16 * h;
#pragma GCC unroll 16
        for (int u = 0; u < B::units; u++) {
          const __m128i unit = _mm_loadu_si128((const __m128i*)(codes + 2 * PANEL_ROWS * u));
          if constexpr (TYPE == Q8_0) {
            dot_rows(_mm256_cvtepi8_epi16(unit), u, u % P);
          } else {
            const __m256i bytes = _mm256_cvtepu8_epi16(unit);
            dot_rows(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), u, 0);
            dot_rows(_mm256_srli_epi16(bytes, 4), 8 + u, P - 1);
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(pb + 16 * h)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (TYPE == Q4_1) m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(pb + 2 * PANEL_ROWS + 16 * h)));
      if constexpr (TYPE == Q4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
      for (int r = 0; r < MR; r++) {
        const int64_t xb_index = (r0 + r) * nb + b;
        const __m256i block_sum = P == 2 ? _mm256_add_epi32(S[r][0], S[r][P - 1]) : S[r][0];
        float* a = acc[r] + 8 * h;
        __m256 s = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(block_sum), d), _mm256_broadcast_ss(xq_d + xb_index),
                                   _mm256_load_ps(a));
        if constexpr (B::has_min) s = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xq_s + xb_index), s);
        _mm256_store_ps(a, s);
      }
    }
  }
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < PANEL_ROWS; j++)
      if (out_mask >> j & 1) out[r * out_stride + j] = acc[r][j];
}
using TileMask = uint32_t;
#endif

// ------------------------------------------------------------------ int8 dot products (--matmul int8)
//
// The same panels multiplied at twice the MACs per instruction: each activation block is
// quantized to unsigned 8-bit codes over its own range (asymmetric: x ≈ dx · q + lo, q in
// 0 .. 255, dx = (max − min) / 255, lo = min) and VNNI's vpdpbusd multiplies four code bytes of
// an activation row (unsigned) with four weight codes of each of 16 weight rows (signed) into
// their int32 lanes. With the weight w = d_w · c + m_w, a block's dot is
//
//   Σ_i x_i · w_i = S · d_w · dx  +  m_w · (dx · Σ q)  +  lo · (d_w · Σ c + 32 · m_w),  S = Σ q_i · c_i
//
// and its last term needs each weight row's code sum Σ c over the block, which a vpdpbusd of
// the codes against ones gives (once per block for a widened panel, once per tile otherwise).
// Accuracy: int8 activations agree with the exact path's top-1 at ~98% (int16 at ~100%; the
// measured figures are in test_engine_reference.py's top-1 test), so this is opt-in. Over the
// block's range rather than symmetric about zero: 98.3% against 96.9%, at one more FMA a block.
// Batch invariance holds as for int16: exact integer sums, and per block, in block order,
// acc = fma(float(S) · d_w, dx, acc), [acc = fma(m_w, dx · Σ q, acc)], acc = fma(wsum, lo, acc)
// with wsum = fma(d_w, float(Σ c), 32 · m_w) computed the same way by every tile.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool HAS_INT8_DOT = true;

// Activation rows [M, K] quantized per 32-value block to unsigned 8-bit codes.
struct QuantizedRows8 {
  using Wide = uint8_t;
  static constexpr bool on_tile_unit = false;
  int64_t M = 0, K = 0, nb = 0;
  std::vector<uint8_t> q;  // [M, K]
  std::vector<float> d;    // [M, nb] dx
  std::vector<float> s;    // [M, nb] dx · Σ q (the min term's activation factor)
  std::vector<float> lo;   // [M, nb] the block's minimum, which code 0 stands for
};

void quantize_block32_u8(const float* x, uint8_t* q, float* d_out, float* s_out, float* lo_out) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float lo = _mm512_reduce_min_ps(_mm512_min_ps(v0, v1));
  const float hi = _mm512_reduce_max_ps(_mm512_max_ps(v0, v1));
  const float d = (hi - lo) / 255.f;
  const __m512 vlo = _mm512_set1_ps(lo), vid = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
  const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(255);
  auto codes = [&](__m512 v) {  // round-to-even((x − lo) / dx), kept in 0 .. 255
    const __m512i c = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, vlo), vid),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_min_epi32(_mm512_max_epi32(c, zero), top);
  };
  const __m512i c0 = codes(v0), c1 = codes(v1);
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(c0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(c1));
  *d_out = d;
  *s_out = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
  *lo_out = lo;
}

void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows8& out) {
  out.M = M, out.K = K, out.nb = K / 32;
  out.q.resize(M * K);
  out.d.resize(M * out.nb);
  out.s.resize(M * out.nb);
  out.lo.resize(M * out.nb);
  at::parallel_for(0, M * out.nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const int64_t m = i / out.nb, b = i % out.nb;
      quantize_block32_u8(x + m * K + 32 * b, out.q.data() + m * K + 32 * b, &out.d[i], &out.s[i], &out.lo[i]);
    }
  });
}

constexpr int BLOCK_QUADS = 8;  // 4-value groups in a 32-value block
// A widened int8 panel block: its 8 quads (64 bytes each: lane j = weight row j's 4 codes),
// then the 16 rows' code sums (int32).
constexpr int64_t WIDE8_BLOCK = BLOCK_QUADS * 64 + 64;
inline int64_t wide_block_size(const QuantizedRows8&) { return WIDE8_BLOCK; }

// A panel block's codes as quads: f(quad vector, v) for v = 0 .. 7, where lane j holds weight
// row j's codes of elements 4v .. 4v + 3. Two 16-bit units (2v' and 2v' + 1) interleaved per row
// are a row's four code bytes 4v' .. 4v' + 3: for Q8_0 quad v', for Q4 the low nibbles quad v'
// and the high nibbles quad 4 + v'.
template <int TYPE, class F>
SS_INLINE void for_each_quad(const uint8_t* codes, F&& f) {
  // word 2j ← word j (unit 2v', row j), word 2j + 1 ← word 16 + j (unit 2v' + 1, row j)
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  if constexpr (TYPE == Q8_0) {
#pragma GCC unroll 8
    for (int v = 0; v < BLOCK_QUADS; v++) f(_mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(codes + 64 * v)), v);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int v = 0; v < BLOCK_QUADS / 2; v++) {
      const __m512i bytes = _mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(codes + 64 * v));
      f(_mm512_and_si512(bytes, low), v);
      f(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low), BLOCK_QUADS / 2 + v);
    }
  }
}

// Code sums: add_codes over a block's quads, then block_code_sums gives each weight row's Σ c
// (Q4's nibbles add bytewise first: eight of them stay below 128; Q8_0's signed codes add by vpdpbusd).
template <int TYPE>
SS_INLINE __m512i add_codes(__m512i sums, __m512i quad) {
  if constexpr (TYPE == Q8_0) return _mm512_dpbusd_epi32(sums, _mm512_set1_epi8(1), quad);
  return _mm512_add_epi8(sums, quad);
}
template <int TYPE>
SS_INLINE __m512i block_code_sums(__m512i sums) {
  if constexpr (TYPE == Q8_0) return sums;
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), sums);
}

// The panel's blocks [b0, b1) as quads and code sums in wide (WIDE8_BLOCK bytes each, from b0).
template <int TYPE>
void widen_panel(const uint8_t* panel, int64_t b0, int64_t b1, uint8_t* wide) {
  using B = PanelBlock<TYPE>;
  for (int64_t b = b0; b < b1; b++) {
    uint8_t* out = wide + (b - b0) * WIDE8_BLOCK;
    __m512i sums = _mm512_setzero_si512();
    for_each_quad<TYPE>(panel + b * B::bytes + B::header, [&](__m512i quad, int v) SS_INLINE_LAMBDA {
      _mm512_storeu_si512(out + 64 * v, quad);
      sums = add_codes<TYPE>(sums, quad);
    });
    _mm512_storeu_si512(out + 64 * BLOCK_QUADS, block_code_sums<TYPE>(sums));
  }
}

// The activation quad (elements 4v .. 4v + 3 of a row's block) as one int32, for broadcasting.
SS_INLINE int32_t x_quad(const uint8_t* xb, int v) { return *reinterpret_cast<const int32_t*>(xb + 4 * v); }

// panel_tile for int8 activations: rows [r0, r0 + MR) × the panel's 16 weight rows over blocks
// [b0, b1), the same contract (in, out, out_mask) as the int16 tile.
template <int TYPE, int MR, bool WIDE>
SS_INLINE void panel_tile(const uint8_t* panel, const uint8_t* wide, const QuantizedRows8& xq, int64_t r0, int64_t b0,
                          int64_t b1, const float* in, int64_t in_stride, float* out, int64_t out_stride,
                          __mmask16 out_mask) {
  using B = PanelBlock<TYPE>;
  constexpr int P = partial_sums<MR>();
  const int64_t K = xq.K, nb = xq.nb;
  const uint8_t* xq_q = xq.q.data();
  const float *xq_d = xq.d.data(), *xq_s = xq.s.data(), *xq_lo = xq.lo.data();
  __m512 sum[MR];
  for (int r = 0; r < MR; r++) sum[r] = in ? _mm512_loadu_ps(in + r * in_stride) : _mm512_setzero_ps();
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* pb = panel + b * B::bytes;
    const uint8_t* xb = xq_q + r0 * K + 32 * b;
    __m512i S[MR][P];
    for (int r = 0; r < MR; r++)
      for (int i = 0; i < P; i++) S[r][i] = _mm512_setzero_si512();
    auto dot_rows = [&](__m512i w, int v, int i) SS_INLINE_LAMBDA {
      asm("" : "+v"(w));  // one load or unpacking for the MR rows
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) {
        S[r][i] = _mm512_dpbusd_epi32(S[r][i], _mm512_set1_epi32(x_quad(xb + r * K, v)), w);
        asm("" : "+v"(S[r][i]));
      }
    };
    __m512i code_sums;
    if constexpr (WIDE) {
      const uint8_t* wb = wide + (b - b0) * WIDE8_BLOCK;
#pragma GCC unroll 8
      for (int v = 0; v < BLOCK_QUADS; v++) dot_rows(_mm512_loadu_si512(wb + 64 * v), v, v % P);
      code_sums = _mm512_loadu_si512(wb + 64 * BLOCK_QUADS);
    } else {
      __m512i sums = _mm512_setzero_si512();
      for_each_quad<TYPE>(pb + B::header, [&](__m512i quad, int v) SS_INLINE_LAMBDA {
        dot_rows(quad, v, TYPE == Q8_0 ? v % P : v / (BLOCK_QUADS / 2) * (P - 1));  // Q4: low nibbles, high
        sums = add_codes<TYPE>(sums, quad);
      });
      code_sums = block_code_sums<TYPE>(sums);
    }
    __m512 d, m;
    load_block_scales<TYPE>(pb, d, m);
    // Σ_i w_i over the block, per weight row: the factor of the activations' offset lo.
    const __m512 wsum = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(code_sums), _mm512_mul_ps(m, _mm512_set1_ps(32.f)));
    for (int r = 0; r < MR; r++) {
      const int64_t xb_index = (r0 + r) * nb + b;
      const __m512i block_sum = P == 2 ? _mm512_add_epi32(S[r][0], S[r][P - 1]) : S[r][0];
      sum[r] = add_block<TYPE>(sum[r], _mm512_cvtepi32_ps(block_sum), d, m, xq_d[xb_index], xq_s[xb_index]);
      sum[r] = _mm512_fmadd_ps(wsum, _mm512_set1_ps(xq_lo[xb_index]), sum[r]);
    }
  }
  for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(out + r * out_stride, out_mask, sum[r]);
}
#else
constexpr bool HAS_INT8_DOT = false;
#endif

// Slices of K: blocks per pass of the row tiles over a panel (12 blocks: 4-7 KB of panel, or
// 12 KB widened, in L1).
constexpr int64_t PANEL_SLICE_BLOCKS = 12;
// Panels per parallel task when a matmul has few rows (a decode step streams its weights from
// DRAM: 64 weight rows, ~23 KiB of Q4_1 at K = 576, keep each thread on one sequential stream
// long enough for the hardware prefetchers, which stop at 4 KiB pages; with 16-row tasks two
// threads streaming a decode step's weights were slower than one). Many rows: one panel a task.
constexpr int64_t FEW_ROWS_PANELS_PER_TASK = 4;

// Where a tile's float sums over one K slice come from and go to: the slice before's partial sums
// in `acc` (none in the first slice), and `acc` again, or in the last slice y's row (its num_valid
// columns from the panel's first), N apart.
struct SliceSums {
  const float* in;
  float* out;
  int64_t out_stride;
  TileMask out_mask;
};
SS_INLINE SliceSums slice_sums(bool first, bool last, float* acc, float* y_row, int64_t N, int64_t num_valid) {
  if (last) return {first ? nullptr : acc, y_row, N, TileMask((1u << num_valid) - 1)};
  return {first ? nullptr : acc, acc, PANEL_ROWS, TileMask(0xFFFF)};
}

// One K slice [b0, b1) of a panel against rows [r, r + MR): the tile's sums start from the slice
// before (`acc`, unless first) and end in `acc` or, in the last slice, in y's columns n0 ...
template <int TYPE, int MR, bool WIDE, class XQ>
SS_INLINE void tile_slice(const uint8_t* panel, const typename XQ::Wide* wide, const XQ& xq, int64_t r, int64_t b0,
                          int64_t b1, bool first, bool last, float* acc, float* y, int64_t N, int64_t n0,
                          int64_t num_valid) {
  const SliceSums io = slice_sums(first, last, acc + r * PANEL_ROWS, y + r * N + n0, N, num_valid);
  panel_tile<TYPE, MR, WIDE>(panel, wide, xq, r, b0, b1, io.in, PANEL_ROWS, io.out, io.out_stride, io.out_mask);
}

// tile_slice for the `rows` (< TILE_MR) rows left after the full tiles.
template <int TYPE, bool WIDE, int MR = 1, class XQ>
SS_INLINE void rest_slice(int rows, const uint8_t* panel, const typename XQ::Wide* wide, const XQ& xq, int64_t r,
                          int64_t b0, int64_t b1, bool first, bool last, float* acc, float* y, int64_t N, int64_t n0,
                          int64_t num_valid) {
  if constexpr (MR < TILE_MR) {
    if (rows == MR) return tile_slice<TYPE, MR, WIDE>(panel, wide, xq, r, b0, b1, first, last, acc, y, N, n0, num_valid);
    rest_slice<TYPE, WIDE, MR + 1>(rows, panel, wide, xq, r, b0, b1, first, last, acc, y, N, n0, num_valid);
  }
}

// Every activation row over one K slice of a panel: tiles of `tile_rows` (TILE_MR, or 1 when
// forced) and one tile of the rest.
template <int TYPE, bool WIDE, class XQ>
void rows_slice(const uint8_t* panel, const typename XQ::Wide* wide, const XQ& xq, int64_t tile_rows, int64_t b0,
                int64_t b1, bool first, bool last, float* acc, float* y, int64_t N, int64_t n0, int64_t num_valid) {
  int64_t r = 0;
  if (tile_rows == TILE_MR)
    for (; r + TILE_MR <= xq.M; r += TILE_MR)
      tile_slice<TYPE, TILE_MR, WIDE>(panel, wide, xq, r, b0, b1, first, last, acc, y, N, n0, num_valid);
  else
    for (; r < xq.M; r++) tile_slice<TYPE, 1, WIDE>(panel, wide, xq, r, b0, b1, first, last, acc, y, N, n0, num_valid);
  if (r < xq.M) rest_slice<TYPE, WIDE>(int(xq.M - r), panel, wide, xq, r, b0, b1, first, last, acc, y, N, n0, num_valid);
}

// One panel (weight rows 16p .. 16p + 15) against every activation row, a slice of K at a time
// when there is more than one tile (a slice of the panel stays in L1 while every tile passes it).
template <int TYPE, class XQ>
void panel_int(const uint8_t* wp, int64_t panel_bytes, int64_t p, int64_t N, const XQ& xq, float* y,
               int64_t tile_rows) {
  thread_local std::vector<float> acc;
  thread_local std::vector<typename XQ::Wide> wide;
  const uint8_t* panel = wp + p * panel_bytes;
  const int64_t n0 = PANEL_ROWS * p, num_valid = std::min<int64_t>(PANEL_ROWS, N - n0);
  const int64_t num_slices = xq.M <= tile_rows ? 1 : (xq.nb + PANEL_SLICE_BLOCKS - 1) / PANEL_SLICE_BLOCKS;
  const int64_t slice = (xq.nb + num_slices - 1) / num_slices;  // even slices
  const bool widen = xq.M >= WIDEN_PANEL_MIN_ROWS;
  if (num_slices > 1) acc.resize(xq.M * PANEL_ROWS);
  if (widen) wide.resize(slice * wide_block_size(xq));
  for (int64_t b0 = 0; b0 < xq.nb; b0 += slice) {
    const int64_t b1 = std::min(xq.nb, b0 + slice);
    const bool first = b0 == 0, last = b1 == xq.nb;
    if (widen) {
      widen_panel<TYPE>(panel, b0, b1, wide.data());
      rows_slice<TYPE, true>(panel, wide.data(), xq, tile_rows, b0, b1, first, last, acc.data(), y, N, n0, num_valid);
    } else {
      const typename XQ::Wide* unwidened = nullptr;  // the tiles widen each unit in registers
      rows_slice<TYPE, false>(panel, unwidened, xq, tile_rows, b0, b1, first, last, acc.data(), y, N, n0, num_valid);
    }
  }
}
// ------------------------------------------------------------------ AMX tiles for the int16 matmul
//
// On CPUs with AMX (Sapphire Rapids and later Xeons), prompt-sized row counts take the int16
// matmul's integer sums from the tile unit instead of vpdpwssd, at the same bits. Each int16
// activation code is split in two digits exact in bf16, xq = 256 · h + l (the high digit kept as
// 256 · h, h = xq >> 8 in −128 .. 127; l = xq & 255), and every weight code (Q4 nibble, Q8_0
// byte) is exact in bf16 too. TDPBF16PS multiplies 16 activation rows' 32 values of a block by
// the block's 16 weight rows, once per digit, into float32 tiles; every product is exact.
// - Q4 codes (0 .. 15): both digits go into one sum tile. Every partial sum, in whatever order
//   the unit adds, is an integer of magnitude at most 32 · (32768 · 15 + 255 · 15) < 2^24, so
//   exact: the tile holds the block's sum S exactly, which is the vpdpwssd tiles' float(S).
// - Q8_0 codes (−128 .. 127) can reach 2^27: each digit has its own sum tile, exact (Σ h · c <
//   2^19, scaled by 256), and S_high + S_low rounds S once, as float(S) does.
// The float epilogue per block is the vpdpwssd tiles' (add_block, shared), so a row's bits are
// the same whichever tile computes it: AMX is a faster tile, not another mode (the tests compare
// them bit for bit). On a 2-core Xeon VM with AMX the tile unit's peak measured ~1,870 GMAC/s a
// thread (measure_amx_peak_macs), which the two digits halve; what bounds these tiles far below
// it is moving data through them: each 16 × 16 × 32 product loads 3 KB of tiles and stores 1 KB
// (Q4) or 2 KB (Q8_0) of sums for the epilogue to read back.
#if SS_BF16_DOT
constexpr int64_t AMX_ROWS = amx::ROWS;  // activation rows per tile (and per C tile); the bf16 matmul's A layout
using amx::AlignedVector;
#endif
#if SS_AMX_TILES
constexpr int64_t AMX_PANELS_PER_TASK = 4;  // panels that share each row tile's A data in L1
// Rows per task: as many as keep their A data (4 bytes a value) within ~1 MB, half an L2, while
// a task passes its panels; each task widens its panels again, so not fewer than needed.
constexpr int64_t amx_rows_per_task(int64_t K) {
  return std::max<int64_t>(AMX_ROWS, (1 << 20) / (4 * K) / AMX_ROWS * AMX_ROWS);
}

// Tile registers (GCC's tile intrinsics paste their tile operand into the register name, so the
// kernel spells them as literals): tmm0, tmm1 the two digits' A tiles, tmm2 the weight block's
// B tile, tmm3 (and for Q8_0 tmm4) the sums of even blocks, tmm5 (and tmm6) those of odd blocks.
using amx::configure_tiles;
using amx::request_permission;

// Activation rows quantized to int16 as for the vpdpwssd tiles (their scales d and s; the codes
// themselves only as two bf16 digits), laid out as the A tiles read them: for each 16-row tile
// and block, the high digits' tile (256 · h; 16 rows × 32 values, 1 KB) then the low digits' tile,
// contiguous (rows past M are zeros, their sums never stored). Rows of an [M, K] array put each
// tile's 16 lines 2K bytes apart, and the tile loads waited on L2 for most of the kernel's time.
struct QuantizedRowsAmx : QuantizedRows {
  using Wide = uint16_t;  // a widened panel's element: a weight code in bf16
  static constexpr bool on_tile_unit = true;
  const uint16_t* digits = nullptr;  // [M / 16][nb][2][16][32], in the calling thread's buffer
  const uint16_t* digit_tiles(int64_t r0, int64_t b) const {
    return digits + ((r0 / AMX_ROWS) * nb + b) * 2 * AMX_ROWS * 32;
  }
};

// 32 int16 values → 32 bf16 values, in order (exact for values of at most 8 significant bits).
SS_INLINE __m512i int16_to_bf16(__m512i v) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// The digits go to a buffer of the calling thread, grown as needed and reused: a prompt's matmuls
// would otherwise fault in megabytes of fresh pages each (one matmul runs at a time per thread).
void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRowsAmx& out) {
  thread_local AlignedVector<uint16_t> buffer;
  const int64_t nb = K / 32, padded = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
  out.M = M, out.K = K, out.nb = nb;
  out.d.assign(padded * nb, 0.f);
  out.s.assign(padded * nb, 0.f);
  if ((int64_t)buffer.size() < padded * K * 2) buffer.resize(padded * K * 2);
  uint16_t* digits = buffer.data();
  out.digits = digits;
  at::parallel_for(0, padded * nb, 256, [&](int64_t begin, int64_t end) {
    alignas(64) int16_t q[32];
    for (int64_t i = begin; i < end; i++) {
      const int64_t m = i / nb, b = i % nb;
      uint16_t* high = digits + (((m / AMX_ROWS) * nb + b) * 2 * AMX_ROWS + m % AMX_ROWS) * 32;
      if (m >= M) {  // padding row: zero codes
        std::memset(high, 0, 64);
        std::memset(high + AMX_ROWS * 32, 0, 64);
        continue;
      }
      quantize_block32(x + m * K + 32 * b, q, &out.d[i], &out.s[i]);
      const __m512i codes = _mm512_load_si512(q);
      _mm512_storeu_si512(high, int16_to_bf16(_mm512_and_si512(codes, _mm512_set1_epi16(int16_t(0xFF00)))));
      _mm512_storeu_si512(high + AMX_ROWS * 32, int16_to_bf16(_mm512_and_si512(codes, _mm512_set1_epi16(0xFF))));
    }
  });
}

// The panel's blocks [b0, b1) widened as for the vpdpwssd tiles (pair p at p · 32, lane 2j + e
// = row j's element 2p + e: the B tile's layout, 16 pairs of 64 bytes), in bf16. Q4 nibbles become
// bf16 by one permute from a table of 0 .. 15 (widening to int16 and converting took 6% of a
// prefill); Q8_0's bytes are widened to int16, then converted.
template <int TYPE>
void widen_panel(const uint8_t* panel, int64_t b0, int64_t b1, uint16_t* wide) {
  if constexpr (TYPE == Q8_0) {
    int16_t* codes = reinterpret_cast<int16_t*>(wide);
    widen_panel<TYPE>(panel, b0, b1, codes);
    for (int64_t i = 0; i < (b1 - b0) * WIDE_BLOCK; i += 32)
      _mm512_storeu_si512(wide + i, int16_to_bf16(_mm512_loadu_si512(codes + i)));
  } else {
    using B = PanelBlock<TYPE>;
    alignas(64) static const int16_t counting[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                                     16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
    const __m512i nibble_bf16 = int16_to_bf16(_mm512_load_si512(counting));  // lane v: bf16(v)
    const __m512i mask = _mm512_set1_epi16(0x0F);
    for (int64_t b = b0; b < b1; b++) {
      const uint8_t* codes = panel + b * B::bytes + B::header;
      uint16_t* out = wide + (b - b0) * WIDE_BLOCK;
      for (int u = 0; u < B::units; u++) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(codes + 2 * PANEL_ROWS * u)));
        _mm512_storeu_si512(out + 2 * PANEL_ROWS * u, _mm512_permutexvar_epi16(_mm512_and_si512(bytes, mask), nibble_bf16));
        _mm512_storeu_si512(out + 2 * PANEL_ROWS * (8 + u), _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), nibble_bf16));
      }
    }
  }
}

// Block b's sums for 16 rows from r0 (the tile unit's work), [row][weight row]: for Q4 the block's
// sum S in sums[0]; for Q8_0 the high digit's (256 · Σ h · c) in sums[0] and the low digit's in
// sums[1]. Even and odd blocks use their own sum tiles and buffers, so a block's products need not
// wait for the block before to be stored and read.
template <int TYPE>
SS_INLINE void amx_block_sums(const uint16_t* wide_block, const QuantizedRowsAmx& xq, int64_t r0, int64_t b,
                              float (*sums)[AMX_ROWS * PANEL_ROWS]) {
  const uint16_t* x_tiles = xq.digit_tiles(r0, b);
  _tile_loadd(2, wide_block, 64);
  _tile_loadd(0, x_tiles, 64);
  _tile_loadd(1, x_tiles + AMX_ROWS * 32, 64);
  // The digits' products into sum tiles SH and SL (the same one for Q4), then out: a macro, as the
  // tile numbers must be literals.
#define SS_AMX_BLOCK_SUMS(SH, SL)  \
  _tile_zero(SH);                  \
  if (SL != SH) _tile_zero(SL);    \
  _tile_dpbf16ps(SH, 0, 2);        \
  _tile_dpbf16ps(SL, 1, 2);        \
  _tile_stored(SH, sums[0], 64);   \
  if (SL != SH) _tile_stored(SL, sums[1], 64)
  if constexpr (TYPE == Q8_0) {
    if (b % 2 == 0) {
      SS_AMX_BLOCK_SUMS(3, 4);
    } else {
      SS_AMX_BLOCK_SUMS(5, 6);
    }
  } else {
    if (b % 2 == 0) {
      SS_AMX_BLOCK_SUMS(3, 3);
    } else {
      SS_AMX_BLOCK_SUMS(5, 5);
    }
  }
#undef SS_AMX_BLOCK_SUMS
}

// Rows [r0, r0 + rows) (rows ≤ 16; the tile computes 16) × one panel's 16 weight rows over
// blocks [b0, b1), from the bf16 panel `wide`; in, out and out_mask as panel_tile's. Per block:
// the sums from the tile unit, then panel_tile's float epilogue. Block b + 1's tile work is
// issued before block b's epilogue, so that the two may overlap.
template <int TYPE>
void amx_panel_tile(const uint8_t* panel, const uint16_t* wide, const QuantizedRowsAmx& xq, int64_t r0, int rows,
                    int64_t b0, int64_t b1, const float* in, int64_t in_stride, float* out, int64_t out_stride,
                    __mmask16 out_mask) {
  using B = PanelBlock<TYPE>;
  alignas(64) float sums[2][2][AMX_ROWS * PANEL_ROWS];  // [block parity][digit]
  // Every loop over the 16 rows runs to 16 (unrolled: the sums stay in registers); the padding
  // rows' scales are zeros, their sums never loaded or stored.
  __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
  for (int r = 0; r < AMX_ROWS; r++) acc[r] = in && r < rows ? _mm512_loadu_ps(in + r * in_stride) : _mm512_setzero_ps();
  amx_block_sums<TYPE>(wide, xq, r0, b0, sums[b0 % 2]);
  for (int64_t b = b0; b < b1; b++) {
    if (b + 1 < b1) amx_block_sums<TYPE>(wide + (b + 1 - b0) * WIDE_BLOCK, xq, r0, b + 1, sums[(b + 1) % 2]);
    const float* high = sums[b % 2][0];
    const float* low = sums[b % 2][1];
    __m512 d, m;
    load_block_scales<TYPE>(panel + b * B::bytes, d, m);
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) {
      const int64_t xb_index = (r0 + r) * xq.nb + b;
      __m512 S = _mm512_load_ps(high + r * PANEL_ROWS);
      if constexpr (TYPE == Q8_0) S = _mm512_add_ps(S, _mm512_load_ps(low + r * PANEL_ROWS));
      acc[r] = add_block<TYPE>(acc[r], S, d, m, xq.d[xb_index], xq.s[xb_index]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < AMX_ROWS; r++)
    if (r < rows) _mm512_mask_storeu_ps(out + r * out_stride, out_mask, acc[r]);
}

// A few panels [p0, p1) (weight rows 16 p0 .. 16 p1 − 1) against activation rows [r0, r1) (a
// multiple of 16 from r0), a slice of K at a time: per slice the panels are widened to bf16, then
// each 16-row tile passes every panel while its digits' A data (16 rows × a slice: 24 KB) stays
// in L1; the rows' whole A data (amx_rows_per_task: ~1 MB) stays in L2 for the next
// panels. One panel per pass, and every row per task, read A from L2, or past it from L3 at 1,024
// rows, for every product: the tile unit waited on loads for most of its time.
template <int TYPE>
void amx_panels(const uint8_t* wp, int64_t panel_bytes, int64_t p0, int64_t p1, int64_t r0, int64_t r1, int64_t N,
                const QuantizedRowsAmx& xq, float* y) {
  thread_local std::vector<float> acc;        // [panel][row][16]: a slice's partial sums
  thread_local AlignedVector<uint16_t> wide;  // [panel][slice block][WIDE_BLOCK]
  const int64_t panels = p1 - p0, rows = r1 - r0;
  const int64_t num_slices = (xq.nb + PANEL_SLICE_BLOCKS - 1) / PANEL_SLICE_BLOCKS;
  const int64_t slice = (xq.nb + num_slices - 1) / num_slices;  // even slices
  if (num_slices > 1) acc.resize(panels * rows * PANEL_ROWS);
  wide.resize(panels * slice * WIDE_BLOCK);
  configure_tiles();
  for (int64_t b0 = 0; b0 < xq.nb; b0 += slice) {
    const int64_t b1 = std::min(xq.nb, b0 + slice);
    const bool first = b0 == 0, last = b1 == xq.nb;
    for (int64_t j = 0; j < panels; j++)
      widen_panel<TYPE>(wp + (p0 + j) * panel_bytes, b0, b1, wide.data() + j * slice * WIDE_BLOCK);
    for (int64_t r = r0; r < r1; r += AMX_ROWS) {
      const int tile_rows = int(std::min(AMX_ROWS, r1 - r));
      for (int64_t j = 0; j < panels; j++) {
        const int64_t n0 = PANEL_ROWS * (p0 + j), num_valid = std::min<int64_t>(PANEL_ROWS, N - n0);
        float* panel_acc = acc.data() + (j * rows + r - r0) * PANEL_ROWS;
        const SliceSums io = slice_sums(first, last, panel_acc, y + r * N + n0, N, num_valid);
        amx_panel_tile<TYPE>(wp + (p0 + j) * panel_bytes, wide.data() + j * slice * WIDE_BLOCK, xq, r, tile_rows, b0,
                             b1, io.in, PANEL_ROWS, io.out, io.out_stride, io.out_mask);
      }
    }
  }
}

// y = x · Wᵀ on the tile unit: tasks of AMX_PANELS_PER_TASK panels × amx_rows_per_task rows, taken
// row block by row block (both threads work in one row block at a time, its A data in each L2).
template <int TYPE>
void amx_matmul(const uint8_t* wp, int64_t panel_bytes, int64_t panels, int64_t N, const QuantizedRowsAmx& xq,
                float* y) {
  const int64_t groups = (panels + AMX_PANELS_PER_TASK - 1) / AMX_PANELS_PER_TASK;
  const int64_t block_rows = amx_rows_per_task(xq.K), row_blocks = (xq.M + block_rows - 1) / block_rows;
  parallel_tasks(groups * row_blocks, [&](int64_t task) {
    const int64_t p0 = task % groups * AMX_PANELS_PER_TASK, r0 = task / groups * block_rows;
    amx_panels<TYPE>(wp, panel_bytes, p0, std::min(panels, p0 + AMX_PANELS_PER_TASK), r0,
                     std::min(xq.M, r0 + block_rows), N, xq, y);
  });
}
#endif

#if SS_BF16_DOT
// ------------------------------------------------------------------ bf16 matmul (--matmul bf16)
//
// y = bf16(x) · bf16(W)ᵀ with float32 sums over all of K: the weights dequantized once (at load)
// and rounded to bf16, in the AMX B tiles' layout (bf16_panels in weight_format.py: [panels][K / 32]
// [16 pairs][16 rows][2]); the activations rounded to bf16 per call, in the A tiles' layout
// (bf16_row_tiles). No integer codes and no per-block epilogue: each row's sums stay in registers
// over the whole of K. Two kernels read these layouts, one per CPU: the AMX tiles where the CPU
// has them and the OS grants them (Sapphire Rapids and later Xeons), else VDPBF16PS in vector
// registers (AVX512-BF16 without AMX: Zen 4). A machine runs every row through the one it has, and
// within a kernel every row of y is one fixed sequence of products over K in block order from zero,
// whatever the number of rows or which tile holds it, so a row's bits do not depend on its batch.
// The two kernels round their sums differently (the tile unit's order of adds is its own), so
// `allow_amx_tiles(false)`, a benchmark's switch, changes bf16 bits on an AMX CPU.
// A task: up to 256 rows of A against up to 1,024 weight rows of B, row pair by row pair: the A pair
// stays in L1 while the task's B pairs pass it, and consecutive tile pairs store to the same 32 rows
// of y, line after line (on a 2-core Xeon VM the four layer shapes at 1,024 rows ran 1.2x faster
// than tasks of 256 × 128 taken panel pair by panel pair, gate_up's 3,072 columns 1.3x). Fewer rows
// (a 256-token chunk) or columns split the task until every thread has two (bf16_tasks).
constexpr int64_t BF16_ROW_PAIRS_PER_TASK = 8;
constexpr int64_t BF16_PANEL_PAIRS_PER_TASK = 32;
constexpr int64_t BF16_TASKS_PER_THREAD = 2;

// Pairs of 16-row tiles that hold M activation rows (the last pair padded with zero rows).
constexpr int64_t bf16_row_pairs(int64_t M) { return (M + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS); }

// A bf16 matmul's row pairs × panel pairs cut into tasks of whole row pairs and panel pairs.
struct Bf16Tasks {
  struct Range {
    int64_t rp0, rp1, pp0, pp1;  // row pairs [rp0, rp1) × panel pairs [pp0, pp1)
  };
  int64_t row_pairs, panel_pairs, rows_per_task, panels_per_task;

  int64_t row_blocks() const { return (row_pairs + rows_per_task - 1) / rows_per_task; }
  int64_t panel_groups() const { return (panel_pairs + panels_per_task - 1) / panels_per_task; }
  int64_t count() const { return row_blocks() * panel_groups(); }
  Range operator[](int64_t task) const {
    const int64_t g = task % panel_groups(), rb = task / panel_groups();
    return {rb * rows_per_task, std::min(row_pairs, (rb + 1) * rows_per_task), g * panels_per_task,
            std::min(panel_pairs, (g + 1) * panels_per_task)};
  }
};

// The largest tasks (row pairs, then panel pairs halved) that still give every thread
// BF16_TASKS_PER_THREAD, so that a thread slowed by another process does not hold the step, then
// evened out (18 panel pairs in two tasks: 9 and 9, not 16 and 2). Any cut gives the same bits.
Bf16Tasks bf16_tasks(int64_t row_pairs, int64_t panel_pairs) {
  const int64_t wanted = BF16_TASKS_PER_THREAD * at::get_num_threads();
  Bf16Tasks t{row_pairs, panel_pairs, BF16_ROW_PAIRS_PER_TASK, BF16_PANEL_PAIRS_PER_TASK};
  while (t.count() < wanted && t.rows_per_task > 1) t.rows_per_task /= 2;
  while (t.count() < wanted && t.panels_per_task > 1) t.panels_per_task /= 2;
  t.rows_per_task = (row_pairs + t.row_blocks() - 1) / t.row_blocks();
  t.panels_per_task = (panel_pairs + t.panel_groups() - 1) / t.panel_groups();
  return t;
}

// x [M, K] float32 rounded to bf16 (nearest even) as the A tiles read it, [M' / 16][K / 32][16][32],
// M' = M rounded up to 32 (whole pairs of row tiles; padding rows zero), in the calling thread's buffer.
const uint16_t* bf16_row_tiles(const float* x, int64_t M, int64_t K) {
  thread_local AlignedVector<uint16_t> buffer;
  const int64_t nb = K / 32, padded = bf16_row_pairs(M) * 2 * AMX_ROWS;
  if ((int64_t)buffer.size() < padded * K) buffer.resize(padded * K);
  uint16_t* tiles = buffer.data();
  // A row's blocks in one run: an integer division per row, not two per 32 values (the pass,
  // three per layer, went from 0.9% to 0.7% of a 1,024-token prefill's samples on Zen 4).
  at::parallel_for(0, padded, AMX_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; m++) {
      uint16_t* dst = tiles + (m / AMX_ROWS) * nb * AMX_ROWS * 32 + (m % AMX_ROWS) * 32;
      const float* src = x + m * K;
      for (int64_t b = 0; b < nb; b++, dst += AMX_ROWS * 32, src += 32) {
        if (m < M)
          _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)));
        else
          std::memset(dst, 0, 64);  // a padding row: zeros
      }
    }
  });
  return tiles;
}

#endif

#if SS_AMX_TILES
// ------------------------------------------------------------------ bf16 matmul on the AMX tiles
//
// Whole 32 × 32 tile pairs store their sums straight into y (a copy through a stack buffer had
// cost ~20%). The kernel reaches ~35-40% of the tile unit's peak at 256-2,048 rows; the same tile
// loop alone ran at ~58%: the rest is moving B through L2 and writing y (float32, M × N).

// Row tiles 2 rp, 2 rp + 1 × panels 2 pp, 2 pp + 1 over all of K: four float32 sum tiles (tmm4 .. 7),
// stored to c[row tile][panel] (16 × 16 floats, rows `stride` bytes apart). between(b) runs after
// block b's products are issued: vector work that the core overlaps with the tile unit's.
template <class Between>
SS_INLINE void bf16_tile_pair(const uint16_t* a, const uint16_t* w, int64_t nb, int64_t rp, int64_t pp,
                              float* const (&c)[2][2], int64_t stride, const Between& between) {
  constexpr int64_t TILE = AMX_ROWS * 32;  // bf16 values of one A or B tile
  const uint16_t* a0 = a + 2 * rp * nb * TILE;
  const uint16_t* a1 = a0 + nb * TILE;
  const uint16_t* w0 = w + 2 * pp * nb * TILE;
  const uint16_t* w1 = w0 + nb * TILE;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t b = 0; b < nb; b++) {
    _tile_loadd(0, a0 + b * TILE, 64);
    _tile_loadd(1, a1 + b * TILE, 64);
    _tile_loadd(2, w0 + b * TILE, 64);
    _tile_loadd(3, w1 + b * TILE, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
    between(b);
  }
  _tile_stored(4, c[0][0], stride);
  _tile_stored(5, c[0][1], stride);
  _tile_stored(6, c[1][0], stride);
  _tile_stored(7, c[1][1], stride);
}

SS_INLINE void bf16_tile_pair(const uint16_t* a, const uint16_t* w, int64_t nb, int64_t rp, int64_t pp,
                              float* const (&c)[2][2], int64_t stride) {
  bf16_tile_pair(a, w, nb, rp, pp, c, stride, [](int64_t) {});
}

// y [M, N] from the A tiles and the bf16 panels (an even number of them).
void bf16_matmul_amx(const uint16_t* a, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t panels, float* y) {
  const int64_t nb = K / 32;
  const Bf16Tasks tasks = bf16_tasks(bf16_row_pairs(M), panels / 2);
  parallel_tasks(tasks.count(), [&](int64_t task) {
    configure_tiles();
    alignas(64) float edge[2][2][AMX_ROWS * PANEL_ROWS];
    const auto [rp0, rp1, pp0, pp1] = tasks[task];
    for (int64_t rp = rp0; rp < rp1; rp++)
      for (int64_t pp = pp0; pp < pp1; pp++) {
        const int64_t r0 = 2 * rp * AMX_ROWS, n0 = 2 * pp * PANEL_ROWS;
        if (r0 + 2 * AMX_ROWS <= M && n0 + 2 * PANEL_ROWS <= N) {  // whole tiles: straight into y
          float* const c[2][2] = {{y + r0 * N + n0, y + r0 * N + n0 + PANEL_ROWS},
                                  {y + (r0 + AMX_ROWS) * N + n0, y + (r0 + AMX_ROWS) * N + n0 + PANEL_ROWS}};
          bf16_tile_pair(a, w, nb, rp, pp, c, N * 4);
          continue;
        }
        float* const c[2][2] = {{edge[0][0], edge[0][1]}, {edge[1][0], edge[1][1]}};
        bf16_tile_pair(a, w, nb, rp, pp, c, PANEL_ROWS * 4);
        for (int i = 0; i < 2; i++)
          for (int j = 0; j < 2; j++) {
            const int64_t ri = r0 + i * AMX_ROWS, nj = n0 + j * PANEL_ROWS;
            if (nj >= N) continue;
            const __mmask16 cols = (__mmask16)((1u << std::min<int64_t>(PANEL_ROWS, N - nj)) - 1);
            for (int64_t r = 0; r < AMX_ROWS && ri + r < M; r++)
              _mm512_mask_storeu_ps(y + (ri + r) * N + nj, cols, _mm512_load_ps(edge[i][j] + r * PANEL_ROWS));
          }
      }
  });
}

// A tiles of bf16(silu(x·Wgᵀ) · (x·Wuᵀ)) for the down matmul, [M' / 16][I / 32][16][32], from x's A
// tiles and gate_up's bf16 panels (gate rows 0..I−1, up rows I..2I−1, I a multiple of 32): each task
// runs gate's tile pair and up's for the same 32 rows × 32 columns into an L1 buffer, and its
// epilogue writes the down matmul's tile straight away. The same sums, the same silu·up (silu_mul's
// formula, simd16::silu) and the same rounding as down(silu_mul(gate_up(x))): the same bits, without
// gate_up's float32 output (M × 2I: 12 MB at 1,024 rows) written, read back and rounded again.
const uint16_t* bf16_swiglu_amx(const uint16_t* a, const uint16_t* w, int64_t M, int64_t K, int64_t I) {
  thread_local AlignedVector<uint16_t> buffer;
  const int64_t nb = K / 32, nbi = I / 32, padded = bf16_row_pairs(M) * 2 * AMX_ROWS;
  if ((int64_t)buffer.size() < padded * I) buffer.resize(padded * I);
  uint16_t* tiles = buffer.data();
  const Bf16Tasks tasks = bf16_tasks(bf16_row_pairs(M), nbi);  // gate's panel pairs (up's follow them)
  parallel_tasks(tasks.count(), [&](int64_t task) {
    configure_tiles();
    // Two sets of gate and up sums: the epilogue of one 32 × 32 block (silu·up, bf16, into the down
    // matmul's tile) runs a row at a time between the tile products of the next, where the vector
    // units are otherwise idle (in turn, the silu's division and exp had cost ~30% of gate_up).
    alignas(64) float sums[2][2][2][2][AMX_ROWS * PANEL_ROWS];  // [set][gate, up][row tile][panel]
    const auto [rp0, rp1, b0, b1] = tasks[task];
    constexpr int64_t ROWS_DONE = 2 * AMX_ROWS;  // epilogue rows of one block (2 row tiles)
    uint16_t* pending = nullptr;                 // the block whose epilogue is due, its tile for row tile 0
    int pending_set = 0;
    int64_t row = ROWS_DONE;                     // the pending block's next epilogue row
    const auto epilogue_rows = [&](int64_t until) SS_INLINE_LAMBDA {
      for (; row < until; row++) {
        const int64_t i = row / AMX_ROWS, r = row % AMX_ROWS, at = r * PANEL_ROWS;
        float(&g)[2][AMX_ROWS * PANEL_ROWS] = sums[pending_set][0][i];
        float(&u)[2][AMX_ROWS * PANEL_ROWS] = sums[pending_set][1][i];
        const simd16::V16 lo = simd16::mul(simd16::silu(simd16::load(g[0] + at)), simd16::load(u[0] + at));
        const simd16::V16 hi = simd16::mul(simd16::silu(simd16::load(g[1] + at)), simd16::load(u[1] + at));
        _mm512_store_si512(pending + i * nbi * AMX_ROWS * 32 + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi.v, lo.v));
      }
    };
    int set = 0;
    for (int64_t rp = rp0; rp < rp1; rp++)
      for (int64_t b = b0; b < b1; b++) {
        float* const g[2][2] = {{sums[set][0][0][0], sums[set][0][0][1]}, {sums[set][0][1][0], sums[set][0][1][1]}};
        float* const u[2][2] = {{sums[set][1][0][0], sums[set][1][0][1]}, {sums[set][1][1][0], sums[set][1][1][1]}};
        // The pending block's 32 rows spread over this block's 2 · nb products.
        bf16_tile_pair(a, w, nb, rp, b, g, PANEL_ROWS * 4, [&](int64_t k) SS_INLINE_LAMBDA {
          epilogue_rows((k + 1) * ROWS_DONE / (2 * nb));
        });
        bf16_tile_pair(a, w, nb, rp, b + nbi, u, PANEL_ROWS * 4, [&](int64_t k) SS_INLINE_LAMBDA {
          epilogue_rows((nb + k + 1) * ROWS_DONE / (2 * nb));
        });
        epilogue_rows(ROWS_DONE);
        pending = tiles + (2 * rp * nbi + b) * AMX_ROWS * 32, pending_set = set, row = 0;
        set ^= 1;
      }
    epilogue_rows(ROWS_DONE);
  });
  return tiles;
}
#endif

#if SS_BF16_DOT
// ------------------------------------------------------------------ bf16 matmul in vector registers (VDPBF16PS)
//
// Where the CPU has AVX512-BF16 but no tile unit (Zen 4), the same layouts multiply in vector
// registers: one line of a B tile (a pair of K values for a panel's 16 weight rows, 64 bytes) is
// one VDPBF16PS operand, which adds both products of a pair to each float32 lane, and the other
// operand is one activation row's pair broadcast to every lane (amx::broadcast_pair: a
// vpbroadcastd from the A tile's line). A register tile holds ROWS activation rows × PANELS panels of sums
// (ROWS · PANELS ≤ 24 of the 32 registers) over the whole of K. Lane n of row m is always
// sum = 0, then sum = VDPBF16PS(sum, x pair, w pair) for each block in order and each of its 16
// pairs in order, whichever register tile, row count or thread holds it: the same bits.
// Measured on a 2-core Zen 4 VM (a standalone loop over these layouts, the layer shapes at 256
// rows): 8 rows × 2 panels and 6 × 4 reach 96-100% of VDPBF16PS's measured peak on one thread,
// 94-98% on two, rows outer (an 8-row slice of A stays in L1 while the task's B panels stream
// past it from L2); panel-outer orders ran 85-90% on two threads, and 4 × 6 spilled (55%). In the
// library 6 × 4 spilled too (bf16_swiglu_vdp), so both kernels take 8 × 2.
constexpr int64_t BF16_VDP_ROWS = 8;  // activation rows of a register tile (× 2 panels: 16 sums)

// The sums of rows m0 .. m0 + ROWS − 1 of the A tiles against panels w[0 .. PANELS − 1], over all of K.
// between(b) runs after block b's products are issued (as bf16_tile_pair's): vector work that the
// core's scheduler interleaves with them.
template <int ROWS, int PANELS, class Between>
SS_INLINE void bf16_vdp_tile(const uint16_t* a, int64_t nb, int64_t m0, const uint16_t* const (&w)[PANELS],
                             __m512 (&sum)[ROWS][PANELS], const Between& between) {
  constexpr int64_t TILE = AMX_ROWS * 32;  // bf16 values of one A tile or one panel's block
  const uint16_t* row[ROWS];
  for (int i = 0; i < ROWS; i++) {
    const int64_t m = m0 + i;
    row[i] = a + (m / AMX_ROWS) * nb * TILE + (m % AMX_ROWS) * 32;
  }
  for (int i = 0; i < ROWS; i++)
    for (int j = 0; j < PANELS; j++) sum[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 16
    for (int q = 0; q < 16; q++) {
      __m512bh line[PANELS];
      for (int j = 0; j < PANELS; j++) line[j] = (__m512bh)_mm512_loadu_si512(w[j] + b * TILE + q * 32);
      for (int i = 0; i < ROWS; i++) {
        const __m512bh x = amx::broadcast_pair(row[i] + b * TILE + 2 * q);
        for (int j = 0; j < PANELS; j++) sum[i][j] = _mm512_dpbf16_ps(sum[i][j], x, line[j]);
      }
    }
    between(b);
  }
}

template <int ROWS, int PANELS>
SS_INLINE void bf16_vdp_tile(const uint16_t* a, int64_t nb, int64_t m0, const uint16_t* const (&w)[PANELS],
                             __m512 (&sum)[ROWS][PANELS]) {
  bf16_vdp_tile<ROWS, PANELS>(a, nb, m0, w, sum, [](int64_t) {});
}

// The tasks' rows (of M) in register tiles of MAX rows and a shorter last one, each run as
// run(rows, m0, pp0, pp1): its row count (a std::integral_constant), first row and the task's
// panel pairs [pp0, pp1). Rows outer: a tile's slice of A stays in L1 while the panels pass it.
template <int MAX, class Run>
void for_each_vdp_tile(const Bf16Tasks& tasks, int64_t M, const Run& run) {
  parallel_tasks(tasks.count(), [&](int64_t task) {
    const auto [rp0, rp1, pp0, pp1] = tasks[task];
    const int64_t m_end = std::min(M, rp1 * 2 * AMX_ROWS);
    for (int64_t m0 = rp0 * 2 * AMX_ROWS; m0 < m_end; m0 += MAX)
      with_tile_rows<MAX>(m_end - m0, [&](auto rows) SS_INLINE_LAMBDA { run(rows, m0, pp0, pp1); });
  });
}

// y [M, N] from the A tiles and the bf16 panels (an even number of them), as bf16_matmul_amx's.
void bf16_matmul_vdp(const uint16_t* a, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t panels, float* y) {
  constexpr int64_t TILE = AMX_ROWS * 32;
  const int64_t nb = K / 32;
  for_each_vdp_tile<BF16_VDP_ROWS>(
      bf16_tasks(bf16_row_pairs(M), panels / 2), M,
      [&](auto rows, int64_t m0, int64_t pp0, int64_t pp1) SS_INLINE_LAMBDA {
        constexpr int ROWS = decltype(rows)::value;
        for (int64_t pp = pp0; pp < pp1; pp++) {
          const uint16_t* const panel[2] = {w + 2 * pp * nb * TILE, w + (2 * pp + 1) * nb * TILE};
          __m512 sum[ROWS][2];
          bf16_vdp_tile<ROWS, 2>(a, nb, m0, panel, sum);
          for (int j = 0; j < 2; j++) {
            const int64_t n0 = (2 * pp + j) * PANEL_ROWS;
            if (n0 >= N) continue;
            const __mmask16 cols = (__mmask16)((1u << std::min<int64_t>(PANEL_ROWS, N - n0)) - 1);
            for (int i = 0; i < ROWS; i++) _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, cols, sum[i][j]);
          }
        }
      });
}

// bf16_swiglu_amx's A tiles of bf16(silu(x·Wgᵀ) · (x·Wuᵀ)) from VDPBF16PS register tiles of 8 rows
// × 2 panels, the matmul's: for a block of 32 columns of the down matmul's K, gate's panel pair,
// then up's, their sums parked in L1; that block's silu·up is rounded to bf16 and stored into its
// lines a row at a time between the products of the next block (two sets of sums), as
// bf16_swiglu_amx's epilogue. The same bits as bf16_matmul_vdp → silu_mul → bf16_row_tiles; rows
// past M are never written (nor read by bf16_matmul_vdp). On a 2-core Zen 4 VM, at 1,024 rows,
// the epilogue run right after its block's products cost 6% of qlinear_bf16_swiglu (12.8 ms a
// layer against 12.1 with silu left out) whatever its instructions (a reciprocal for the
// division, a cheaper exp: both level): its chains of dependent vector ops held up the products
// behind them. Spread over the next block's products it costs 2-3% (12.3-12.5 ms); a half row at
// a time ran no faster (0.97-0.99x). A single 6 × 4 tile over both pairs (24 sums) had GCC spill its sums
// to the stack after every block of K (1.03-1.04x slower).
const uint16_t* bf16_swiglu_vdp(const uint16_t* a, const uint16_t* w, int64_t M, int64_t K, int64_t I) {
  constexpr int64_t TILE = AMX_ROWS * 32;
  thread_local AlignedVector<uint16_t> buffer;
  const int64_t nb = K / 32, nbi = I / 32, padded = bf16_row_pairs(M) * 2 * AMX_ROWS;
  if ((int64_t)buffer.size() < padded * I) buffer.resize(padded * I);
  uint16_t* tiles = buffer.data();
  for_each_vdp_tile<BF16_VDP_ROWS>(
      bf16_tasks(bf16_row_pairs(M), nbi), M,  // over gate's panel pairs (up's follow them)
      [&](auto rows, int64_t m0, int64_t b0, int64_t b1) SS_INLINE_LAMBDA {
        constexpr int ROWS = decltype(rows)::value;
        // [block b's set, (b − b0) % 2][gate, up][row][panel][lane]: block b fills one set while the
        // epilogue of block b − 1 reads the other, from `row` on (ROWS: none due).
        alignas(64) float sums[2][2][ROWS][2][16];
        int row = ROWS;
        const auto epilogue_rows = [&](int64_t block, int until) SS_INLINE_LAMBDA {
          for (; row < until; row++) {
            const float(&g)[2][16] = sums[(block - b0) % 2][0][row];
            const float(&u)[2][16] = sums[(block - b0) % 2][1][row];
            const simd16::V16 lo = simd16::mul(simd16::silu(simd16::load(g[0])), simd16::load(u[0]));
            const simd16::V16 hi = simd16::mul(simd16::silu(simd16::load(g[1])), simd16::load(u[1]));
            const int64_t m = m0 + row;
            _mm512_store_si512(tiles + ((m / AMX_ROWS) * nbi + block) * TILE + (m % AMX_ROWS) * 32,
                               (__m512i)_mm512_cvtne2ps_pbh(hi.v, lo.v));
          }
        };
        for (int64_t b = b0; b < b1; b++) {
          const int64_t up = b + nbi;  // up's panel pair for gate's b
          const uint16_t* const panels[2][2] = {{w + 2 * b * nb * TILE, w + (2 * b + 1) * nb * TILE},
                                                {w + 2 * up * nb * TILE, w + (2 * up + 1) * nb * TILE}};
#pragma GCC unroll 2
          for (int h = 0; h < 2; h++) {  // gate, then up; block b − 1's rows spread over both (done by up's end)
            __m512 sum[ROWS][2];
            bf16_vdp_tile<ROWS, 2>(a, nb, m0, panels[h], sum, [&](int64_t k) SS_INLINE_LAMBDA {
              epilogue_rows(b - 1, (h * nb + k + 1) * ROWS / (2 * nb));
            });
            for (int i = 0; i < ROWS; i++)
              for (int j = 0; j < 2; j++) _mm512_store_ps(sums[(b - b0) % 2][h][i][j], sum[i][j]);
          }
          row = 0;  // block b's epilogue is due
        }
        epilogue_rows(b1 - 1, ROWS);
      });
  return tiles;
}

#endif

// Row counts from which the engine's int16 matmul takes the AMX tiles, where it has them (a tile
// is 16 rows: on a 2-core Xeon VM with AMX, Q4_1 layer shapes ran 0.60-0.75x the vpdpwssd tiles
// at 8 rows, 0.97-1.14x at 12, 1.04-1.22x at 16 and 1.30-1.49x at 32).
constexpr int64_t AMX_MIN_ROWS = 16;
// Whether the engine's path may take them: on unless a benchmark turns them off to compare.
std::atomic<bool> amx_tiles_allowed{true};

// Whether the AMX tiles can run here: built in (-march=native on an AMX CPU) and granted by the OS.
bool amx_tiles_usable() {
#if SS_AMX_TILES
  return request_permission();
#else
  return false;
#endif
}

#if SS_BF16_DOT
// The bf16 matmul's kernel on this machine: the AMX tiles where usable (and not turned off by a
// benchmark), else VDPBF16PS.
bool bf16_on_tiles() { return amx_tiles_allowed.load(std::memory_order_relaxed) && amx_tiles_usable(); }

void bf16_matmul(const uint16_t* a, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t panels, float* y) {
#if SS_AMX_TILES
  if (bf16_on_tiles()) return bf16_matmul_amx(a, w, M, K, N, panels, y);
#endif
  bf16_matmul_vdp(a, w, M, K, N, panels, y);
}

const uint16_t* bf16_swiglu(const uint16_t* a, const uint16_t* w, int64_t M, int64_t K, int64_t I) {
#if SS_AMX_TILES
  if (bf16_on_tiles()) return bf16_swiglu_amx(a, w, M, K, I);
#endif
  return bf16_swiglu_vdp(a, w, M, K, I);
}
#endif

#else
constexpr bool HAS_INT16_DOT = false;
constexpr bool HAS_INT8_DOT = false;
bool amx_tiles_usable() { return false; }
std::atomic<bool> amx_tiles_allowed{false};
#endif

// A matmul's activations x [M, K] (float32 or bfloat16) as contiguous float32 rows, checked.
at::Tensor float_rows(const at::Tensor& x_in, int64_t K) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  return x_in.to(at::kFloat).contiguous();
}

// The float32 result y in the activations' dtype.
at::Tensor in_dtype_of(const at::Tensor& y, const at::Tensor& x_in) {
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

}  // namespace

// y[M, N] = x[M, K] · dequant(W)[N, K]ᵀ in float32; y has x's dtype (float32 or bfloat16).
at::Tensor qlinear(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t K) {
  check_weight(w, type, K);
  const at::Tensor x = float_rows(x_in, K);
  const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return in_dtype_of(y, x_in);
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
  return in_dtype_of(y, x_in);
}

#if defined(__AVX2__) && defined(__FMA__)
namespace {
// y[M, N] = x[M, K] · W[N, K]ᵀ with x quantized per 32-value block as XQ holds it (int16 or int8
// codes, or int16 codes as bf16 digits for the AMX tiles); W is Q4_0, Q4_1 or Q8_0 in panels
// (repack_panels). y has x's dtype. `path`: the register tiles, which never change a bit:
// INT16_AUTO and INT16_PANELS take tiles of TILE_MR rows and one of the rest, INT16_ROWS one row
// per tile (the tests compare them); with QuantizedRowsAmx, the AMX tiles.
template <class XQ>
at::Tensor integer_matmul(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t K, int64_t N, int64_t path) {
  TORCH_CHECK(path >= INT16_AUTO && path <= INT16_AMX, "path must be 0 (auto), 1 (rows), 2 (panels) or 3 (amx), got ",
              path);
  const PanelLayout l = panel_layout(type);
  TORCH_CHECK(K % 32 == 0, "K=", K, " is not a multiple of 32");
  const int64_t panels = (N + PANEL_ROWS - 1) / PANEL_ROWS, panel_bytes = PANEL_ROWS * (K / 32) * l.block_bytes;
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) == panels && w.size(1) == panel_bytes,
              "weight must be a contiguous uint8 [", panels, ", ", panel_bytes, "] tensor (repack_panels of [", N, ", ", K, "])");
  const at::Tensor x = float_rows(x_in, K);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return in_dtype_of(y, x_in);
  XQ xq;
  quantize_rows(x.data_ptr<float>(), M, K, xq);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if constexpr (XQ::on_tile_unit) {
    switch (type) {
      case Q4_0: amx_matmul<Q4_0>(wp, panel_bytes, panels, N, xq, yp); break;
      case Q4_1: amx_matmul<Q4_1>(wp, panel_bytes, panels, N, xq, yp); break;
      default: amx_matmul<Q8_0>(wp, panel_bytes, panels, N, xq, yp); break;
    }
  } else {
    const int64_t tile_rows = path == INT16_ROWS ? 1 : TILE_MR;
    const int64_t panels_per_task = M < TILE_MR ? FEW_ROWS_PANELS_PER_TASK : 1;
    parallel_tasks((panels + panels_per_task - 1) / panels_per_task, [&](int64_t task) {
      for (int64_t p = task * panels_per_task; p < std::min(panels, (task + 1) * panels_per_task); p++) {
        switch (type) {
          case Q4_0: panel_int<Q4_0>(wp, panel_bytes, p, N, xq, yp, tile_rows); break;
          case Q4_1: panel_int<Q4_1>(wp, panel_bytes, p, N, xq, yp, tile_rows); break;
          default: panel_int<Q8_0>(wp, panel_bytes, p, N, xq, yp, tile_rows); break;
        }
      }
    });
  }
  return in_dtype_of(y, x_in);
}
}  // namespace
#endif

// The integer matmul with int16 activations (see "integer dot products").
at::Tensor qlinear_int16(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t K, int64_t N, int64_t path) {
  TORCH_CHECK(HAS_INT16_DOT, "the integer matmul needs AVX2 and FMA");
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(path != INT16_AMX || amx_tiles_usable(), "the AMX tiles need an AMX-BF16 CPU, a kernel build for it "
              "and the OS's permission (this process has ", SS_AMX_TILES ? "no permission" : "no such build", ")");
#if SS_AMX_TILES
  const bool prompt_sized = path == INT16_AUTO && x.dim() == 2 && x.size(0) >= AMX_MIN_ROWS;
  if (path == INT16_AMX || (prompt_sized && amx_tiles_allowed.load(std::memory_order_relaxed) && amx_tiles_usable()))
    return integer_matmul<QuantizedRowsAmx>(x, w, type, K, N, path);
#endif
  return integer_matmul<QuantizedRows>(x, w, type, K, N, path);
#else
  return {};
#endif
}

// The integer matmul with int8 activations (see "int8 dot products"): `--matmul int8`.
at::Tensor qlinear_int8(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t K, int64_t N, int64_t path) {
  TORCH_CHECK(HAS_INT8_DOT, "the int8 matmul needs AVX512-VNNI (this kernel build was compiled without it)");
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return integer_matmul<QuantizedRows8>(x, w, type, K, N, path);
#else
  return {};
#endif
}

#if SS_BF16_DOT
namespace {
// A weight's bf16 panels for N rows, as bf16_panels (weight_format.py) lays them out.
void check_bf16_panels(const at::Tensor& wb, int64_t N, const char* name) {
  TORCH_CHECK(wb.scalar_type() == at::kBFloat16 && wb.dim() == 4 && wb.is_contiguous() && wb.size(0) % 2 == 0 &&
                  wb.size(2) == PANEL_ROWS && wb.size(3) == 32 && wb.size(0) * PANEL_ROWS >= N,
              name, " must be a contiguous bfloat16 [even panels, K / 32, 16, 32] tensor (bf16_panels) of ", N, " rows");
}
}  // namespace
#endif

namespace {
// The bf16 matmuls refuse to run, by name, where neither kernel can.
void require_bf16_dot() {
  TORCH_CHECK(SS_BF16_DOT, "the bf16 matmul needs AVX512-BF16 (Zen 4, or a Xeon with AMX) and a kernel build for it "
              "(this build has none)");
}

#if SS_BF16_DOT
// gate_up's and down's panels for a SwiGLU FFN of N outputs; returns I (down's K).
int64_t check_swiglu_panels(const at::Tensor& gate_up_wb, const at::Tensor& down_wb, int64_t N) {
  check_bf16_panels(gate_up_wb, gate_up_wb.size(0) * PANEL_ROWS, "gate_up_wb");
  check_bf16_panels(down_wb, N, "down_wb");
  const int64_t I = down_wb.size(1) * 32;
  TORCH_CHECK(gate_up_wb.size(0) * PANEL_ROWS == 2 * I, "gate_up_wb must hold 2 × ", I, " rows (gate, then up) for a ",
              "down_wb of K = ", I, " (a multiple of 32)");
  return I;
}

// y [M, N] in x's dtype from `multiply(x's A tiles, M, y as float32)`, x [M, K] float32 or bfloat16.
template <class Multiply>
at::Tensor on_bf16_row_tiles(const at::Tensor& x_in, int64_t K, int64_t N, const Multiply& multiply) {
  const at::Tensor x = float_rows(x_in, K);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) multiply(bf16_row_tiles(x.data_ptr<float>(), M, K), M, y.data_ptr<float>());
  return in_dtype_of(y, x_in);
}
#endif
}  // namespace

// The bf16 matmul (see "bf16 matmul"): `--matmul bf16`, on the AMX tiles or in VDPBF16PS registers.
// wb: the weight's bf16 panels [panels (even), K / 32, 16, 32] (bf16_panels), of N rows.
at::Tensor qlinear_bf16(const at::Tensor& x_in, const at::Tensor& wb, int64_t N) {
  require_bf16_dot();
#if SS_BF16_DOT
  check_bf16_panels(wb, N, "wb");
  const int64_t K = wb.size(1) * 32;
  return on_bf16_row_tiles(x_in, K, N, [&](const uint16_t* a, int64_t M, float* y) {
    bf16_matmul(a, reinterpret_cast<const uint16_t*>(wb.data_ptr<at::BFloat16>()), M, K, N, wb.size(0), y);
  });
#else
  return {};
#endif
}

// A SwiGLU FFN with both matmuls bf16: down(silu(gate) · up) for x [M, K], gate_up's bf16 panels
// (2I rows: gate, then up) and down's (N rows, K = I): the bits of
// qlinear_bf16(silu_mul(qlinear_bf16(x, gate_up)), down), in one call (bf16_swiglu).
at::Tensor qlinear_bf16_swiglu(const at::Tensor& x_in, const at::Tensor& gate_up_wb, const at::Tensor& down_wb, int64_t N) {
  require_bf16_dot();
#if SS_BF16_DOT
  const int64_t I = check_swiglu_panels(gate_up_wb, down_wb, N), K = gate_up_wb.size(1) * 32;
  return on_bf16_row_tiles(x_in, K, N, [&](const uint16_t* a, int64_t M, float* y) {
    const uint16_t* h = bf16_swiglu(a, reinterpret_cast<const uint16_t*>(gate_up_wb.data_ptr<at::BFloat16>()), M, K, I);
    bf16_matmul(h, reinterpret_cast<const uint16_t*>(down_wb.data_ptr<at::BFloat16>()), M, I, N, down_wb.size(0), y);
  });
#else
  return {};
#endif
}

bool has_int16_dot() { return HAS_INT16_DOT; }
bool has_int8_dot() { return HAS_INT8_DOT; }
bool has_amx_tiles() { return amx_tiles_usable(); }
bool allow_amx_tiles(bool allowed) { return amx_tiles_allowed.exchange(allowed); }

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

#if defined(__AVX512F__)
namespace {
// MACs per second of `dot` (macs_per_dot each) on the calling thread: ten independent chains,
// `iterations` rounds. Named registers (an array here is kept on the stack, and the loop measures
// store forwarding), each chain its own start (GCC merges identical chains), pinned by asm.
template <class Start, class Dot>
double ten_chains_macs(int64_t iterations, double macs_per_dot, const Start& start, const Dot& dot) {
  using clock = std::chrono::steady_clock;
  auto a0 = start(0), a1 = start(1), a2 = start(2), a3 = start(3), a4 = start(4), a5 = start(5), a6 = start(6),
       a7 = start(7), a8 = start(8), a9 = start(9);
  asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9));
  auto t0 = clock::now();
  for (int64_t n = 0; n < iterations; n++) {
    a0 = dot(a0), a1 = dot(a1), a2 = dot(a2), a3 = dot(a3), a4 = dot(a4), a5 = dot(a5), a6 = dot(a6), a7 = dot(a7);
    a8 = dot(a8), a9 = dot(a9);
    asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9));
  }
  auto t1 = clock::now();
  return 10.0 * iterations * macs_per_dot / std::chrono::duration<double>(t1 - t0).count();
}
}  // namespace
#endif

// measure_peak_macs for the int8 matmul's instruction: 512-bit vpdpbusd (64 MACs each); 0 where
// the build has no int8 matmul.
double measure_int8_peak_macs(int64_t iterations) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  __m512i w = _mm512_set1_epi8(1), x = _mm512_set1_epi8(-1);
  asm volatile("" : "+v"(w), "+v"(x));
  return ten_chains_macs(
      iterations, 64, [](int i) { return _mm512_set1_epi32(i); },
      [&](__m512i a) SS_INLINE_LAMBDA { return _mm512_dpbusd_epi32(a, w, x); });
#else
  (void)iterations;
  return 0.0;
#endif
}

// measure_peak_macs for the bf16 matmul's vector instruction: 512-bit VDPBF16PS (32 MACs each); 0
// without AVX512-BF16.
double measure_bf16_dot_peak_macs(int64_t iterations) {
#if SS_BF16_DOT
  __m512bh w = (__m512bh)_mm512_set1_epi16(0x3f80), x = (__m512bh)_mm512_set1_epi16(int16_t(0xbf80));
  asm volatile("" : "+v"(w), "+v"(x));
  return ten_chains_macs(
      iterations, 32, [](int i) { return _mm512_set1_ps(float(i)); },
      [&](__m512 a) SS_INLINE_LAMBDA { return _mm512_dpbf16_ps(a, w, x); });
#else
  (void)iterations;
  return 0.0;
#endif
}

// The tile unit's peak on the calling thread: TDPBF16PS (16 × 16 × 32 bf16 MACs into float32)
// into four independent sum tiles, `iterations` rounds of four; 0 without the AMX tiles. The int16
// matmul's tiles issue two per block (one per digit), so at most half of this is its MACs.
double measure_amx_peak_macs(int64_t iterations) {
#if SS_AMX_TILES
  if (!amx_tiles_usable()) return 0.0;
  using clock = std::chrono::steady_clock;
  configure_tiles();
  alignas(64) static const uint16_t ones[AMX_ROWS * 32] = {};
  _tile_loadd(0, ones, 64);
  _tile_loadd(1, ones, 64);
  _tile_loadd(2, ones, 64);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  auto t0 = clock::now();
  for (int64_t n = 0; n < iterations; n++) {
    _tile_dpbf16ps(3, 0, 2);
    _tile_dpbf16ps(4, 1, 2);
    _tile_dpbf16ps(5, 0, 2);
    _tile_dpbf16ps(6, 1, 2);
  }
  auto t1 = clock::now();
  return 4.0 * iterations * AMX_ROWS * PANEL_ROWS * 32 / std::chrono::duration<double>(t1 - t0).count();
#else
  return 0.0;
#endif
}

// Rows `ids` of W dequantized: [len(ids), K] float32 (an embedding lookup). `N` > 0: W is
// in panels (repack_panels) and holds N rows.
at::Tensor dequant_rows(const at::Tensor& w, int64_t type, int64_t K, const at::Tensor& ids_in, int64_t rows_in_panels) {
  const bool in_panels = rows_in_panels > 0;
  const TypeInfo info = type_info(type);
  const int64_t row_bytes = K / info.block_elems * info.block_bytes;
  const int64_t N = in_panels ? rows_in_panels : w.size(0);
  if (in_panels) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == (N + PANEL_ROWS - 1) / PANEL_ROWS && w.size(1) == PANEL_ROWS * row_bytes, "not a [", N, ", ", K, "] weight in panels");
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
    std::vector<uint8_t> row(in_panels ? row_bytes : 0);
    for (int64_t i = begin; i < end; i++) {
      if (!in_panels) {
        dequant_row(type, wp + idp[i] * row_bytes, K, op + i * K);
        continue;
      }
      panel_row(wp, panel_layout(type), row_bytes, K / 32, idp[i], row.data());
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
  m.def("qlinear_bf16", &qlinear_bf16,
        "y = bf16(x) · bf16(W)ᵀ, float32 sums, on the AMX tiles or with VDPBF16PS (wb: bf16_panels)",
        py::arg("x"), py::arg("wb"), py::arg("N"));
  m.def("qlinear_bf16_swiglu", &qlinear_bf16_swiglu,
        "down(silu(gate) · up) with both matmuls bf16: qlinear_bf16's bits, gate_up's output never stored",
        py::arg("x"), py::arg("gate_up_wb"), py::arg("down_wb"), py::arg("N"));
  m.def("qlinear_int8", &qlinear_int8,
        "y = x · Wᵀ in integers: x quantized to unsigned int8 per 32-value block over its range (Q4_0/Q4_1/Q8_0 "
        "weights in panels; batch-invariant; AVX512-VNNI)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("k"), py::arg("n"), py::arg("path") = 0);
  m.def("repack_panels", &repack_panels, "a Q4_0/Q4_1/Q8_0 weight's rows repacked in 16-row panels for the integer matmul",
        py::arg("w"), py::arg("type"), py::arg("k"));
  m.def("measure_peak_macs", &measure_peak_macs,
        "this thread's measured peak MACs/s: (int16 pairs as the integer matmul issues them, float32 FMA)",
        py::arg("iterations") = 20000000);
  m.def("measure_int8_peak_macs", &measure_int8_peak_macs,
        "this thread's measured peak MACs/s of the int8 matmul's vpdpbusd (0 without AVX512-VNNI)",
        py::arg("iterations") = 20000000);
  m.def("measure_bf16_dot_peak_macs", &measure_bf16_dot_peak_macs,
        "this thread's measured peak MACs/s of the bf16 matmul's VDPBF16PS (0 without AVX512-BF16)",
        py::arg("iterations") = 20000000);
  m.def("has_int16_dot", &has_int16_dot, "whether this build has the integer matmul (AVX2 + FMA)");
  m.def("has_int8_dot", &has_int8_dot, "whether this build has the int8 matmul (AVX512-VNNI)");
  m.def("measure_amx_peak_macs", &measure_amx_peak_macs,
        "this thread's measured peak MACs/s of the tile unit's TDPBF16PS (0 without the AMX tiles)",
        py::arg("iterations") = 2000000);
  m.def("has_amx_tiles", &has_amx_tiles, "whether the int16 matmul can take AMX tiles here (built in, OS permission)");
  m.def("allow_amx_tiles", &allow_amx_tiles,
        "let the engine's int16 and bf16 matmuls take the AMX tiles (the default) or not, for benchmarks to "
        "compare: the int16 matmul's bits are the same both ways, the bf16 matmul's VDPBF16PS kernel rounds its "
        "own way; returns the previous setting",
        py::arg("allowed"));
  m.def("dequant_rows", &dequant_rows, "rows of a GGUF-typed weight as float32", py::arg("w"), py::arg("type"),
        py::arg("k"), py::arg("ids"), py::arg("rows_in_panels") = 0);
}
