// What the kernel files export to each other and to the Python module (bindings.cpp).
// Each *.cpp is one translation unit of the single extension module `swarmserve_cpu`;
// their helpers stay in anonymous namespaces, only these are shared.
#pragma once

#include <torch/extension.h>

#include <tuple>

// qlinear.cpp: matmuls over GGUF-typed weights.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t K);
// qlinear_int16's tiles (bit-identical): the engine's choice (AUTO: AMX from 16 rows where the CPU and
// the build have it, else PANELS), or one forced by the tests and benchmarks: PANELS (8 rows, 4 on AVX2,
// and one of the rest), ROWS (one row per tile), AMX (16 rows a tile unit op).
enum Int16Path : int64_t { INT16_AUTO = 0, INT16_ROWS = 1, INT16_PANELS = 2, INT16_AMX = 3 };
at::Tensor qlinear_int16(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t K, int64_t N,
                         int64_t path = INT16_AUTO);
// bf16(x) · bf16(W)ᵀ with float32 sums (`--matmul bf16`: the AMX tiles, else VDPBF16PS); wb: the weight's bf16 panels.
at::Tensor qlinear_bf16(const at::Tensor& x, const at::Tensor& wb, int64_t N);
// down(silu(gate) · up), the bits of qlinear_bf16 → silu_mul → qlinear_bf16, in one call.
at::Tensor qlinear_bf16_swiglu(const at::Tensor& x, const at::Tensor& gate_up_wb, const at::Tensor& down_wb, int64_t N);
// The same panels with int8 activations (AVX512-VNNI builds; `--matmul int8`), the same paths.
at::Tensor qlinear_int8(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t K, int64_t N,
                        int64_t path = INT16_AUTO);

// layer_ops.cpp: everything in a decoder layer except the matmuls.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_starts, const at::Tensor& query_lens, const at::Tensor& context_lens,
                           const at::Tensor& block_tables, double scale,
                           const c10::optional<at::Tensor>& window_starts = c10::nullopt,
                           const c10::optional<at::Tensor>& window_positions = c10::nullopt, bool tiles = true);
// Whether attention over a bfloat16 cache with heads of head_dim runs on the AMX tiles (32 or 64, AMX).
bool attention_on_tiles(int64_t head_dim);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                                                double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor qkv_rope_write(const at::Tensor& qkv, int64_t H, int64_t Hkv, const c10::optional<at::Tensor>& q_norm,
                          const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& cos_table,
                          const at::Tensor& sin_table, const at::Tensor& positions, const at::Tensor& slot_mapping,
                          at::Tensor& k_cache, at::Tensor& v_cache, bool interleaved);

// Each file's Python functions and classes, added to the one module.
void register_qlinear(pybind11::module_& m);
void register_layer_ops(pybind11::module_& m);
void register_decoder(pybind11::module_& m);
