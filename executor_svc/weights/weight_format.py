"""The weight-format layer: matmul weights kept in their GGUF storage type.

The model calls `linear(x, w)` and `embedding(token_ids, w)` and never sees the
format. A weight is one of:

- `PackedWeight` (the CPU path): the GGUF rows byte for byte — Q4_0, Q4_1, Q8_0,
  Q4_K, Q5_K, Q6_K blocks, or F32/F16/BF16 values — in a uint8 tensor
  `[rows, row_bytes]`. Resident memory is the file's. The C++ kernel
  (`cpu_kernels/qlinear.cpp`) dequantizes a few rows at a time into float32 with
  gguf-py's exact arithmetic and accumulates in float32 in a fixed order, so a
  row's result never depends on how many rows share the matmul.
- the same `PackedWeight` with `kernel=Kernel.TRITON` (the GPU path): the plain GGUF rows on
  the device, multiplied by the Triton dequant-matmul (`kernels/qmatmul.py`), which
  decodes the blocks in registers; resident memory is again the file's.
- a dense `torch.Tensor` (`--kernels torch` on a GPU): dequantized once at load to the
  compute dtype.

Rows are independent in every GGUF type, so the loader's row work — llama's Q/K
un-permutation, fusing Q/K/V and gate/up by concatenating rows — is done on the
packed bytes without dequantizing anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Union

import numpy as np
import torch
import torch.nn.functional as F

from executor_svc.errors import ModelLoadError
from executor_svc.weights.gguf_types import PACKED_TYPES

if TYPE_CHECKING:
    from executor_svc.weights.gguf_file import GGUFTensor

# Types the integer matmul runs (activations quantized to int16 per 32-value block).
INT16_DOT_TYPES = frozenset({2, 3, 8})  # Q4_0, Q4_1, Q8_0
PANEL_ROWS = 16  # weight rows per panel of the integer matmul's layout (qlinear.cpp)

_qlinear_module = None


def _kernels():
    """The compiled kernels module, looked up once (this is on every matmul's path)."""
    global _qlinear_module
    if _qlinear_module is None:
        from executor_svc.cpu_kernels import load

        _qlinear_module = load()
    return _qlinear_module


def has_int8_dot() -> bool:
    """Whether this CPU's kernel build has the int8 matmul (`--matmul int8`: it needs AVX512-VNNI)."""
    from executor_svc.cpu_kernels import CpuKernelsUnavailable

    try:
        return bool(_kernels().has_int8_dot())
    except CpuKernelsUnavailable:
        return False


def has_bf16_dot() -> bool:
    """Whether this CPU's kernel build has AVX512-BF16's dot products, which the bf16 matmul needs
    (`--matmul bf16`: on the AMX tiles where the CPU has them, else VDPBF16PS)."""
    from executor_svc.cpu_kernels import CpuKernelsUnavailable

    try:
        return bool(_kernels().has_bf16_dot_products())
    except CpuKernelsUnavailable:
        return False


def has_int16_dot() -> bool:
    """Whether this CPU's kernel build has the integer matmul (it needs AVX2 and FMA)."""
    from executor_svc.cpu_kernels import CpuKernelsUnavailable

    try:
        return bool(_kernels().has_int16_dot())
    except CpuKernelsUnavailable:  # no compiler: the exact path reports the real error when it runs
        return False


def has_matmul(name: str) -> bool:
    """Whether this CPU's kernel build runs `--matmul name` (exact always; int16 needs AVX2 and FMA,
    int8 AVX512-VNNI, bf16 AVX512-BF16)."""
    needs = {"int16": has_int16_dot, "int8": has_int8_dot, "bf16": has_bf16_dot}
    return name not in needs or needs[name]()


class Kernel(IntEnum):
    """The kernel that multiplies a packed weight (the values are the C++ layer stack's, decoder.cpp;
    its 0 is a dense float tensor, which is not a PackedWeight)."""

    # GGUF rows [rows, row_bytes] dequantized in float32 on the CPU (qlinear.cpp): the exact path.
    EXACT = 1
    # Activations quantized to int16 per 32-value block (qlinear.cpp, "integer dot products").
    # Only INT16_DOT_TYPES; `data` is uint8 [ceil(rows / 16), 16 · row_bytes]: 16-row panels
    # (qlinear.cpp, "the integer matmul's weight layout"; for_kernel repacks).
    INT16 = 2
    # The Triton dequant-matmul (kernels/qmatmul.py) on the data's device: plain GGUF rows.
    TRITON = 3
    # INT16's panels with activations quantized to unsigned 8 bits per 32-value block over the
    # block's range (qlinear.cpp, "int8 dot products"): `--matmul int8`, AVX512-VNNI.
    INT8 = 4
    # The weight dequantized once and rounded to bf16, in the AMX tiles' layout (bf16_panels):
    # `data` is bfloat16 [even panels, cols / 32, 16, 32]; activations rounded to bf16, float32
    # sums over all of K, on the tile unit or with VDPBF16PS (qlinear.cpp, "bf16 matmul"):
    # `--matmul bf16`, AVX512-BF16 CPUs (Zen 4, Xeons with AMX).
    BF16 = 5

    @property
    def in_panels(self) -> bool:
        """Whether the weight's data is the integer matmul's 16-row panels."""
        return self in (Kernel.INT16, Kernel.INT8)


# `--matmul` modes whose packed weights take a kernel of their own → that kernel (int16 and int8
# multiply in integers; bf16 in bf16 products).
MATMUL_KERNELS = {"int16": Kernel.INT16, "int8": Kernel.INT8, "bf16": Kernel.BF16}


def bf16_panels(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight [rows, cols] rounded to bf16 in the bf16 matmul's B-tile layout:
    [panels, cols / 32, 16, 32], panel p's block b as 16 pairs of columns (2 b' and 2 b' + 1) of
    its 16 rows, the rows padded with zeros to an even number of panels (the kernel takes them
    two at a time)."""
    rows, cols = w.shape
    panels = -(-rows // (2 * PANEL_ROWS)) * 2
    padded = torch.zeros(panels * PANEL_ROWS, cols, dtype=torch.bfloat16)
    padded[:rows] = w.to(torch.bfloat16)
    blocks = cols // 32
    return (
        padded.view(panels, PANEL_ROWS, blocks, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(panels, blocks, 16, 32)
    )


def from_bf16_panels(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of bf16_panels' weight as float32 [len(ids), cols], gathered from their panels."""
    blocks = panels.shape[1]
    tiles = panels[ids // PANEL_ROWS].view(len(ids), blocks, 16, PANEL_ROWS, 2)
    return tiles[torch.arange(len(ids)), :, :, ids % PANEL_ROWS].reshape(len(ids), -1).float()


@dataclass(frozen=True)
class PackedWeight:
    """A [rows, cols] matmul weight as its GGUF blocks: `data` is uint8 [rows, row_bytes],
    or, for the integer matmul, the same blocks repacked in panels of 16 rows."""

    data: torch.Tensor
    tensor_type: int
    shape: tuple[int, int]
    kernel: Kernel = Kernel.EXACT

    def __post_init__(self) -> None:
        if self.tensor_type not in PACKED_TYPES:
            raise ModelLoadError(f"GGML tensor type {self.tensor_type} has no CPU matmul kernel")
        name, block_elems, block_bytes = PACKED_TYPES[self.tensor_type]
        rows, cols = self.shape
        if cols % block_elems:
            raise ModelLoadError(f"a {name} row of {cols} values is not a whole number of {block_elems}-value blocks")
        if self.kernel.in_panels and self.tensor_type not in INT16_DOT_TYPES:
            raise ModelLoadError(f"the integer matmul does not run {name} weights")
        if self.kernel == Kernel.BF16:
            expected = (-(-rows // (2 * PANEL_ROWS)) * 2, cols // 32, 16, 32)
            if tuple(self.data.shape) != expected or self.data.dtype != torch.bfloat16:
                raise ModelLoadError(f"bf16 panels {tuple(self.data.shape)} do not hold a [{rows}, {cols}] weight")
            return
        row_bytes = cols // block_elems * block_bytes
        expected = (-(-rows // PANEL_ROWS), PANEL_ROWS * row_bytes) if self.kernel.in_panels else (rows, row_bytes)
        if tuple(self.data.shape) != expected or self.data.dtype != torch.uint8:
            raise ModelLoadError(f"packed {name} data {tuple(self.data.shape)} does not hold a [{rows}, {cols}] weight")

    @classmethod
    def from_gguf(cls, tensor: GGUFTensor, row_order: np.ndarray | None = None) -> "PackedWeight":
        """Copy a 2-D GGUF tensor's rows out of the memory map (optionally reordered)."""
        if len(tensor.shape) != 2:
            raise ModelLoadError(f"tensor {tensor.name!r} has shape {tensor.shape}; a matmul weight is 2-D")
        if int(tensor.tensor_type) not in PACKED_TYPES:
            supported = ", ".join(name for name, _, _ in PACKED_TYPES.values())
            raise ModelLoadError(
                f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the CPU matmul kernel does not run "
                f"(it runs {supported})"
            )
        rows = tensor.shape[0]
        raw = np.asarray(tensor.raw).view(np.uint8).reshape(rows, -1)
        if row_order is not None:
            raw = raw[row_order]
        return cls(torch.from_numpy(np.array(raw, copy=True)), int(tensor.tensor_type), tensor.shape)

    @classmethod
    def concat(cls, parts: list["PackedWeight"]) -> "Weight":
        """Rows of several weights stacked into one matmul when they share a type; else kept apart.
        (Stack before for_kernel: weights in panels do not stack.)"""
        if any(p.kernel.in_panels or p.kernel == Kernel.BF16 for p in parts):
            raise ValueError("stack weights before repacking them for the integer matmul")
        if len({p.tensor_type for p in parts}) > 1 or len({p.shape[1] for p in parts}) > 1:
            return tuple(parts)
        rows = sum(p.shape[0] for p in parts)
        return cls(torch.cat([p.data for p in parts]), parts[0].tensor_type, (rows, parts[0].shape[1]))

    def for_kernel(self, kernel: Kernel = Kernel.INT16) -> "PackedWeight":
        """This weight as the CPU matmul `kernel` reads it: in panels for the integer matmul (INT16
        or INT8) where its type allows, else unchanged. Both read the same panels: one already in them is only re-tagged.
        BF16: the weight dequantized and rounded to bf16 in its panels (bf16_panels), whatever its
        type, where its rows are whole 32-value blocks."""
        if kernel == Kernel.BF16:
            if self.kernel == kernel or self.shape[1] % 32:
                return self
            return PackedWeight(bf16_panels(self.dequantize()), self.tensor_type, self.shape, kernel)
        if not kernel.in_panels:
            raise ValueError(f"{kernel.name} is not an integer matmul")
        if self.tensor_type not in INT16_DOT_TYPES or self.kernel == kernel:
            return self
        data = (
            self.data if self.kernel.in_panels else _kernels().repack_panels(self.data, self.tensor_type, self.shape[1])
        )
        return PackedWeight(data, self.tensor_type, self.shape, kernel)

    def on_triton(self, device: torch.device) -> "PackedWeight":
        """This weight's GGUF rows on `device`, multiplied by the Triton kernel."""
        return PackedWeight(self.data.to(device), self.tensor_type, self.shape, Kernel.TRITON)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def type_name(self) -> str:
        return PACKED_TYPES[self.tensor_type][0]

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [rows, cols] (tests and the dense GPU path)."""
        return self.rows(torch.arange(self.shape[0]))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32 [len(ids), cols] (an embedding lookup; under BF16 the bf16 values)."""
        if self.kernel == Kernel.BF16:
            return from_bf16_panels(self.data, ids)
        if self.kernel == Kernel.TRITON:  # on the device: gathered, then dequantized in torch
            from executor_svc.kernels.qmatmul import dequantize

            return dequantize(self.data[ids], self.tensor_type, self.shape[1])
        rows_in_panels = self.shape[0] if self.kernel.in_panels else 0
        return _kernels().dequant_rows(self.data, self.tensor_type, self.shape[1], ids, rows_in_panels)


# A weight as the model holds it: packed, dense, or packed parts whose outputs are concatenated.
Weight = Union[PackedWeight, torch.Tensor, tuple[PackedWeight, ...]]


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] · wᵀ (+ bias) → [T, rows], in x's dtype."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, tuple):
        y = torch.cat([linear(x, part) for part in w], dim=-1)
    elif w.kernel == Kernel.INT16:
        y = _kernels().qlinear_int16(x, w.data, w.tensor_type, w.shape[1], w.shape[0])
    elif w.kernel == Kernel.INT8:
        y = _kernels().qlinear_int8(x, w.data, w.tensor_type, w.shape[1], w.shape[0])
    elif w.kernel == Kernel.BF16:
        y = _kernels().qlinear_bf16(x, w.data, w.shape[0])
    elif w.kernel == Kernel.EXACT:
        y = _kernels().qlinear(x, w.data, w.tensor_type, w.shape[1])
    else:
        from executor_svc.kernels.qmatmul import qmatmul

        y = qmatmul(x, w.data, w.tensor_type, w.shape[1])
    return y if bias is None else y + bias


DENSE_KIND = 0  # decoder.cpp's kind for a dense float tensor (F.linear); the others are Kernel values


def cpu_matmul_parts(w: Weight) -> list[tuple[torch.Tensor, int, int, int, int]] | None:
    """w as the C++ layer stack takes a matmul weight (decoder.cpp): a (data, kernel, type,
    cols, rows) tuple per part; None when a part runs on another device's kernel."""
    parts = w if isinstance(w, tuple) else (w,)
    specs = []
    for p in parts:
        if isinstance(p, torch.Tensor):
            specs.append((p, DENSE_KIND, 0, p.shape[1], p.shape[0]))
        elif p.kernel in (Kernel.EXACT, Kernel.INT16, Kernel.INT8, Kernel.BF16) and p.data.device.type == "cpu":
            specs.append((p.data, int(p.kernel), p.tensor_type, p.shape[1], p.shape[0]))
        else:
            return None
    return specs


def embedding(token_ids: torch.Tensor, w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `token_ids` of the embedding table → [len(token_ids), hidden] in dtype."""
    if isinstance(w, torch.Tensor):
        return w[token_ids].to(dtype)
    return w.rows(token_ids).to(dtype)


def weight_bytes(w: Weight | None) -> int:
    """Resident bytes of one weight."""
    if w is None:
        return 0
    if isinstance(w, tuple):
        return sum(p.nbytes for p in w)
    if isinstance(w, PackedWeight):
        return w.nbytes
    return w.numel() * w.element_size()
