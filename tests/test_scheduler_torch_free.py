"""The scheduler runs without torch: no scheduler_svc module, and not `swarmserve serve`'s
supervisor, imports executor_svc or torch (directly or through anything they import).

Each check runs in a fresh interpreter, since this test process has long imported both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("torch", "executor_svc")

# Imports `modules` (and, for a package, every module under it), then prints the names in
# sys.modules that fall under a forbidden package.
_PROBE = """
import importlib, json, pkgutil, sys
for name in json.loads(sys.argv[1]):
    module = importlib.import_module(name)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), prefix=name + "."):
        importlib.import_module(info.name)
forbidden = tuple(json.loads(sys.argv[2]))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in forbidden)))
"""


def imported_forbidden(modules: list[str]) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "protos"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules), json.dumps(FORBIDDEN)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "modules",
    [
        ["scheduler_svc"],  # the package and every module in it, main included
        ["clients.serve"],  # `swarmserve serve`'s supervisor starts the executor as a process, never imports it
        ["service_common"],
    ],
)
def test_imports_neither_torch_nor_the_executor(modules: list[str]) -> None:
    assert imported_forbidden(modules) == []


def test_the_probe_sees_a_forbidden_import() -> None:
    assert "executor_svc.errors" in imported_forbidden(["executor_svc.errors"])
