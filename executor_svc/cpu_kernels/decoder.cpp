// A dense decoder's layers (llama, qwen2, qwen3) run in one call from Python.
//
// The model's Python loop (model.py, `Transformer.forward_prepared`) makes nine kernel
// calls per layer; at batch 1 on a small model, their Python and binding overhead
// (~3 ms of a ~9 ms step on two cores) left the second thread idle a third of the step.
// `DenseStack` holds each layer's weights once and runs the same kernels, in the same
// order, with the same arguments, from C++: its output is bit-identical to the loop's.
//
// Per layer:  qkv = x·Wqkvᵀ (+ bias) → q/k norm, RoPE, K/V into the cache → attention →
//             x, residual = add_rms_norm(attn·Woᵀ, residual, ffn_norm) →
//             x, residual = add_rms_norm(silu(gate)·up·Wdownᵀ, residual, next layer's attn_norm).
//
// The last layer's output feeds only the LM head, so past its K/V writes it runs on the rows that
// need logits alone (llama.cpp's trim of unused outputs): a prompt's last token rather than all
// of a chunk's, none for a chunk mid-prompt. Every kernel here computes a row on its own (the
// same bits whatever rows share the call), so those rows' bits are the full layer's.

#include "kernels.h"

#include <optional>
#include <vector>

namespace {

// How one part of a matmul weight is multiplied (weight_format.py's `linear`):
enum LinearKind : int64_t {
  DENSE = 0,  // a float tensor [N, K]: at::linear
  EXACT = 1,  // GGUF rows [N, row_bytes]: qlinear (dequantize, float32 dot products)
  INT16 = 2,  // Q4_0/Q4_1/Q8_0 rows in 16-row panels (repack_panels): qlinear_int16
  INT8 = 4,   // the same panels with int8 activations: qlinear_int8 (3 is Triton's, never here)
  BF16 = 5,   // bf16 panels [panels, K / 32, 16, 32] (bf16_panels): qlinear_bf16 (AMX tiles or VDPBF16PS)
};

struct LinearPart {
  at::Tensor data;
  int64_t kind, type, k, n;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case INT16: return qlinear_int16(x, data, type, k, n);
      case INT8: return qlinear_int8(x, data, type, k, n);
      case BF16: return qlinear_bf16(x, data, n);
      case EXACT: return qlinear(x, data, type, k);
      default: return at::linear(x, data);
    }
  }
};

// A matmul weight: one part, or parts whose outputs are concatenated (rows of different types).
struct Linear {
  std::vector<LinearPart> parts;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    if (parts.size() == 1 && parts[0].kind == DENSE) return at::linear(x, parts[0].data, bias);  // F.linear(x, w, bias)
    at::Tensor y;
    if (parts.size() == 1) {
      y = parts[0](x);
    } else {
      std::vector<at::Tensor> ys;
      ys.reserve(parts.size());
      for (const LinearPart& p : parts) ys.push_back(p(x));
      y = at::cat(ys, -1);
    }
    return bias ? y + *bias : y;
  }
};

using PartSpec = std::tuple<at::Tensor, int64_t, int64_t, int64_t, int64_t>;  // (data, kind, type, k, n)

// A step's query rows as paged_attention takes them: (query_starts, query_lens, context_lens,
// block_tables, window_starts, window_positions) — cpu_ops.py's CpuAttentionMetadata.
using AttentionRows = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                                 c10::optional<at::Tensor>>;

Linear make_linear(const std::vector<PartSpec>& specs, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(!specs.empty(), "a matmul weight needs at least one part");
  Linear l;
  for (const auto& [data, kind, type, k, n] : specs) {
    TORCH_CHECK(kind == DENSE || kind == EXACT || kind == INT16 || kind == INT8 || kind == BF16, "unknown matmul kind ", kind);
    TORCH_CHECK(data.device().is_cpu(), "the CPU layer stack needs its weights on the CPU");
    l.parts.push_back({data, kind, type, k, n});
  }
  if (bias.has_value() && bias->defined()) l.bias = *bias;
  return l;
}

struct DenseLayer {
  Linear qkv, o_proj, gate_up, down;
  c10::optional<at::Tensor> q_norm, k_norm;
  at::Tensor ffn_norm, next_norm;  // next_norm: the next layer's attn_norm, or the final norm
  bool swiglu_fused;            // gate_up and down one bf16 part each, unbiased (swiglu_fits_bf16)

  // down(silu(gate) · up): in one call where both matmuls are bf16 (the same bits,
  // without gate_up's float32 output stored and read back), else the three calls of the layer loop.
  at::Tensor ffn(const at::Tensor& x) const {
    if (swiglu_fused && x.scalar_type() == at::kFloat)
      return qlinear_bf16_swiglu(x, gate_up.parts[0].data, down.parts[0].data, down.parts[0].n);
    return down(silu_mul(gate_up(x)));
  }
};

// Whether qlinear_bf16_swiglu can run a layer's FFN: both weights one bf16 part, no bias, and
// gate_up twice as many rows as down's K (a multiple of 32).
bool swiglu_fits_bf16(const Linear& gate_up, const Linear& down) {
  const auto one_bf16 = [](const Linear& l) { return l.parts.size() == 1 && l.parts[0].kind == BF16 && !l.bias; };
  return one_bf16(gate_up) && one_bf16(down) && down.parts[0].k % 32 == 0 && gate_up.parts[0].n == 2 * down.parts[0].k;
}

class DenseStack {
 public:
  DenseStack(int64_t num_heads, int64_t num_kv_heads, double eps, double scale)
      : H_(num_heads), Hkv_(num_kv_heads), eps_(eps), scale_(scale) {}

  void add_layer(const std::vector<PartSpec>& qkv, const c10::optional<at::Tensor>& qkv_bias,
                 const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                 const std::vector<PartSpec>& o_proj, const at::Tensor& ffn_norm, const std::vector<PartSpec>& gate_up,
                 const std::vector<PartSpec>& down, const at::Tensor& next_norm) {
    Linear gate_up_l = make_linear(gate_up, c10::nullopt), down_l = make_linear(down, c10::nullopt);
    const bool swiglu_fused = swiglu_fits_bf16(gate_up_l, down_l);
    layers_.push_back({make_linear(qkv, qkv_bias), make_linear(o_proj, c10::nullopt), std::move(gate_up_l),
                       std::move(down_l), q_norm, k_norm, ffn_norm, next_norm, swiglu_fused});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: the first layer's normed input; residual: the residual stream (both [T, hidden]; residual
  // is updated IN PLACE, but for a trimmed last layer, which adds to its logits rows' copy).
  // kv: each layer's (K, V) cache, [num_blocks, block_size, Hkv, D] each.
  // `attention`: the step's requests as paged_attention reads them. `logits_rows` (with the
  // attention of those rows alone, `logits_attention`): the rows the LM head reads, where they
  // are fewer than the step's; the last layer then runs past its K/V write on them alone.
  // Returns the final norm of the last residual for the LM head: for `logits_rows` where given
  // (in that order), else for every row.
  at::Tensor forward(at::Tensor x, at::Tensor residual, const std::vector<std::pair<at::Tensor, at::Tensor>>& kv,
                     const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& positions,
                     const at::Tensor& slot_mapping, const AttentionRows& attention,
                     const c10::optional<at::Tensor>& logits_rows,
                     const c10::optional<AttentionRows>& logits_attention) const {
    TORCH_CHECK(static_cast<int64_t>(kv.size()) == num_layers(), "kv must hold ", num_layers(), " layers' (K, V)");
    TORCH_CHECK(logits_rows.has_value() == logits_attention.has_value(), "logits_rows and logits_attention come together");
    for (int64_t i = 0; i < num_layers(); i++) {
      const DenseLayer& layer = layers_[i];
      at::Tensor k_cache = kv[i].first;
      at::Tensor v_cache = kv[i].second;
      const at::Tensor qkv = layer.qkv(x);
      at::Tensor q = qkv_rope_write(qkv, H_, Hkv_, layer.q_norm, layer.k_norm, eps_, cos_table, sin_table, positions,
                                    slot_mapping, k_cache, v_cache, false);
      const AttentionRows* rows = &attention;
      if (i == num_layers() - 1 && logits_rows.has_value()) {  // the LM head's rows from here on
        if (logits_rows->numel() == 0) return x.new_empty({0, x.size(1)});
        q = q.index_select(0, *logits_rows);
        residual = residual.index_select(0, *logits_rows);
        rows = &*logits_attention;
      }
      const auto& [starts, lens, contexts, tables, window_starts, window_positions] = *rows;
      const at::Tensor attn =
          paged_attention(q, k_cache, v_cache, starts, lens, contexts, tables, scale_, window_starts, window_positions);
      std::tie(x, residual) =
          add_rms_norm(layer.o_proj(attn.view({attn.size(0), -1})), residual, layer.ffn_norm, eps_);
      std::tie(x, residual) = add_rms_norm(layer.ffn(x), residual, layer.next_norm, eps_);
    }
    return x;
  }

 private:
  int64_t H_, Hkv_;
  double eps_, scale_;
  std::vector<DenseLayer> layers_;
};

}  // namespace

void register_decoder(pybind11::module_& m) {
  py::class_<DenseStack>(m, "DenseStack",
                         "a dense decoder's layers, run in one call (bit-identical to model.py's layer loop)")
      .def(py::init<int64_t, int64_t, double, double>(), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("eps"), py::arg("scale"))
      .def("add_layer", &DenseStack::add_layer, "one layer's weights; a matmul weight is a list of "
           "(data, kind, type, k, n) parts", py::arg("qkv"), py::arg("qkv_bias"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("o_proj"), py::arg("ffn_norm"), py::arg("gate_up"), py::arg("down"),
           py::arg("next_norm"))
      .def_property_readonly("num_layers", &DenseStack::num_layers)
      .def("forward", &DenseStack::forward, py::arg("x"), py::arg("residual"), py::arg("kv"), py::arg("cos_table"),
           py::arg("sin_table"), py::arg("positions"), py::arg("slot_mapping"), py::arg("attention"),
           py::arg("logits_rows") = py::none(), py::arg("logits_attention") = py::none());
}
