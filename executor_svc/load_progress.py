"""A progress bar while a large GGUF's weights load, for a person at a terminal.

Loading reads the tensors one by one through `gguf.tensors`; `load_progress` hands the
loader a view of the file whose tensor mapping advances a bar by each tensor's bytes the
first time it is fetched. Only on a terminal (stderr a TTY) and only for files worth
waiting on; elsewhere the file passes through unchanged and nothing is drawn.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from executor_svc.weights.gguf_file import GGUFFile, GGUFTensor

MIN_PROGRESS_BYTES = 256 << 20  # smaller files load in about a second: no bar


class _ProgressTensors(Mapping[str, GGUFTensor]):
    def __init__(self, tensors: Mapping[str, GGUFTensor], bar) -> None:
        self._tensors = tensors
        self._bar = bar
        self._fetched: set[str] = set()

    def __getitem__(self, name: str) -> GGUFTensor:
        tensor = self._tensors[name]
        if name not in self._fetched:
            self._fetched.add(name)
            self._bar.update(tensor.raw.nbytes)
        return tensor

    def __contains__(self, name: object) -> bool:  # a membership test reads nothing
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


@contextmanager
def load_progress(gguf: GGUFFile, stream=None, min_bytes: int = MIN_PROGRESS_BYTES) -> Iterator[GGUFFile]:
    """`gguf`, or a view of it that draws a bar on `stream` (stderr) while its tensors are read."""
    stream = stream or sys.stderr
    total = sum(t.raw.nbytes for t in gguf.tensors.values())
    if total < min_bytes or not stream.isatty():
        yield gguf
        return
    from tqdm import tqdm

    # mininterval=0: a redraw per tensor, a few hundred in all.
    with tqdm(
        total=total,
        desc=f"loading {gguf.path.name}",
        unit="B",
        unit_scale=True,
        file=stream,
        leave=False,
        mininterval=0,
    ) as bar:
        yield dataclasses.replace(gguf, tensors=_ProgressTensors(gguf.tensors, bar))
