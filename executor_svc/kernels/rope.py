"""Rotary position embedding (half-split), in place or out of place.

One program rotates every head of one token. The arithmetic rounds where the
torch reference (`TorchOps.rope`) rounds: cos/sin are cast to x's dtype and each
product and sum is rounded to it, so half-precision results match the reference
bit for bit rather than being more exact than it. In place is safe because a
program reads both halves of a pair before it writes either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.checks import FLOAT_DTYPES, check_same_device, check_tensor


@triton.jit
def _rope_kernel(
    x_ptr,  # [T, H, D]
    cos_ptr,  # [T, D // 2]
    sin_ptr,
    out_ptr,  # [T, H, D]; may be x
    stride_x_token,
    stride_x_head,
    stride_cos,
    stride_sin,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < NUM_HEADS)[:, None] & (i < HALF)[None, :]  # [BLOCK_H, BLOCK_HALF]
    first = i
    second = i + HALF
    dtype = x_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + token * stride_cos + i, mask=i < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin + i, mask=i < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    x_row = x_ptr + token * stride_x_token + h[:, None] * stride_x_head
    x1 = tl.load(x_row + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    out_row = out_ptr + token * stride_out_token + h[:, None] * stride_out_head
    tl.store(out_row + first[None, :], out1.to(dtype), mask=mask)
    tl.store(out_row + second[None, :], out2.to(dtype), mask=mask)


def apply_rope(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim // 2]
    sin: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q or k by position; writes `out` (a new tensor when None; pass x for in place).

    Half-split: dimension i pairs with i + head_dim/2.
    """
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("cos", cos, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("sin", sin, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")
    half = head_dim // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (num_tokens, half):
            raise ValueError(f"{name} shape {tuple(table.shape)} != ({num_tokens}, {half})")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, ndim=3, dtypes=(x.dtype,))
        if out.shape != x.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != x shape {tuple(x.shape)}")
    check_same_device(x=x, cos=cos, sin=sin, out=out)
    if num_tokens == 0:
        return out
    _rope_kernel[(num_tokens,)](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return out
