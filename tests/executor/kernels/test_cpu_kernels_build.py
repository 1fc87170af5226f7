"""Building and loading the C++ kernels (executor_svc/cpu_kernels/__init__.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from executor_svc.cpu_kernels import build_root, load, source_signature


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start():
    """torch's builder waits forever for its `lock` file to go; a build killed midway left one,
    and every later executor start hung at loading the kernels."""
    load()
    build_dir = build_root() / f"kernels-{source_signature()}"
    (build_dir / "lock").touch()
    started = subprocess.run(
        [sys.executable, "-c", "from executor_svc.cpu_kernels import load; load()"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr
    assert not (build_dir / "lock").exists()


# The CPUs the developers' machines have (the build compiles for the one it runs on, -march=native):
# a change made and tested on one must not break the others' builds, whose `#if` branches it never
# compiled.
OTHER_CPUS = {
    "avx2 (Zen 3)": ["-march=x86-64-v3"],
    "avx512-bf16 without amx (Zen 4)": ["-march=icelake-server", "-mavx512bf16"],
    "amx (Sapphire Rapids)": ["-march=sapphirerapids"],
}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
@pytest.mark.parametrize("cpu", OTHER_CPUS, ids=lambda c: c.split(" ")[0])
def test_the_kernels_compile_for_each_cpu_the_project_runs_on(cpu):
    """The kernel sources with ISA dispatch compile (syntax and names, -fsyntax-only) with the flags
    the build uses (`CFLAGS`, torch's includes) for an AVX2-only CPU, an AVX-512 one without AMX and
    an AMX one, whatever CPU runs the test: each `#if` branch of the dispatch is compiled somewhere."""
    import sysconfig

    from torch.utils import cpp_extension

    from executor_svc.cpu_kernels import CFLAGS, SOURCE_DIR

    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    includes.append(f"-isystem{sysconfig.get_paths()['include']}")
    flags = [f for f in CFLAGS if not f.startswith("-march")] + OTHER_CPUS[cpu]
    # torch's builder defines these and compiles C++20 (where a template-id whose name only some
    # builds declare is looked up at instantiation: C++17 would refuse it in a discarded branch)
    defines = ["-DTORCH_EXTENSION_NAME=swarmserve_cpu", "-DTORCH_API_INCLUDE_EXTENSION_H", "-std=c++20"]
    compiles = {  # decoder.cpp and bindings.cpp have no ISA branches; the build itself compiles them
        source: subprocess.Popen(
            ["g++", "-fsyntax-only", *defines, *includes, *flags, str(SOURCE_DIR / source)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for source in ("qlinear.cpp", "layer_ops.cpp")
    }
    for source, compiling in compiles.items():
        _, errors = compiling.communicate(timeout=600)
        assert compiling.returncode == 0, f"{source} for {cpu}:\n{errors[-3000:]}"
