"""The short causal conv of a Gated DeltaNet layer over a ragged batch, with its state update.

Two launches, in this order on the stream:
- `_conv_kernel`: one program per (token, channel block). Token t at offset o of its
  request's query convolves the `kernel` inputs ending at itself: the request's conv state
  (from its pool slot) for window offsets before its first new token, its own new inputs
  after. The taps are summed in float32 in a fixed order (tap 0 first), then SiLU.
- `_state_kernel`: one program per (request, channel block). It writes the conv state after
  each verify position (for a request verifying drafts), then the request's next conv
  state into its slot: the last `kernel − 1` rows of (old state, new inputs). Every read of
  the old state happens before that write, and the slot belongs to this program alone.

A token's result depends on its own request's rows only, in an order fixed by the kernel
size: batch-invariant by construction. The torch reference is `gated_delta_net.causal_conv1d`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.checks import FLOAT_DTYPES, check_same_device, check_tensor
from executor_svc.model.gated_delta_net import DeltaNetPlan

BLOCK_CHANNELS = 256


@triton.jit
def _window_rows(
    x_ptr,
    states_ptr,
    offsets,
    row_mask,
    cols,
    col_mask,
    query_start,
    slot,
    stride_x,
    stride_slot,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """Rows at window offsets `offsets` of one request (offset < WIDTH: its old conv state, else its
    input row query_start + offset − WIDTH) as float32 [len(offsets), BLOCK]."""
    in_state = offsets < WIDTH
    state_rows = tl.where(in_state, offsets, 0)
    x_rows = tl.where(in_state, 0, query_start + offsets - WIDTH)
    mask = row_mask[:, None] & col_mask[None, :]
    from_state = tl.load(
        states_ptr + slot * stride_slot + state_rows[:, None] * CHANNELS + cols[None, :],
        mask=mask & in_state[:, None],
        other=0.0,
    )
    from_x = tl.load(x_ptr + x_rows[:, None] * stride_x + cols[None, :], mask=mask & ~in_state[:, None], other=0.0)
    return from_state.to(tl.float32) + from_x.to(tl.float32)


@triton.jit
def _conv_kernel(
    x_ptr,  # [T, C] rows strided
    states_ptr,  # [num_slots, WIDTH, C] contiguous
    weight_ptr,  # [C, KERNEL] contiguous
    out_ptr,  # [T, C] contiguous, x's dtype
    table_ptr,  # [6, R] int32: query starts, lens, window starts, window index, slots, launch order
    token_requests_ptr,  # [T] int32
    num_requests,
    stride_x,
    stride_slot,
    CHANNELS: tl.constexpr,
    KERNEL: tl.constexpr,
    TAPS: tl.constexpr,  # next power of two ≥ KERNEL
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < CHANNELS
    r = tl.load(token_requests_ptr + t)
    query_start = tl.load(table_ptr + r)
    slot = tl.load(table_ptr + 4 * num_requests + r).to(tl.int64)
    taps = tl.arange(0, TAPS)
    tap_mask = taps < KERNEL
    # Window offset of tap j: (t − query_start) + j; offsets < KERNEL − 1 are the old state.
    rows = _window_rows(
        x_ptr,
        states_ptr,
        t - query_start + taps,
        tap_mask,
        cols,
        col_mask,
        query_start,
        slot,
        stride_x,
        stride_slot,
        CHANNELS,
        KERNEL - 1,
    )  # [TAPS, BLOCK]
    weights = tl.load(
        weight_ptr + cols[None, :] * KERNEL + taps[:, None], mask=tap_mask[:, None] & col_mask[None, :], other=0.0
    )
    products = rows * weights.to(tl.float32)
    acc = tl.sum(tl.where(taps[:, None] == 0, products, 0.0), axis=0)
    for j in tl.static_range(1, KERNEL):  # tap by tap, in order: the reference's summation order
        acc = acc + tl.sum(tl.where(taps[:, None] == j, products, 0.0), axis=0)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t.to(tl.int64) * CHANNELS + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _state_kernel(
    x_ptr,  # [T, C] rows strided
    states_ptr,  # [num_slots, WIDTH, C] contiguous: read, then the request's slot rewritten
    windows_ptr,  # [num_windows, max_window, WIDTH, C] contiguous (unused without windows)
    table_ptr,  # [6, R] int32 (`DeltaNetPlan.kernel_table`)
    num_requests,
    max_window,
    stride_x,
    stride_slot,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    ROWS: tl.constexpr,  # next power of two ≥ WIDTH
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < CHANNELS
    query_start = tl.load(table_ptr + r)
    query_len = tl.load(table_ptr + num_requests + r)
    window_start = tl.load(table_ptr + 2 * num_requests + r)
    window_index = tl.load(table_ptr + 3 * num_requests + r).to(tl.int64)
    slot = tl.load(table_ptr + 4 * num_requests + r).to(tl.int64)
    rows = tl.arange(0, ROWS)
    row_mask = rows < WIDTH
    if window_start >= 0:
        # After query offset e the state is the WIDTH rows ending at e: window offsets e + 1 + j.
        first = window_start - query_start
        for e in range(first, query_len):
            values = _window_rows(
                x_ptr,
                states_ptr,
                e + 1 + rows,
                row_mask,
                cols,
                col_mask,
                query_start,
                slot,
                stride_x,
                stride_slot,
                CHANNELS,
                WIDTH,
            )
            position = (window_index * max_window + e - first) * WIDTH
            tl.store(
                windows_ptr + (position + rows[:, None]) * CHANNELS + cols[None, :],
                values.to(windows_ptr.dtype.element_ty),
                mask=row_mask[:, None] & col_mask[None, :],
            )
    values = _window_rows(
        x_ptr,
        states_ptr,
        query_len + rows,
        row_mask,
        cols,
        col_mask,
        query_start,
        slot,
        stride_x,
        stride_slot,
        CHANNELS,
        WIDTH,
    )
    tl.store(
        states_ptr + slot * stride_slot + rows[:, None] * CHANNELS + cols[None, :],
        values.to(states_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def causal_conv1d(
    x: torch.Tensor,  # [T, C]
    conv_states: torch.Tensor,  # [num_slots, kernel − 1, C]: the plan's slots updated IN PLACE
    weight: torch.Tensor,  # [C, kernel]
    plan: DeltaNetPlan,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv then SiLU → (out [T, C] in x's dtype, the conv state after each verify
    position [num_windows, max_window, kernel − 1, C] or None), as `gated_delta_net.causal_conv1d`."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("conv_states", conv_states, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    check_same_device(x=x, conv_states=conv_states, weight=weight, table=plan.kernel_table)
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    if weight.shape[0] != channels or conv_states.shape[1:] != (kernel - 1, channels) or kernel < 2:
        raise ValueError(
            f"x {tuple(x.shape)}, conv_states {tuple(conv_states.shape)} and weight {tuple(weight.shape)} "
            "do not describe one conv of kernel ≥ 2 over the same channels"
        )
    if num_tokens != plan.token_requests.shape[0]:
        raise ValueError(f"x has {num_tokens} rows but the plan schedules {plan.token_requests.shape[0]} tokens")
    if not conv_states.is_contiguous() or not weight.is_contiguous():
        raise ValueError("conv_states and weight must be contiguous")
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    windows = plan.window_requests
    window_states = (
        torch.empty(len(windows), plan.max_window, kernel - 1, channels, dtype=conv_states.dtype, device=x.device)
        if windows
        else None
    )
    if num_tokens == 0:
        return out, window_states
    if window_states is not None:  # shorter windows leave rows past their end: the reference repeats the last state
        window_states.zero_()
    block = min(BLOCK_CHANNELS, triton.next_power_of_2(channels))
    num_requests = len(plan.query_lens)
    grid_channels = triton.cdiv(channels, block)
    _conv_kernel[(num_tokens, grid_channels)](
        x,
        conv_states,
        weight,
        out,
        plan.kernel_table,
        plan.token_requests,
        num_requests,
        x.stride(0),
        conv_states.stride(0),
        CHANNELS=channels,
        KERNEL=kernel,
        TAPS=triton.next_power_of_2(kernel),
        BLOCK=block,
        num_warps=4,
    )
    _state_kernel[(num_requests, grid_channels)](
        x,
        conv_states,
        window_states if window_states is not None else out,
        plan.kernel_table,
        num_requests,
        plan.max_window,
        x.stride(0),
        conv_states.stride(0),
        CHANNELS=channels,
        WIDTH=kernel - 1,
        ROWS=triton.next_power_of_2(kernel - 1),
        BLOCK=block,
        num_warps=4,
    )
    return out, window_states
