"""The forward pass's hot-path operations in plain torch: the CPU path and the reference.

`Transformer` calls its ops only through this interface, so the Triton kernels
(`executor_svc/kernels/triton_ops.py`) drop in with the same signatures and are
tested against these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from executor_svc.model import attention, gated_delta_net
from executor_svc.model.gated_delta_net import DeltaNetPlan
from executor_svc.model.ragged_batch import RaggedBatch


class TorchOps:
    name = "torch"
    kv_layout = "token_major"  # the KV cache's layout these ops read (kv_cache.py)

    def layer_stack(self, config, weights, scale: float) -> None:
        """No fused layer stack here: the model runs its layer loop on these ops (see CpuOps')."""
        return None

    def prepare(self, batch: RaggedBatch, block_size: int) -> Any:
        """Per-step attention metadata, built once and passed to every layer's `attention`."""
        return attention.build_attention_plan(batch, block_size)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., n] → weight · x / rms(x), computed in float32, returned in x's dtype."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): the residual add fused with the next norm."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding. x [T, heads, head_dim]; cos/sin [T, head_dim // 2] float32.

        Half-split: dimension i pairs with i + head_dim/2 (Hugging Face, qwen2/qwen3 GGUFs;
        llama GGUFs' interleaved Q/K rows are permuted to it at load, see model_weights).
        """
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I] (gate then up) → silu(gate) · up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        attention.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
    ) -> torch.Tensor:
        return attention.paged_attention(q, k_cache, v_cache, metadata, scale)

    def qkv_rope_write(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The qkv matmul's output → q [T, heads, head_dim]; K and V go to the cache (in place)."""
        return qkv_rope_write(
            self,
            qkv,
            num_heads,
            num_kv_heads,
            q_norm,
            k_norm,
            eps,
            cos_table,
            sin_table,
            positions,
            slot_mapping,
            k_cache,
            v_cache,
        )

    # ----------------------------------------------------------- Gated DeltaNet (hybrid models)

    def prepare_delta_net(
        self, batch: RaggedBatch, conv_kernel: int, min_chunked_tokens: int | None = None
    ) -> DeltaNetPlan:
        """Per-step DeltaNet metadata, built once and passed to every DeltaNet layer; prefills of at
        least `min_chunked_tokens` take the chunked delta rule (None: none, the batch-invariant way)."""
        return gated_delta_net.build_delta_net_plan(
            batch.query_starts,
            batch.query_lens,
            list(batch.logits_counts),
            list(batch.state_slots),
            batch.token_ids.device,
            conv_kernel,
            min_chunked_tokens,
        )

    def causal_conv1d(
        self, x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, plan: DeltaNetPlan
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, C] → (SiLU(causal conv) [T, C], conv states after each verify position
        [num_windows, max_window, kernel − 1, C] or None); conv_states [slots, kernel − 1, C] updated in place."""
        return gated_delta_net.causal_conv1d(x, conv_states, weight, plan)

    def gated_delta_rule(
        self,
        mixed: torch.Tensor,
        alpha: torch.Tensor,
        beta: torch.Tensor,
        a: torch.Tensor,
        dt_bias: torch.Tensor,
        states: torch.Tensor,
        plan: DeltaNetPlan,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The conv's output [T, q | k | v] and the raw gates [T, H] → (o [T, H, dv] float32, the states
        before the verify windows [num_windows, H, dk, dv] or None); states [slots, H, dk, dv] updated in place."""
        return gated_delta_net.gated_delta_rule(mixed, alpha, beta, a, dt_bias, states, plan)


def qkv_rope_write(
    ops,
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim]: q heads, k heads, v heads
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None,  # [head_dim] (qwen3) or None
    k_norm: torch.Tensor | None,
    eps: float,
    cos_table: torch.Tensor,  # [context, head_dim // 2] float32, indexed by position
    sin_table: torch.Tensor,
    positions: torch.Tensor,  # [T] int64
    slot_mapping: torch.Tensor,  # [num_tokens ≤ T] int64: the real tokens' flat KV slots
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Per-head q/k RMSNorm (if given), half-split RoPE, K/V stored: composed of `ops`' own
    rms_norm, rope and write_kv (the reference for fused implementations)."""
    head_dim = cos_table.shape[1] * 2
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(-1, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q = ops.rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = ops.rms_norm(k, k_norm, eps)
    cos, sin = cos_table[positions], sin_table[positions]
    q = ops.rope(q, cos, sin)
    k = ops.rope(k, cos, sin)
    num_tokens = slot_mapping.shape[0]
    ops.write_kv(k[:num_tokens], v[:num_tokens].contiguous(), k_cache, v_cache, slot_mapping)
    return q
