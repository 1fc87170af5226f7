"""GGUF tensors → the weights the forward pass uses.

Matmul weights stay in their GGUF type on the CPU (`weight_format.PackedWeight`);
on a GPU they are dequantized once to the compute dtype. Two GGUF conventions are
undone here, on rows, so the forward pass has one shape for every architecture:

- llama.cpp's converter permutes the Q and K rows of `llama` models so that RoPE
  rotates interleaved pairs (x0, x1), (x2, x3), ...; we permute them back to the
  half-split layout Hugging Face uses (x_i pairs with x_{i + d/2}), which is what
  qwen2/qwen3 files already use. Transformers does the same when it loads a GGUF.
- Q, K and V are concatenated into one matrix and gate/up into another, so a layer
  runs three GEMMs instead of five.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from executor_svc.errors import ModelLoadError
from executor_svc.model_config import ModelConfig
from executor_svc.weight_format import PackedWeight, Weight, weight_bytes

if TYPE_CHECKING:  # reading GGUF files needs the gguf package; the shapes alone do not
    from executor_svc.gguf_file import GGUFFile, GGUFTensor


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    o_proj: Weight  # [hidden, num_heads * head_dim]
    ffn_norm: torch.Tensor  # [hidden]
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]


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
        for layer in self.layers:
            tensors += [getattr(layer, f.name) for f in fields(layer)]
        return sum(weight_bytes(t) for t in tensors)


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
    int16_dot: bool = False,
) -> ModelWeights:
    """The model's weights: matmul weights packed in their GGUF type (`packed`, the CPU
    default) or dequantized to `dtype` (the GPU path); norms and biases in `dtype`.
    `int16_dot`: packed Q4_0/Q4_1/Q8_0 weights multiply with int16-quantized activations."""
    if packed is None:
        packed = device.type == "cpu"
    if int16_dot and not packed:
        raise ValueError("the integer matmul runs packed weights only")

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

    def matrix(names: list[str], shapes: list[tuple[int, int]], num_heads: list[int | None] | None = None) -> Weight:
        """One matmul weight from the rows of one or more GGUF tensors (a fused QKV or gate/up)."""
        heads = num_heads or [None] * len(names)
        parts = []
        for name, shape, n in zip(names, shapes, heads):
            t = tensor(name, shape)
            # llama Q/K rows back to half-split RoPE order; rows are independent in every GGUF type.
            order = unpermute_qk_rows(np.arange(shape[0]), n) if n else None
            if packed:
                w = PackedWeight.from_gguf(t, order)
                parts.append(w.with_int16_dot() if int16_dot else w)
            else:
                values = t.dequantize()
                parts.append(values if order is None else values[order])
        if packed:
            return parts[0] if len(parts) == 1 else PackedWeight.concat(parts)
        values = np.ascontiguousarray(np.concatenate(parts))
        return torch.from_numpy(values).to(device=device, dtype=dtype)

    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    is_llama = config.architecture == "llama"
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        bias = None
        if config.has_qkv_bias:
            bias = torch.cat(
                [vector(p + "attn_q.bias", (q_rows,)), vector(p + "attn_k.bias", (kv_rows,)), vector(p + "attn_v.bias", (kv_rows,))]
            )
        layers.append(
            LayerWeights(
                attn_norm=vector(p + "attn_norm.weight", (h,)),
                qkv=matrix(
                    [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                    [(q_rows, h), (kv_rows, h), (kv_rows, h)],
                    [config.num_heads, config.num_kv_heads, None] if is_llama else None,
                ),
                qkv_bias=bias,
                q_norm=vector(p + "attn_q_norm.weight", (d,)) if config.has_qk_norm else None,
                k_norm=vector(p + "attn_k_norm.weight", (d,)) if config.has_qk_norm else None,
                o_proj=matrix([p + "attn_output.weight"], [(h, q_rows)]),
                ffn_norm=vector(p + "ffn_norm.weight", (h,)),
                gate_up=matrix([p + "ffn_gate.weight", p + "ffn_up.weight"], [(inter, h), (inter, h)]),
                down=matrix([p + "ffn_down.weight"], [(h, inter)]),
            )
        )
    embed = matrix(["token_embd.weight"], [(config.vocab_size, h)])
    lm_head = embed if config.tie_word_embeddings else matrix(["output.weight"], [(config.vocab_size, h)])
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
