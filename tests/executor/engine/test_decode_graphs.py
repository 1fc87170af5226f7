"""Graph-captured decode's bookkeeping on the CPU: a fake capture stands in for the CUDA graph.

The fake does what a graph does with memory: replay re-runs the captured work on
the same static buffers, so what is checked here is the buckets, the padding rows
and the copying of each step's tensors into the buffers (the Triton ops interpreted).
"""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.engine.decode_graphs import DecodeGraphs, bucket_for, is_plain_decode  # noqa: E402
from executor_svc.kernels.triton_ops import TritonOps  # noqa: E402
from executor_svc.kv.block_allocator import NULL_BLOCK_ID  # noqa: E402
from executor_svc.kv.kv_cache import KVCache  # noqa: E402
from executor_svc.model.ragged_batch import RaggedBatch, RequestSlice  # noqa: E402
from executor_svc.model.torch_ops import TorchOps  # noqa: E402
from executor_svc.model.transformer import Transformer  # noqa: E402
from executor_svc.tools.random_model import model_config, random_weights  # noqa: E402
from executor_svc.weights.weight_format import Kernel, PackedWeight  # noqa: E402

BLOCK_SIZE = 16
DEVICE = torch.device("cpu")


class FakeCapture:
    """capture(fn) records fn (running nothing, as a graph capture runs nothing); replay() runs it
    over the same buffers."""

    def __init__(self) -> None:
        self.num_captures = 0
        self.num_replays = 0

    def __call__(self, fn):
        self.num_captures += 1

        def replay():
            self.num_replays += 1
            return fn()

        return replay


def as_triton_weights(weights):
    """Dense float32 matmul weights as F32 GGUF rows for the Triton dequant-matmul, which is row-invariant
    (the CPU's dense GEMM is not: it would make padding rows change real rows' bits)."""

    def packed(w: torch.Tensor) -> PackedWeight:
        return PackedWeight(w.contiguous().view(torch.uint8).reshape(w.shape[0], -1), 0, tuple(w.shape), Kernel.TRITON)

    layers = [
        replace(
            layer,
            qkv=packed(layer.qkv),
            o_proj=packed(layer.o_proj),
            gate_up=packed(layer.gate_up),
            down=packed(layer.down),
        )
        for layer in weights.layers
    ]
    return replace(weights, embed=packed(weights.embed), lm_head=packed(weights.lm_head), layers=layers)


@pytest.fixture(scope="module")
def model_and_cache():
    config = model_config(
        "tiny",
        num_layers=1,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=120,
        context_length=128,
    )
    model = Transformer(
        config, as_triton_weights(random_weights(config, torch.float32, DEVICE, seed=4)), DEVICE, ops=TritonOps()
    )
    kv_cache = KVCache(config, num_blocks=1 + 5 * 3, block_size=BLOCK_SIZE, dtype=torch.float32, device=DEVICE)
    kv_cache.tensor.normal_(generator=torch.Generator().manual_seed(5))
    return model, kv_cache


def decode_batch(positions: list[int], tokens: list[int]) -> RaggedBatch:
    """Request r decodes tokens[r] at positions[r], its blocks 1 + 3r .. 3 + 3r."""
    slices = [
        RequestSlice([t], p, list(range(1 + 3 * r, 4 + 3 * r)), 1) for r, (p, t) in enumerate(zip(positions, tokens))
    ]
    return RaggedBatch.build(slices, BLOCK_SIZE, DEVICE)


def test_bucket_is_the_smallest_that_holds_the_requests():
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 16, 16, 32, 32]
    assert bucket_for(33) is None
    assert bucket_for(3, (8, 2)) == 8


def test_replays_give_the_eager_logits_and_kv(model_and_cache):
    model, kv_cache = model_and_cache
    capture = FakeCapture()
    graphs = DecodeGraphs(model, kv_cache, capture=capture)
    for positions, tokens, bucket, num_captures in [
        ([5, 30, 17], [7, 8, 9], 4, 1),  # three requests: captured at 4, one padding row
        ([6, 31, 18, 40], [10, 11, 12, 13], 4, 1),  # the same bucket replays, no new capture
        ([41], [3], 1, 2),
    ]:
        batch = decode_batch(positions, tokens)
        eager = model.forward(batch, kv_cache)
        kv_after_eager = kv_cache.tensor.clone()
        replayed = graphs.forward(batch)
        assert torch.equal(replayed, eager)
        # The same K/V went to the requests' slots; the padding row wrote the null block only.
        assert torch.equal(kv_cache.tensor[:, :, NULL_BLOCK_ID + 1 :], kv_after_eager[:, :, NULL_BLOCK_ID + 1 :])
        assert capture.num_captures == num_captures and graphs.captured_buckets[-1 if bucket == 4 else 0] == bucket


def test_rows_past_the_requests_are_padding_in_the_null_block(model_and_cache):
    model, kv_cache = model_and_cache
    graphs = DecodeGraphs(model, kv_cache, capture=FakeCapture())
    graphs.forward(decode_batch([9, 20, 33, 2, 45], [1, 2, 3, 4, 5]))  # bucket 8: rows 5..7 are padding
    static = graphs._steps[8].batch
    assert static.token_ids[5:].tolist() == [0, 0, 0] and static.positions[5:].tolist() == [0, 0, 0]
    assert static.slot_mapping[5:].tolist() == [NULL_BLOCK_ID * BLOCK_SIZE] * 3
    assert bool((static.block_tables[5:] == NULL_BLOCK_ID).all())
    # Request rows: their own positions and tables, the tail of each table null.
    assert static.positions[:5].tolist() == [9, 20, 33, 2, 45]
    assert graphs._steps[8].metadata.tile_first_positions[:5].tolist() == [9, 20, 33, 2, 45]
    assert static.block_tables[1, :4].tolist() == [4, 5, 6, NULL_BLOCK_ID]


def test_only_plain_decode_steps_replay(model_and_cache):
    model, kv_cache = model_and_cache
    graphs = DecodeGraphs(model, kv_cache, capture=FakeCapture())
    prefill = RaggedBatch.build([RequestSlice([1, 2, 3], 0, [1], 1)], BLOCK_SIZE, DEVICE)
    verify = RaggedBatch.build([RequestSlice([1, 2], 4, [1], 2)], BLOCK_SIZE, DEVICE)
    too_many = RaggedBatch.build([RequestSlice([1], 0, [1], 1)] * 33, BLOCK_SIZE, DEVICE)
    for batch in (prefill, verify, too_many):
        assert not is_plain_decode(batch) or batch is too_many
        assert not graphs.can_run(batch)
        with pytest.raises(ValueError, match="not a decode step a graph replays"):
            graphs.forward(batch)
    assert graphs.captured_buckets == []
    with pytest.raises(ValueError, match="Triton ops"):
        DecodeGraphs(Transformer(model.config, model.weights, DEVICE, ops=TorchOps()), kv_cache, capture=FakeCapture())


@pytest.mark.slow
def test_the_engine_replays_plain_decode_steps_and_gives_the_eager_tokens(make_tiny_engine):
    """In the engine (on the CPU the engine builds no graphs; one with the fake capture is put in):
    plain decode steps replay, prefill chunks and verify steps run eagerly, and the greedy tokens
    are the engine's without graphs."""
    from gguf import GGMLQuantizationType

    from executor_svc.engine.request_state import NewRequest
    from tests.support.engine_driver import drive
    from tests.support.tiny_gguf import TinyModelSpec

    spec = TinyModelSpec("llama", GGMLQuantizationType.Q8_0, num_layers=1)
    requests = [
        NewRequest("a", list(range(40, 50)), max_new_tokens=5, ignore_eos=True),
        NewRequest("b", [60, 61, 62], max_new_tokens=4, ignore_eos=True),
        NewRequest("c", [70, 71], max_new_tokens=3, ignore_eos=True),
    ]
    tokens = {}
    for use_graphs in (False, True):
        engine = make_tiny_engine(spec, kernels="triton", device="cpu", dtype="float32", kv_cache_bytes=1 << 20)
        assert engine.model_runner.decode_graphs is None  # no CUDA here
        capture = FakeCapture()
        if use_graphs:
            engine.model_runner.decode_graphs = DecodeGraphs(
                engine.model_runner.model, engine.kv.cache, capture=capture
            )
        # Request c speculates (its steps run eagerly); a and b decode plainly, from 1 to 3 requests a step.
        budget = lambda step, request_id: 2 if request_id == "c" else 0  # noqa: E731
        tokens[use_graphs] = drive(
            engine, requests, chunk_size=4, arrival_steps={"b": 2, "c": 3}, draft_budget=budget
        ).tokens
        if use_graphs:
            assert capture.num_replays > 0 and capture.num_captures >= 2
    assert tokens[True] == tokens[False]
