// A 16-lane float32 vector, the unit every CPU kernel here computes in.
//
// The kernels define their arithmetic in 16-lane chains (FMA lane by lane, then a
// fixed lane reduction), so one source gives the same instruction sequence per
// lane on every x86 build:
//   - AVX-512: one zmm register;
//   - AVX2 + FMA: two ymm registers (lanes 0..7, 8..15) — the same lane math, and
//     `reduce_add` sums lanes by the very tree `_mm512_reduce_add_ps` uses
//     (l + 8, then l + 4, l + 2, l + 1), so results are bit-identical to AVX-512;
//   - anything else: SS_SIMD16 is 0 and the kernels take their scalar paths.
// Compiled with -ffp-contract=off: a multiply-add is fused only where `fmadd` says so.

#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define SS_SIMD16 1
#else
#define SS_SIMD16 0
#endif

#define SS_INLINE inline __attribute__((always_inline))
#define SS_INLINE_LAMBDA __attribute__((always_inline))  // after a lambda's parameters

// run(std::integral_constant<int, R>{}) for R = rows (1 .. MAX): a register tile's row count fixed at
// compile time, so that its accumulators stay in registers, for a kernel's last, shorter tile.
template <int MAX, class Run>
SS_INLINE void with_tile_rows(int64_t rows, const Run& run) {
  if constexpr (MAX > 1) {
    if (rows < MAX) return with_tile_rows<MAX - 1>(rows, run);
  }
  run(std::integral_constant<int, MAX>{});
}

#if SS_SIMD16
namespace simd16 {

#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
struct V16 {
  __m512 v;
};
SS_INLINE V16 zero() { return {_mm512_setzero_ps()}; }
SS_INLINE V16 set1(float x) { return {_mm512_set1_ps(x)}; }
SS_INLINE V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
SS_INLINE void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
SS_INLINE V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
SS_INLINE V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
SS_INLINE V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
SS_INLINE V16 div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
SS_INLINE V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
SS_INLINE V16 min(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
SS_INLINE V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a·b + c
SS_INLINE V16 fnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c − a·b
SS_INLINE float reduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
SS_INLINE float reduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
// 16 unsigned / signed bytes → 16 floats.
SS_INLINE V16 u8x16(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
SS_INLINE V16 i8x16(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))}; }
// 16 bfloat16 (raw bits) → 16 floats, exactly.
SS_INLINE V16 bf16x16(const void* p) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
// 16 IEEE half values at p → float32 (exact).
SS_INLINE V16 f16x16(const void* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
SS_INLINE V16 round_nearest(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a · 2^n for integral n (exp's last step).
SS_INLINE V16 scale_pow2(V16 a, V16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }
// Lanes l < n of a, 0 elsewhere.
SS_INLINE V16 keep_first(V16 a, int64_t n) {
  const __mmask16 m = (__mmask16)(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
  return {_mm512_maskz_mov_ps(m, a.v)};
}
SS_INLINE V16 first_or(V16 a, int64_t n, float fill) {  // lanes < n from a, the rest `fill`
  const __mmask16 m = (__mmask16)(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
  return {_mm512_mask_blend_ps(m, _mm512_set1_ps(fill), a.v)};
}
// The first n (0..16) floats at p, zeros after: a tail load that never reads past p + n (masked
// lanes do not fault). A masked load, not a copy through the stack: the copy's small stores
// stalled the 64-byte load that read them back (store forwarding), ~80 cycles a vector in silu_mul.
SS_INLINE V16 load_first(const float* p, int64_t n) {
  const __mmask16 m = (__mmask16)(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
  return {_mm512_maskz_loadu_ps(m, p)};
}
#else
constexpr bool kAvx512 = false;
struct V16 {
  __m256 a, b;  // lanes 0..7, 8..15
};
SS_INLINE V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
SS_INLINE V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
SS_INLINE V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
SS_INLINE void store(float* p, V16 x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
SS_INLINE V16 add(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
SS_INLINE V16 sub(V16 x, V16 y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
SS_INLINE V16 mul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
SS_INLINE V16 div(V16 x, V16 y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
SS_INLINE V16 max(V16 x, V16 y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
SS_INLINE V16 min(V16 x, V16 y) { return {_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)}; }
SS_INLINE V16 fmadd(V16 x, V16 y, V16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
SS_INLINE V16 fnmadd(V16 x, V16 y, V16 z) { return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)}; }
// _mm512_reduce_add_ps's tree: (l, l+8), then (l, l+4), (l, l+2), (l, l+1).
SS_INLINE float reduce_add(V16 x) {
  const __m256 s8 = _mm256_add_ps(x.a, x.b);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
SS_INLINE float reduce_max(V16 x) {  // max is exact: any order gives the same value
  const __m256 s8 = _mm256_max_ps(x.a, x.b);
  const __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_max_ss(s2, _mm_movehdup_ps(s2)));
}
SS_INLINE V16 u8x16(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
SS_INLINE V16 i8x16(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
SS_INLINE V16 bf16x16(const void* p) {
  const __m128i lo = _mm_loadu_si128((const __m128i*)p), hi = _mm_loadu_si128((const __m128i*)p + 1);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
}
// 16 IEEE half values at p → float32 (exact; F16C).
SS_INLINE V16 f16x16(const void* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p + 1))};
}
SS_INLINE V16 round_nearest(V16 x) {
  return {_mm256_round_ps(x.a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(x.b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// a · 2^n for integral n with a in [0.5, 4) and n in [-127, 128] (exp's range): build 2^n
// in two halves so n = 128 and n = −127 stay exact, as scalef does.
SS_INLINE __m256 scale_pow2_8(__m256 a, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h1 = _mm256_srai_epi32(ni, 1), h2 = _mm256_sub_epi32(ni, h1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
}
SS_INLINE V16 scale_pow2(V16 x, V16 n) { return {scale_pow2_8(x.a, n.a), scale_pow2_8(x.b, n.b)}; }
SS_INLINE V16 keep_first(V16 x, int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lim = _mm256_set1_epi32((int)(n < 0 ? 0 : n > 16 ? 16 : n));
  const __m256 ma = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, idx));
  const __m256 mb = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, _mm256_add_epi32(idx, _mm256_set1_epi32(8))));
  return {_mm256_and_ps(x.a, ma), _mm256_and_ps(x.b, mb)};
}
SS_INLINE V16 first_or(V16 x, int64_t n, float fill) {  // lanes < n from x, the rest `fill`
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lim = _mm256_set1_epi32((int)(n < 0 ? 0 : n > 16 ? 16 : n));
  const __m256 ma = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, idx));
  const __m256 mb = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, _mm256_add_epi32(idx, _mm256_set1_epi32(8))));
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, x.a, ma), _mm256_blendv_ps(f, x.b, mb)};
}
// The first n (0..16) floats at p, zeros after, by masked loads (vmaskmovps: masked lanes neither
// read nor fault), as the AVX-512 one.
SS_INLINE V16 load_first(const float* p, int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lim = _mm256_set1_epi32((int)(n < 0 ? 0 : n > 16 ? 16 : n));
  const __m256i ma = _mm256_cmpgt_epi32(lim, idx);
  const __m256i mb = _mm256_cmpgt_epi32(lim, _mm256_add_epi32(idx, _mm256_set1_epi32(8)));
  return {_mm256_maskload_ps(p, ma), _mm256_maskload_ps(p + 8, mb)};
}
#endif

// exp(x) for float32 lanes: Cephes' expf (range reduction by ln 2 in two parts, a
// degree-5 polynomial, scale by 2^n). ~1 ulp; exp(x) for x < -87.3 is not 0 but
// < 1.2e-38 (callers that need exact zeros mask them).
SS_INLINE V16 exp(V16 x) {
  x = min(max(x, set1(-87.3f)), set1(88.3f));
  const V16 n = round_nearest(mul(x, set1(1.44269504088896341f)));
  V16 r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  V16 y = set1(1.9875691500E-4f);
  y = fmadd(y, r, set1(1.3981999507E-3f));
  y = fmadd(y, r, set1(8.3334519073E-3f));
  y = fmadd(y, r, set1(4.1665795894E-2f));
  y = fmadd(y, r, set1(1.6666665459E-1f));
  y = fmadd(y, r, set1(5.0000001201E-1f));
  y = fmadd(y, mul(r, r), add(r, set1(1.0f)));
  return scale_pow2(y, n);
}

// silu(g) = g / (1 + exp(−g)): SwiGLU's gate, the one formula of silu_mul and the fused bf16 FFN.
SS_INLINE V16 silu(V16 g) { return div(g, add(set1(1.0f), exp(sub(zero(), g)))); }

}  // namespace simd16
#endif
