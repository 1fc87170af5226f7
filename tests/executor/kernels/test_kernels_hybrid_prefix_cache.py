"""The hybrid prefix cache through the Triton kernels (under the interpreter on the CPU, for real on
a GPU): snapshots taken by capture windows, replays and verify windows give an agent's next turn
the tokens of the torch reference without a cache."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.engine.engine import Engine, EngineConfig  # noqa: E402
from executor_svc.engine.request_state import NewRequest  # noqa: E402
from executor_svc.kernels.triton_ops import TritonOps  # noqa: E402
from service_common.sampling_params import SamplingParams  # noqa: E402
from tests.support.engine_driver import ScriptedDrafter, drive  # noqa: E402
from tests.support.tiny_hybrid_gguf import TinyHybridSpec, write_tiny_hybrid_model  # noqa: E402


@pytest.mark.slow
def test_next_turns_through_the_triton_kernels_give_the_reference_tokens(tmp_path):
    _, path = write_tiny_hybrid_model(tmp_path / "qwen35.gguf", TinyHybridSpec("qwen35"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = Engine(
        EngineConfig(
            model=str(path), kv_cache_bytes=4 << 20, kernels="torch", num_state_slots=4, enable_prefix_caching=False
        )
    )
    engine = Engine(
        EngineConfig(
            model=str(path), kv_cache_bytes=4 << 20, kernels="triton", num_state_slots=4, device=device, dtype="float32"
        )
    )
    assert isinstance(engine.model_runner.ops, TritonOps)
    # a: boundary 32 inside its 37-token prompt (a capture window); b: 33 tokens, boundary on the last row (a replay).
    firsts = {
        "a": [3, 80, 71, 72, 79, 79, 82, 3, 90, 82, 85, 79, 71, 1, 2, 150, 200, 260, 40, 41, 42, 7, 9] * 2,
        "b": [150, 200, 260, 40, 41, 42, 7, 9, 11, 13, 3, 80, 71] * 3,
    }
    firsts = {"a": firsts["a"][:37], "b": firsts["b"][:33]}
    turn1 = [NewRequest(f"{k}1", p, SamplingParams(), 6, ignore_eos=True) for k, p in firsts.items()]
    expected1 = drive(reference, turn1).tokens
    assert drive(engine, turn1).tokens == expected1
    turn2 = [
        NewRequest(f"{k}2", p + expected1[f"{k}1"] + [5, 6], SamplingParams(), 8, ignore_eos=True)
        for k, p in firsts.items()
    ]
    expected2 = drive(reference, turn2).tokens
    engine.drafter = ScriptedDrafter(expected2, "partial", engine.model_config.vocab_size)
    run = drive(engine, turn2, chunk_size=8, draft_budget=3)
    assert run.tokens == expected2
    assert run.cached_tokens == {"a2": 32, "b2": 32}
    assert 0 < run.num_accepted < run.num_drafted
