"""Triton kernels for the executor's hot path, and the `TritonOps` that bundles them.

Importing this package does not import triton: callers ask `triton_available()`
first and import `executor_svc.kernels.triton_ops` only when it says yes, so the
CPU path never needs triton installed.
"""

from __future__ import annotations

import importlib
import os


def triton_available() -> bool:
    """True when triton is installed and can run here: on a CUDA/ROCm device, or interpreted.

    The interpreter (`TRITON_INTERPRET=1`, read by triton itself) runs the kernels on
    CPU tensors; that is how they are tested without an accelerator.
    """
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - not installed, or installed without a working backend
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    import torch

    return torch.cuda.is_available()  # ROCm builds of torch answer through torch.cuda too
