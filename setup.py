"""Build hook: generate the Python protobuf/gRPC code from protos/ at install time.

The generated modules (`swarmserve.executor.v1.executor_pb2`, ...) are written next
to their .proto files under protos/, which is the package root of the `swarmserve`
namespace, so editable and regular installs import them the same way. They are
never committed or edited by hand.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTO_ROOT = ROOT / "protos"


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    if not sources:
        return
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={include}",
        f"--python_out={PROTO_ROOT}",
        f"--pyi_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
