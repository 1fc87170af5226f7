"""The scheduler runs without torch: no scheduler_svc module imports executor_svc or torch
(directly or through anything it imports). Nor does `swarmserve serve`'s supervisor load
torch: of the executor it reads only its flags.

Each check runs in a fresh interpreter, since this test process has long imported both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

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


def imported_forbidden(modules: list[str], forbidden: tuple[str, ...] = ("torch", "executor_svc")) -> list[str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "protos"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules), json.dumps(forbidden)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("modules", [["scheduler_svc"], ["service_common"]])  # each package and every module in it
def test_imports_neither_torch_nor_the_executor(modules: list[str]) -> None:
    assert imported_forbidden(modules) == []


def test_serve_reads_the_executor_s_flags_without_torch() -> None:
    assert imported_forbidden(["clients.serve", "clients.cli"], forbidden=("torch",)) == []
    assert set(imported_forbidden(["clients.serve"])) <= {"executor_svc", "executor_svc.config", "executor_svc.flags"}


def test_the_probe_sees_a_forbidden_import() -> None:
    assert "executor_svc.errors" in imported_forbidden(["executor_svc.errors"])
