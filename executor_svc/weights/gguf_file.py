"""Opening a GGUF file: metadata as plain Python values, tensors dequantized on demand.

The container's header (metadata, then tensor infos) is parsed here in one pass over the
mapped file, with the same results as the `gguf` package's GGUFReader: that reader builds
a numpy view per value, so a tokenizer's vocabulary (~100,000 strings for the embedded
model) took 3 s on an idle CPU and 12 s at a load of 12, a large part of a restart. The
`gguf` package still names the types and dequantizes. Failures become one clear
`ModelLoadError` that names the file and the problem; checked besides the reader's own
checks: the magic, that every tensor lies inside the file, that every tensor type is one
we can dequantize.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from gguf.quants import quant_shape_to_byte_shape

from executor_svc.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

# GGUF value types (gguf.GGUFValueType): scalars as struct formats and numpy dtypes.
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Tensor types stored as plain values (others are raw bytes of blocks), as GGUFReader shapes them.
_VALUE_TENSOR_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: rows first (GGUF lists ne0 = row length first)
    tensor_type: GGMLQuantizationType
    raw: np.ndarray  # memory-mapped bytes or values, as stored

    def dequantize(self) -> np.ndarray:
        """The tensor as float32, in `shape`."""
        if self.tensor_type == GGMLQuantizationType.F32:
            values = np.asarray(self.raw, dtype=np.float32)
        elif self.tensor_type == GGMLQuantizationType.F16:
            values = np.asarray(self.raw, dtype=np.float16).astype(np.float32)
        else:
            values = quants.dequantize(self.raw, self.tensor_type)
        return values.reshape(self.shape)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0 (the row length) first
    tensor_type: int
    offset: int  # from the start of the data section


class _Header:
    """A cursor over the mapped header; `order` is struct's byte order ('<' or '>')."""

    def __init__(self, buffer, order: str) -> None:
        self.buffer = buffer
        self.order = order
        self.offset = 0

    def scalar(self, fmt: str):
        value = struct.unpack_from(self.order + fmt, self.buffer, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"a string of {length} bytes at byte {self.offset} runs past the end of the file")
        text = str(self.buffer[self.offset : end], encoding="utf-8")
        self.offset = end
        return text

    def value(self, value_type: int):
        if value_type == _STRING:
            return self.string()
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is not None:
            return self.scalar(fmt)
        if value_type == _ARRAY:
            return self.array()
        raise ValueError(f"unknown metadata value type {value_type}")

    def array(self) -> list:
        """The items, flattened if they are arrays themselves (as GGUFReader's contents() are)."""
        item_type, count = self.scalar("I"), self.scalar("Q")
        fmt = _SCALAR_FORMATS.get(item_type)
        if fmt is not None:
            dtype = np.dtype(self.order + fmt)
            if self.offset + count * dtype.itemsize > len(self.buffer):
                raise ValueError(f"an array of {count} values at byte {self.offset} runs past the end of the file")
            values = np.frombuffer(self.buffer, dtype, count, self.offset).tolist()
            self.offset += count * dtype.itemsize
            return values
        if item_type == _STRING:
            return [self.string() for _ in range(count)]
        if item_type == _ARRAY:
            return [v for _ in range(count) for v in self.array()]
        raise ValueError(f"unknown metadata array item type {item_type}")


def _read_header(buffer) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    """(metadata, tensor infos, where the tensor data starts)."""
    order = "<"
    version = struct.unpack_from("<I", buffer, 4)[0]
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        order = ">"
        version = struct.unpack_from(">I", buffer, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})")
    header = _Header(buffer, order)
    header.offset = 8
    num_tensors, num_keys = header.scalar("Q"), header.scalar("Q")
    metadata: dict[str, Any] = {}
    alignment = DEFAULT_ALIGNMENT
    for _ in range(num_keys):
        key = header.string()
        value_type = header.scalar("I")
        if key in metadata:
            raise ValueError(f"metadata key {key!r} appears twice")
        metadata[key] = header.value(value_type)
        if key == "general.alignment":
            if value_type != _UINT32:
                raise ValueError("general.alignment must be a uint32")
            alignment = metadata[key]
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment must be a power of two, got {alignment}")
    infos = []
    for _ in range(num_tensors):
        name = header.string()
        num_dims = header.scalar("I")
        dims = tuple(header.scalar("Q") for _ in range(num_dims))
        infos.append(_TensorInfo(name, dims, header.scalar("I"), header.scalar("Q")))
    data_start = -(-header.offset // alignment) * alignment
    return metadata, infos, data_start


def _tensor(path: Path, data: np.memmap, info: _TensorInfo, data_start: int, order: str) -> GGUFTensor:
    tensor_type = GGMLQuantizationType(info.tensor_type)
    num_elements = math.prod(info.dims)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    num_bytes = num_elements * type_size // block_size
    start = data_start + info.offset
    if start + num_bytes > len(data):
        raise ModelLoadError(
            f"{path} is truncated: tensor {info.name!r} ends at byte {start + num_bytes} "
            f"but the file has {len(data)} bytes"
        )
    if tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
        raise ModelLoadError(
            f"{path}: tensor {info.name!r} has type {tensor_type.name}, which is not supported (supported: {supported})"
        )
    np_shape = tuple(reversed(info.dims))
    value_dtype = _VALUE_TENSOR_DTYPES.get(tensor_type)
    if value_dtype is None:
        dtype, count, raw_shape = np.dtype(np.uint8), num_bytes, quant_shape_to_byte_shape(np_shape, tensor_type)
    else:
        dtype, count, raw_shape = np.dtype(value_dtype).newbyteorder(order), num_elements, np_shape
    raw = data[start : start + count * dtype.itemsize].view(dtype)[:count].reshape(raw_shape)
    return GGUFTensor(info.name, tuple(int(n) for n in np_shape), tensor_type, raw)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file; raises ModelLoadError naming what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                metadata, infos, data_start = _read_header(buffer)
                order = "<" if struct.unpack_from("<I", buffer, 4)[0] & 0xFFFF else ">"
        except (ValueError, struct.error, OverflowError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    data = np.memmap(path, mode="r")
    tensors: dict[str, GGUFTensor] = {}
    for info in infos:
        if info.name in tensors:
            raise ModelLoadError(f"{path} is not a readable GGUF file: tensor {info.name!r} appears twice")
        try:
            tensors[info.name] = _tensor(path, data, info, data_start, order)
        except (ValueError, KeyError) as exc:  # an unknown type number, a shape its blocks do not divide
            raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)
