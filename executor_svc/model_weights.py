"""GGUF tensors → the dense weights the forward pass uses.

Quantized tensors are dequantized once at load to the compute dtype. Two GGUF
conventions are undone here so the forward pass has one shape for every
architecture:

- llama.cpp's converter permutes the Q and K rows of `llama` models so that RoPE
  rotates interleaved pairs (x0, x1), (x2, x3), ...; we permute them back to the
  half-split layout Hugging Face uses (x_i pairs with x_{i + d/2}), which is what
  qwen2/qwen3 files already use. Transformers does the same when it loads a GGUF.
- Q, K and V are concatenated into one matrix and gate/up into another, so a layer
  runs three GEMMs instead of five.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from executor_svc.errors import ModelLoadError
from executor_svc.model_config import ModelConfig

if TYPE_CHECKING:  # reading GGUF files needs the gguf package; the shapes alone do not
    from executor_svc.gguf_file import GGUFFile


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    ffn_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    rope_freq_factors: torch.Tensor | None  # [head_dim // 2]


def unpermute_qk_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE permutation of Q/K rows (its `permute` inverted)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_weights(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    def array(name: str, shape: tuple[int, ...]) -> np.ndarray:
        tensor = gguf.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{gguf.path}: tensor {name!r} is missing")
        if tensor.shape != shape:
            raise ModelLoadError(f"{gguf.path}: tensor {name!r} has shape {tensor.shape}, expected {shape}")
        return tensor.dequantize()

    def to_torch(values: np.ndarray) -> torch.Tensor:
        values = np.ascontiguousarray(values)
        if not values.flags.writeable:  # F32 tensors come straight from the memory map
            values = values.copy()
        return torch.from_numpy(values).to(device=device, dtype=dtype)

    h, d = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        q = array(p + "attn_q.weight", (q_rows, h))
        k = array(p + "attn_k.weight", (kv_rows, h))
        v = array(p + "attn_v.weight", (kv_rows, h))
        if config.architecture == "llama":
            q = unpermute_qk_rows(q, config.num_heads)
            k = unpermute_qk_rows(k, config.num_kv_heads)
        bias = None
        if config.has_qkv_bias:
            bias = np.concatenate(
                [array(p + "attn_q.bias", (q_rows,)), array(p + "attn_k.bias", (kv_rows,)), array(p + "attn_v.bias", (kv_rows,))]
            )
        layers.append(
            LayerWeights(
                attn_norm=to_torch(array(p + "attn_norm.weight", (h,))),
                qkv=to_torch(np.concatenate([q, k, v])),
                qkv_bias=None if bias is None else to_torch(bias),
                q_norm=to_torch(array(p + "attn_q_norm.weight", (d,))) if config.has_qk_norm else None,
                k_norm=to_torch(array(p + "attn_k_norm.weight", (d,))) if config.has_qk_norm else None,
                o_proj=to_torch(array(p + "attn_output.weight", (h, q_rows))),
                ffn_norm=to_torch(array(p + "ffn_norm.weight", (h,))),
                gate_up=to_torch(
                    np.concatenate(
                        [
                            array(p + "ffn_gate.weight", (config.intermediate_size, h)),
                            array(p + "ffn_up.weight", (config.intermediate_size, h)),
                        ]
                    )
                ),
                down=to_torch(array(p + "ffn_down.weight", (h, config.intermediate_size))),
            )
        )
    embed = to_torch(array("token_embd.weight", (config.vocab_size, h)))
    lm_head = embed if config.tie_word_embeddings else to_torch(array("output.weight", (config.vocab_size, h)))
    freq_factors = None
    if config.has_rope_freq_factors:
        freq_factors = torch.from_numpy(array("rope_freqs.weight", (d // 2,)).copy()).float()
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=to_torch(array("output_norm.weight", (h,))),
        lm_head=lm_head,
        rope_freq_factors=freq_factors,
    )
