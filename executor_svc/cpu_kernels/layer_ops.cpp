// Everything in a decoder layer except the matmuls, for the CPU: ragged paged
// attention, RMSNorm (with the residual add fused), the qkv post-processing
// (q/k RMSNorm, RoPE, KV-cache write) and SiLU·mul — one call each, float32 math
// (but attention's bfloat16 dot products, below), tensors in float32 or bfloat16.
//
// Batch invariance by construction: every output row is computed by the same
// instruction sequence whatever the batch, the tiling and the thread count.
//
// - Attention: a query row walks its request's keys from key 0 in fixed
//   KV_CHUNK-key chunks (an online softmax: running max, rescale, sum in key
//   order within a chunk). A row stops at its own position; the chunk boundaries
//   never move. A score is one fused multiply-add chain over d per key, each key
//   in a vector lane of its own (no reductions across lanes), so rows share each
//   key load: K is stored d-major per cache block (CacheLayout; a token-major cache
//   is gathered into the same order, the same bits). Work items (request, KV head,
//   query tile, head range) and row blocks only decide which rows are computed
//   together, never how a row is computed. Over a bfloat16 cache, q and the
//   probabilities are rounded to bfloat16 and the products run in hardware: on the
//   AMX tiles where the CPU has them (16 rows a tile, 32-key blocks from key 0;
//   see "attention on the AMX tiles"), else as vdpbf16ps with AVX512_BF16 (see
//   attention's bfloat16 section).
// - Row ops (norms, RoPE, SiLU): each row is reduced by one fixed sequence
//   (16-lane float32 chains, then a fixed lane reduction).
//
// Compiled with -ffp-contract=off: a multiply-add is fused only where an
// intrinsic says so, identically everywhere.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "simd16.h"

namespace {

using bf16 = c10::BFloat16;
using f16 = c10::Half;  // a KV cache element only (--kv-cache-dtype float16); activations are float32 or bfloat16
constexpr int64_t KV_CHUNK = 64;          // keys per online-softmax step (fixed: part of the arithmetic)
constexpr int64_t QUERY_TILE_TOKENS = 16;  // tokens of one request per work item (does not affect results)
constexpr int64_t PARALLEL_MIN_ROW_KEYS = 512;  // below this many (q row, key) pairs (~10 µs), one thread (no effect on results)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------ scalar helpers

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }
inline float to_f(f16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }  // bf16, f16: round to nearest even
// The value x takes once stored in T (torch computes a bf16 op in float32 and rounds).
template <typename T>
inline float rnd(float x) { return to_f(from_f<T>(x)); }
template <>
inline float rnd<float>(float x) { return x; }

// ------------------------------------------------------------------ vector helpers

#if SS_SIMD16
using simd16::V16;
SS_INLINE V16 load16(const float* p) { return simd16::load(p); }
SS_INLINE V16 load16(const bf16* p) { return simd16::bf16x16(p); }
SS_INLINE V16 load16(const f16* p) { return simd16::f16x16(p); }
// The first n (0..16) values at p, zeros after.
SS_INLINE V16 load16_first(const float* p, int64_t n) { return simd16::load_first(p, n); }
SS_INLINE V16 load16_first(const bf16* p, int64_t n) {
  alignas(32) bf16 tmp[16];
  std::memset(tmp, 0, sizeof(tmp));
  std::memcpy(tmp, p, std::max<int64_t>(0, std::min<int64_t>(16, n)) * sizeof(bf16));
  return simd16::bf16x16(tmp);
}

#endif

// Σ x[i]² in a fixed order: 16-lane chain, masked tail, fixed lane reduction.
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
#if SS_SIMD16
  V16 acc = simd16::zero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const V16 v = load16(x + i);
    acc = simd16::fmadd(v, v, acc);
  }
  if (i < n) {
    const V16 v = load16_first(x + i, n - i);
    acc = simd16::fmadd(v, v, acc);
  }
  return simd16::reduce_add(acc);
#else
  float lanes[16] = {0};
  for (int64_t i = 0; i < n; i++) {
    const float v = to_f(x[i]);
    lanes[i % 16] += v * v;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; l++) lanes[l] += lanes[l + w];
  return lanes[0];
#endif
}

template <typename F>
void dispatch_float(at::ScalarType type, const char* name, F&& f) {
  if (type == at::kFloat) {
    f(float{});
  } else if (type == at::kBFloat16) {
    f(bf16{});
  } else {
    TORCH_CHECK(false, name, ": unsupported dtype ", type);
  }
}

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// The KV cache's element type: the activations' dtype, or float16 (--kv-cache-dtype), whatever
// the activations are; f gets a value of that type.
template <typename F>
void dispatch_kv(at::ScalarType type, F&& f) {
  if (type == at::kFloat) {
    f(float{});
  } else if (type == at::kBFloat16) {
    f(bf16{});
  } else if (type == at::kHalf) {
    f(f16{});
  } else {
    TORCH_CHECK(false, "the KV cache must be float32, bfloat16 or float16, not ", type);
  }
}

void check_kv_type(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "the KV caches must be on the CPU");
  dispatch_kv(k_cache.scalar_type(), [](auto) {});
}

// ------------------------------------------------------------------ attention

struct WorkItem {
  int64_t request, kv_head, token_begin, token_end, head_begin, head_end;  // heads within the GQA group
  int64_t cost;
};

// Where element (block, slot in block, kv head, d) of a K or V cache [num_blocks, block_size, Hkv, D]
// lives, by its strides (k_layout and v_layout say which layouts each takes). KVCache picks the
// layouts for the C++ kernels; no result depends on them.
struct CacheLayout {
  int64_t block, slot, head, d, block_size;
  // Element d = 0 of head kv_head at flat slot `flat_slot` (block id · block_size + slot in block).
  int64_t at_slot(int64_t flat_slot, int64_t kv_head) const {
    return (flat_slot / block_size) * block + (flat_slot % block_size) * slot + kv_head * head;
  }
  // The same for a request's token `position`, through its block table.
  int64_t offset(int64_t position, const int32_t* table, int64_t kv_head) const {
    return at_slot(table[position / block_size] * block_size + position % block_size, kv_head);
  }
};

// K: row-major (contiguous: a token's head is D consecutive values, vLLM's flash layout) or d-major
// (each block is [Hkv, D, block_size], the tensor permuted to the common shape: one d of 16
// consecutive keys is one vector load, which is how attention scores keys).
CacheLayout k_layout(const at::Tensor& k_cache) {
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), D = k_cache.size(3);
  if (k_cache.is_contiguous()) return {bs * Hkv * D, Hkv * D, D, 1, bs};
  const std::vector<int64_t> d_major = {bs * Hkv * D, 1, D * bs, bs};
  TORCH_CHECK(k_cache.strides().vec() == d_major,
              "k_cache must be contiguous [num_blocks, block_size, Hkv, D], or d-major: a contiguous [num_blocks, "
              "Hkv, D, block_size] permuted to that shape");
  return {bs * Hkv * D, 1, D * bs, bs, bs};
}

// V: token-major (contiguous, as K's row-major) or head-major (each block is [Hkv, block_size, D],
// the tensor permuted to the common shape: one head's values of a block's keys are one run, which
// is how attention reads them, a head at a time; token-major puts the other heads' rows between).
CacheLayout v_layout(const at::Tensor& v_cache) {
  const int64_t bs = v_cache.size(1), Hkv = v_cache.size(2), D = v_cache.size(3);
  if (v_cache.is_contiguous()) return {bs * Hkv * D, Hkv * D, D, 1, bs};
  const std::vector<int64_t> head_major = {bs * Hkv * D, D, bs * D, 1};
  TORCH_CHECK(v_cache.strides().vec() == head_major,
              "v_cache must be contiguous [num_blocks, block_size, Hkv, D], or head-major: a contiguous [num_blocks, "
              "Hkv, block_size, D] permuted to that shape");
  return {bs * Hkv * D, D, bs * D, 1, bs};
}

// Every score, probability and output row is computed by one fixed sequence whatever the item,
// so a row's bits depend on its request's keys only:
//   score(q, k_j) = (fma over d = 0, 1, …, D-1 of q[d]·k_j[d], from 0) · scale, each key j in a
//   vector lane of its own (no lane reduction);
//   per KV_CHUNK keys from key 0: the chunk's max, exp, the sum of the chunk's exps (a fixed tree
//   over lanes), acc ← acc·alpha, then acc ← fma(p_j, v_j, acc) key by key.
// Rows of an item share each load of a key (blocks of SCORE_ROWS / PV_ROWS rows); which rows are
// blocked together changes only the speed.
constexpr int64_t KEY_GROUP = 16;  // keys scored together, one per lane
constexpr int64_t GROUPS = KV_CHUNK / KEY_GROUP;
static_assert(KV_CHUNK % KEY_GROUP == 0, "a chunk is whole key groups");

// Where an item's keys and values are: key k of the request is at its position, but a tree row
// reads keys window_start.. from its window's positions (see paged_attention); past max_keys, zeros.
template <typename C>
struct KeySource {
  const C* k_cache;
  const C* v_cache;
  const int32_t* table;
  CacheLayout kl, vl;
  int64_t kv_head, Hkv, D, max_keys, window_start;
  const int64_t* window_positions;

  int64_t position_of(int64_t key) const {
    return key >= window_start ? window_positions[key - window_start] : key;
  }
  const C* v_row(int64_t key) const { return v_cache + vl.offset(position_of(key), table, kv_head); }
  // rows[j] = v_row(k0 + j) for j < n: a block-table lookup per cache block, not two integer
  // divisions per key (per chunk of every work item: they showed in attention's profile).
  void value_rows(int64_t k0, int64_t n, const C** rows) const {
    int64_t j = 0;
    while (j < n && k0 + j < window_start) {
      const int64_t position = k0 + j, in_block = position % vl.block_size;
      const C* row = v_cache + vl.offset(position, table, kv_head);
      const int64_t run = std::min({n - j, vl.block_size - in_block, window_start - position});
      for (int64_t i = 0; i < run; i++, row += vl.slot) rows[j++] = row;
    }
    for (; j < n; j++) rows[j] = v_row(k0 + j);
  }
  // Key group g of the chunk at c0 (16 keys, d-major: D rows of 16): in place where its 16 keys are
  // one block's consecutive d-major slots, else gathered (the same values) into gathered[g]; past
  // the last key, zeros (`zeros`: D × 16 of them).
  void locate_groups(int64_t c0, const C** kg, int64_t* ks, C* gathered, const C* zeros) const {
    for (int64_t g = 0; g < GROUPS; g++) {
      const int64_t k0 = c0 + g * KEY_GROUP;
      ks[g] = KEY_GROUP;
      if (k0 >= max_keys) {
        kg[g] = zeros;
      } else if (kl.slot == 1 && kl.block_size >= KEY_GROUP && k0 + KEY_GROUP <= window_start) {
        kg[g] = k_cache + kl.offset(k0, table, kv_head);
        ks[g] = kl.d;
      } else {
        C* dst = gathered + g * D * KEY_GROUP;
        for (int64_t j = 0; j < KEY_GROUP; j++) {
          if (k0 + j >= max_keys) {
            for (int64_t d = 0; d < D; d++) dst[d * KEY_GROUP + j] = C(0.f);
            continue;
          }
          const C* src = k_cache + kl.offset(position_of(k0 + j), table, kv_head);
          for (int64_t d = 0; d < D; d++) dst[d * KEY_GROUP + j] = src[d * kl.d];
        }
        kg[g] = dst;
      }
    }
  }
};

template <typename C>
struct Scratch {
  std::vector<float> q, acc, m, l, s, alpha;
  std::vector<int64_t> n;
  std::vector<C> kt, zeros;  // gathered key groups [GROUPS][D][16]; one group of zeros
  std::vector<bf16> q16, p16, zero_row;  // the bfloat16 dot products' q, probabilities and padding row
};

#if SS_SIMD16
#if defined(__AVX512F__)
constexpr int SCORE_ROWS = 4, SCORE_GROUPS = 4, PV_ROWS = 4, PV_VECS = 4;  // 16-21 of 32 registers
#else
constexpr int SCORE_ROWS = 2, SCORE_GROUPS = 2, PV_ROWS = 2, PV_VECS = 2;  // 13 of 16 registers
#endif
static_assert(GROUPS % SCORE_GROUPS == 0, "score passes cover the chunk");

// s[r][16 g + j] = Σ_d q[r][d] · K_g[d][j] for MR rows and the chunk's key groups (group g's d
// row at kg[g] + d · ks[g]); groups at or past `groups` are skipped.
template <int MR, typename C>
SS_INLINE void score_rows(const float* q, int64_t D, const C* const* kg, const int64_t* ks, int64_t groups, float* s) {
  for (int g0 = 0; g0 < groups; g0 += SCORE_GROUPS) {
    V16 acc[MR][SCORE_GROUPS];
    for (int r = 0; r < MR; r++)
      for (int g = 0; g < SCORE_GROUPS; g++) acc[r][g] = simd16::zero();
    const C* kp[SCORE_GROUPS];
    int64_t stride[SCORE_GROUPS];
    for (int g = 0; g < SCORE_GROUPS; g++) {
      kp[g] = kg[g0 + g];
      stride[g] = ks[g0 + g];
    }
    for (int64_t d = 0; d < D; d++) {
      V16 k[SCORE_GROUPS];
      for (int g = 0; g < SCORE_GROUPS; g++) k[g] = load16(kp[g] + d * stride[g]);
      for (int r = 0; r < MR; r++) {
        const V16 qb = simd16::set1(q[r * D + d]);
        for (int g = 0; g < SCORE_GROUPS; g++) acc[r][g] = simd16::fmadd(qb, k[g], acc[r][g]);
      }
    }
    for (int r = 0; r < MR; r++)
      for (int g = 0; g < SCORE_GROUPS; g++) simd16::store(s + r * KV_CHUNK + KEY_GROUP * (g0 + g), acc[r][g]);
  }
}

// Columns [c0, c0 + 16 CW) of MR rows' accumulators: acc ← acc·alpha_r, then acc += p[r][j]·v_j for
// the row's keys j < n[r], in key order.
template <int MR, int CW, typename C>
SS_INLINE void accumulate_rows(float* acc, int64_t D, const float* alpha, const float* p, const int64_t* n,
                               const C* const* v, int64_t c0) {
  V16 a[MR][CW];
  int64_t n_min = n[0], n_max = n[0];
  for (int r = 0; r < MR; r++) {
    const V16 va = simd16::set1(alpha[r]);
    for (int c = 0; c < CW; c++) a[r][c] = simd16::mul(simd16::load(acc + r * D + c0 + 16 * c), va);
    n_min = std::min(n_min, n[r]);
    n_max = std::max(n_max, n[r]);
  }
  for (int64_t j = 0; j < n_min; j++) {
    V16 vv[CW];
    for (int c = 0; c < CW; c++) vv[c] = load16(v[j] + c0 + 16 * c);
    for (int r = 0; r < MR; r++) {
      const V16 pj = simd16::set1(p[r * KV_CHUNK + j]);
      for (int c = 0; c < CW; c++) a[r][c] = simd16::fmadd(pj, vv[c], a[r][c]);
    }
  }
  for (int64_t j = n_min; j < n_max; j++) {  // the causal diagonal: rows end at their own positions
    V16 vv[CW];
    for (int c = 0; c < CW; c++) vv[c] = load16(v[j] + c0 + 16 * c);
    for (int r = 0; r < MR; r++) {
      if (j >= n[r]) continue;
      const V16 pj = simd16::set1(p[r * KV_CHUNK + j]);
      for (int c = 0; c < CW; c++) a[r][c] = simd16::fmadd(pj, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < CW; c++) simd16::store(acc + r * D + c0 + 16 * c, a[r][c]);
}

template <int MR, typename C>
SS_INLINE void accumulate_block(float* acc, int64_t D, const float* alpha, const float* p, const int64_t* n,
                                const C* const* v) {
  int64_t c0 = 0;
  for (; c0 + 16 * PV_VECS <= D; c0 += 16 * PV_VECS) accumulate_rows<MR, PV_VECS>(acc, D, alpha, p, n, v, c0);
  for (; c0 + 16 <= D; c0 += 16) accumulate_rows<MR, 1>(acc, D, alpha, p, n, v, c0);
  for (; c0 < D; c0++)  // a head_dim that is not whole vectors: the same fma per lane, one at a time
    for (int r = 0; r < MR; r++) {
      float x = acc[r * D + c0] * alpha[r];
      for (int64_t j = 0; j < n[r]; j++) x = std::fma(p[r * KV_CHUNK + j], to_f(v[j][c0]), x);
      acc[r * D + c0] = x;
    }
}
#endif

// Scores of rows [0, rows) (q rows D apart) for the chunk's key groups, into s (KV_CHUNK per row).
template <typename C>
void score_chunk(const float* q, int64_t rows, int64_t D, const C* const* kg, const int64_t* ks, int64_t groups,
                 float* s) {
#if SS_SIMD16
  int64_t r = 0;
  for (; r + SCORE_ROWS <= rows; r += SCORE_ROWS) score_rows<SCORE_ROWS>(q + r * D, D, kg, ks, groups, s + r * KV_CHUNK);
  switch (rows - r) {
    case 3: if constexpr (SCORE_ROWS > 3) score_rows<3>(q + r * D, D, kg, ks, groups, s + r * KV_CHUNK); break;
    case 2: if constexpr (SCORE_ROWS > 2) score_rows<2>(q + r * D, D, kg, ks, groups, s + r * KV_CHUNK); break;
    case 1: score_rows<1>(q + r * D, D, kg, ks, groups, s + r * KV_CHUNK); break;
    default: break;
  }
#else
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < groups; g++)
      for (int64_t j = 0; j < KEY_GROUP; j++) {
        float x = 0.f;
        for (int64_t d = 0; d < D; d++) x = std::fma(q[r * D + d], to_f(kg[g][d * ks[g] + j]), x);
        s[r * KV_CHUNK + g * KEY_GROUP + j] = x;
      }
#endif
}

// Rows [0, rows): acc ← acc·alpha + Σ_{j < n} p_j v_j (see accumulate_rows).
template <typename C>
void accumulate_chunk(float* acc, int64_t rows, int64_t D, const float* alpha, const float* p, const int64_t* n,
                      const C* const* v) {
#if SS_SIMD16
  int64_t r = 0;
  for (; r + PV_ROWS <= rows; r += PV_ROWS)
    accumulate_block<PV_ROWS>(acc + r * D, D, alpha + r, p + r * KV_CHUNK, n + r, v);
  switch (rows - r) {
    case 3: if constexpr (PV_ROWS > 3) accumulate_block<3>(acc + r * D, D, alpha + r, p + r * KV_CHUNK, n + r, v); break;
    case 2: if constexpr (PV_ROWS > 2) accumulate_block<2>(acc + r * D, D, alpha + r, p + r * KV_CHUNK, n + r, v); break;
    case 1: accumulate_block<1>(acc + r * D, D, alpha + r, p + r * KV_CHUNK, n + r, v); break;
    default: break;
  }
#else
  for (int64_t r = 0; r < rows; r++)
    for (int64_t d = 0; d < D; d++) {
      float x = acc[r * D + d] * alpha[r];
      for (int64_t j = 0; j < n[r]; j++) x = std::fma(p[r * KV_CHUNK + j], to_f(v[j][d]), x);
      acc[r * D + d] = x;
    }
#endif
}

// One row's chunk: s[0..n) scores → probabilities p = exp(s·scale − m_new) (zeros from n on);
// updates the row's running max m and sum l; returns alpha = exp(m_old − m_new).
inline float softmax_chunk(float* s, int64_t n, float scale, float& m, float& l) {
#if SS_SIMD16
  static_assert(GROUPS == 4, "softmax_chunk handles four 16-lane vectors");
  V16 x[GROUPS];
  const V16 vs = simd16::set1(scale);
  for (int g = 0; g < GROUPS; g++)
    x[g] = simd16::first_or(simd16::mul(simd16::load(s + 16 * g), vs), n - 16 * g, NEG_INF);
  const float chunk_max = simd16::reduce_max(simd16::max(simd16::max(x[0], x[1]), simd16::max(x[2], x[3])));
  const float m_new = std::max(m, chunk_max);
  const V16 vm = simd16::set1(m_new);
  V16 p[GROUPS];
  for (int g = 0; g < GROUPS; g++) {
    p[g] = simd16::keep_first(simd16::exp(simd16::sub(x[g], vm)), n - 16 * g);
    simd16::store(s + 16 * g, p[g]);
  }
  const float psum = simd16::reduce_add(simd16::add(simd16::add(p[0], p[1]), simd16::add(p[2], p[3])));
#else
  float chunk_max = NEG_INF;
  for (int64_t j = 0; j < n; j++) chunk_max = std::max(chunk_max, s[j] * scale);
  const float m_new = std::max(m, chunk_max);
  float psum = 0.f;
  for (int64_t j = 0; j < KV_CHUNK; j++) {
    s[j] = j < n ? std::exp(s[j] * scale - m_new) : 0.f;
    psum += s[j];
  }
#endif
  const float alpha = m == NEG_INF ? 0.f : std::exp(m - m_new);
  l = l * alpha + psum;
  m = m_new;
  return alpha;
}

#if defined(__AVX512BF16__)
// A bfloat16 KV cache on a CPU with AVX512_BF16 (Zen 4, Sapphire Rapids): q and the probabilities
// are rounded to bfloat16 too, and every q·k and p·v product runs as vdpbf16ps (two products per
// float32 lane per instruction, twice the fused multiply-adds' rate). Per row, one fixed sequence:
//   score(q, k_j) = over d-pairs e = 0, 2, …: acc ← acc + q[e+1]k_j[e+1] + q[e]k_j[e] (vdpbf16ps);
//   per 64-key chunk, p_j = bf16(2^(s_j · scale · log2 e − m)) with the tiles' softmax (softmax_block:
//   m moves only when a chunk exceeds it by 2^8, l a 16-lane sum); acc ← acc·alpha, then over key
//   pairs (j, j+1) from 0: acc ← acc + p_{j+1} v_{j+1} + p_j v_j, a row's odd last key paired with
//   a zero row; out = acc / (l's lanes summed by simd16's tree). On a 2-core Zen 4 VM (one layer of
//   9 heads × 64, 256 queries at 4k of context, one thread) that softmax, written as bf16 in the same
//   pass, took the kernel from 54% to 65% of VDPBF16PS's measured peak (9.2 → 7.7 ms on two threads;
//   the float32 softmax, then its rounding pass, had been ~30% of its time), and p · v over 6 rows
//   instead of 4 to 66% (7.5 ms). Then scores over a chunk's four key groups a pass (6 rows, 24
//   sums: a q pair broadcast per four dot products, not two), value rows found per cache block
//   (not by two integer divisions per key) and output rows stored by vector: 1.16-1.20x at 1,024
//   queries over their own keys (4.1 → 3.6 ms, 72% of peak), 1.07-1.12x at 256 over 4k (76%),
//   1.3-1.5x for one decode row (alternated builds). Packing a chunk's value pairs once for all
//   its rows, instead of unpacking them per block of rows, measured 0.92-0.97x: not kept.
// The float32 path above stays the reference (`--kv-cache-dtype float32`).
constexpr int BF_SCORE_ROWS = 6, BF_PV_ROWS = 6;

constexpr float BF16_MAX_LIFT = 8.f;  // log2 units: probabilities stay ≤ 2^8 before a row's max moves

// 2^x for x ≤ BF16_MAX_LIFT: n = round(x), 2^(x − n) by a degree-3 minimax polynomial (relative
// error < 7.5e-5 on [−½, ½], under bf16's half ulp 2^−9: p is rounded to bf16 for the tile anyway;
// degree 4 cost two more instructions a row for nothing the tile keeps), scaled by 2^n. Below
// 2^−125 it stays at ~2^−125, a weight that adds nothing: a denormal result costs a microcode
// assist per instruction (at 2^−126 the polynomial's 0.99993 made every masked lane one, and
// 1,024-query attention ran 1.4x slower), and a real model's attention sinks put most keys that
// far down.
SS_INLINE __m512 exp2_for_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(5.51715009e-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.42610961e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.93260968e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.99928057e-1f));
  return _mm512_scalef_ps(y, n);
}

inline __mmask16 first_lanes(int64_t n) {  // lanes [0, n), n clamped to 0..16
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// One row's block of scores s (16 · GROUPS) → its probabilities p (bf16); updates the row's
// reference max m (log2 units) and its 16-lane sum l; returns the factor its accumulators take
// first (1 unless m moved). p_j = 2^(s_j · c − m), the product and the subtraction one fused step;
// m moves when the block's top score exceeds (m + BF16_MAX_LIFT) · (1 / c), to the top score · c
// (c > 0, so the top score's product is the top product). Few instructions (it is what the dot
// products do not hide: the tile unit holds the vector ports while it works): only a row's last
// block (keys past its position masked off) takes masks. GROUPS: 2 for the tiles' 32-key blocks,
// 4 for the VDPBF16PS kernel's 64-key chunks; l += the groups' probabilities summed pairwise.
template <int GROUPS>
SS_INLINE float softmax_block(const float* s, int64_t visible, float c, float inv_c, float& m, __m512& l, bf16* p) {
  static_assert(GROUPS == 2 || GROUPS == 4, "a block is two or four 16-key groups");
  const bool whole = visible >= 16 * GROUPS;
  __mmask16 k[GROUPS];
  __m512 x[GROUPS];
  for (int g = 0; g < GROUPS; g++) {
    k[g] = 0xFFFF;
    x[g] = _mm512_loadu_ps(s + 16 * g);
  }
  if (!whole) {
    const __m512 neg_inf = _mm512_set1_ps(NEG_INF);
    for (int g = 0; g < GROUPS; g++) {
      k[g] = first_lanes(visible - 16 * g);
      x[g] = _mm512_mask_mov_ps(neg_inf, k[g], x[g]);
    }
  }
  __m512 top = _mm512_max_ps(x[0], x[1]);
  if constexpr (GROUPS == 4) top = _mm512_max_ps(top, _mm512_max_ps(x[2], x[3]));
  float alpha = 1.f;
  if (m == NEG_INF) {
    m = _mm512_reduce_max_ps(top) * c;
  } else if (_mm512_cmp_ps_mask(top, _mm512_set1_ps((m + BF16_MAX_LIFT) * inv_c), _CMP_GT_OQ)) {
    const float m_new = _mm512_reduce_max_ps(top) * c;
    alpha = std::exp2(m - m_new);
    m = m_new;
    l = _mm512_mul_ps(l, _mm512_set1_ps(alpha));
  }
  const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(m);
  __m512 q[GROUPS];
  for (int g = 0; g < GROUPS; g++) {
    q[g] = exp2_for_bf16(_mm512_fmsub_ps(x[g], vc, vm));
    if (!whole) q[g] = _mm512_maskz_mov_ps(k[g], q[g]);
  }
  __m512 sum = _mm512_add_ps(q[0], q[1]);
  if constexpr (GROUPS == 4) sum = _mm512_add_ps(sum, _mm512_add_ps(q[2], q[3]));
  l = _mm512_add_ps(l, sum);
  for (int g = 0; g < GROUPS; g += 2)
    _mm512_storeu_si512(p + 16 * g, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(q[g + 1], q[g])));
  return alpha;
}


inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// Word 2i of the result: word i of the first row (key i's d); word 2i + 1: key i's d + 1.
inline __m512i pair_index() {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; i++) {
    idx[2 * i] = static_cast<int16_t>(i);
    idx[2 * i + 1] = static_cast<int16_t>(16 + i);
  }
  return _mm512_load_si512(idx);
}

// 16 keys' (d, d+1) pairs, key order, from two d-major rows of 16 values `stride` apart.
SS_INLINE __m512i key_pairs(const bf16* row, int64_t stride, __m512i idx) {
  const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + stride));
  return _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(d0), d1, 1));
}


// s[r][16 g + j] for MR rows of bfloat16 q (D apart) against the chunk's key groups, NG groups a
// pass (each key pair formed once a pass, each q pair broadcast once per NG groups).
template <int MR, int NG>
SS_INLINE void score_rows_bf16(const bf16* q, int64_t D, const bf16* const* kg, const int64_t* ks, int64_t groups,
                               float* s, __m512i idx) {
  for (int g0 = 0; g0 < groups; g0 += NG) {
    __m512 acc[MR][NG];
    for (int r = 0; r < MR; r++)
      for (int g = 0; g < NG; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; e += 2) {
      __m512i k[NG];
      for (int g = 0; g < NG; g++) k[g] = key_pairs(kg[g0 + g] + e * ks[g0 + g], ks[g0 + g], idx);
      for (int r = 0; r < MR; r++) {
        const __m512bh qb = amx::broadcast_pair(q + r * D + e);
        for (int g = 0; g < NG; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(k[g]), qb);
      }
    }
    for (int r = 0; r < MR; r++)
      for (int g = 0; g < NG; g++) _mm512_storeu_ps(s + r * KV_CHUNK + KEY_GROUP * (g0 + g), acc[r][g]);
  }
}

// A chunk's four groups in one pass of BF_SCORE_ROWS rows (24 sums); a request's last chunk,
// when it holds only one or two groups of keys, in one pass of two (the zero groups past its
// last key are scored only inside a pass, and masked by the softmax).
void score_chunk_bf16(const bf16* q, int64_t rows, int64_t D, const bf16* const* kg, const int64_t* ks,
                      int64_t groups, float* s) {
  static_assert(GROUPS == 4, "a chunk is four key groups");
  const __m512i idx = pair_index();
  for (int64_t r0 = 0; r0 < rows; r0 += BF_SCORE_ROWS) {
    const int64_t mr = std::min<int64_t>(BF_SCORE_ROWS, rows - r0);
    with_tile_rows<BF_SCORE_ROWS>(mr, [&](auto rows) SS_INLINE_LAMBDA {  // a row's sequence is the same in any of these
      constexpr int MR = decltype(rows)::value;
      if (groups > 2)
        score_rows_bf16<MR, 4>(q + r0 * D, D, kg, ks, groups, s + r0 * KV_CHUNK, idx);
      else
        score_rows_bf16<MR, 2>(q + r0 * D, D, kg, ks, groups, s + r0 * KV_CHUNK, idx);
    });
  }
}

// MR rows' accumulators (D floats each, each 32-d block in unpack order: lanes d = 0-3, 8-11, 16-19,
// 24-27, then 4-7, 12-15, 20-23, 28-31): acc ← acc·alpha, then the key pairs [j0, j1) (even), all
// of them keys of every row. `v`: the chunk's value rows.
template <int MR, int CB>  // CB: 32-d blocks, from column c0
SS_INLINE void accumulate_pairs_bf16(float* acc, int64_t D, const float* alpha, const bf16* p, int64_t j0,
                                     int64_t j1, const bf16* const* v, int64_t c0) {
  __m512 a[MR][2 * CB];
  bool rescale = false;  // x · 1 = x: skip the multiplies when no row's max moved (most chunks)
  for (int r = 0; r < MR; r++) rescale |= alpha[r] != 1.f;
  for (int r = 0; r < MR; r++) {
    const __m512 va = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < 2 * CB; c++) {
      a[r][c] = _mm512_loadu_ps(acc + r * D + c0 + 16 * c);
      if (rescale) a[r][c] = _mm512_mul_ps(a[r][c], va);
    }
  }
  for (int64_t j = j0; j < j1; j += 2) {
    __m512i pairs[2 * CB];
    for (int b = 0; b < CB; b++) {
      const __m512i x0 = _mm512_loadu_si512(v[j] + c0 + 32 * b);
      const __m512i x1 = _mm512_loadu_si512(v[j + 1] + c0 + 32 * b);
      pairs[2 * b] = _mm512_unpacklo_epi16(x0, x1);
      pairs[2 * b + 1] = _mm512_unpackhi_epi16(x0, x1);
    }
    for (int r = 0; r < MR; r++) {
      const __m512bh pb = amx::broadcast_pair(p + r * KV_CHUNK + j);
      for (int c = 0; c < 2 * CB; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], as_bh(pairs[c]), pb);
    }
  }
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < 2 * CB; c++) _mm512_storeu_ps(acc + r * D + c0 + 16 * c, a[r][c]);
}

template <int MR>
SS_INLINE void accumulate_block_bf16(float* acc, int64_t D, const float* alpha, const bf16* p, int64_t j0, int64_t j1,
                                     const bf16* const* v) {
  int64_t c0 = 0;
  for (; c0 + 64 <= D; c0 += 64) accumulate_pairs_bf16<MR, 2>(acc, D, alpha, p, j0, j1, v, c0);
  if (c0 < D) accumulate_pairs_bf16<MR, 1>(acc, D, alpha, p, j0, j1, v, c0);
}

// Rows [0, rows): acc ← acc·alpha + the row's keys j < n[r] (see above). The pairs all rows share
// run MR rows at a time; each row's own tail (the causal diagonal) runs alone.
void accumulate_chunk_bf16(float* acc, int64_t rows, int64_t D, const float* alpha, const bf16* p, const int64_t* n,
                           const bf16* const* v, const bf16* zero_row) {
  const bf16* tail[2];
  const float one = 1.f;
  for (int64_t r0 = 0; r0 < rows; r0 += BF_PV_ROWS) {
    const int64_t mr = std::min<int64_t>(BF_PV_ROWS, rows - r0);
    int64_t shared = n[r0];
    for (int64_t r = r0; r < r0 + mr; r++) shared = std::min(shared, n[r]);
    shared &= ~int64_t{1};
    float* a = acc + r0 * D;
    const bf16* pr = p + r0 * KV_CHUNK;
    with_tile_rows<BF_PV_ROWS>(mr, [&](auto rows) SS_INLINE_LAMBDA {  // a row's sequence is the same in any of these
      accumulate_block_bf16<decltype(rows)::value>(a, D, alpha + r0, pr, 0, shared, v);
    });
    for (int64_t r = 0; r < mr; r++) {
      const int64_t nr = n[r0 + r];
      for (int64_t j = shared; j < nr; j += 2) {
        tail[0] = v[j];
        tail[1] = j + 1 < nr ? v[j + 1] : zero_row;
        accumulate_block_bf16<1>(a + r * D, D, &one, pr + r * KV_CHUNK + j, 0, 2, tail);
      }
    }
  }
}

// A row's D accumulators in unpack order → d order.
inline int64_t unpacked_position(int64_t d) {
  const int64_t block = d / 32, i = d % 32;
  const int64_t lane = (i % 8) / 4 * 16 + (i / 8) * 4 + i % 4;
  return block * 32 + lane;
}

// q's row (D values, float32 or bf16) rounded to bf16 (nearest even, as c10's conversion).
template <typename T>
SS_INLINE void to_bf16_row(const T* src, int64_t D, bf16* dst) {
  if constexpr (std::is_same<T, bf16>::value) {
    std::memcpy(dst, src, D * sizeof(bf16));
  } else {
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + d))));
  }
}

// An output row: the accumulators (unpack order, see unpacked_position) back in d order, / l.
template <typename T>
SS_INLINE void store_output_row(const float* a, float l, int64_t D, T* o) {
  static const std::vector<int32_t> order = [] {
    std::vector<int32_t> o(32);
    for (int i = 0; i < 32; i++) o[i] = static_cast<int32_t>(unpacked_position(i));
    return o;
  }();
  const __m512i first = _mm512_loadu_si512(order.data()), second = _mm512_loadu_si512(order.data() + 16);
  const __m512 vl = _mm512_set1_ps(l);
  for (int64_t b = 0; b < D; b += 32) {
    const __m512 lo = _mm512_loadu_ps(a + b), hi = _mm512_loadu_ps(a + b + 16);
    const __m512 x0 = _mm512_div_ps(_mm512_permutex2var_ps(lo, first, hi), vl);
    const __m512 x1 = _mm512_div_ps(_mm512_permutex2var_ps(lo, second, hi), vl);
    if constexpr (std::is_same<T, bf16>::value) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + b), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x0)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + b + 16), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x1)));
    } else {
      _mm512_storeu_ps(o + b, x0);
      _mm512_storeu_ps(o + b + 16, x1);
    }
  }
}
#endif

#if SS_AMX_TILES
// ------------------------------------------------------------------ attention on the AMX tiles
// A bfloat16 KV cache on a CPU with AMX (Sapphire Rapids and later Xeons): q · k and p · v run
// on the tile unit, 16 query rows a tile, and only the softmax on vectors. Per row, one fixed
// sequence whatever rows share its tile (a tile computes each of its rows on its own):
//   keys in blocks of 32 from key 0; s_j = q · k_j (bf16 q and k, the tile's float32 sums);
//   t_j = s_j · scale · log2 e; the row's reference max m (log2 units) is set by its first
//   block and moves to a block's max only when that exceeds m + BF16_MAX_LIFT (then acc and l
//   are scaled by 2^(m_old − m_new) — rarely, so the accumulators can stay in tile registers);
//   p_j = 2^(t_j − m) (a degree-4 polynomial: p is rounded to bf16 for the tile anyway), zero
//   past the row's position; l (16 lanes) += p_0..15 + p_16..31; acc += bf16(p) · V;
//   out = acc / (l's lanes summed by simd16's tree).
// A block past a row's position adds zeros to it (its probabilities are exact zeros, its
// values finite) and leaves m and l alone, so a row's bits do not depend on how far its tile
// goes. Every row — a prompt's, a decode's, a verify's — takes this path over a bfloat16 cache
// here, so greedy output does not depend on batching, chunking or speculation.
constexpr int64_t AMX_KEY_BLOCK = 32;        // keys per tile product (one bf16 pair per 32-bit lane)
constexpr int64_t AMX_QUERY_TILE_TOKENS = 64;  // tokens of one request per work item (no effect on results)
constexpr int64_t AMX_MAX_HEAD_DIM = 64;      // accumulators: D / 16 tiles of tmm0 .. tmm3

// A request's keys and values for one KV head, packed as the tiles load them, for keys [0, keys):
// per 32-key block, K's B tiles [group of 16 keys][32-d half][16 d-pairs][16 keys × (d, d+1)], then
// V's B tiles [16 d (unpack order, see unpacked_position)][16 key pairs × (key, key + 1)] per 16-d
// column tile; zeros past the last key (a zero probability times a finite value adds nothing).
// Packed once per step for all the request's rows on that head (its items share it).
struct AmxPacked {
  bf16* data = nullptr;
  int64_t k_block = 0, v_block = 0;  // bf16 values per block of K tiles, of V tiles
  static int64_t values_per_block(int64_t D) { return (2 * (D / 32) + D / 16) * amx::ROWS * 32; }
  static int64_t blocks_for(int64_t keys) { return (keys + AMX_KEY_BLOCK - 1) / AMX_KEY_BLOCK; }
  AmxPacked(bf16* at, int64_t D) : data(at), k_block(2 * (D / 32) * amx::ROWS * 32), v_block(D / 16 * amx::ROWS * 32) {}
  bf16* k_tile(int64_t block, int64_t g, int64_t half) const {
    return data + block * (k_block + v_block) + g * (k_block / 2) + half * amx::ROWS * 32;
  }
  bf16* v_tile(int64_t block, int64_t col) const {
    return data + block * (k_block + v_block) + k_block + col * amx::ROWS * 32;
  }
};

void pack_keys_for_tiles(const KeySource<bf16>& keys, Scratch<bf16>& sc, const AmxPacked& pk) {
  const int64_t D = keys.D, halves = D / 32;
  const int64_t blocks = AmxPacked::blocks_for(keys.max_keys);
  sc.kt.resize(GROUPS * D * KEY_GROUP);
  if (static_cast<int64_t>(sc.zeros.size()) != D * KEY_GROUP) sc.zeros.assign(D * KEY_GROUP, bf16(0.f));
  if (static_cast<int64_t>(sc.zero_row.size()) != D) sc.zero_row.assign(D, bf16(0.f));
  const __m512i idx = pair_index();
  const bf16* kg[GROUPS];
  int64_t ks[GROUPS];
  static_assert(KV_CHUNK % AMX_KEY_BLOCK == 0, "a chunk of located key groups is whole tile blocks");
  for (int64_t c0 = 0; c0 < blocks * AMX_KEY_BLOCK; c0 += KV_CHUNK) {
    keys.locate_groups(c0, kg, ks, sc.kt.data(), sc.zeros.data());
    for (int64_t g = 0; g < GROUPS && c0 + g * KEY_GROUP < blocks * AMX_KEY_BLOCK; g++) {
      const int64_t block = (c0 + g * KEY_GROUP) / AMX_KEY_BLOCK;
      for (int64_t h = 0; h < halves; h++) {
        bf16* dst = pk.k_tile(block, g % 2, h);
        for (int64_t e = 0; e < 16; e++)
          _mm512_store_si512(dst + 32 * e, key_pairs(kg[g] + (32 * h + 2 * e) * ks[g], ks[g], idx));
      }
    }
  }
  const bf16* zero = sc.zero_row.data();
  for (int64_t block = 0; block < blocks; block++)
    for (int64_t e = 0; e < 16; e++) {
      const int64_t j0 = block * AMX_KEY_BLOCK + 2 * e;
      const bf16* x0 = j0 < keys.max_keys ? keys.v_row(j0) : zero;
      const bf16* x1 = j0 + 1 < keys.max_keys ? keys.v_row(j0 + 1) : zero;
      for (int64_t h = 0; h < halves; h++) {
        const __m512i a = _mm512_loadu_si512(x0 + 32 * h), b = _mm512_loadu_si512(x1 + 32 * h);
        _mm512_store_si512(pk.v_tile(block, 2 * h) + 32 * e, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(pk.v_tile(block, 2 * h + 1) + 32 * e, _mm512_unpackhi_epi16(a, b));
      }
    }
}

// The accumulator tiles (GCC's tile intrinsics need literal register numbers): tmm0 .. tmm3, 16
// columns of d each.
template <int COLS>
SS_INLINE void acc_tiles_store(float* o, int64_t stride) {
  _tile_stored(0, o, stride);
  if constexpr (COLS > 1) _tile_stored(1, o + 16, stride);
  if constexpr (COLS > 2) _tile_stored(2, o + 32, stride);
  if constexpr (COLS > 3) _tile_stored(3, o + 48, stride);
}
template <int COLS>
SS_INLINE void acc_tiles_load(const float* o, int64_t stride) {
  _tile_loadd(0, o, stride);
  if constexpr (COLS > 1) _tile_loadd(1, o + 16, stride);
  if constexpr (COLS > 2) _tile_loadd(2, o + 32, stride);
  if constexpr (COLS > 3) _tile_loadd(3, o + 48, stride);
}
// acc += P · V for one block: the probabilities (16 rows × 32 keys, bf16) into tmm6, each column
// tile's values in turn into tmm7.
template <int COLS>
SS_INLINE void acc_tiles_add_pv(const bf16* p, const AmxPacked& pk, int64_t block) {
  _tile_loadd(6, p, AMX_KEY_BLOCK * 2);
  _tile_loadd(7, pk.v_tile(block, 0), 64);
  _tile_dpbf16ps(0, 6, 7);
  if constexpr (COLS > 1) {
    _tile_loadd(7, pk.v_tile(block, 1), 64);
    _tile_dpbf16ps(1, 6, 7);
  }
  if constexpr (COLS > 2) {
    _tile_loadd(7, pk.v_tile(block, 2), 64);
    _tile_dpbf16ps(2, 6, 7);
  }
  if constexpr (COLS > 3) {
    _tile_loadd(7, pk.v_tile(block, 3), 64);
    _tile_dpbf16ps(3, 6, 7);
  }
}
// s = q · k for one block's 32 keys into tmm4 (keys 0-15) and tmm5 (16-31), stored to s (16 × 32).
SS_INLINE void score_tiles(const bf16* q16, int64_t D, const AmxPacked& pk, int64_t block, float* s) {
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t h = 0; h < D / 32; h++) {
    _tile_loadd(6, q16 + 32 * h, D * 2);
    _tile_loadd(7, pk.k_tile(block, 0, h), 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, pk.k_tile(block, 1, h), 64);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(4, s, AMX_KEY_BLOCK * 4);
  _tile_stored(5, s + 16, AMX_KEY_BLOCK * 4);
}

// Rows [0, n) of a row tile (q16: 16 rows × D bf16, zeros past n; num_keys: each row's keys, in
// token order) over the packed keys; writes each row's acc (unpack order) and l. Software-
// pipelined so that the tile unit and the vectors take turns in small pieces: block b + 1's scores
// go to the tile unit before the vectors compute block b's probabilities, and block b − 1's p · v
// between the first and the second half of the rows. In one burst per block (scores, p · v, then
// every row's softmax) the tiles and the vectors overlapped less: one row tile over 4k keys took
// ~1.1x as long (this Xeon, the kernel timed on its own).
template <int COLS>
void amx_row_tile(const bf16* q16, int64_t D, const int64_t* num_keys, int64_t n, const AmxPacked& pk, float c,
                  float* acc, float* l_out) {
  alignas(64) float s[2][amx::ROWS * AMX_KEY_BLOCK];      // blocks b and b + 1
  alignas(64) bf16 p[2][amx::ROWS * AMX_KEY_BLOCK] = {};  // blocks b and b − 1 (rows past n stay zero)
  __m512 l[amx::ROWS];
  float m[amx::ROWS], alpha[amx::ROWS];
  for (int r = 0; r < amx::ROWS; r++) l[r] = _mm512_setzero_ps(), m[r] = NEG_INF;
  const float inv_c = 1.f / c;
  const int64_t blocks = AmxPacked::blocks_for(num_keys[n - 1]);  // the last row sees the most keys
  bool rescale = false;
  auto softmax_rows = [&](int64_t block, int64_t r0, int64_t r1) {
    const float* sb = s[block % 2];
    bf16* pb = p[block % 2];
    for (int64_t r = r0; r < r1; r++) {
      const int64_t visible = num_keys[r] - block * AMX_KEY_BLOCK;
      if (visible <= 0) {  // past the row's position: zero probabilities, nothing else
        _mm512_store_si512(pb + r * AMX_KEY_BLOCK, _mm512_setzero_si512());
        alpha[r] = 1.f;
        continue;
      }
      alpha[r] = softmax_block<2>(sb + r * AMX_KEY_BLOCK, visible, c, inv_c, m[r], l[r], pb + r * AMX_KEY_BLOCK);
      rescale |= alpha[r] != 1.f;
    }
  };
  _tile_zero(0);
  if constexpr (COLS > 1) _tile_zero(1);
  if constexpr (COLS > 2) _tile_zero(2);
  if constexpr (COLS > 3) _tile_zero(3);
  score_tiles(q16, D, pk, 0, s[0]);
  for (int64_t block = 0; block < blocks; block++) {
    if (block + 1 < blocks) score_tiles(q16, D, pk, block + 1, s[(block + 1) % 2]);
    rescale = false;
    softmax_rows(block, 0, n / 2);
    if (block > 0) acc_tiles_add_pv<COLS>(p[(block - 1) % 2], pk, block - 1);
    softmax_rows(block, n / 2, n);
    if (rescale) {  // a row's max moved: scale its accumulators (the other rows' stay as they are)
      acc_tiles_store<COLS>(acc, D * 4);
      for (int64_t r = 0; r < n; r++)
        if (alpha[r] != 1.f)
          for (int64_t d = 0; d < D; d += 16)
            _mm512_store_ps(acc + r * D + d, _mm512_mul_ps(_mm512_load_ps(acc + r * D + d), _mm512_set1_ps(alpha[r])));
      acc_tiles_load<COLS>(acc, D * 4);
    }
  }
  acc_tiles_add_pv<COLS>(p[(blocks - 1) % 2], pk, blocks - 1);
  acc_tiles_store<COLS>(acc, D * 4);
  for (int64_t r = 0; r < n; r++) l_out[r] = simd16::reduce_add(V16{l[r]});
}

struct AmxScratch {
  amx::AlignedVector<bf16> q16;
  amx::AlignedVector<float> acc;
  std::vector<int64_t> num_keys;
  std::vector<float> l;
};

// attention_item on the tiles (a bfloat16 cache, D a multiple of 32 up to AMX_MAX_HEAD_DIM), over
// its request's keys packed for its KV head.
template <typename T>
void attention_item_amx(const WorkItem& it, const T* q, T* out, int64_t query_start, int64_t first_position,
                        int64_t H, int64_t Hkv, int64_t D, float scale, const AmxPacked& packed, AmxScratch& ax) {
  const int64_t G = H / Hkv, nh = it.head_end - it.head_begin;
  const int64_t rows = (it.token_end - it.token_begin) * nh;
  const int64_t padded = (rows + amx::ROWS - 1) / amx::ROWS * amx::ROWS;
  ax.q16.assign(padded * D, bf16(0.f));
  ax.acc.resize(amx::ROWS * D);
  ax.num_keys.resize(rows);
  ax.l.resize(amx::ROWS);
  for (int64_t i = 0; i < rows; i++) {
    const int64_t t = it.token_begin + i / nh, h = it.head_begin + i % nh;
    const T* src = q + ((query_start + t) * H + it.kv_head * G + h) * D;
    to_bf16_row(src, D, ax.q16.data() + i * D);
    ax.num_keys[i] = first_position + t + 1;
  }
  const float c = scale * 1.44269504088896341f;
  for (int64_t r0 = 0; r0 < rows; r0 += amx::ROWS) {
    const int64_t n = std::min<int64_t>(amx::ROWS, rows - r0);
    if (D > 32)
      amx_row_tile<4>(ax.q16.data() + r0 * D, D, ax.num_keys.data() + r0, n, packed, c, ax.acc.data(), ax.l.data());
    else
      amx_row_tile<2>(ax.q16.data() + r0 * D, D, ax.num_keys.data() + r0, n, packed, c, ax.acc.data(), ax.l.data());
    for (int64_t r = 0; r < n; r++) {
      const int64_t i = r0 + r, t = it.token_begin + i / nh, h = it.head_begin + i % nh;
      T* o = out + ((query_start + t) * H + it.kv_head * G + h) * D;
      store_output_row(ax.acc.data() + r * D, ax.l[r], D, o);
    }
  }
}
#endif

template <typename T>
inline void to_float_row(const T* src, float* dst, int64_t D) {
  int64_t d = 0;
#if SS_SIMD16
  for (; d + 16 <= D; d += 16) simd16::store(dst + d, load16(src + d));
#endif
  for (; d < D; d++) dst[d] = to_f(src[d]);
}

// T: q's and the output's dtype; C: the KV cache's (K and V values are converted exactly to float32
// as they are read, float32 math, but for the bfloat16 dot products over a bfloat16 cache).
template <typename T, typename C>
void attention_item(const WorkItem& it, const T* q, const C* k_cache, const C* v_cache, T* out, const int32_t* table,
                    const CacheLayout& kl, const CacheLayout& vl, int64_t query_start, int64_t first_position,
                    int64_t H, int64_t Hkv, int64_t D, float scale, int64_t window_start,
                    const int64_t* window_positions, Scratch<C>& sc) {
  const int64_t G = H / Hkv;
  const int64_t nh = it.head_end - it.head_begin;
  const int64_t rows = (it.token_end - it.token_begin) * nh;
  sc.acc.assign(rows * D, 0.f);
  sc.m.assign(rows, NEG_INF);
  sc.s.resize(rows * KV_CHUNK);
  sc.alpha.resize(rows);
  sc.n.resize(rows);
  sc.kt.resize(GROUPS * D * KEY_GROUP);
  if (static_cast<int64_t>(sc.zeros.size()) != D * KEY_GROUP) sc.zeros.assign(D * KEY_GROUP, C(0.f));  // never written
#if defined(__AVX512BF16__)
  constexpr bool kBf16Cache = std::is_same<C, bf16>::value;
#else
  constexpr bool kBf16Cache = false;
#endif
  const bool bf16_dots = kBf16Cache && D % 32 == 0;
  // A row's sum l: one float, or with the bfloat16 dot products 16 lanes (softmax_block).
  sc.l.assign(bf16_dots ? rows * 16 : rows, 0.f);
  // Row i = (token t, head h): q row (query_start + t, kv_head * G + h), in float32, or rounded
  // to bfloat16 for the bfloat16 dot products.
  if (bf16_dots)
    sc.q16.resize(rows * D);
  else
    sc.q.resize(rows * D);
  for (int64_t t = it.token_begin; t < it.token_end; t++)
    for (int64_t h = it.head_begin; h < it.head_end; h++) {
      const int64_t i = (t - it.token_begin) * nh + (h - it.head_begin);
      const T* src = q + ((query_start + t) * H + it.kv_head * G + h) * D;
#if defined(__AVX512BF16__)
      if (bf16_dots) {
        to_bf16_row(src, D, sc.q16.data() + i * D);
        continue;
      }
#endif
      to_float_row(src, sc.q.data() + i * D, D);
    }
  // The bfloat16 dot products' softmax (softmax_block): scores in log2 units, c = scale · log2 e,
  // and the 16 lanes of l summed by simd16's tree at the end.
  [[maybe_unused]] const float c = scale * 1.44269504088896341f, inv_c = 1.f / c;
  if (bf16_dots) {
    sc.p16.resize(rows * KV_CHUNK);
    if (static_cast<int64_t>(sc.zero_row.size()) != D) sc.zero_row.assign(D, bf16(0.f));  // never written
  }
  const int64_t max_keys = first_position + it.token_end;  // the last token's keys
  const KeySource<C> keys{k_cache, v_cache, table, kl, vl, it.kv_head, Hkv, D, max_keys,
                          window_start, window_positions};
  const C* kg[GROUPS];
  int64_t ks[GROUPS];
  // The values' rows are scattered over the cache (runs of a block's keys at best) and, with the
  // weights streaming through the caches every step, come from DRAM: ask for the next chunk's
  // rows while this one is computed (it does not change any value). A d-major key group is one
  // contiguous run the hardware prefetcher follows.
  constexpr int64_t kLine = 64;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(C));
  const C* value_rows[2][KV_CHUNK];  // this chunk's value rows, and the next one's (prefetched)
  auto prefetch_values = [&](int64_t c) {
    const C** vr = value_rows[(c / KV_CHUNK) % 2];
    const int64_t nc = std::min(KV_CHUNK, max_keys - c);
    keys.value_rows(c, nc, vr);
    for (int64_t j = 0; j < nc; j++)
      for (int64_t b = 0; b < row_bytes; b += kLine) __builtin_prefetch(reinterpret_cast<const char*>(vr[j]) + b);
  };
  prefetch_values(0);
  for (int64_t c0 = 0; c0 < max_keys; c0 += KV_CHUNK) {
    const int64_t nc = std::min(KV_CHUNK, max_keys - c0);
    if (c0 + KV_CHUNK < max_keys) prefetch_values(c0 + KV_CHUNK);
    // Rows whose token sees a key of this chunk: a suffix of the item's rows.
    const int64_t t_first = std::max(it.token_begin, c0 - first_position);
    const int64_t i0 = (t_first - it.token_begin) * nh;
    const int64_t active = rows - i0;
    if (active <= 0) continue;
    keys.locate_groups(c0, kg, ks, sc.kt.data(), sc.zeros.data());
    const C* const* vp = value_rows[(c0 / KV_CHUNK) % 2];
    const int64_t groups = (nc + KEY_GROUP - 1) / KEY_GROUP;
    float* s0 = sc.s.data() + i0 * KV_CHUNK;
#if defined(__AVX512BF16__)
    if constexpr (kBf16Cache) {
      if (bf16_dots) score_chunk_bf16(sc.q16.data() + i0 * D, active, D, kg, ks, groups, s0);
    }
#endif
    if (!bf16_dots) score_chunk<C>(sc.q.data() + i0 * D, active, D, kg, ks, groups, s0);
    for (int64_t t = t_first, i = i0; t < it.token_end; t++)
      for (int64_t h = 0; h < nh; h++) sc.n[i++] = std::min(KV_CHUNK, first_position + t + 1 - c0);
#if defined(__AVX512BF16__)
    if constexpr (kBf16Cache) {
      if (bf16_dots) {
        for (int64_t i = i0; i < rows; i++) {  // the probabilities, rounded to bf16 for vdpbf16ps
          __m512 l = _mm512_loadu_ps(sc.l.data() + 16 * i);
          sc.alpha[i] = softmax_block<GROUPS>(sc.s.data() + i * KV_CHUNK, sc.n[i], c, inv_c, sc.m[i], l,
                                              sc.p16.data() + i * KV_CHUNK);
          _mm512_storeu_ps(sc.l.data() + 16 * i, l);
        }
        accumulate_chunk_bf16(sc.acc.data() + i0 * D, active, D, sc.alpha.data() + i0, sc.p16.data() + i0 * KV_CHUNK,
                              sc.n.data() + i0, vp, sc.zero_row.data());
        continue;
      }
    }
#endif
    for (int64_t i = i0; i < rows; i++)
      sc.alpha[i] = softmax_chunk(sc.s.data() + i * KV_CHUNK, sc.n[i], scale, sc.m[i], sc.l[i]);
    accumulate_chunk<C>(sc.acc.data() + i0 * D, active, D, sc.alpha.data() + i0, s0, sc.n.data() + i0, vp);
  }
  for (int64_t t = it.token_begin; t < it.token_end; t++)
    for (int64_t h = it.head_begin; h < it.head_end; h++) {
      const int64_t i = (t - it.token_begin) * nh + (h - it.head_begin);
      T* o = out + ((query_start + t) * H + it.kv_head * G + h) * D;
      const float* a = sc.acc.data() + i * D;
#if defined(__AVX512BF16__)
      if (bf16_dots) {
        store_output_row(a, simd16::reduce_add(simd16::load(sc.l.data() + 16 * i)), D, o);
        continue;
      }
#endif
      const float l = sc.l[i];
      for (int64_t d = 0; d < D; d++) o[d] = from_f<T>(a[d] / l);
    }
}

at::Tensor int64_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D");
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name, " must be int64 or int32");
  return (t.scalar_type() == at::kLong ? t : t.to(at::kLong)).contiguous();  // no dispatch when it already is
}

void check_float_type(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

}  // namespace

// Causal attention of each query row over its own request's paged KV.
//   q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (float32, bfloat16 or float16;
//   K row-major or d-major, see CacheLayout);
//   query_starts, query_lens, context_lens [R] int; block_tables [R, max_blocks] int32.
// Optional, for draft trees: window_starts [R] int64 and window_positions [R, W] int64. Where
// window_starts[r] >= 0, request r (one tree row) reads logical key window_starts[r] + k from
// position window_positions[r, k] (its ancestor at depth k), every earlier key in place: the
// keys, in the order, a decode of its path reads, so the row gets that decode's bits.
// Rows not covered by a request (padding at the end) come back as zeros. `tiles`: over a
// bfloat16 cache on an AMX CPU, run on the tiles (true, always in the engine); false runs the
// vector kernels instead, for the tests and benchmarks that compare the two.
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_starts_in, const at::Tensor& query_lens_in,
                           const at::Tensor& context_lens_in, const at::Tensor& block_tables_in, double scale,
                           const c10::optional<at::Tensor>& window_starts_in,
                           const c10::optional<at::Tensor>& window_positions_in, bool tiles) {
  check_float_type(q_in, "q");
  TORCH_CHECK(q_in.dim() == 3, "q must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must be [num_blocks, block_size, Hkv, D]");
  check_kv_type(k_cache, v_cache);
  const CacheLayout kl = k_layout(k_cache), vl = v_layout(v_cache);
  const at::Tensor q = q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q (", D, ") and the cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads ", H, " is not a multiple of num_kv_heads ", Hkv);
  const at::Tensor starts = int64_contiguous(query_starts_in, "query_starts");
  const at::Tensor lens = int64_contiguous(query_lens_in, "query_lens");
  const at::Tensor ctx = int64_contiguous(context_lens_in, "context_lens");
  const int64_t R = starts.size(0);
  TORCH_CHECK(lens.size(0) == R && ctx.size(0) == R, "query_starts, query_lens and context_lens differ in length");
  TORCH_CHECK(block_tables_in.dim() == 2 && block_tables_in.size(0) == R, "block_tables must be [num_requests, max_blocks]");
  const at::Tensor tables =
      (block_tables_in.scalar_type() == at::kInt ? block_tables_in : block_tables_in.to(at::kInt)).contiguous();
  const int64_t max_blocks = tables.size(1);
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t G = H / Hkv;
  TORCH_CHECK(window_starts_in.has_value() == window_positions_in.has_value(),
              "window_starts and window_positions come together");
  at::Tensor window_starts, window_positions;
  int64_t W = 0;
  if (window_starts_in.has_value()) {
    window_starts = int64_contiguous(*window_starts_in, "window_starts");
    TORCH_CHECK(window_starts.size(0) == R, "window_starts must have one entry per request");
    TORCH_CHECK(window_positions_in->dim() == 2 && window_positions_in->size(0) == R &&
                    window_positions_in->scalar_type() == at::kLong,
                "window_positions must be [num_requests, W] int64");
    window_positions = window_positions_in->contiguous();
    W = window_positions.size(1);
  }
  const int64_t* wsp = window_starts.defined() ? window_starts.data_ptr<int64_t>() : nullptr;
  const int64_t* wpp = window_positions.defined() ? window_positions.data_ptr<int64_t>() : nullptr;

  at::Tensor out = at::empty_like(q);
  // Zero the rows no request owns (the padded tail, or any gap).
  std::vector<char> covered(T, 0);
  int64_t total_rows = 0;
  for (int64_t r = 0; r < R; r++) {
    TORCH_CHECK(lp[r] >= 1 && sp[r] >= 0 && sp[r] + lp[r] <= T, "request ", r, ": rows [", sp[r], ", ", sp[r] + lp[r],
                ") outside q's ", T, " rows");
    TORCH_CHECK(cp[r] >= lp[r] && (cp[r] + block_size - 1) / block_size <= max_blocks, "request ", r,
                ": context_len ", cp[r], " does not fit query_len ", lp[r], " and ", max_blocks, " blocks");
    for (int64_t b = 0; b < (cp[r] + block_size - 1) / block_size; b++) {
      const int32_t block = tp[r * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "request ", r, ": block table entry ", block, " outside [0, ",
                  num_blocks, ")");
    }
    if (wsp != nullptr && wsp[r] >= 0) {
      TORCH_CHECK(lp[r] == 1 && wsp[r] < cp[r] && cp[r] - wsp[r] <= W, "request ", r, ": a tree row reads keys ",
                  wsp[r], "..", cp[r], " through ", W, " window positions, as one query row");
      for (int64_t k = 0; k < cp[r] - wsp[r]; k++) {
        const int64_t position = wpp[r * W + k];
        TORCH_CHECK(position >= wsp[r] && position / block_size < max_blocks, "request ", r, ": window position ",
                    position, " outside its block table");
        const int32_t block = tp[r * max_blocks + position / block_size];
        TORCH_CHECK(block >= 0 && block < num_blocks, "request ", r, ": block table entry ", block, " outside [0, ",
                    num_blocks, ")");
      }
    }
    for (int64_t t = sp[r]; t < sp[r] + lp[r]; t++) covered[t] = 1;
    total_rows += lp[r];
  }
  if (total_rows < T) {
    const int64_t row_bytes = H * D * q.element_size();
    char* base = static_cast<char*>(out.data_ptr());
    for (int64_t t = 0; t < T; t++)
      if (!covered[t]) std::memset(base + t * row_bytes, 0, row_bytes);
  }

  // Over a bfloat16 cache on an AMX CPU, every row runs on the tiles (see attention_item_amx).
#if SS_AMX_TILES
  const bool on_tiles = tiles && k_cache.scalar_type() == at::kBFloat16 && attention_on_tiles(D);
  const int64_t tile_tokens = on_tiles ? AMX_QUERY_TILE_TOKENS : QUERY_TILE_TOKENS;
#else
  const bool on_tiles = false;
  const int64_t tile_tokens = QUERY_TILE_TOKENS;
#endif
  // Work items: (request, KV head, tile of tokens), split further by query head
  // when there are too few to keep the threads busy. Largest first, pulled dynamically.
  const int64_t num_threads = at::get_num_threads();
  int64_t full_items = 0;
  for (int64_t r = 0; r < R; r++) full_items += Hkv * ((lp[r] + tile_tokens - 1) / tile_tokens);
  // On the tiles an item packs its keys once for all its rows: a GQA group's heads stay together.
  const int64_t heads_per_item = on_tiles || full_items >= 4 * num_threads ? G : 1;
  std::vector<WorkItem> items;
  items.reserve(full_items * (G / heads_per_item));
  for (int64_t r = 0; r < R; r++)
    for (int64_t g = 0; g < Hkv; g++)
      for (int64_t t0 = 0; t0 < lp[r]; t0 += tile_tokens)
        for (int64_t h0 = 0; h0 < G; h0 += heads_per_item) {
          const int64_t t1 = std::min(lp[r], t0 + tile_tokens);
          const int64_t keys = cp[r] - lp[r] + t1;
          items.push_back({r, g, t0, t1, h0, h0 + heads_per_item, (t1 - t0) * heads_per_item * keys});
        }
  // A (request, KV head)'s items run one after another (the groups largest first, then each
  // group's items largest first): a prompt chunk's token tiles all read one head's keys, which stay
  // in L2 between them (1 MB at 4k keys, D = 64), where items ordered by cost alone went round the
  // heads and read 3 MB of keys from L3 (1.03-1.09x on a 1,024-query attention over 4k keys on
  // the tiles; the vector kernels over a float16 cache measured the same either way). For decode
  // rows, one item per group, it is the order by cost.
  std::vector<int64_t> group_cost(R * Hkv, 0);
  for (const WorkItem& it : items) group_cost[it.request * Hkv + it.kv_head] += it.cost;
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    const int64_t ga = a.request * Hkv + a.kv_head, gb = b.request * Hkv + b.kv_head;
    if (group_cost[ga] != group_cost[gb]) return group_cost[ga] > group_cost[gb];
    return ga != gb ? ga < gb : a.cost > b.cost;
  });

  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  int64_t total_cost = 0;
  for (const WorkItem& it : items) total_cost += it.cost;
  // Small steps (a few µs of work) run on the calling thread: starting the pool costs more. A decode
  // step of one request at ~130 tokens of context (~1,200 pairs, ~25 µs) is worth two threads.
  const int64_t num_workers = total_cost < PARALLEL_MIN_ROW_KEYS ? 1 : std::min(num_threads, num_items);
  auto run_workers = [&](auto&& worker) {
    if (num_workers <= 1) {
      worker(0, 1);
    } else {
      at::parallel_for(0, num_workers, 1, worker);
    }
  };
  const float fscale = static_cast<float>(scale);
  // A tree row reads keys window_start.. through its window's positions (see above); others, none.
  auto window_start_of = [&](int64_t r) { return wsp != nullptr && wsp[r] >= 0 ? wsp[r] : INT64_MAX; };
  auto window_of = [&](int64_t r) -> const int64_t* { return wsp != nullptr && wsp[r] >= 0 ? wpp + r * W : nullptr; };
  dispatch_float(q.scalar_type(), "paged_attention", [&](auto q_tag) {
    dispatch_kv(k_cache.scalar_type(), [&](auto kv_tag) {
      using T = decltype(q_tag);
      using C = decltype(kv_tag);
      const T* qp = ptr<T>(q);
      const C* kc = ptr<C>(k_cache);
      const C* vc = ptr<C>(v_cache);
      T* op = ptr<T>(out);
#if SS_AMX_TILES
      // On the tiles, a (request, KV head)'s keys are packed once for all its items. One with
      // several items (a prompt chunk's token tiles) is packed by a pass before the items, into
      // a buffer they share; one with a single item (a decode, verify or tree row: its rows fit
      // one token tile) is packed by the worker that runs the item, right before it, into that
      // worker's own buffer, which the item then reads from L2: a separate pass over every
      // decode row's keys wrote them all out first (~13 MB for 16 requests at 1k tokens) and
      // read them back from L3. Either way the same packed values, so the same bits.
      thread_local amx::AlignedVector<bf16> packed_keys;
      std::vector<int64_t> pack_offset;  // (request, KV head) x's keys at packed_base + pack_offset[x]
      bf16* packed_base = nullptr;
      auto packs_alone = [&](int64_t r) { return lp[r] <= tile_tokens; };  // its heads' one item each
      auto keys_of = [&](auto r, auto kv_head) {  // generic: only instantiated over a bfloat16 cache
        return KeySource<C>{kc, vc, tp + r * max_blocks, kl, vl, kv_head, Hkv, D, cp[r],
                            window_start_of(r), window_of(r)};
      };
      if constexpr (std::is_same<C, bf16>::value) {
        if (on_tiles) {
          pack_offset.assign(R * Hkv + 1, 0);
          for (int64_t x = 0; x < R * Hkv; x++) {
            const int64_t r = x / Hkv;
            const int64_t shared = packs_alone(r) ? 0 : AmxPacked::blocks_for(cp[r]) * AmxPacked::values_per_block(D);
            pack_offset[x + 1] = pack_offset[x] + shared;
          }
          if (static_cast<int64_t>(packed_keys.size()) < pack_offset.back()) packed_keys.resize(pack_offset.back());
          packed_base = packed_keys.data();  // the workers see their own thread_local, not this one
          if (pack_offset.back() > 0) {
            std::atomic<int64_t> next_pack{0};
            auto pack = [&](int64_t, int64_t) {
              Scratch<C> sc;
              for (int64_t x; (x = next_pack.fetch_add(1)) < R * Hkv;)
                if (!packs_alone(x / Hkv))
                  pack_keys_for_tiles(keys_of(x / Hkv, x % Hkv), sc, AmxPacked(packed_base + pack_offset[x], D));
            };
            run_workers(pack);
          }
        }
      }
#endif
      run_workers([&](int64_t, int64_t) {
        Scratch<C> sc;
#if SS_AMX_TILES
        AmxScratch ax;
        if (on_tiles) amx::configure_tiles();
#endif
        for (int64_t i; (i = next.fetch_add(1)) < num_items;) {
          const WorkItem& it = items[i];
          const int64_t window_start = window_start_of(it.request);
          const int64_t* window = window_of(it.request);
#if SS_AMX_TILES
          if constexpr (std::is_same<C, bf16>::value) {
            if (on_tiles) {
              bf16* keys_at = packed_base + pack_offset[it.request * Hkv + it.kv_head];
              if (packs_alone(it.request)) {
                thread_local amx::AlignedVector<bf16> own_keys;
                const int64_t size = AmxPacked::blocks_for(cp[it.request]) * AmxPacked::values_per_block(D);
                if (static_cast<int64_t>(own_keys.size()) < size) own_keys.resize(size);
                keys_at = own_keys.data();
                pack_keys_for_tiles(keys_of(it.request, it.kv_head), sc, AmxPacked(keys_at, D));
              }
              attention_item_amx<T>(it, qp, op, sp[it.request], cp[it.request] - lp[it.request], H, Hkv, D, fscale,
                                    AmxPacked(keys_at, D), ax);
              continue;
            }
          }
#endif
          attention_item<T, C>(it, qp, kc, vc, op, tp + it.request * max_blocks, kl, vl, sp[it.request],
                               cp[it.request] - lp[it.request], H, Hkv, D, fscale, window_start, window, sc);
        }
      });
    });
  });
  return out;
}

// ------------------------------------------------------------------ row ops

namespace {

// Rows per parallel task: enough elements that a thread's share is worth waking it.
int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

// x as [rows, n] with a row stride (the last dim contiguous); copies only when it must.
struct Rows {
  at::Tensor t;
  int64_t rows, n, stride;
};
Rows as_rows(const at::Tensor& x_in, const char* name) {
  check_float_type(x_in, name);
  TORCH_CHECK(x_in.dim() >= 1, name, " must have at least one dimension");
  const int64_t n = x_in.size(-1);
  at::Tensor x = x_in;
  int64_t stride = n;
  if (x.dim() == 2 && x.stride(1) == 1 && x.stride(0) >= n) {
    stride = x.stride(0);
  } else if (!x.is_contiguous()) {
    x = x.contiguous();
  }
  return {x, n == 0 ? 0 : x.numel() / n, n, stride};
}

std::vector<float> weight_f32(const at::Tensor& w, int64_t n, const char* name) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n, name, " must be [", n, "]");
  check_float_type(w, name);
  const at::Tensor wc = w.contiguous();
  std::vector<float> out(n);
  if (wc.scalar_type() == at::kFloat) {
    std::memcpy(out.data(), wc.data_ptr<float>(), n * sizeof(float));
  } else {
    const bf16* p = reinterpret_cast<const bf16*>(wc.data_ptr());
    for (int64_t i = 0; i < n; i++) out[i] = static_cast<float>(p[i]);
  }
  return out;
}

// out[i] = rnd(w[i] · rnd(x[i] · r)) with r = 1/sqrt(mean(x²) + eps): TorchOps.rms_norm's
// arithmetic (normalize in float32, round to x's dtype, then scale by the weight).
template <typename T>
inline void rms_norm_row(const T* x, const float* w, float eps, int64_t n, T* out) {
  const float r = 1.0f / std::sqrt(sum_squares(x, n) / (float)n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = from_f<T>(w[i] * rnd<T>(to_f(x[i]) * r));
}


}  // namespace

// x [..., n] → weight · x / rms(x) in float32 math, returned in x's dtype (a new tensor).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const Rows x = as_rows(x_in, "x");
  const std::vector<float> w = weight_f32(weight, x.n, "weight");
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  at::Tensor out = at::empty(shape, x_in.options().memory_format(at::MemoryFormat::Contiguous));
  dispatch_float(x.t.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x.t);
    T* op = ptr<T>(out);
    at::parallel_for(0, x.rows, row_grain(x.n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; r++) rms_norm_row<T>(xp + r * x.stride, w.data(), (float)eps, x.n, op + r * x.n);
    });
  });
  return out;
}

// residual += x (rounded to residual's dtype, IN PLACE), then (rms_norm(residual), residual).
// residual must be contiguous and of x's dtype and shape; the returned residual is the same tensor.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, at::Tensor& residual, const at::Tensor& weight,
                                                double eps) {
  const Rows x = as_rows(x_in, "x");
  check_float_type(residual, "residual");
  TORCH_CHECK(residual.is_contiguous() && residual.scalar_type() == x_in.scalar_type() && residual.sizes() == x_in.sizes(),
              "residual must be contiguous, with x's dtype and shape");
  const std::vector<float> w = weight_f32(weight, x.n, "weight");
  at::Tensor out = at::empty_like(residual);
  dispatch_float(x.t.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x.t);
    T* rp = ptr<T>(residual);
    T* op = ptr<T>(out);
    at::parallel_for(0, x.rows, row_grain(x.n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; r++) {
        T* res = rp + r * x.n;
        const T* xr = xp + r * x.stride;
        for (int64_t i = 0; i < x.n; i++) res[i] = from_f<T>(to_f(res[i]) + to_f(xr[i]));
        rms_norm_row<T>(res, w.data(), (float)eps, x.n, op + r * x.n);
      }
    });
  });
  return {out, residual};
}

// gate_up [T, 2I] (gate then up) → silu(gate) · up [T, I], x's dtype; silu(g) = g / (1 + exp(-g)).
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const Rows x = as_rows(gate_up_in, "gate_up");
  TORCH_CHECK(gate_up_in.dim() == 2 && x.n % 2 == 0, "gate_up must be [T, 2 * I]");
  const int64_t I = x.n / 2;
  at::Tensor out = at::empty({x.rows, I}, gate_up_in.options().memory_format(at::MemoryFormat::Contiguous));
  dispatch_float(x.t.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x.t);
    T* op = ptr<T>(out);
    at::parallel_for(0, x.rows, row_grain(x.n), [&](int64_t b, int64_t e) {
      alignas(64) float silu[16];
      for (int64_t r = b; r < e; r++) {
        const T* g = xp + r * x.stride;
        const T* u = g + I;
        T* o = op + r * I;
        for (int64_t i = 0; i < I; i += 16) {
          const int64_t n = std::min<int64_t>(16, I - i);
#if SS_SIMD16
          const V16 gv = load16_first(g + i, n);
          const V16 sv = simd16::silu(gv);
          if constexpr (std::is_same_v<T, float>) {
            if (n == 16) {  // the same one multiply per element as below, 16 at a time (it was 6% of a prefill)
              simd16::store(o + i, simd16::mul(sv, simd16::load(u + i)));
              continue;
            }
          }
          simd16::store(silu, sv);
#else
          for (int64_t l = 0; l < n; l++) {
            const float gl = to_f(g[i + l]);
            silu[l] = gl / (1.0f + std::exp(-gl));
          }
#endif
          for (int64_t l = 0; l < n; l++) o[i + l] = from_f<T>(rnd<T>(silu[l]) * to_f(u[i + l]));
        }
      }
    });
  });
  return out;
}

namespace {

struct CacheLayouts {
  CacheLayout k, v;
};

CacheLayouts check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t Hkv, int64_t D) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == Hkv && k_cache.size(3) == D,
              "k_cache and v_cache must be [num_blocks, block_size, ", Hkv, ", ", D, "]");
  check_kv_type(k_cache, v_cache);
  return {k_layout(k_cache), v_layout(v_cache)};
}

// One head's D values (already in the cache's type) into K's slot `slot` (flat), head g.
template <typename C>
inline void store_key(const C* src, C* k_cache, const CacheLayout& kl, int64_t slot, int64_t g, int64_t D) {
  C* dst = k_cache + kl.at_slot(slot, g);
  if (kl.d == 1) {
    std::memcpy(dst, src, D * sizeof(C));
  } else {
    for (int64_t d = 0; d < D; d++) dst[d * kl.d] = src[d];
  }
}

// n values from src to dst, rounded to dst's type (a copy when the types agree).
template <typename T, typename C>
inline void store_row(const T* src, C* dst, int64_t n) {
  if constexpr (std::is_same<T, C>::value) {
    std::memcpy(dst, src, n * sizeof(T));
  } else {
    for (int64_t i = 0; i < n; i++) dst[i] = from_f<C>(to_f(src[i]));
  }
}

// A token's Hkv value heads (Hkv · D values, head by head) into V's slot `slot` (flat), rounded to
// the cache's type: one run when token-major, a run per head when head-major.
template <typename T, typename C>
inline void store_values(const T* src, C* v_cache, const CacheLayout& vl, int64_t slot, int64_t Hkv, int64_t D) {
  if (vl.head == D) return store_row(src, v_cache + vl.at_slot(slot, 0), Hkv * D);
  for (int64_t g = 0; g < Hkv; g++) store_row(src + g * D, v_cache + vl.at_slot(slot, g), D);
}

const int64_t* slots_ptr(const at::Tensor& slot_mapping, int64_t num_slots, at::Tensor& holder) {
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong, "slot_mapping must be 1-D int64");
  holder = slot_mapping.contiguous();
  const int64_t* p = holder.data_ptr<int64_t>();
  for (int64_t i = 0; i < holder.size(0); i++)
    TORCH_CHECK(p[i] >= 0 && p[i] < num_slots, "slot ", p[i], " outside the cache's [0, ", num_slots, ")");
  return p;
}

// One head: optional per-head RMSNorm, then RoPE (cos/sin already rounded to T), into dst.
// T: the activations' dtype (every rounding the layer makes); C: dst's (q: T; a cached K: the KV
// cache's, one more rounding as it is stored, as `k.to(cache dtype)` would).
template <typename T, typename C = T>
inline void norm_rope_head(const T* src, const float* norm_w, float eps, const float* c, const float* s, int64_t D,
                           bool interleaved, C* dst) {
  alignas(64) float x[512];
  if (norm_w != nullptr) {
    const float r = 1.0f / std::sqrt(sum_squares(src, D) / (float)D + eps);
    for (int64_t d = 0; d < D; d++) x[d] = rnd<T>(norm_w[d] * rnd<T>(to_f(src[d]) * r));
  } else {
    for (int64_t d = 0; d < D; d++) x[d] = to_f(src[d]);
  }
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i++) {
    const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float x1 = x[a], x2 = x[b];
    dst[a] = from_f<C>(rnd<T>(rnd<T>(x1 * c[i]) - rnd<T>(x2 * s[i])));
    dst[b] = from_f<C>(rnd<T>(rnd<T>(x2 * c[i]) + rnd<T>(x1 * s[i])));
  }
}

}  // namespace

// The qkv matmul's output → q, with K and V stored in the paged cache:
//   qkv [T, (H + 2 Hkv) · D] (q heads, k heads, v heads); q_norm, k_norm [D] or None (qwen3);
//   cos_table, sin_table [context, D/2] float32, indexed by positions [T] int64;
//   slot_mapping [N ≤ T] int64: token t < N writes its roped K and its V to flat slot
//   slot_mapping[t] of k_cache / v_cache [num_blocks, block_size, Hkv, D] (IN PLACE).
// Returns q [T, H, D] (normed and roped) in qkv's dtype. The arithmetic is TorchOps'
// rms_norm then rope (cos/sin rounded to the activations' dtype first).
at::Tensor qkv_rope_write(const at::Tensor& qkv_in, int64_t H, int64_t Hkv, const c10::optional<at::Tensor>& q_norm,
                          const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& cos_table,
                          const at::Tensor& sin_table, const at::Tensor& positions_in, const at::Tensor& slot_mapping,
                          at::Tensor& k_cache, at::Tensor& v_cache, bool interleaved) {
  const Rows x = as_rows(qkv_in, "qkv");
  TORCH_CHECK(qkv_in.dim() == 2, "qkv must be [T, (H + 2 Hkv) * D]");
  TORCH_CHECK(H > 0 && Hkv > 0 && x.n % (H + 2 * Hkv) == 0, "qkv's width ", x.n, " is not (H + 2 Hkv) * D");
  const int64_t D = x.n / (H + 2 * Hkv);
  TORCH_CHECK(D % 2 == 0 && D <= 512, "head_dim must be even and at most 512");
  const int64_t T = x.rows;
  const auto [kl, vl] = check_cache(k_cache, v_cache, Hkv, D);
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == D / 2 && cos_table.sizes() == sin_table.sizes() &&
                  cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat,
              "cos_table and sin_table must be float32 [context, ", D / 2, "]");
  const at::Tensor cos_t = cos_table.contiguous(), sin_t = sin_table.contiguous();
  TORCH_CHECK(positions_in.dim() == 1 && positions_in.size(0) == T && positions_in.scalar_type() == at::kLong,
              "positions must be int64 [", T, "]");
  const at::Tensor positions = positions_in.contiguous();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos_t.size(0), "position ", pp[t], " outside the RoPE table's ", cos_t.size(0));
  at::Tensor slots_holder;
  const int64_t* slots = slots_ptr(slot_mapping, k_cache.size(0) * k_cache.size(1), slots_holder);
  const int64_t N = slot_mapping.size(0);
  TORCH_CHECK(N <= T, "slot_mapping has more tokens (", N, ") than qkv (", T, ")");
  std::vector<float> qw, kw;
  if (q_norm.has_value() && q_norm->defined()) qw = weight_f32(*q_norm, D, "q_norm");
  if (k_norm.has_value() && k_norm->defined()) kw = weight_f32(*k_norm, D, "k_norm");
  at::Tensor q = at::empty({T, H, D}, qkv_in.options().memory_format(at::MemoryFormat::Contiguous));
  const float* cp = cos_t.data_ptr<float>();
  const float* sp = sin_t.data_ptr<float>();
  dispatch_float(x.t.scalar_type(), "qkv_rope_write", [&](auto tag) {
    dispatch_kv(k_cache.scalar_type(), [&](auto kv_tag) {
      using T_ = decltype(tag);
      using C = decltype(kv_tag);
      const T_* xp = ptr<T_>(x.t);
      T_* qp = ptr<T_>(q);
      C* kc = ptr<C>(k_cache);
      C* vc = ptr<C>(v_cache);
      at::parallel_for(0, T, row_grain(x.n), [&](int64_t b, int64_t e) {
        alignas(64) float c[256], s[256];
        alignas(64) C key[512];
        for (int64_t t = b; t < e; t++) {
          const T_* row = xp + t * x.stride;
          for (int64_t i = 0; i < D / 2; i++) {
            c[i] = rnd<T_>(cp[pp[t] * (D / 2) + i]);
            s[i] = rnd<T_>(sp[pp[t] * (D / 2) + i]);
          }
          for (int64_t h = 0; h < H; h++)
            norm_rope_head<T_>(row + h * D, qw.empty() ? nullptr : qw.data(), (float)eps, c, s, D, interleaved,
                               qp + (t * H + h) * D);
          if (t < N) {
            for (int64_t g = 0; g < Hkv; g++) {
              norm_rope_head<T_, C>(row + (H + g) * D, kw.empty() ? nullptr : kw.data(), (float)eps, c, s, D,
                                    interleaved, key);
              store_key(key, kc, kl, slots[t], g, D);
            }
            store_values(row + (H + Hkv) * D, vc, vl, slots[t], Hkv, D);
          }
        }
      });
    });
  });
  return q;
}

// x [T, heads, D] → RoPE(x) (a new tensor, x's dtype); cos, sin [T, D/2] float32 per token.
// TorchOps.rope's arithmetic (cos/sin rounded to x's dtype first).
at::Tensor rope(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  check_float_type(x_in, "x");
  TORCH_CHECK(x_in.dim() == 3, "x must be [T, heads, D]");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), Hx = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0 && D <= 512, "head_dim must be even and at most 512");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D / 2 && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos and sin must be float32 [", T, ", ", D / 2, "]");
  const at::Tensor ct = cos.contiguous(), st = sin.contiguous();
  at::Tensor out = at::empty_like(x);
  dispatch_float(x.scalar_type(), "rope", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = ptr<T_>(x);
    T_* op = ptr<T_>(out);
    const float* cp = ct.data_ptr<float>();
    const float* sp = st.data_ptr<float>();
    at::parallel_for(0, T, row_grain(Hx * D), [&](int64_t b, int64_t e) {
      alignas(64) float c[256], s[256];
      for (int64_t t = b; t < e; t++) {
        for (int64_t i = 0; i < D / 2; i++) {
          c[i] = rnd<T_>(cp[t * (D / 2) + i]);
          s[i] = rnd<T_>(sp[t * (D / 2) + i]);
        }
        for (int64_t h = 0; h < Hx; h++)
          norm_rope_head<T_>(xp + (t * Hx + h) * D, nullptr, 0.f, c, s, D, interleaved, op + (t * Hx + h) * D);
      }
    });
  });
  return out;
}

// k, v [N, Hkv, D] → slots slot_mapping[N] of k_cache / v_cache (IN PLACE), like attention.write_kv.
void write_kv(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_in.dim() == 3 && k_in.sizes() == v_in.sizes(), "k and v must be [N, Hkv, D]");
  const int64_t N = k_in.size(0), Hkv = k_in.size(1), D = k_in.size(2);
  check_float_type(k_in, "k");
  TORCH_CHECK(v_in.scalar_type() == k_in.scalar_type(), "k and v must share a dtype");
  const auto [kl, vl] = check_cache(k_cache, v_cache, Hkv, D);
  TORCH_CHECK(slot_mapping.size(0) == N, "slot_mapping must have one slot per token");
  at::Tensor holder;
  const int64_t* slots = slots_ptr(slot_mapping, k_cache.size(0) * k_cache.size(1), holder);
  // Rows may be strided (views of the qkv output) as long as each token's heads are packed.
  auto packed = [&](const at::Tensor& t) {
    return (t.stride(2) == 1 && t.stride(1) == D) ? t : t.contiguous();
  };
  const at::Tensor k = packed(k_in), v = packed(v_in);
  dispatch_float(k.scalar_type(), "write_kv", [&](auto tag) {
    dispatch_kv(k_cache.scalar_type(), [&](auto kv_tag) {
      using T = decltype(tag);
      using C = decltype(kv_tag);
      const T* kp = ptr<T>(k);
      const T* vp = ptr<T>(v);
      C* kc = ptr<C>(k_cache);
      C* vc = ptr<C>(v_cache);
      std::vector<C> key(Hkv * D);
      for (int64_t t = 0; t < N; t++) {
        store_row(kp + t * k.stride(0), key.data(), Hkv * D);
        for (int64_t g = 0; g < Hkv; g++) store_key(key.data() + g * D, kc, kl, slots[t], g, D);
        store_values(vp + t * v.stride(0), vc, vl, slots[t], Hkv, D);
      }
    });
  });
}

bool has_bf16_dot_products() { return SS_BF16_DOT; }

// Whether attention over a bfloat16 cache with these heads runs on the AMX tiles.
bool attention_on_tiles(int64_t head_dim) {
#if SS_AMX_TILES
  return head_dim % 32 == 0 && head_dim <= AMX_MAX_HEAD_DIM && amx::request_permission();
#else
  (void)head_dim;
  return false;
#endif
}

void register_layer_ops(pybind11::module_& m) {
  m.def("has_bf16_dot_products", &has_bf16_dot_products,
        "whether this build has AVX512-BF16's dot products: the bf16 matmul (`--matmul bf16`, on the AMX tiles "
        "where usable, else VDPBF16PS), and attention over a bfloat16 KV cache that rounds q and the "
        "probabilities to bfloat16 and multiplies in hardware rather than in float32");
  m.def("paged_attention", &paged_attention,
        "causal attention of each query row over its own request's paged KV (float32 math, batch-invariant)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("query_starts"), py::arg("query_lens"),
        py::arg("context_lens"), py::arg("block_tables"), py::arg("scale"), py::arg("window_starts") = py::none(),
        py::arg("window_positions") = py::none(), py::arg("tiles") = true);
  m.def("attention_on_tiles", &attention_on_tiles,
        "whether attention over a bfloat16 KV cache with heads of head_dim runs on the AMX tiles: 32 or 64, on a "
        "build that has them, in a process the OS lets use them",
        py::arg("head_dim"));
  m.def("rms_norm", &rms_norm, "weight · x / rms(x), float32 math, x's dtype", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place; returns (rms_norm(residual), residual)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_mul", &silu_mul, "[T, 2I] (gate, up) → silu(gate) · up [T, I]", py::arg("gate_up"));
  m.def("qkv_rope_write", &qkv_rope_write,
        "qkv → q [T, H, D] after optional q/k RMSNorm and RoPE; K and V written to the paged cache in place",
        py::arg("qkv"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("q_norm"), py::arg("k_norm"),
        py::arg("eps"), py::arg("cos_table"), py::arg("sin_table"), py::arg("positions"), py::arg("slot_mapping"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("interleaved") = false);
  m.def("rope", &rope, "x [T, heads, D] → RoPE(x), cos/sin [T, D/2] float32", py::arg("x"), py::arg("cos"),
        py::arg("sin"), py::arg("interleaved") = false);
  m.def("write_kv", &write_kv, "k, v [N, Hkv, D] into their slots of the paged cache (in place)", py::arg("k"),
        py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
}
