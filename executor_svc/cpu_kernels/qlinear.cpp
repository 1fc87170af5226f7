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
// is always the same instruction sequence — four 16-lane float32 FMA chains over
// K (chain = (k / 16) mod 4), summed (c0 + c1) + (c2 + c3), then a fixed lane
// reduction — whatever M is, whichever tile the row falls in and however the
// rows are split over threads. So a row's bits never depend on its batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
// 16 unsigned bytes → 16 floats.
inline __m512 u8x16_to_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
inline __m512 i8x16_to_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
#endif

// One 32-element block of nibbles (low nibbles are elements 0..15, high 16..31)
// → d * q + m (m = 0 for none), or d * (q - 8) for Q4_0.
inline void dequant_nibbles32(const uint8_t* qs, float d, float m, float offset, bool has_min, float* out) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128((const __m128i*)qs);
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m), voff = _mm512_set1_ps(offset);
  __m512 a = _mm512_sub_ps(u8x16_to_ps(lo), voff), b = _mm512_sub_ps(u8x16_to_ps(hi), voff);
  a = _mm512_mul_ps(vd, a);
  b = _mm512_mul_ps(vd, b);
  if (has_min) {
    a = _mm512_add_ps(a, vm);
    b = _mm512_add_ps(b, vm);
  }
  _mm512_storeu_ps(out, a);
  _mm512_storeu_ps(out + 16, b);
#else
  for (int i = 0; i < 16; i++) {
    float a = d * ((float)(qs[i] & 0x0F) - offset), b = d * ((float)(qs[i] >> 4) - offset);
    out[i] = has_min ? a + m : a;
    out[i + 16] = has_min ? b + m : b;
  }
#endif
}

// 32 codes given as bytes (already combined) → ds * q - dm  (K-quants), one rounding each.
inline void dequant_k32(const uint8_t* q, float ds, float dm, float* out) {
#if defined(__AVX512F__)
  const __m512 vd = _mm512_set1_ps(ds), vm = _mm512_set1_ps(dm);
  for (int h = 0; h < 2; h++) {
    const __m512 v = u8x16_to_ps(_mm_loadu_si128((const __m128i*)(q + 16 * h)));
    _mm512_storeu_ps(out + 16 * h, _mm512_sub_ps(_mm512_mul_ps(vd, v), vm));
  }
#else
  for (int i = 0; i < 32; i++) out[i] = ds * (float)q[i] - dm;
#endif
}

void dequant_q4_k(const uint8_t* blk, float* out) {
  const float d = fp16_to_fp32(load_u16(blk)), dmin = fp16_to_fp32(load_u16(blk + 2));
  const uint8_t* scales = blk + 4;
  const uint8_t* qs = blk + 16;
  alignas(64) uint8_t codes[32];
  for (int s = 0; s < 8; s++) {
    uint8_t sc, m;
    scale_min_k4(scales, s, &sc, &m);
    const uint8_t* src = qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int l = 0; l < 32; l++) codes[l] = (src[l] >> shift) & 0x0F;
    dequant_k32(codes, d * (float)sc, dmin * (float)m, out + 32 * s);
  }
}

void dequant_q5_k(const uint8_t* blk, float* out) {
  const float d = fp16_to_fp32(load_u16(blk)), dmin = fp16_to_fp32(load_u16(blk + 2));
  const uint8_t* scales = blk + 4;
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + 48;
  alignas(64) uint8_t codes[32];
  for (int s = 0; s < 8; s++) {
    uint8_t sc, m;
    scale_min_k4(scales, s, &sc, &m);
    const uint8_t* src = qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int l = 0; l < 32; l++) codes[l] = ((src[l] >> shift) & 0x0F) | (((qh[l] >> s) & 1) << 4);
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
#if defined(__AVX512F__)
      _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_set1_ps(ds0), _mm512_cvtepi32_ps(_mm512_loadu_si512(codes))));
      _mm512_storeu_ps(dst + 16, _mm512_mul_ps(_mm512_set1_ps(ds1), _mm512_cvtepi32_ps(_mm512_loadu_si512(codes + 16))));
#else
      for (int l = 0; l < 16; l++) dst[l] = ds0 * (float)codes[l];
      for (int l = 16; l < 32; l++) dst[l] = ds1 * (float)codes[l];
#endif
    }
  }
}

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
        float* dst = out + 32 * b;
#if defined(__AVX512F__)
        const __m512 vd = _mm512_set1_ps(d);
        _mm512_storeu_ps(dst, _mm512_mul_ps(vd, i8x16_to_ps(_mm_loadu_si128((const __m128i*)(blk + 2)))));
        _mm512_storeu_ps(dst + 16, _mm512_mul_ps(vd, i8x16_to_ps(_mm_loadu_si128((const __m128i*)(blk + 18)))));
#else
        for (int i = 0; i < 32; i++) dst[i] = d * (float)(int8_t)blk[2 + i];
#endif
      }
      return;
    case Q4_K:
      for (int64_t b = 0; b < K / QK_K; b++) dequant_q4_k(row + 144 * b, out + QK_K * b);
      return;
    case Q5_K:
      for (int64_t b = 0; b < K / QK_K; b++) dequant_q5_k(row + 176 * b, out + QK_K * b);
      return;
    case Q6_K:
      for (int64_t b = 0; b < K / QK_K; b++) dequant_q6_k(row + 210 * b, out + QK_K * b);
      return;
    default:
      TORCH_CHECK(false, "GGML tensor type ", type, " has no CPU dequantize kernel");
  }
}

// ------------------------------------------------------------------ dot products
//
// NR activation rows against one dequantized weight row. Every (row, weight row)
// pair runs the identical chain structure, so tiling rows by 4 or 1 changes nothing.

#if defined(__AVX512F__)
template <int NR>
inline void dot_rows(const float* w, const float* const* x, int64_t K, float* out) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
    const __m512 w2 = _mm512_loadu_ps(w + k + 32), w3 = _mm512_loadu_ps(w + k + 48);
    for (int r = 0; r < NR; r++) {
      acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[r] + k), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[r] + k + 16), acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x[r] + k + 32), acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(x[r] + k + 48), acc[r][3]);
    }
  }
  for (int c = 0; k < K; k += 16, c++) {  // the tail: chain (k / 16) mod 4, masked
    const int64_t n = K - k < 16 ? K - k : 16;
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    const __m512 wv = _mm512_maskz_loadu_ps(mask, w + k);
    for (int r = 0; r < NR; r++) acc[r][c] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x[r] + k), acc[r][c]);
  }
  for (int r = 0; r < NR; r++)
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}
#else
template <int NR>
inline void dot_rows(const float* w, const float* const* x, int64_t K, float* out) {
  for (int r = 0; r < NR; r++) {
    float lanes[64] = {0};
    for (int64_t k = 0; k < K; k++) lanes[k % 64] += w[k] * x[r][k];
    float chains[4][16];
    for (int c = 0; c < 4; c++)
      for (int l = 0; l < 16; l++) chains[c][l] = lanes[16 * c + l];
    float sum[16];
    for (int l = 0; l < 16; l++) sum[l] = (chains[0][l] + chains[1][l]) + (chains[2][l] + chains[3][l]);
    for (int width = 8; width >= 1; width /= 2)
      for (int l = 0; l < width; l++) sum[l] = sum[l] + sum[l + width];
    out[r] = sum[0];
  }
}
#endif

constexpr int64_t ROWS_PER_TASK = 16;  // weight rows dequantized together (K ≤ 16k → ≤ 1 MiB of floats)

void check_weight(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous uint8 [N, row_bytes] tensor");
  const TypeInfo info = type_info(type);
  TORCH_CHECK(K % info.block_elems == 0, "K=", K, " is not a multiple of the type's block of ", info.block_elems);
  TORCH_CHECK(w.size(1) == K / info.block_elems * info.block_bytes, "weight rows have ", w.size(1), " bytes, expected ",
              K / info.block_elems * info.block_bytes, " for K=", K);
}

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
  const int64_t num_tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(ROWS_PER_TASK * K);
    for (int64_t task = begin; task < end; task++) {
      const int64_t n0 = task * ROWS_PER_TASK, n1 = std::min(N, n0 + ROWS_PER_TASK);
      for (int64_t n = n0; n < n1; n++) dequant_row(type, wp + n * row_bytes, K, wbuf.data() + (n - n0) * K);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        const float* xs[4] = {xp + m * K, xp + (m + 1) * K, xp + (m + 2) * K, xp + (m + 3) * K};
        for (int64_t n = n0; n < n1; n++) {
          float out[4];
          dot_rows<4>(wbuf.data() + (n - n0) * K, xs, K, out);
          for (int r = 0; r < 4; r++) yp[(m + r) * N + n] = out[r];
        }
      }
      for (; m < M; m++) {
        const float* xs[1] = {xp + m * K};
        for (int64_t n = n0; n < n1; n++) dot_rows<1>(wbuf.data() + (n - n0) * K, xs, K, yp + m * N + n);
      }
    }
  });
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// Rows `ids` of W dequantized: [len(ids), K] float32 (an embedding lookup).
at::Tensor dequant_rows(const at::Tensor& w, int64_t type, int64_t K, const at::Tensor& ids_in) {
  check_weight(w, type, K);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), N = w.size(0), row_bytes = w.size(1);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++) TORCH_CHECK(idp[i] >= 0 && idp[i] < N, "row id ", idp[i], " outside [0, ", N, ")");
  at::Tensor out = at::empty({n, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) dequant_row(type, wp + idp[i] * row_bytes, K, op + i * K);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "y = x · dequant(W)ᵀ for a GGUF-typed weight (float32 accumulation, batch-invariant)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("k"));
  m.def("dequant_rows", &dequant_rows, "rows of a GGUF-typed weight as float32", py::arg("w"), py::arg("type"),
        py::arg("k"), py::arg("ids"));
}
