"""SwiGLU's activation: silu(gate) · up from the fused gate/up projection.

The input is [T, 2I], gate then up, as `F.linear(x, gate_up)` produces it. The
silu is computed in float32 and rounded to the input dtype before the multiply,
where the torch reference (`F.silu(gate) * up`) rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_svc.kernels.checks import FLOAT_DTYPES, check_same_device, check_tensor

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * I]
    out_ptr,  # [T, I] contiguous
    stride_in,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    dtype = gate_up_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + token * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * stride_in + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * INTERMEDIATE + cols, (activated * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate then up) → silu(gate) · up [T, I]."""
    check_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_DTYPES)
    check_same_device(gate_up=gate_up)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up width {width} is odd; expected gate and up of equal width")
    intermediate = width // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(intermediate))
    _silu_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        gate_up,
        out,
        gate_up.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        num_warps=4,
    )
    return out
