"""`--kernels triton` in the real engine (interpreted on CPU): the same greedy tokens as torch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from executor_svc.engine import EngineConfig  # noqa: E402
from executor_svc.kernels.triton_ops import TritonOps  # noqa: E402
from executor_svc.request_state import NewRequest  # noqa: E402
from executor_svc.torch_ops import TorchOps  # noqa: E402
from tests.engine_driver import drive  # noqa: E402
from tests.tiny_gguf import TinyModelSpec, qwen3_spec  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")


@pytest.mark.parametrize("spec", [TinyModelSpec("llama"), qwen3_spec()], ids=["llama", "qwen3"])
def test_triton_kernels_in_the_engine_give_the_torch_tokens(make_tiny_engine, spec):
    requests = [
        NewRequest("a", [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], max_new_tokens=6, ignore_eos=True),
        NewRequest("b", [60, 61, 62], max_new_tokens=6, ignore_eos=True),
    ]
    runs = {}
    for kernels in ("torch", "triton"):
        engine = make_tiny_engine(spec, kernels=kernels, device="cpu", kv_cache_bytes=1 << 20)
        assert isinstance(engine.ops, TritonOps if kernels == "triton" else TorchOps)
        runs[kernels] = drive(engine, requests, chunk_size=7, arrival_steps={"b": 1}, draft_budget=2).tokens
    assert runs["triton"] == runs["torch"]


def test_auto_kernels_are_the_cpp_kernels_on_the_cpu_and_torch_on_request(make_tiny_engine):
    from executor_svc.cpu_ops import CpuOps

    assert isinstance(make_tiny_engine(kv_cache_bytes=1 << 20).ops, CpuOps)
    assert isinstance(make_tiny_engine(kv_cache_bytes=1 << 20, kernels="torch").ops, TorchOps)


def test_bad_device_and_kernels_values_are_refused():
    with pytest.raises(ValueError, match="kernels must be one of"):
        EngineConfig(kernels="cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(device="tpu")
