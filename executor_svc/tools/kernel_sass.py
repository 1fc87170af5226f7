"""The dequant-matmul's inner loop as an H200 would run it, read without one.

    python -m executor_svc.tools.kernel_sass [--types Q4_K,Q6_K] [--launches skinny,tiled] [--k-steps 1,2]

Builds `qmatmul._qmatmul_kernel` for sm_90 with triton's bundled toolchain (no GPU, no
driver), specialised as a launch specialises it (pointers and the sizes a real model has
divisible by 16), disassembles it with triton's bundled cuobjdump and counts the
instructions of its main loop (the widest backward branch): in all, per weight value a
thread handles, and the loads by kind. On the H200 the kernel's M = 1 bandwidth followed
the loop's instruction count, not its bytes (F16 at 27% of the copy, Q4_K at 3%): an issue
bound, which this measures on any machine. Times still need the card (gpu_check).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from executor_svc.weights.gguf_types import PACKED_TYPES

if TYPE_CHECKING:
    from executor_svc.kernels.qmatmul import Launch

# triton and the kernel are imported where a build needs them: importing the kernel module
# decides for good whether its kernels are interpreted (TRITON_INTERPRET), so the parsing here
# must not do it for whoever imports this module.

TYPE_IDS = {name: type_id for type_id, (name, _, _) in PACKED_TYPES.items()}
SIGNATURE = {
    "x_ptr": "*bf16",
    "w_ptr": "*u8",
    "wv_ptr": "*fp16",
    "out_ptr": "*bf16",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_xm": "i32",
    "row_bytes": "i32",
    "row_values": "i32",
}
# What a launch on a real model's shapes specialises as divisible by 16 (M and row counts vary).
DIVISIBLE_BY_16 = ("x_ptr", "w_ptr", "wv_ptr", "out_ptr", "N", "K", "stride_xm", "row_bytes", "row_values")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")


@dataclass(frozen=True)
class LoopCount:
    """The main loop of one build: its instructions and the loads among them."""

    type_name: str
    launch: Launch
    instructions: int
    values_per_thread: int  # weight values one thread dequantizes per iteration
    loads: dict[str, int]
    mma: int

    @property
    def per_value(self) -> float:
        return self.instructions / self.values_per_thread


def cuobjdump() -> Path:
    import triton

    return Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "cuobjdump"


def build_sm90(type_id: int, launch: Launch) -> bytes:
    """The kernel's cubin for an H200, as a bfloat16 launch of `launch` on `type_id` builds it."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from executor_svc.kernels import qmatmul as qm

    constexprs = qm.kernel_constexprs(type_id, launch, tl.bfloat16)
    signature = dict(SIGNATURE, **{name: "constexpr" for name in constexprs})
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE_BY_16}
    source = ASTSource(fn=qm._qmatmul_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": launch.num_warps})
    return kernel.asm["cubin"]


def main_loop(sass: str) -> list[tuple[int, str]]:
    """(address, opcode) of the instructions inside the widest backward branch."""
    instructions = [(int(m[1], 16), m[2], m[3]) for m in INSTRUCTION.finditer(sass)]
    loop = None
    for address, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target[1], 16) < address:
            span = (int(target[1], 16), address)
            loop = span if loop is None or span[1] - span[0] > loop[1] - loop[0] else loop
    if loop is None:
        raise ValueError("no loop in the kernel's machine code")
    return [(a, op) for a, op, _ in instructions if loop[0] <= a <= loop[1]]


def count(type_name: str, launch: Launch) -> LoopCount:
    from executor_svc.kernels.qmatmul import BLOCK_K

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(build_sm90(TYPE_IDS[type_name], launch))
        cubin.flush()
        sass = subprocess.run(
            [str(cuobjdump()), "-sass", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    loop = main_loop(sass)
    opcodes = collections.Counter(op for _, op in loop)
    loads = {op: n for op, n in sorted(opcodes.items()) if op.startswith("LDG")}  # LDGSTS too
    mma = sum(n for op, n in opcodes.items() if op.startswith(("HMMA", "HGMMA")))
    values = launch.block_n * BLOCK_K * launch.k_steps // (32 * launch.num_warps)
    return LoopCount(type_name, launch, len(loop), values, loads, mma)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="F16,Q4_0,Q8_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--launches", default="skinny,tiled", help="skinny, tiled (qmatmul.SKINNY / TILED)")
    parser.add_argument("--k-steps", default="", help="comma-separated K_STEPS to build besides the launch's own")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's kernels cannot be built
        parser.error("kernel_sass builds the kernel: run it without TRITON_INTERPRET=1")
    from executor_svc.kernels.qmatmul import SKINNY, TILED

    launches = {"skinny": SKINNY, "tiled": TILED}
    print(
        f"{'type':6} {'launch':7} {'k_steps':>7} {'loop':>6} {'/value':>7} {'mma':>4}  loads (per iteration, per thread)"
    )
    for type_name in args.types.split(","):
        for launch_name in args.launches.split(","):
            base = launches[launch_name]
            steps = sorted({base.k_steps, *(int(s) for s in args.k_steps.split(",") if s)})
            for k_steps in steps:
                c = count(type_name, replace(base, k_steps=k_steps))
                loads = " ".join(f"{op}x{n}" for op, n in c.loads.items())
                print(
                    f"{type_name:6} {launch_name:7} {k_steps:>7} {c.instructions:>6} {c.per_value:>7.1f} {c.mma:>4}  {loads}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
