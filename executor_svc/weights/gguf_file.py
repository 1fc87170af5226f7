"""Opening a GGUF file: metadata as plain Python values, tensors dequantized on demand.

The `gguf` package parses the container; this module turns its failures into
one clear `ModelLoadError` that names the file and the problem, and checks what
the reader does not (the magic, that every tensor lies inside the file, that
every tensor type is one we can dequantize).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants

from executor_svc.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

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


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file; raises ModelLoadError naming what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    file_size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises many types on malformed input
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc

    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = field.contents()
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot read metadata key {key!r}: {exc}") from exc

    tensors: dict[str, GGUFTensor] = {}
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > file_size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {tensor.name!r} ends at byte {end} but the file has {file_size} bytes"
            )
        tensor_type = GGMLQuantizationType(tensor.tensor_type)
        if tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has type {tensor_type.name}, "
                f"which is not supported (supported: {supported})"
            )
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        tensors[tensor.name] = GGUFTensor(tensor.name, shape, tensor_type, tensor.data)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)
