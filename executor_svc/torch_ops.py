"""The forward pass's hot-path operations in plain torch: the CPU path and the reference.

`Transformer` calls its ops only through this interface, so the Triton kernels
(`executor_svc/kernels/triton_ops.py`) drop in with the same signatures and are
tested against these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from executor_svc import attention
from executor_svc.ragged_batch import RaggedBatch


class TorchOps:
    name = "torch"

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

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
        """Rotary embedding. x [T, heads, head_dim]; cos/sin [T, head_dim // 2] float32.

        Half-split (default): dimension i pairs with i + head_dim/2 (Hugging Face,
        qwen2/qwen3 GGUFs). Interleaved: 2i pairs with 2i + 1 (llama GGUFs as stored).
        """
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        if interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
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
