"""`TorchOps`' interface on the Triton kernels: a drop-in `ops=` for `Transformer`.

Every method takes and returns what the `TorchOps` method of the same name does
(shapes, dtypes, in-place writes), so the model code does not know which it runs.

The attention kernel's tile sizes are fixed per instance (and, where left to the
default, by the model's dtype and head_dim): they decide the order of the softmax
reduction, so keeping them fixed for a model is what makes a request's result
independent of the batch it runs in.
"""

from __future__ import annotations

import torch

from executor_svc.kernels.causal_conv1d import causal_conv1d
from executor_svc.kernels.chunk_gated_delta_rule import CHUNK_TOKENS
from executor_svc.kernels.gated_delta_rule import gated_delta_rule
from executor_svc.kernels.kv_store import write_kv
from executor_svc.kernels.paged_attention import AttentionMetadata, build_attention_metadata, paged_attention
from executor_svc.kernels.rms_norm import add_rms_norm, rms_norm
from executor_svc.kernels.rope import apply_rope
from executor_svc.kernels.silu_mul import silu_mul
from executor_svc.model.gated_delta_net import DeltaNetPlan, build_delta_net_plan
from executor_svc.model.ragged_batch import RaggedBatch
from executor_svc.model.torch_ops import TorchOps, qkv_rope_write


class TritonOps:
    name = "triton"
    kv_layout = "token_major"  # the KV cache's layout these ops read (kv_cache.py)

    def __init__(
        self, query_tile_tokens: int = 16, kv_tile_keys: int | None = None, delta_rule_chunk_tokens: int = CHUNK_TOKENS
    ) -> None:
        """query_tile_tokens: tokens of one request per attention program (times the GQA group
        gives its rows); kv_tile_keys: keys per step of the online softmax (None: chosen from
        the dtype and head_dim, see `default_kv_tile_keys`); delta_rule_chunk_tokens: the chunk C
        of the chunked delta rule (its rounding depends on it). Powers of two."""
        if query_tile_tokens < 1 or query_tile_tokens & (query_tile_tokens - 1):
            raise ValueError(f"query_tile_tokens must be a power of two, got {query_tile_tokens}")
        if kv_tile_keys is not None and (kv_tile_keys < 16 or kv_tile_keys & (kv_tile_keys - 1)):
            raise ValueError(f"kv_tile_keys must be a power of two >= 16, got {kv_tile_keys}")
        if delta_rule_chunk_tokens < 16 or delta_rule_chunk_tokens & (delta_rule_chunk_tokens - 1):
            raise ValueError(f"delta_rule_chunk_tokens must be a power of two >= 16, got {delta_rule_chunk_tokens}")
        self.query_tile_tokens = query_tile_tokens
        self.kv_tile_keys = kv_tile_keys
        self.delta_rule_chunk_tokens = delta_rule_chunk_tokens

    layer_stack = TorchOps.layer_stack  # none: the model runs its layer loop on these ops

    def prepare(self, batch: RaggedBatch, block_size: int) -> AttentionMetadata:
        """Per-step attention metadata (the query tiles), built once and passed to every layer's `attention`."""
        return build_attention_metadata(batch, block_size, self.query_tile_tokens)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., n] → weight · x / rms(x), computed in float32, returned in x's dtype (promoted with weight's)."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): the residual add fused with the next norm."""
        return add_rms_norm(x, residual, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding into a new tensor. x [T, heads, head_dim]; cos/sin [T, head_dim // 2] float32."""
        return apply_rope(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I] (gate then up) → silu(gate) · up [T, I]."""
        return silu_mul(gate_up)

    def write_kv(
        self,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        q: torch.Tensor,  # [num_padded_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, metadata, scale, kv_tile_keys=self.kv_tile_keys)

    def qkv_rope_write(
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
    ) -> torch.Tensor:
        """TorchOps.qkv_rope_write, composed of this class's kernels (not yet one fused kernel)."""
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
        least `min_chunked_tokens` take the chunked kernel (None: none, the batch-invariant way).
        Decode and verify rows always take the recurrent kernel: a verify window's rollback replays
        its positions with it (`DeltaRuleWindow`)."""
        return build_delta_net_plan(
            batch.query_starts,
            batch.query_lens,
            list(batch.logits_counts),
            list(batch.state_slots),
            batch.token_ids.device,
            min_chunked_tokens=min_chunked_tokens,
        )

    def causal_conv1d(
        self, x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, plan: DeltaNetPlan
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, C] → (SiLU(causal conv) [T, C], conv states after each verify position or None);
        conv_states [slots, kernel − 1, C] updated in place."""
        return causal_conv1d(x, conv_states, weight, plan)

    def gated_delta_rule(self, mixed, alpha, beta, a, dt_bias, states, plan: DeltaNetPlan):
        """(o [T, H, dv] float32, states before the verify windows or None); states updated in place."""
        return gated_delta_rule(mixed, alpha, beta, a, dt_bias, states, plan, self.delta_rule_chunk_tokens)
