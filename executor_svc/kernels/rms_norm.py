"""RMSNorm, alone or fused with the residual add before it, in float32 math.

One program normalises one row. The rounding follows the torch reference
(`TorchOps.rms_norm`): the normalised row is rounded to x's dtype before the
weight multiply, and the fused variant rounds `residual + x` to the residual's
dtype before normalising it, as the unfused ops would. Rows may be strided views
with up to two leading dimensions (the per-head q/k norm of qwen3 reads q
straight out of the fused QKV output); the last dimension must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.checks import FLOAT_DTYPES, check_same_device, check_tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [A, B, N] strided rows
    residual_ptr,  # [A, B, N] strided rows; read only when HAS_RESIDUAL
    weight_ptr,  # [N]
    out_ptr,  # [A * B, N] contiguous
    new_residual_ptr,  # [A * B, N] contiguous; written only when HAS_RESIDUAL
    inner_rows,  # B
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner_rows
    inner = row % inner_rows
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0)
        summed = (r.to(tl.float32) + x).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * N + cols, summed, mask=mask)
        x = summed.to(tl.float32)
        normed_dtype = new_residual_ptr.dtype.element_ty
    else:
        normed_dtype = x_ptr.dtype.element_ty
    mean_square = tl.sum(x * x, axis=0) / N
    normed = (x * (1.0 / tl.sqrt(mean_square + eps))).to(normed_dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as a [A, B, N] view (a copy only when more than two leading dims do not flatten).

    A 2-D x becomes [T, 1, N], not [1, T, N]: B and the strides then do not change with the
    number of tokens, so triton compiles one kernel per model rather than one per batch size.
    """
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if x.dim() == 1:
        return x[None, None]
    if x.dim() == 2:
        return x[:, None]
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _launch(x, residual, weight, eps):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    n = x.shape[-1]
    if weight.shape[0] != n:
        raise ValueError(f"weight has {weight.shape[0]} entries for rows of {n}")
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOAT_DTYPES)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        check_same_device(x=x, residual=residual, weight=weight)
        residual_dtype = torch.promote_types(residual.dtype, x.dtype)
        normed_dtype = residual_dtype
    else:
        check_same_device(x=x, weight=weight)
        normed_dtype = x.dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, normed_dtype), device=x.device)
    new_residual = torch.empty(x.shape, dtype=residual_dtype, device=x.device) if residual is not None else out
    x3 = _as_rows("x", x)
    r3 = _as_rows("residual", residual) if residual is not None else x3
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows == 0 or n == 0:
        return out, new_residual
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(num_rows,)](
        x3,
        r3,
        weight,
        out,
        new_residual,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        eps,
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] → weight · x / rms(x), computed in float32, returned like `TorchOps.rms_norm`."""
    out, _ = _launch(x, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one pass over the row."""
    return _launch(x, residual, weight, eps)
