"""The Qwen3.5 hybrid decoder (qwen35, qwen35moe) run over one ragged batch.

Three layers in four are Gated DeltaNet (linear attention with a per-request
recurrent state, `gated_delta_net.py`), every fourth is gated full attention over the
paged KV. Each layer: RMSNorm → token mixer → residual → RMSNorm → FFN (SwiGLU, or
the MoE with a shared expert) → residual.

- DeltaNet: one matmul gives qkv, the output gate z, β and α; qkv goes through the
  short causal conv (SiLU), q and k are L2-normalised, the gated delta rule updates
  the request's state, and each head's output is RMS-normalised and gated by SiLU(z).
  The conv and the delta rule go through the ops (`prepare_delta_net`, `causal_conv1d`,
  `gated_delta_rule`): the torch reference on the CPU, the Triton kernels with
  `--kernels triton`; both update the state pool's rows in place.
- Gated attention: q's projection carries a per-head output gate (each head's q rows
  then its gate rows), q and k get a per-head RMSNorm, RoPE turns only the first
  `rope.dimension_count` dims of each head, and the attention output is multiplied by
  sigmoid(gate) before the output projection. (Qwen3.5's RoPE is multi-section, but
  text positions are equal in every section, so it is the plain rotation.)

GGUF norms already include Qwen3.5's "1 +" (the converter adds it), so every norm is
the same RMSNorm as the dense model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.recurrent_state import RecurrentStatePool, StepCapture
from executor_svc.model.gated_delta_net import DeltaNetPlan, DeltaRuleWindow, build_delta_net_plan
from executor_svc.model.invariant_elementwise import invariant_map
from executor_svc.model.ragged_batch import RaggedBatch
from executor_svc.model.transformer import Decoder, embed, ffn, lm_head
from executor_svc.weights.model_config import ModelConfig
from executor_svc.weights.model_weights import DeltaNetWeights, LayerWeights, ModelWeights
from executor_svc.weights.weight_format import linear

# Prefill slices at least this long take the chunked delta rule when batch invariance is off.
MIN_CHUNKED_PREFILL_TOKENS = 64


@dataclass(frozen=True)
class CapturePlan:
    """The step's state snapshots inside prefill chunks (see `RecurrentStatePool.capture_in_step`),
    built once per step and used by every DeltaNet layer.

    The conv state at a boundary is just the inputs before it. The delta-rule state there is had
    for free when the request's rows take the recurrent form: the step's plan gives it a window
    starting at the boundary, and the ops hand back the state before a window (as for a verify
    window, but nothing else of it is kept). A request taking the chunked form (long prefills
    without batch invariance) or whose boundary is its last row (a window needs two) has the
    updates before the boundary replayed onto a copy of its state before the step instead.
    """

    source_slots: torch.Tensor  # [C] int64: the capturing requests' slots (their state before the step)
    rows: torch.Tensor  # [C] int64: the snapshot rows written
    conv_rows: (
        torch.Tensor
    )  # [C, kernel − 1] int64: rows of cat(source conv states, step inputs) that are the conv state at the boundary
    window_rows: dict[int, int]  # request index → snapshot row, for requests whose window starts at the boundary
    window_counts: tuple[int, ...]  # [R]: the verify windows, and the capture windows
    replay: DeltaNetPlan | None  # the delta rule over token_rows, onto replay_rows (None: no replays)
    replay_source_slots: torch.Tensor
    replay_rows: torch.Tensor
    token_rows: torch.Tensor  # [Σ num_tokens] int64: the step rows before each replayed boundary

    @classmethod
    def build(
        cls, captures: list[StepCapture], batch: RaggedBatch, conv_kernel: int, min_chunked_tokens: int | None, device
    ) -> "CapturePlan | None":
        if not captures:
            return None
        request_of = {slot: r for r, slot in enumerate(batch.state_slots)}
        width, base = conv_kernel - 1, len(captures) * (conv_kernel - 1)  # step inputs follow the stacked conv states
        conv_rows, window_rows, window_counts = [], {}, list(batch.logits_counts)
        replayed, token_rows, replay_starts = [], [], []
        for c, capture in enumerate(captures):
            r = request_of[capture.slot]
            start, n, m = batch.query_starts[r], batch.query_lens[r], capture.num_tokens
            if m >= n or window_counts[r] > 1:
                raise ValueError(
                    f"slot {capture.slot}: a capture after {m} of a prefill chunk of {n} tokens is not inside it"
                )
            # As the causal conv's next state: offsets below `width` are the old state, the rest step inputs.
            conv_rows.append([c * width + o if o < width else base + start + o - width for o in range(m, m + width)])
            is_chunked = min_chunked_tokens is not None and n >= min_chunked_tokens
            if n - m > 1 and not is_chunked:
                window_rows[r], window_counts[r] = capture.row, n - m
            else:
                replayed.append(capture)
                replay_starts.append(len(token_rows))
                token_rows.extend(range(start, start + m))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        replay_rows = [c.row for c in replayed]
        replay = None
        if replayed:
            replay = build_delta_net_plan(
                replay_starts, [c.num_tokens for c in replayed], [1] * len(replayed), replay_rows, device
            )
        return cls(
            source_slots=as_tensor([c.slot for c in captures]),
            rows=as_tensor([c.row for c in captures]),
            conv_rows=as_tensor(conv_rows).reshape(len(captures), width),
            window_rows=window_rows,
            window_counts=tuple(window_counts),
            replay=replay,
            replay_source_slots=as_tensor([c.slot for c in replayed]),
            replay_rows=as_tensor(replay_rows),
            token_rows=as_tensor(token_rows),
        )


class HybridTransformer(Decoder):
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        device: torch.device,
        ops=None,
        dtype: torch.dtype | None = None,
        batch_invariant: bool = True,
    ) -> None:
        super().__init__(config, weights, device, ops, dtype)
        # Off: long prefills use the chunked delta rule (faster; rounding then depends on chunk boundaries).
        self.batch_invariant = batch_invariant

    @torch.inference_mode()
    def forward(self, batch: RaggedBatch, kv_cache: KVCache, state_pool: RecurrentStatePool) -> torch.Tensor:
        """Run the batch, writing its KV and updating its requests' recurrent states (and keeping
        each verify window's states in the pool); returns float32 logits [batch.num_logits, vocab]."""
        c, w, ops = self.config, self.weights, self.ops
        if len(batch.state_slots) != batch.num_requests or min(batch.state_slots, default=0) < 0:
            raise ValueError("a hybrid model's batch needs a recurrent-state slot for every request")
        metadata = ops.prepare(batch, kv_cache.block_size)
        # Off: long prefills take the chunked delta rule (where the ops have it).
        min_chunked_tokens = None if self.batch_invariant else MIN_CHUNKED_PREFILL_TOKENS
        capture_plan = CapturePlan.build(state_pool.begin_step(), batch, c.conv_kernel, min_chunked_tokens, self.device)
        if capture_plan is not None:  # the ops read windows off the logits counts: add the capture windows
            delta_net_plan = ops.prepare_delta_net(
                replace(batch, logits_counts=capture_plan.window_counts), c.conv_kernel, min_chunked_tokens
            )
        else:
            delta_net_plan = ops.prepare_delta_net(batch, c.conv_kernel, min_chunked_tokens)
        x, residual = embed(batch, c, w, ops, self.dtype)  # each [T_padded, hidden]
        for layer_index, layer in enumerate(w.layers):
            if layer.delta_net is not None:
                mixed = self._delta_net(layer_index, layer.delta_net, x, delta_net_plan, state_pool, capture_plan)
            else:
                mixed = self._gated_attention(layer_index, layer, x, batch, kv_cache, metadata)
            x, residual = ops.add_rms_norm(mixed, residual, layer.ffn_norm, c.rms_norm_eps)
            x, residual = ffn(x, residual, layer_index, c, w, ops)
        return lm_head(x[batch.logits_indices], batch, w)

    def _gated_attention(
        self, layer_index: int, layer: LayerWeights, x, batch: RaggedBatch, kv_cache: KVCache, metadata
    ):
        c, ops = self.config, self.ops
        t, heads, kv_heads, d, rd = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dims
        qkv = linear(x, layer.qkv)  # [T, heads * 2 * head_dim + 2 * kv_heads * head_dim]
        q_and_gate = qkv[:, : 2 * heads * d].view(t, heads, 2, d)
        gate = q_and_gate[:, :, 1].reshape(t, heads * d)
        k = qkv[:, 2 * heads * d : (2 * heads + kv_heads) * d].view(t, kv_heads, d)
        v = qkv[:, (2 * heads + kv_heads) * d :].view(t, kv_heads, d)
        q = ops.rms_norm(q_and_gate[:, :, 0].contiguous(), layer.q_norm, c.rms_norm_eps)
        k = ops.rms_norm(k.contiguous(), layer.k_norm, c.rms_norm_eps)
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        q = torch.cat([ops.rope(q[..., :rd].contiguous(), cos, sin), q[..., rd:]], dim=-1)
        k = torch.cat([ops.rope(k[..., :rd].contiguous(), cos, sin), k[..., rd:]], dim=-1)
        k_cache, v_cache = kv_cache.layer(layer_index)
        n = batch.num_tokens
        ops.write_kv(k[:n].contiguous(), v[:n].contiguous(), k_cache, v_cache, batch.slot_mapping)
        attn = ops.attention(q.contiguous(), k_cache, v_cache, metadata, self.scale)  # [T, heads, head_dim]
        return linear(attn.reshape(t, heads * d) * invariant_map(torch.sigmoid, gate), layer.o_proj)

    def _delta_net(
        self,
        layer_index: int,
        dn: DeltaNetWeights,
        x,
        plan: DeltaNetPlan,
        pool: RecurrentStatePool,
        captures: CapturePlan | None,
    ):
        c, ops = self.config, self.ops
        n, heads, dv = plan.token_requests.shape[0], c.num_linear_value_heads, c.linear_value_head_dim
        proj = linear(x[:n], dn.in_proj)  # [n, conv_dim + value_dim + 2 * heads]: padding rows skipped
        mixed, z, beta, alpha = proj.split([c.conv_dim, c.linear_value_dim, heads, heads], dim=-1)
        conv_states, recurrent_states = pool.layer(layer_index)
        if captures is not None:  # before the step's ops move the slots past the boundaries
            stacked = torch.cat([conv_states[captures.source_slots].flatten(0, 1), mixed.to(conv_states.dtype)])
            conv_states[captures.rows] = stacked[captures.conv_rows]
        mixed, conv_windows = ops.causal_conv1d(mixed, conv_states, dn.conv, plan)
        if captures is not None and captures.replay is not None:  # the updates before each boundary again
            recurrent_states[captures.replay_rows] = recurrent_states[captures.replay_source_slots]
            rows = captures.token_rows
            ops.gated_delta_rule(
                mixed[rows], alpha[rows], beta[rows], dn.a, dn.dt_bias, recurrent_states, captures.replay
            )
        o, window_starts = ops.gated_delta_rule(mixed, alpha, beta, dn.a, dn.dt_bias, recurrent_states, plan)
        for i, r in enumerate(plan.window_requests):  # keep what restores the state after any kept draft
            if captures is not None and r in captures.window_rows:  # a capture window: only its start is wanted
                recurrent_states[captures.window_rows[r]] = window_starts[i]
                continue
            # Copies, not views: a view would keep the whole step's tensors alive until the next step.
            count, end = plan.window_lens[r], plan.query_starts[r] + plan.query_lens[r]
            rows = slice(end - count, end)
            window = DeltaRuleWindow(
                window_starts[i], mixed[rows].clone(), alpha[rows].clone(), beta[rows].clone(), dn.a, dn.dt_bias, ops
            )
            pool.keep_window(layer_index, plan.state_slots[r], conv_windows[i, :count].clone(), window)
        normed = ops.rms_norm(o.to(x.dtype), dn.norm, c.rms_norm_eps)  # [n, heads, dv]
        gated = (normed.float() * invariant_map(F.silu, z.reshape(n, heads, dv).float())).to(x.dtype)
        out = linear(gated.reshape(n, heads * dv), dn.out_proj)
        if out.shape[0] < x.shape[0]:  # padding rows of a batch-invariant step
            out = torch.cat([out, out.new_zeros(x.shape[0] - n, out.shape[1])])
        return out
