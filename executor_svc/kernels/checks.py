"""Argument checks shared by the kernel wrappers.

A Triton kernel trusts its pointers and strides: a wrong dtype, a transposed view
or a CPU tensor without the interpreter reads garbage or crashes the process. The
wrappers call these first so a caller gets a ValueError that names the argument.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    last_dim_contiguous: bool = True,
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected one of {allowed}")
    if last_dim_contiguous and tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {tensor.stride()}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and that device one triton can run on."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, other in devices.items():
        if other != device:
            raise ValueError(f"{name} is on {other} but {first_name} is on {device}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    return device
