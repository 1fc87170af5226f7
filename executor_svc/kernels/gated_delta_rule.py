"""The gated delta rule, recurrent form, over a ragged batch: decode, verify and prefill rows alike.

One program per (request, value head, tile of value columns) holds that tile of the
head's state S [dk, BV] in float32 registers and walks the request's tokens in order:

    q, k ← L2-normalised (q · dk^-1/2), read straight from the conv's output
    S ← exp(a · softplus(α + dt_bias)) · S
    S ← S + k ⊗ sigmoid(β) · (v − Sᵀk)
    o = Sᵀq

then writes S back into the request's pool slot. Value columns are independent in this
update, so tiling them changes nothing; the reductions run over the whole key dimension
in one `tl.sum` whose shape is fixed by the model (dk), never by the batch. A request's
bits therefore depend on its own tokens only: batch-invariant by construction, and the
state after any token is the same whether the request ran alone, in a batch, in one
prefill or in chunks. The gates and the L2 norms are computed inside (torch's reductions
on a GPU may pick their strategy by the number of rows).

A request verifying drafts gets its state before the verify window stored as well; the
pool replays the window with this same kernel (`DeltaRuleWindow.state_after`), so a
partial acceptance restores exactly the state plain decoding has.
The torch reference is `gated_delta_net.gated_delta_rule`.

`gated_delta_rule` is the op: the plan's recurrent requests (decode, verify, and every
prefill in the batch-invariant mode) take this kernel, its chunked ones (prefills of at
least `min_chunked_tokens`, given only when batch invariance is off) the chunked kernel of
`chunk_gated_delta_rule.py`, in the same step. The chunked form is batch-invariant too, but its
rounding depends on where its chunks start, i.e. on the engine's prefill chunking: a prompt
prefilled in one step and in several gives the same bits only when every step but the last is a
multiple of C tokens and every step takes the chunked form; otherwise the same values up to
rounding (and a prefix hit or a recompute after preemption runs tokens in the chunked form that
were decoded in the recurrent one). That is why it is not taken in the batch-invariant mode,
whose promise covers chunking, prefix hits and preemption as well as the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.checks import FLOAT_DTYPES, check_same_device, check_tensor
from executor_svc.kernels.chunk_gated_delta_rule import CHUNK_TOKENS, launch_chunked, log_decay, write_strength
from executor_svc.model.gated_delta_net import DeltaNetPlan, num_key_heads_of

MAX_VALUE_TILE = 32  # value columns per program: registers hold dk × this many float32


@triton.jit
def _gated_delta_rule_kernel(
    mixed_ptr,  # [T, 2 · KEY_HEADS · DK + HEADS · DV] rows strided: q | k | v
    alpha_ptr,  # [T, HEADS] rows strided
    beta_ptr,  # [T, HEADS] rows strided
    a_ptr,  # [HEADS]
    dt_bias_ptr,  # [HEADS]
    states_ptr,  # [num_slots, HEADS, DK, DV] float32 contiguous
    out_ptr,  # [T, HEADS, DV] float32 contiguous
    window_starts_ptr,  # [num_windows, HEADS, DK, DV] float32 (unused without windows)
    table_ptr,  # [6, R] int32 (`DeltaNetPlan.kernel_table`)
    num_requests,  # this launch's requests are the first of the launch order
    stride_mixed,
    stride_alpha,
    stride_beta,
    q_scale,  # dk^-1/2
    HEADS: tl.constexpr,
    KEY_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,  # next power of two ≥ DK
    BV: tl.constexpr,
):
    value_tile = tl.program_id(0)
    r = tl.load(table_ptr + 5 * num_requests + tl.program_id(1) // HEADS)
    h = tl.program_id(1) % HEADS
    key_head = h % KEY_HEADS  # value heads are tiled over key heads
    query_start = tl.load(table_ptr + r)
    query_len = tl.load(table_ptr + num_requests + r)
    window_start = tl.load(table_ptr + 2 * num_requests + r)
    window_index = tl.load(table_ptr + 3 * num_requests + r).to(tl.int64)
    slot = tl.load(table_ptr + 4 * num_requests + r).to(tl.int64)

    ks = tl.arange(0, BK)
    vs = value_tile * BV + tl.arange(0, BV)
    k_mask, v_mask = ks < DK, vs < DV
    tile = (h * DK + ks[:, None]) * DV + vs[None, :]
    tile_mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(states_ptr + slot * (HEADS * DK * DV) + tile, mask=tile_mask, other=0.0)  # [BK, BV]
    a = tl.load(a_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for t in range(query_start, query_start + query_len):
        if t == window_start:
            tl.store(window_starts_ptr + window_index * (HEADS * DK * DV) + tile, s, mask=tile_mask)
        row = mixed_ptr + t * stride_mixed
        q = tl.load(row + key_head * DK + ks, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(row + (KEY_HEADS + key_head) * DK + ks, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * KEY_HEADS * DK + h * DV + vs, mask=v_mask, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * q_scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        decay = tl.exp(log_decay(tl.load(alpha_ptr + t * stride_alpha + h).to(tl.float32), dt_bias, a))
        strength = write_strength(tl.load(beta_ptr + t * stride_beta + h).to(tl.float32))
        s = s * decay
        predicted = tl.sum(s * k[:, None], axis=0)  # [BV]: what S already returns for k
        s = s + k[:, None] * ((v - predicted) * strength)[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + (t * HEADS + h) * DV + vs, o, mask=v_mask)
    tl.store(states_ptr + slot * (HEADS * DK * DV) + tile, s, mask=tile_mask)


def gated_delta_rule(
    mixed: torch.Tensor,  # [T, 2 · key_dim + value_dim]
    alpha: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    a: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H]
    states: torch.Tensor,  # [num_slots, H, dk, dv] float32: the plan's slots updated IN PLACE
    plan: DeltaNetPlan,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """→ (o [T, H, dv] float32, the states before the verify windows [num_windows, H, dk, dv] or None),
    as `gated_delta_net.gated_delta_rule`: the plan's chunked requests in the chunked form, C =
    `chunk_tokens` (a power of two ≥ 16), the others in the recurrent form."""
    check_tensor("mixed", mixed, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("alpha", alpha, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("beta", beta, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("a", a, ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("dt_bias", dt_bias, ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("states", states, ndim=4, dtypes=(torch.float32,))
    check_same_device(mixed=mixed, alpha=alpha, beta=beta, a=a, dt_bias=dt_bias, states=states, table=plan.kernel_table)
    num_tokens = mixed.shape[0]
    _, heads, dk, dv = states.shape
    key_heads = num_key_heads_of(mixed, states)
    if (
        alpha.shape != (num_tokens, heads)
        or beta.shape != (num_tokens, heads)
        or a.shape != (heads,)
        or dt_bias.shape != (heads,)
    ):
        raise ValueError(
            f"alpha {tuple(alpha.shape)}, beta {tuple(beta.shape)}, a {tuple(a.shape)}, dt_bias {tuple(dt_bias.shape)} "
            f"do not match {num_tokens} tokens of {heads} heads"
        )
    if num_tokens != plan.token_requests.shape[0]:
        raise ValueError(f"mixed has {num_tokens} rows but the plan schedules {plan.token_requests.shape[0]} tokens")
    if not states.is_contiguous():
        raise ValueError("states must be contiguous")
    if chunk_tokens < 16 or chunk_tokens & (chunk_tokens - 1):
        raise ValueError(f"chunk_tokens must be a power of two >= 16, got {chunk_tokens}")
    out = torch.empty(num_tokens, heads, dv, dtype=torch.float32, device=mixed.device)
    windows = plan.window_requests
    window_starts = (
        torch.empty(len(windows), heads, dk, dv, dtype=torch.float32, device=mixed.device) if windows else None
    )
    if num_tokens == 0:
        return out, window_starts
    num_requests, num_chunked = len(plan.query_lens), plan.num_chunked
    num_recurrent = num_requests - num_chunked
    if num_recurrent:
        value_tile = min(MAX_VALUE_TILE, triton.next_power_of_2(dv))
        block_k = triton.next_power_of_2(dk)
        _gated_delta_rule_kernel[(triton.cdiv(dv, value_tile), num_recurrent * heads)](
            mixed,
            alpha,
            beta,
            a,
            dt_bias,
            states,
            out,
            window_starts if window_starts is not None else out,
            plan.kernel_table,
            num_requests,
            mixed.stride(0),
            alpha.stride(0),
            beta.stride(0),
            dk**-0.5,
            HEADS=heads,
            KEY_HEADS=key_heads,
            DK=dk,
            DV=dv,
            BK=block_k,
            BV=value_tile,
            num_warps=4 if block_k * value_tile >= 2048 else 2,
        )
    if num_chunked:
        chunked_lens = [n for n, chunked in zip(plan.query_lens, plan.chunked) if chunked]
        launch_chunked(
            mixed,
            alpha,
            beta,
            a,
            dt_bias,
            states,
            out,
            plan.kernel_table,
            chunked_lens,
            num_recurrent,
            num_chunked,
            key_heads,
            chunk_tokens,
        )
    return out, window_starts
