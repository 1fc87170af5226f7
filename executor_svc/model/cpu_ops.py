"""`TorchOps`' interface on the C++ CPU kernels (`cpu_kernels/layer_ops.cpp`): a drop-in `ops=`.

Each method takes and returns what the `TorchOps` method of the same name does, with
float32 math and tensors in float32 or bfloat16, in one C++ call instead of a
handful of torch ops. Differences worth knowing:

- `add_rms_norm` updates `residual` IN PLACE and returns it (TorchOps returns a new
  tensor). The model's residual stream is its own tensor, so nothing else sees it.
- `attention` has no padding and no gathers: each query row walks its own
  request's keys from key 0 in fixed 32-key chunks (online softmax), so its bits
  do not depend on the batch, its request's query length or the thread count.
  Rows past the batch's real tokens come back as zeros.
- `qkv_rope_write` fuses the per-head q/k RMSNorm (qwen3), RoPE and the KV-cache
  write; TorchOps has a composed reference of the same name.

Results match TorchOps to float32 rounding (reductions run in a different, fixed
order), not bit for bit; within each implementation they are batch-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.cpu_kernels import load
from executor_svc.model.ragged_batch import RaggedBatch, tree_paths
from executor_svc.model.torch_ops import TorchOps
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.weight_format import cpu_matmul_parts


def attention_on_tiles(head_dim: int) -> bool:
    """Whether attention over a bfloat16 KV cache with heads of `head_dim` runs on the AMX tiles
    here (head_dim 32 or 64 on an AMX CPU; see layer_ops.cpp)."""
    return bool(load().attention_on_tiles(head_dim))


def bfloat16_attention_is_fastest(head_dim: int) -> bool:
    """Whether attention over a bfloat16 KV cache is this CPU's fastest for heads of `head_dim`
    (`--matmul bf16` then takes one by default): on the AMX tiles, or as VDPBF16PS dot products on
    a CPU without AMX (Zen 4: a 256-token chunk at 1-8k of context 1.8-1.9x the float16 cache's
    kernel, `bench_prefill`'s chunk-cost table). On an AMX CPU, heads the tiles do not take would get
    VDPBF16PS, which measured slower there than float16's kernel (13.9 against 10.6 ms)."""
    kernels = load()
    if kernels.has_amx_tiles():
        return attention_on_tiles(head_dim)
    return bool(kernels.has_bf16_dot_products())


@dataclass(frozen=True)
class CpuAttentionMetadata:
    """One step's requests, as the C++ attention reads them; built once per step."""

    query_starts: torch.Tensor  # [R] int64
    query_lens: torch.Tensor  # [R] int64
    context_lens: torch.Tensor  # [R] int64
    block_tables: torch.Tensor  # [R, max_blocks] int32
    # Draft trees only (else None): [R] int64, -1 where a request reads its keys in place,
    # and [R, W] int64, the positions a tree row reads its keys window_starts[r].. from.
    window_starts: torch.Tensor | None = None
    window_positions: torch.Tensor | None = None
    # The attention of the rows that need logits alone (batch.logits_indices, in that order), where
    # they are fewer than the step's rows: the layer stack's last layer runs on them alone.
    logits_only: CpuAttentionMetadata | None = None

    def as_rows(self) -> tuple:
        """What DenseStack.forward takes as `attention` (decoder.cpp's AttentionRows)."""
        return (
            self.query_starts,
            self.query_lens,
            self.context_lens,
            self.block_tables,
            self.window_starts,
            self.window_positions,
        )


# A run of query rows the C++ attention reads as one request: (query start, query len, context
# len, the batch's request, window start, window positions); a tree row is a unit of its own.
Unit = tuple[int, int, int, int, int, list[int]]


def _units(batch: RaggedBatch) -> list[Unit]:
    """Each request as one unit, but each tree row one over the context and its ancestors."""
    units: list[Unit] = []
    for r, (start, m, n) in enumerate(zip(batch.query_starts, batch.query_lens, batch.context_lens)):
        parents = batch.tree_parents[r] if batch.tree_parents else None
        if parents is None:
            units.append((start, m, n, r, -1, []))
            continue
        first_position = n - m
        for row, path in enumerate(tree_paths(parents)):
            positions = [first_position + ancestor for ancestor in path]
            units.append((start + row, 1, first_position + len(path), r, first_position, positions))
    return units


def _logits_units(batch: RaggedBatch, units: list[Unit]) -> list[Unit]:
    """The units cut to the rows that need logits (each request's last logits_counts rows), renumbered
    in logits_indices' order: a unit keeps a suffix of its rows, which attend as they did."""
    kept: list[Unit] = []
    row = 0
    for start, m, n, r, window_start, positions in units:
        first_logit = batch.query_starts[r] + batch.query_lens[r] - batch.logits_counts[r]
        keep = start + m - max(start, first_logit)
        if keep > 0:
            kept.append((row, keep, n, r, window_start, positions))
            row += keep
    return kept


def _metadata(
    batch: RaggedBatch, units: list[Unit], logits_only: CpuAttentionMetadata | None = None
) -> CpuAttentionMetadata:
    """The C++ attention's tensors for these units (none: a step whose rows need no logits): one
    tensor built from their lists, three views of it, and the block tables' rows they read."""
    starts, lens, contexts, requests, window_starts, window_positions = zip(*units) if units else ((),) * 6
    starts, lens, contexts = torch.tensor([starts, lens, contexts], dtype=torch.int64).view(3, -1)
    requests = list(requests)
    tables = batch.block_tables
    if requests != list(range(batch.num_requests)):
        tables = tables[requests].contiguous()
    if all(w < 0 for w in window_starts):
        return CpuAttentionMetadata(starts, lens, contexts, tables, logits_only=logits_only)
    width = max(len(p) for p in window_positions)
    padded = [p + [0] * (width - len(p)) for p in window_positions]
    return CpuAttentionMetadata(
        starts,
        lens,
        contexts,
        tables,
        torch.tensor(window_starts),
        torch.tensor(padded, dtype=torch.int64).reshape(len(padded), width),
        logits_only,
    )


class CpuLayerStack:
    """A dense model's decoder layers run by one C++ call per step (`DenseStack`, decoder.cpp):
    the same kernels as the layer loop in model/transformer.py, in the same order, so the same bits, without
    nine Python calls per layer."""

    def __init__(self, stack) -> None:
        self._stack = stack

    @classmethod
    def build(cls, kernels, config: ModelConfig, weights, scale: float) -> "CpuLayerStack | None":
        """The stack for these weights, or None where a layer is not a plain dense one (MoE
        experts, DeltaNet mixers, an output-gated attention) or a weight lives off the CPU."""
        if config.is_hybrid or config.num_experts:
            return None
        stack = kernels.DenseStack(config.num_heads, config.num_kv_heads, config.rms_norm_eps, scale)
        for i, layer in enumerate(weights.layers):
            matmuls = [cpu_matmul_parts(w) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            if any(m is None for m in matmuls):
                return None
            next_norm = weights.layers[i + 1].attn_norm if i + 1 < len(weights.layers) else weights.final_norm
            qkv, o_proj, gate_up, down = matmuls
            stack.add_layer(
                qkv, layer.qkv_bias, layer.q_norm, layer.k_norm, o_proj, layer.ffn_norm, gate_up, down, next_norm
            )
        return cls(stack)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        batch: RaggedBatch,
        metadata: "CpuAttentionMetadata",
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> torch.Tensor:
        """x, residual [T, hidden] from the embedding → the LM head's input: the final norm of the
        last layer's output at the rows of batch.logits_indices (residual is updated in place; kv:
        each layer's (K, V) cache, KVCache.layers). Where fewer rows need logits than the step
        computes, the last layer runs on those alone (decoder.cpp), else on all and they are picked."""
        trimmed = metadata.logits_only is not None
        rows = self._stack.forward(
            x,
            residual,
            kv,
            cos_table,
            sin_table,
            batch.positions,
            batch.slot_mapping,
            metadata.as_rows(),
            batch.logits_indices if trimmed else None,
            metadata.logits_only.as_rows() if trimmed else None,
        )
        return rows if trimmed else rows[batch.logits_indices]


class CpuOps:
    name = "cpu"
    # Each block's K as [Hkv, D, block_size] (a key per lane), V as [Hkv, block_size, D] (kv_cache.py).
    kv_layout = "d_major"

    def __init__(self) -> None:
        self._k = load()

    def layer_stack(self, config: ModelConfig, weights, scale: float) -> CpuLayerStack | None:
        """All of a dense model's layers in one C++ call, or None where the model needs the layer loop."""
        return CpuLayerStack.build(self._k, config, weights, scale)

    def prepare(self, batch: RaggedBatch, block_size: int) -> CpuAttentionMetadata:
        """Per-step attention metadata, and where fewer rows need logits than the step computes (a
        prompt chunk), that of those rows alone (the layer stack's last layer)."""
        units = _units(batch)
        logits_only = None
        if batch.logits_counts and batch.num_logits < batch.num_tokens:
            logits_only = _metadata(batch, _logits_units(batch, units))
        return _metadata(batch, units, logits_only)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., n] → weight · x / rms(x), computed in float32, returned in x's dtype."""
        return self._k.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); `residual` is updated IN PLACE and returned."""
        return self._k.add_rms_norm(x, residual, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding into a new tensor. x [T, heads, head_dim]; cos/sin [T, head_dim // 2] float32."""
        return self._k.rope(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I] (gate then up) → silu(gate) · up [T, I]."""
        return self._k.silu_mul(gate_up)

    def write_kv(
        self,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        self._k.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        q: torch.Tensor,  # [num_padded_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        m = metadata
        return self._k.paged_attention(
            q,
            k_cache,
            v_cache,
            m.query_starts,
            m.query_lens,
            m.context_lens,
            m.block_tables,
            scale,
            m.window_starts,
            m.window_positions,
        )

    def qkv_rope_write(
        self,
        qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim]
        num_heads: int,
        num_kv_heads: int,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        cos_table: torch.Tensor,  # [context, head_dim // 2] float32 (the whole table)
        sin_table: torch.Tensor,
        positions: torch.Tensor,  # [T] int64
        slot_mapping: torch.Tensor,  # [num_tokens ≤ T] int64
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, heads, head_dim] after q/k RMSNorm and RoPE; K and V written to the cache (in place)."""
        return self._k.qkv_rope_write(
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

    # Gated DeltaNet (hybrid models): no C++ kernel yet; the torch reference, which is batch-invariant.
    prepare_delta_net = TorchOps.prepare_delta_net
    causal_conv1d = TorchOps.causal_conv1d
    gated_delta_rule = TorchOps.gated_delta_rule
