"""A model of a given shape with random weights: what the kernel checks run without a GGUF file.

The weights are scaled so activations stay O(1) through any number of layers
(linear weights ~ N(0, 1/fan_in), norm weights near 1), so logits are neither
saturated nor all equal and greedy decoding is a meaningful comparison between
two implementations of the same ops.
"""

from __future__ import annotations

import torch

from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.model_weights import LayerWeights, ModelWeights


def model_config(
    name: str,
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    context_length: int = 4096,
    has_qk_norm: bool = False,
    has_qkv_bias: bool = False,
) -> ModelConfig:
    return ModelConfig(
        architecture="qwen3" if has_qk_norm else ("qwen2" if has_qkv_bias else "llama"),
        name=name,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        context_length=context_length,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_linear_factor=1.0,
        has_qkv_bias=has_qkv_bias,
        has_qk_norm=has_qk_norm,
        has_rope_freq_factors=False,
        tie_word_embeddings=False,
    )


def random_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ModelWeights:
    gen = torch.Generator(device=device).manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        w = torch.randn(out_features, in_features, generator=gen, device=device, dtype=torch.float32)
        return (w * in_features**-0.5).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen, device=device, dtype=torch.float32)).to(dtype)

    h, d = config.hidden_size, config.head_dim
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * d

    def bias(n: int) -> torch.Tensor:
        return (0.1 * torch.randn(n, generator=gen, device=device, dtype=torch.float32)).to(dtype)

    layers = [
        LayerWeights(
            attn_norm=norm(h),
            qkv=linear(qkv_rows, h),
            qkv_bias=bias(qkv_rows) if config.has_qkv_bias else None,
            q_norm=norm(d) if config.has_qk_norm else None,
            k_norm=norm(d) if config.has_qk_norm else None,
            o_proj=linear(h, config.num_heads * d),
            ffn_norm=norm(h),
            gate_up=linear(2 * config.intermediate_size, h),
            down=linear(h, config.intermediate_size),
        )
        for _ in range(config.num_layers)
    ]
    embed = torch.randn(config.vocab_size, h, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=norm(h),
        lm_head=linear(config.vocab_size, h),
        rope_freq_factors=None,
    )


# Per GGUF type: (byte offsets of its float16 scale fields in a block, the typical |code · sub-scale|
# one weight's scale multiplies, and for the types with an offset, the offset field's multiple of d
# that centres the codes).
_SCALE_FIELDS = {
    "Q4_0": ((0,), 4.6, None),
    "Q4_1": ((0,), 4.6, (2, -7.5)),
    "Q8_0": ((0,), 74.0, None),
    "Q4_K": ((0,), 32 * 4.6, (2, 7.5)),
    "Q5_K": ((0,), 32 * 9.2, (2, 15.5)),
    "Q6_K": ((208,), 74 * 18.5, None),
}


def random_gguf_rows(
    rows: int, cols: int, tensor_type: int, gen: torch.Generator, device: torch.device, scale: float = 1.0
) -> torch.Tensor:
    """Random GGUF rows uint8 [rows, row_bytes] of a weight ~ N(0, scale² / cols) in spread: random
    codes, float16 scales set so a row's dot product with an O(1) vector stays O(scale)."""
    from executor_svc.weights.gguf_types import PACKED_TYPES

    name, block_elems, block_bytes = PACKED_TYPES[tensor_type]
    if block_elems == 1:
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        values = torch.randn(rows, cols, generator=gen, device=device) * (scale * cols**-0.5)
        return values.to(dtype).view(torch.uint8).reshape(rows, -1)
    num_blocks = cols // block_elems
    blocks = torch.randint(0, 256, (rows, num_blocks, block_bytes), generator=gen, device=device, dtype=torch.uint8)
    offsets, spread, offset_field = _SCALE_FIELDS[name]
    d = torch.full((rows, num_blocks, 1), scale / (spread * cols**0.5), device=device)
    for offset in offsets:
        blocks[..., offset : offset + 2] = d.to(torch.float16).view(torch.uint8)
    if offset_field is not None:
        offset, multiple = offset_field
        blocks[..., offset : offset + 2] = (d * multiple).to(torch.float16).view(torch.uint8)
    return blocks.reshape(rows, -1)


def random_packed_weights(
    config: ModelConfig, tensor_type: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> ModelWeights:
    """`random_weights` with every matmul weight (embedding and LM head too) as random GGUF rows of
    `tensor_type` on `device`, for the Triton dequant-matmul."""
    from executor_svc.weights.weight_format import Kernel, PackedWeight

    gen = torch.Generator(device=device).manual_seed(seed)
    dense = random_weights(config, dtype, device, seed)

    def packed(w: torch.Tensor) -> PackedWeight:
        rows, cols = w.shape
        return PackedWeight(
            random_gguf_rows(rows, cols, tensor_type, gen, device), tensor_type, (rows, cols), Kernel.TRITON
        )

    layers = [
        LayerWeights(
            **{
                **vars(layer),
                "qkv": packed(layer.qkv),
                "o_proj": packed(layer.o_proj),
                "gate_up": packed(layer.gate_up),
                "down": packed(layer.down),
            }
        )
        for layer in dense.layers
    ]
    return ModelWeights(
        embed=packed(dense.embed),
        layers=layers,
        final_norm=dense.final_norm,
        lm_head=packed(dense.lm_head),
        rope_freq_factors=None,
    )
