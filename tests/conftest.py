"""Shared fixtures: tiny random GGUFs and engines on them, the embedded model in the engine,
and the transformers reference."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The Triton interpreter runs tl.dot through numpy's OpenBLAS, whose AVX2 (Haswell/Zen)
# sgemm kernels sum a row differently at a tile's edge than inside it: a Triton kernel's
# bit-for-bit batch invariance (by construction on a GPU) then fails under the interpreter
# on AVX2 CPUs only (AVX-512 ones use other kernels). OpenBLAS's generic kernels keep each
# row's order fixed. It must be set before numpy loads OpenBLAS, i.e. before any test module.
os.environ.setdefault("OPENBLAS_CORETYPE", "Prescott")
if "numpy" in sys.modules and os.environ["OPENBLAS_CORETYPE"] == "Prescott":
    print("conftest: numpy was imported before OPENBLAS_CORETYPE could be set; interpreter invariance tests may fail")

# The Triton kernels are tested interpreted (no GPU here). triton decides whether a kernel is
# interpreted when its module is imported, so this must hold before any test module imports
# triton: a module's own setdefault comes too late when another that imports triton is collected
# first (`pytest tests/executor/tools/test_gpu_check.py tests/executor/kernels/test_qmatmul.py`
# failed 33 of qmatmul's tests). Tests that build kernels for a card unset it in a subprocess.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The reference never fetches anything from a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Markers by folder (pyproject.toml describes them), so that a folder's tests are selected or
# left out whole: `pytest tests/executor -m "not e2e and not slow"` is the fast loop.
FOLDER_MARKERS = {
    ("e2e",): "e2e",
    ("executor", "kernels"): "gpu",
    ("executor", "tools"): "gpu",
}
# A test that takes one of these fixtures loads the embedded model or the transformers reference.
SLOW_FIXTURES = {"engine_fp32", "engine_default", "hf_reference"}


def pytest_collection_modifyitems(config, items):
    tests_dir = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(tests_dir):
            continue
        parts = item.path.relative_to(tests_dir).parts
        for prefix, marker in FOLDER_MARKERS.items():
            if parts[: len(prefix)] == prefix:
                item.add_marker(marker)
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker("slow")


@pytest.fixture(scope="session")
def default_model_path():
    from executor_svc.weights.model_source import resolve_model_path

    return resolve_model_path("default")


@pytest.fixture(scope="session")
def engine_fp32():
    """The embedded model, float32, batch-invariant: shared by the correctness tests."""
    from executor_svc.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model="default", dtype="float32", kv_cache_bytes=512 << 20))


@pytest.fixture(scope="session")
def engine_default():
    """The embedded model with default settings (on the CPU: the int16 matmul where it runs)."""
    from executor_svc.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model="default", kv_cache_bytes=512 << 20))


@pytest.fixture(scope="session")
def hf_reference(default_model_path):
    """transformers loading the same GGUF, float32: the correctness reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(default_model_path.parent), default_model_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    return tokenizer, model


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory):
    """tiny_gguf_path(spec) -> the path of that tiny random GGUF, written once per session."""
    from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model

    paths = {}

    def path_of(spec: TinyModelSpec = TinyModelSpec()):
        if spec not in paths:
            paths[spec] = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf", spec)
        return paths[spec]

    return path_of


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_gguf_path):
    """make_tiny_engine(spec, **EngineConfig fields) -> a fresh Engine on that tiny random GGUF."""
    from executor_svc.engine.engine import Engine, EngineConfig
    from tests.support.tiny_gguf import TinyModelSpec

    def make(spec: TinyModelSpec = TinyModelSpec(), **config):
        return Engine(EngineConfig(model=str(tiny_gguf_path(spec)), **config))

    return make


@pytest.fixture(scope="module")
def engine(make_tiny_engine):
    """A tiny random model's engine, one per test module, for in-process services."""
    from tests.support.tiny_gguf import TinyModelSpec

    return make_tiny_engine(TinyModelSpec(context_length=256), kv_cache_bytes=8 << 20)
