"""C++ kernels for the CPU hot path, compiled once per machine and loaded on demand.

The `*.cpp` files beside this one are one extension module (pybind11 over ATen; each
file registers its own functions, `kernels.h` is what they share), built with
torch's JIT extension builder the first time it is asked for.
`make venv` builds them ahead of time (`python -m executor_svc.cpu_kernels`), so a
service start only loads them.

The build is tuned for the CPU it runs on (`-march=native`): the build folder is
keyed by the CPU's model and flags, so a copied cache never runs on a CPU that
lacks an instruction it was compiled for, and by the source, so two checkouts
never rebuild over each other.

Why C++ and not torch ops: a decode step of a small model is ~300 tiny ops, and
each eager torch op costs microseconds of dispatch; the quantized matmuls must
read GGUF blocks as stored, which no torch CPU kernel does for every GGUF type.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("qlinear.cpp", "layer_ops.cpp", "decoder.cpp", "bindings.cpp")
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")


class CpuKernelsUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded here (no compiler, or a build error)."""


def _cpu_signature() -> str:
    """The CPU model and its instruction-set flags: what `-march=native` depends on."""
    text = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                text += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def build_root() -> Path:
    base = os.environ.get("SWARMSERVE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "swarmserve", "cpu_kernels"
    )
    return Path(base) / _cpu_signature()


def source_signature() -> str:
    """The sources, their folder, the flags and torch's version: a build folder is never shared by
    two of them (torch's build file holds the sources' absolute paths, so two checkouts with the
    same sources would otherwise rebuild over each other)."""
    import torch

    text = b"".join((SOURCE_DIR / name).read_bytes() for name in SOURCES)
    for header in sorted(SOURCE_DIR.glob("*.h")):
        text += header.read_bytes()
    text += repr((str(SOURCE_DIR), CFLAGS, torch.__version__)).encode()
    return hashlib.blake2b(text, digest_size=6).hexdigest()


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One builder per build folder, and no wait on a dead one. torch's builder marks a build with
    a `lock` file and waits, forever, for it to go: a build killed midway (Ctrl-C at the first
    start, a test's timeout) left it behind, and every later start hung. An flock dies with its
    process, so whoever holds this one knows no build is running and removes a leftover `lock`."""
    with open(build_dir / "build.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _find_ninja() -> None:
    """torch's builder runs `ninja` from PATH; the pip-installed one sits beside this Python,
    which is not on PATH when the venv is used without activating it."""
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load() -> ModuleType:
    """The compiled kernels module, built if it is not yet."""
    from torch.utils import cpp_extension

    _find_ninja()
    build_dir = build_root() / f"kernels-{source_signature()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            return cpp_extension.load(
                name="swarmserve_cpu",
                sources=[str(SOURCE_DIR / name) for name in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as exc:  # compiler missing, build error, ABI mismatch
        raise CpuKernelsUnavailable(
            f"the CPU kernels could not be built or loaded: {exc}. They need a C++17 compiler "
            f"(g++) and ninja; see the README. Build log folder: {build_dir}"
        ) from exc


def build_all() -> None:
    load()
