"""GGUF tensors → the weights the forward pass uses.

Matmul weights stay in their GGUF type (`weight_format.PackedWeight`): on the CPU
for the C++ kernels, on the device for the Triton dequant-matmul (`triton`); only
`--kernels torch` on a GPU dequantizes them once to the compute dtype. Two GGUF conventions are
undone here, on rows, so the forward pass has one shape for every architecture:

- llama.cpp's converter permutes the Q and K rows of `llama` models so that RoPE
  rotates interleaved pairs (x0, x1), (x2, x3), ...; we permute them back to the
  half-split layout Hugging Face uses (x_i pairs with x_{i + d/2}), which is what
  qwen2/qwen3 files already use. Transformers does the same when it loads a GGUF.
- Q, K and V are concatenated into one matrix and gate/up into another, so a layer
  runs three GEMMs instead of five. A DeltaNet layer's qkv, z, beta and alpha
  projections likewise become one matrix.

Mixture-of-experts tensors are 3-D in GGUF (`ffn_{gate,up,down}_exps`: [experts,
rows, cols]); each expert's rows are sliced out into its own matmul weight, gate and
up fused, so the experts run through the same `linear` as everything else.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from executor_svc.errors import ModelLoadError
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.weight_format import Kernel, PackedWeight, Weight, weight_bytes

if TYPE_CHECKING:  # reading GGUF files needs the gguf package; the shapes alone do not
    from executor_svc.weights.gguf_file import GGUFFile, GGUFTensor


@dataclass
class MoeWeights:
    """A sparse FFN: a router over experts, each a SwiGLU MLP, and optionally a gated shared expert."""

    router: Weight  # [num_experts, hidden]
    expert_gate_up: list[Weight]  # per expert [2 * expert_intermediate, hidden]
    expert_down: list[Weight]  # per expert [hidden, expert_intermediate]
    shared_gate_up: Weight | None = None  # [2 * shared_intermediate, hidden]
    shared_down: Weight | None = None  # [hidden, shared_intermediate]
    shared_gate: torch.Tensor | None = (
        None  # [hidden]: the shared expert's output is scaled by sigmoid(x · shared_gate)
    )


@dataclass
class DeltaNetWeights:
    """A Gated DeltaNet (linear attention) layer, value heads in ggml's tiled order
    (value head h reads key head h % num_key_heads)."""

    in_proj: Weight  # [conv_dim + value_dim + 2 * value_heads, hidden]: qkv, z, beta, alpha
    conv: torch.Tensor  # [conv_dim, conv_kernel]: depthwise causal conv over q, k, v
    dt_bias: torch.Tensor  # [value_heads]
    a: torch.Tensor  # [value_heads]: -exp(A_log), the per-head decay rate
    norm: torch.Tensor  # [value_head_dim]: gated RMSNorm of each head's output
    out_proj: Weight  # [hidden, value_dim]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    # Full attention (None in a DeltaNet layer). Gated (qwen35): each head's q rows are
    # followed by as many output-gate rows.
    qkv: Weight | None  # [(num_heads * (2 if gated else 1) + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    o_proj: Weight | None  # [hidden, num_heads * head_dim]
    ffn_norm: torch.Tensor  # [hidden]
    gate_up: Weight | None  # [2 * intermediate, hidden]; None with experts
    down: Weight | None  # [hidden, intermediate]
    moe: MoeWeights | None = None
    delta_net: DeltaNetWeights | None = None


@dataclass
class ModelWeights:
    embed: Weight  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Weight  # [vocab, hidden]; the embedding itself when tied
    rope_freq_factors: torch.Tensor | None  # [head_dim // 2]

    @property
    def is_packed(self) -> bool:
        return not isinstance(self.lm_head, torch.Tensor)

    @property
    def num_bytes(self) -> int:
        """Resident bytes of every weight (the tied embedding counted once)."""
        tensors = [self.embed, self.final_norm, self.rope_freq_factors]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        return sum(weight_bytes(t) for t in tensors) + sum(_nested_bytes(layer) for layer in self.layers)

    @property
    def streamed_bytes(self) -> int:
        """Weight bytes one decode step reads: every layer and the LM head (the embedding only by
        row; every expert of an MoE layer: a bound there), so the step's floor is this over the
        memory bandwidth."""
        return sum(_nested_bytes(layer) for layer in self.layers) + weight_bytes(self.lm_head)


def _nested_bytes(value) -> int:
    """Resident bytes of a weights dataclass, its nested dataclasses and lists of weights."""
    if value is None:
        return 0
    if isinstance(value, (LayerWeights, MoeWeights, DeltaNetWeights)):
        return sum(_nested_bytes(getattr(value, f.name)) for f in fields(value))
    if isinstance(value, list):
        return sum(_nested_bytes(v) for v in value)
    return weight_bytes(value)


def unpermute_qk_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE permutation of Q/K rows (its `permute` inverted)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_weights(
    gguf: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    packed: bool | None = None,
    matmul_kernel: Kernel | None = None,
    triton: bool = False,
) -> ModelWeights:
    """The model's weights: matmul weights packed in their GGUF type (`packed`, the CPU
    default) or dequantized to `dtype` (`--kernels torch` on a GPU); norms and biases in `dtype`.
    `matmul_kernel` (Kernel.INT16 or INT8): packed Q4_0/Q4_1/Q8_0 weights multiply with activations
    quantized to int16 (`--matmul int16`) or int8 (`--matmul int8`) per 32-value block; BF16
    (`--matmul bf16`): the layers' weights dequantized and rounded to bf16 in the AMX tiles' layout
    (which the VDPBF16PS kernel reads too).
    `triton`: packed weights go to `device` as plain GGUF rows, for the Triton dequant-matmul."""
    if packed is None:
        packed = device.type == "cpu" or triton
    if matmul_kernel is not None and not packed:
        raise ValueError("the CPU matmul kernels (int16, int8, bf16) run packed weights only")
    if triton and (matmul_kernel is not None or not packed):
        raise ValueError("the Triton dequant-matmul runs packed weights in the plain GGUF layout")

    def tensor(name: str, shape: tuple[int, ...]) -> GGUFTensor:
        found = gguf.tensors.get(name)
        if found is None:
            raise ModelLoadError(f"{gguf.path}: tensor {name!r} is missing")
        if found.shape != shape:
            raise ModelLoadError(f"{gguf.path}: tensor {name!r} has shape {found.shape}, expected {shape}")
        return found

    def vector(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        values = np.ascontiguousarray(tensor(name, shape).dequantize())
        return torch.from_numpy(values.copy()).to(device=device, dtype=dtype)

    def matrix(
        names: list[str],
        shapes: list[tuple[int, int]],
        num_heads: list[int | None] | None = None,
        kernel: Kernel | None = matmul_kernel,
    ) -> Weight:
        """One matmul weight from the rows of one or more GGUF tensors (a fused QKV or gate/up),
        multiplied by the integer matmul `kernel` where its type allows (the model's unless told)."""
        heads = num_heads or [None] * len(names)
        parts = []
        for name, shape, n in zip(names, shapes, heads):
            t = tensor(name, shape)
            # llama Q/K rows back to half-split RoPE order; rows are independent in every GGUF type.
            order = unpermute_qk_rows(np.arange(shape[0]), n) if n else None
            if packed:
                parts.append(PackedWeight.from_gguf(t, order))
            else:
                values = t.dequantize()
                parts.append(values if order is None else values[order])
        if packed:
            return for_matmul(parts[0] if len(parts) == 1 else PackedWeight.concat(parts), kernel)
        values = np.ascontiguousarray(np.concatenate(parts))
        return torch.from_numpy(values).to(device=device, dtype=dtype)

    def expert_matrices(name: str, shape: tuple[int, int, int]) -> list[Weight]:
        """The experts of a 3-D [experts, rows, cols] tensor, one matmul weight each."""
        t = tensor(name, shape)
        num_experts, rows, cols = shape
        if packed:
            raw = np.asarray(t.raw).view(np.uint8).reshape(num_experts, rows, -1)
            return [
                PackedWeight(torch.from_numpy(raw[e].copy()), int(t.tensor_type), (rows, cols))
                for e in range(num_experts)
            ]
        values = t.dequantize()
        return [
            torch.from_numpy(np.ascontiguousarray(values[e])).to(device=device, dtype=dtype) for e in range(num_experts)
        ]

    def fuse(parts: list[Weight]) -> Weight:
        if packed:
            return PackedWeight.concat(parts)
        return torch.cat(parts)

    def for_matmul(w: Weight, kernel: Kernel | None = matmul_kernel) -> Weight:
        """A packed weight in the layout and the place its matmul reads (repacked for the integer
        matmul, or moved to the device for the Triton kernel: once, after any stacking)."""
        if isinstance(w, tuple):
            return tuple(for_matmul(part, kernel) for part in w)
        if not isinstance(w, PackedWeight):
            return w
        if kernel is not None:
            return w.for_kernel(kernel)
        return w.on_triton(device) if triton else w

    h, d = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    is_llama = config.architecture == "llama"
    is_gated_attention = config.is_hybrid  # Qwen3.5's full attention has a per-head output gate
    ffn_norm_name = "post_attention_norm" if config.is_hybrid else "ffn_norm"

    def attention(p: str) -> dict:
        bias = None
        if config.has_qkv_bias:
            bias = torch.cat(
                [
                    vector(p + "attn_q.bias", (q_rows,)),
                    vector(p + "attn_k.bias", (kv_rows,)),
                    vector(p + "attn_v.bias", (kv_rows,)),
                ]
            )
        q_shape = (2 * q_rows if is_gated_attention else q_rows, h)
        return dict(
            qkv=matrix(
                [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                [q_shape, (kv_rows, h), (kv_rows, h)],
                [config.num_heads, config.num_kv_heads, None] if is_llama else None,
            ),
            qkv_bias=bias,
            q_norm=vector(p + "attn_q_norm.weight", (d,)) if config.has_qk_norm else None,
            k_norm=vector(p + "attn_k_norm.weight", (d,)) if config.has_qk_norm else None,
            o_proj=matrix([p + "attn_output.weight"], [(h, q_rows)]),
        )

    def delta_net(p: str) -> dict:
        c = config
        heads = c.num_linear_value_heads
        return dict(
            qkv=None,
            qkv_bias=None,
            q_norm=None,
            k_norm=None,
            o_proj=None,
            delta_net=DeltaNetWeights(
                in_proj=matrix(
                    [p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight", p + "ssm_alpha.weight"],
                    [(c.conv_dim, h), (c.linear_value_dim, h), (heads, h), (heads, h)],
                ),
                conv=vector(p + "ssm_conv1d.weight", (c.conv_dim, c.conv_kernel)),
                dt_bias=vector(p + "ssm_dt.bias", (heads,)),
                a=vector(p + "ssm_a", (heads,)),
                norm=vector(p + "ssm_norm.weight", (c.linear_value_head_dim,)),
                out_proj=matrix([p + "ssm_out.weight"], [(h, c.linear_value_dim)]),
            ),
        )

    def dense_ffn(p: str) -> dict:
        inter = config.intermediate_size
        return dict(
            gate_up=matrix([p + "ffn_gate.weight", p + "ffn_up.weight"], [(inter, h), (inter, h)]),
            down=matrix([p + "ffn_down.weight"], [(h, inter)]),
        )

    def moe_ffn(p: str) -> dict:
        c = config
        n, ff = c.num_experts, c.expert_intermediate_size
        if p + "ffn_gate_up_exps.weight" in gguf.tensors:  # newer converters fuse gate and up
            gate_up = expert_matrices(p + "ffn_gate_up_exps.weight", (n, 2 * ff, h))
        else:
            gates = expert_matrices(p + "ffn_gate_exps.weight", (n, ff, h))
            ups = expert_matrices(p + "ffn_up_exps.weight", (n, ff, h))
            gate_up = [fuse([g, u]) for g, u in zip(gates, ups)]
        moe = MoeWeights(
            router=matrix([p + "ffn_gate_inp.weight"], [(n, h)]),
            expert_gate_up=[for_matmul(w) for w in gate_up],
            expert_down=[for_matmul(w) for w in expert_matrices(p + "ffn_down_exps.weight", (n, h, ff))],
        )
        if c.shared_expert_intermediate_size:
            sff = c.shared_expert_intermediate_size
            moe.shared_gate_up = matrix([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"], [(sff, h), (sff, h)])
            moe.shared_down = matrix([p + "ffn_down_shexp.weight"], [(h, sff)])
            gate_name = p + "ffn_gate_inp_shexp.weight"
            gate_shape = gguf.tensors[gate_name].shape if gate_name in gguf.tensors else (h,)
            moe.shared_gate = vector(gate_name, gate_shape if gate_shape in ((h,), (1, h)) else (h,)).reshape(h)
        return dict(gate_up=None, down=None, moe=moe)

    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        is_recurrent = bool(config.recurrent_layers and config.recurrent_layers[i])
        layers.append(
            LayerWeights(
                attn_norm=vector(p + "attn_norm.weight", (h,)),
                ffn_norm=vector(p + ffn_norm_name + ".weight", (h,)),
                **(delta_net(p) if is_recurrent else attention(p)),
                **(moe_ffn(p) if config.is_moe else dense_ffn(p)),
            )
        )
    # The logits' matmul keeps int16 activations under `--matmul int8` and `bf16`: it is a fixed
    # rule by weight, so batch invariance holds, and it costs nothing a prompt pays (one row of
    # logits per prompt; a decode step streams the weight from memory either way), where int8
    # there measured 97.8% top-1 agreement with exact against 98.3% (test_engine_reference.py),
    # and the embedding table it shares stays packed for lookups.
    logits_dot = Kernel.INT16 if matmul_kernel is not None else None
    embed = matrix(["token_embd.weight"], [(config.vocab_size, h)], kernel=logits_dot)
    lm_head = (
        embed if config.tie_word_embeddings else matrix(["output.weight"], [(config.vocab_size, h)], kernel=logits_dot)
    )
    freq_factors = None
    if config.has_rope_freq_factors:
        freq_factors = torch.from_numpy(tensor("rope_freqs.weight", (d // 2,)).dequantize().copy()).float()
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=vector("output_norm.weight", (h,)),
        lm_head=lm_head,
        rope_freq_factors=freq_factors,
    )
