"""kernel_sass: the dequant-matmul's main loop for sm_90, counted without a card."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

REPO_ROOT = Path(__file__).resolve().parents[3]

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.U16 R2, desc[UR4][R4.64] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   LDG.E.U8 R3, desc[UR4][R6.64] ;
        /*0050*/                   BRA 0x40 ;
        /*0060*/                   EXIT ;
"""


def test_the_main_loop_is_the_widest_backward_branch():
    """A forward-jumping tail loop (the `BRA 0x40` self-loop) is narrower than the real one."""
    from executor_svc.tools.kernel_sass import main_loop

    assert main_loop(SASS) == [(0x10, "LDG.E.U16"), (0x20, "HMMA.16816.F32.BF16"), (0x30, "BRA")]
    with pytest.raises(ValueError, match="no loop"):
        main_loop("/*0000*/ EXIT ;")


@pytest.mark.slow
def test_it_counts_the_q4_k_decode_loop():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-m", "executor_svc.tools.kernel_sass", "--types", "Q4_K", "--launches", "skinny"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = done.stdout.splitlines()[1].split()
    assert row[:3] == ["Q4_K", "skinny", "1"]
    instructions, per_value, mma = int(row[3]), float(row[4]), int(row[5])
    assert mma > 0 and instructions > 0 and per_value == pytest.approx(instructions / 8, abs=0.06)
    assert any(load.startswith("LDGSTS") for load in row[6:])  # its quants copied ahead (16-byte aligned)
