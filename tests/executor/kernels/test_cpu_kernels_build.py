"""Building and loading the C++ kernels (executor_svc/cpu_kernels/__init__.py)."""

from __future__ import annotations

import subprocess
import sys

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
