"""A llama-family decoder (llama, qwen2, qwen3, and qwen3moe's sparse FFN) run over one ragged batch.

RMSNorm → fused QKV (+bias for qwen2) → per-head q/k RMSNorm (qwen3), RoPE
(half-split) and the KV write in one op → paged attention → output proj →
RMSNorm → SwiGLU MLP, thirty-odd times, then the final norm and the LM head for
only the rows that need logits. Matmuls go through the weight-format layer
(`linear`), everything else through the ops (`TorchOps`, `CpuOps`, `TritonOps`).

The arithmetic follows Hugging Face's implementation op for op where that is free
(norm in float32, cos/sin from a float32 table, logits in float32), so that
greedy output stays equal to the transformers reference.
"""

from __future__ import annotations

import torch

from executor_svc.kv.kv_cache import KVCache
from executor_svc.model.moe import moe_ffn
from executor_svc.model.ragged_batch import RaggedBatch
from executor_svc.model.torch_ops import TorchOps
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.model_weights import ModelWeights
from executor_svc.weights.weight_format import embedding, linear


def rope_tables(config: ModelConfig, freq_factors: torch.Tensor | None, device: torch.device):
    """cos and sin for every position of the context: each [context_length, rotary_dims // 2], float32."""
    d = config.rotary_dims
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    positions = torch.arange(config.context_length, dtype=torch.int64).float() / config.rope_linear_factor
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos().to(device), freqs.sin().to(device)


def embed(batch: RaggedBatch, config: ModelConfig, weights: ModelWeights, ops, dtype: torch.dtype):
    """The batch's token embeddings as the residual stream [T_padded, hidden], and the first layer's input (normed)."""
    residual = embedding(batch.token_ids, weights.embed, dtype)
    return ops.rms_norm(residual, weights.layers[0].attn_norm, config.rms_norm_eps), residual


def ffn(x: torch.Tensor, residual: torch.Tensor, layer_index: int, config: ModelConfig, weights: ModelWeights, ops):
    """A layer's second half, the same in every model here: the FFN (SwiGLU, or the MoE), its residual
    add, and the next layer's input norm (the final norm after the last layer); returns (x, residual)."""
    layer = weights.layers[layer_index]
    if layer.moe is None:
        out = linear(ops.silu_mul(linear(x, layer.gate_up)), layer.down)
    else:
        out = moe_ffn(x, layer.moe, config.num_experts_per_token, ops)
    next_norm = weights.layers[layer_index + 1].attn_norm if layer_index + 1 < config.num_layers else weights.final_norm
    return ops.add_rms_norm(out, residual, next_norm, config.rms_norm_eps)


def lm_head(rows: torch.Tensor, batch: RaggedBatch, weights: ModelWeights) -> torch.Tensor:
    """float32 logits [batch.num_logits, vocab] from the final hidden states at batch.logits_indices."""
    logits = linear(rows, weights.lm_head).float()
    return logits[: batch.num_logits]


class Decoder:
    """What every decoder here holds: its ops, compute dtype, weights, RoPE tables and attention scale."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        device: torch.device,
        ops=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.ops = ops or TorchOps()
        # Activations and KV: the norms are loaded in the compute dtype, so they say it by default.
        self.dtype = dtype or weights.final_norm.dtype
        self.config = config
        self.weights = weights
        self.device = device
        self.rope_cos, self.rope_sin = rope_tables(config, weights.rope_freq_factors, device)
        self.scale = config.head_dim**-0.5


class Transformer(Decoder):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The layer loop below in one native call, where the ops have one (CpuOps): same bits.
        self.layer_stack = self.ops.layer_stack(self.config, self.weights, self.scale)

    @torch.inference_mode()
    def forward(self, batch: RaggedBatch, kv_cache: KVCache, state_pool=None) -> torch.Tensor:
        """Run the batch, writing its KV; returns float32 logits [batch.num_logits, vocab].
        (`state_pool` is the hybrid model's; a transformer has none.)"""
        return self.forward_prepared(batch, self.ops.prepare(batch, kv_cache.block_size), kv_cache)

    @torch.inference_mode()
    def forward_prepared(self, batch: RaggedBatch, metadata, kv_cache: KVCache) -> torch.Tensor:
        """`forward` with the attention metadata already built: device work only, no host
        reads, which is what a captured graph replays (decode_graphs.py)."""
        c, w, ops = self.config, self.weights, self.ops
        x, residual = embed(batch, c, w, ops, self.dtype)  # each [T_padded, hidden]
        if self.layer_stack is not None:
            rows = self.layer_stack.forward(x, residual, batch, metadata, kv_cache.layers, self.rope_cos, self.rope_sin)
            return lm_head(rows, batch, w)
        for layer_index, layer in enumerate(w.layers):
            k_cache, v_cache = kv_cache.layer(layer_index)
            qkv = linear(x, layer.qkv, layer.qkv_bias)  # [T_padded, (heads + 2 * kv_heads) * head_dim]
            q = ops.qkv_rope_write(
                qkv,
                c.num_heads,
                c.num_kv_heads,
                layer.q_norm,
                layer.k_norm,
                c.rms_norm_eps,
                self.rope_cos,
                self.rope_sin,
                batch.positions,
                batch.slot_mapping,
                k_cache,
                v_cache,
            )  # [T_padded, heads, head_dim]; K and V are in the cache
            attn = ops.attention(q, k_cache, v_cache, metadata, self.scale)  # [T_padded, heads, head_dim]
            x, residual = ops.add_rms_norm(
                linear(attn.view(attn.shape[0], -1), layer.o_proj), residual, layer.ffn_norm, c.rms_norm_eps
            )
            x, residual = ffn(x, residual, layer_index, c, w, ops)
        return lm_head(x[batch.logits_indices], batch, w)
