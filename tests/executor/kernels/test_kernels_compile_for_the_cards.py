"""The Triton kernels built down to machine code for the cards, without one: the interpreter the
other kernel tests run under compiles nothing, so a kernel that cannot be built, or that asks for
more shared memory than a card has, would otherwise first fail on the card."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

# Run without the interpreter. Shared memory is what the compiled kernel asks of one block; the
# limits: an H200's opt-in maximum per block (227 KiB), an RX 9070 XT's LDS (64 KiB).
COMPILE_FOR_THE_CARDS = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from executor_svc.kernels import chunk_gated_delta_rule as delta, qmatmul as qm
from executor_svc.tools import kernel_sass

CARDS = ((GPUTarget("cuda", 90, 32), "cubin", 232448), (GPUTarget("hip", "gfx1201", 32), "hsaco", 65536))


def build(name, fn, signature, constexprs, num_warps, num_stages=None):
    signature = dict(signature, **{key: "constexpr" for key in constexprs})
    options = dict(num_warps=num_warps, **({} if num_stages is None else dict(num_stages=num_stages)))
    for target, binary, shared_limit in CARDS:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target, options=options)
        assert kernel.asm[binary], (name, target)
        assert kernel.metadata.shared <= shared_limit, (name, target.arch, kernel.metadata.shared, shared_limit)
        print(name, target.arch, "ok")


# The dequant-matmul for Q4_K in bfloat16, both launches.
for launch_name, launch in (("skinny", qm.SKINNY), ("tiled", qm.TILED)):
    build(
        f"qmatmul-{launch_name}",
        qm._qmatmul_kernel,
        kernel_sass.SIGNATURE,
        qm.kernel_constexprs(12, launch, tl.bfloat16),
        launch.num_warps,
    )

# The chunked gated delta rule at Qwen3.5-9B's heads (32 value heads, 16 key heads, 128 wide), float32
# and bfloat16 activations, as launch_chunked launches it.
HEADS = dict(HEADS=32, KEY_HEADS=16, DK=128, DV=128, BK=128, CHUNK=delta.CHUNK_TOKENS)
for dtype in ("fp32", "bf16"):
    inputs = {"mixed_ptr": f"*{dtype}", "alpha_ptr": f"*{dtype}", "beta_ptr": f"*{dtype}", "a_ptr": "*fp32",
              "dt_bias_ptr": "*fp32", "w_ptr": "*fp32", "u_ptr": "*fp32"}
    table = {"table_ptr": "*i32", "num_requests": "i32", "first_launch": "i32", "stride_mixed": "i32",
             "stride_alpha": "i32", "stride_beta": "i32"}
    build(f"chunk-wy-{dtype}", delta._chunk_wy_kernel, dict(inputs, **table), dict(HEADS, BDV=128), 4)
    state = dict(inputs, states_ptr="*fp32", out_ptr="*fp32", **table, q_scale="fp32")
    build(f"chunk-state-{dtype}", delta._chunk_state_kernel, state, dict(HEADS, BV=32), 4, delta.STATE_KERNEL_STAGES)
"""

BUILT = [
    f"{name} {arch} ok"
    for name in (
        "qmatmul-skinny",
        "qmatmul-tiled",
        "chunk-wy-fp32",
        "chunk-state-fp32",
        "chunk-wy-bf16",
        "chunk-state-bf16",
    )
    for arch in ("90", "gfx1201")
]


@pytest.mark.slow
def test_the_kernels_build_for_the_h200_and_the_rx_9070_xt_within_their_shared_memory():
    """The dequant-matmul's two launches and the chunked delta rule's two kernels, with triton's
    bundled toolchains: an H200 (sm_90) and RDNA4 (gfx1201). The delta rule's state kernel asked an
    H200 for 295 KB in float32 before its pipeline depth was set (STATE_KERNEL_STAGES)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when it is unset
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_THE_CARDS],
        cwd=Path(__file__).resolve().parents[3],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == BUILT
