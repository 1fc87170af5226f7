"""`--kernels triton` in the real engine (interpreted on CPU): the same greedy tokens as torch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

from executor_svc.engine.engine import EngineConfig  # noqa: E402
from executor_svc.engine.request_state import NewRequest  # noqa: E402
from executor_svc.kernels.triton_ops import TritonOps  # noqa: E402
from executor_svc.model.torch_ops import TorchOps  # noqa: E402
from executor_svc.weights.weight_format import Kernel, PackedWeight  # noqa: E402
from tests.support.engine_driver import drive  # noqa: E402
from tests.support.tiny_gguf import TinyModelSpec, qwen3_spec  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")


@pytest.mark.slow
@pytest.mark.parametrize("spec", [TinyModelSpec("llama"), qwen3_spec()], ids=["llama", "qwen3"])
def test_triton_kernels_in_the_engine_give_the_torch_tokens(make_tiny_engine, spec):
    requests = [
        NewRequest(
            "a",
            [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
            max_new_tokens=6,
            ignore_eos=True,
        ),
        NewRequest("b", [60, 61, 62], max_new_tokens=6, ignore_eos=True),
    ]
    runs = {}
    for kernels in ("torch", "triton"):
        engine = make_tiny_engine(spec, kernels=kernels, device="cpu", kv_cache_bytes=1 << 20)
        assert isinstance(engine.model_runner.ops, TritonOps if kernels == "triton" else TorchOps)
        runs[kernels] = drive(engine, requests, chunk_size=7, arrival_steps={"b": 1}, draft_budget=2).tokens
    assert runs["triton"] == runs["torch"]


@pytest.mark.slow
def test_triton_dequant_matmul_on_resident_gguf_blocks_gives_the_cpu_kernels_tokens(make_tiny_engine):
    """Quantized weights stay GGUF blocks for the Triton kernels (as many bytes as the C++ kernels
    hold), and greedy decoding with them matches the exact C++ path, speculation and chunking included.
    (One small Q8_0 model: the interpreter is slow; every type is checked against gguf-py in kernels/test_qmatmul.)"""
    spec = TinyModelSpec("llama", GGMLQuantizationType.Q8_0)
    requests = [
        NewRequest("a", list(range(40, 58)), max_new_tokens=5, ignore_eos=True),
        NewRequest("b", [60, 61, 62], max_new_tokens=5, ignore_eos=True),
    ]
    engines = {
        kernels: make_tiny_engine(spec, kernels=kernels, device="cpu", dtype="float32", kv_cache_bytes=1 << 20)
        for kernels in ("cpu", "triton")
    }
    qkv = engines["triton"].model_runner.model.weights.layers[0].qkv
    assert isinstance(qkv, PackedWeight) and qkv.kernel == Kernel.TRITON and qkv.type_name == spec.tensor_type.name
    assert engines["triton"].model_runner.weight_bytes == engines["cpu"].model_runner.weight_bytes
    tokens = {
        k: drive(e, requests, chunk_size=7, arrival_steps={"b": 1}, draft_budget=2).tokens for k, e in engines.items()
    }
    assert tokens["triton"] == tokens["cpu"]


def test_auto_kernels_are_the_cpp_kernels_on_the_cpu_and_torch_on_request(make_tiny_engine):
    from executor_svc.model.cpu_ops import CpuOps

    assert isinstance(make_tiny_engine(kv_cache_bytes=1 << 20).model_runner.ops, CpuOps)
    assert isinstance(make_tiny_engine(kv_cache_bytes=1 << 20, kernels="torch").model_runner.ops, TorchOps)


def test_bad_device_and_kernels_values_are_refused():
    with pytest.raises(ValueError, match="kernels must be one of"):
        EngineConfig(kernels="cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(device="tpu")
