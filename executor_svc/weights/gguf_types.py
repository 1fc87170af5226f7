"""The GGUF storage types the matmul kernels run: one table, read by the weight format and by
the kernels (the C++ kernels' `qlinear.cpp` and the Triton `kernels/qmatmul.py`) alike.

It imports nothing of the executor, so a kernel can read it without reaching back into the
weight format that calls the kernel.
"""

from __future__ import annotations

# ggml type id → (name, elements per block, bytes per block); the types the CPU kernel runs.
PACKED_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
