"""Elementwise functions whose result for an element does not depend on the tensor around it.

torch's CPU kernels run a contiguous elementwise op in SIMD steps and finish the
remainder with scalar code; for transcendental functions (exp, softplus, sigmoid,
SiLU) the vector path (SLEEF) and the scalar path (libm) can round differently. So
whether an element lands in the remainder, which depends on how many elements the
tensor has (its batch, its prefill chunk), or at which thread-split boundary, could
change its last bit, and a recurrent state integrates every such bit. `invariant_map`
pads the flat tensor to a multiple of every CPU's SIMD step and runs it in serial
slices of that size, so every element always takes the vector path.
On a GPU every element runs the same scalar code already; the function is applied as is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

VECTOR_SPAN = 64  # elements: a multiple of torch's CPU loop step (two vectors: 16 floats with AVX2, 32 with AVX-512)
SERIAL_SLICE = 16384  # elements per call: below torch's parallel grain (32768), so one thread runs it whole


def invariant_map(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, each element's bits independent of x's size."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.zeros(-(-n // VECTOR_SPAN) * VECTOR_SPAN, dtype=x.dtype, device=x.device)
    padded[:n] = flat
    out = torch.empty_like(padded)
    for start in range(0, padded.numel(), SERIAL_SLICE):
        out[start : start + SERIAL_SLICE] = fn(padded[start : start + SERIAL_SLICE])
    return out[:n].view(x.shape)
