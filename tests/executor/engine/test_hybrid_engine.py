"""The engine on hybrid (qwen35, qwen35moe) and MoE (qwen3moe) models: greedy tokens equal
transformers'; a request's tokens do not depend on its batch, its prefill chunking,
preemption, or speculation (drafts kept fully, partly, not at all; the recurrent state
rolled back to the last kept token); seeded sampling is reproducible with speculation;
running out of recurrent-state slots is clean back-pressure."""

from __future__ import annotations

import grpc
import pytest
import torch

from executor_svc.engine.engine import Engine, EngineConfig, ScheduledRequest, StepRequest
from executor_svc.engine.request_state import NewRequest
from executor_svc.errors import OutOfKVBlocksError, OutOfStateSlotsError
from executor_svc.model import gated_delta_net
from service_common.sampling_params import SamplingParams
from tests.support.engine_driver import ScriptedDrafter, drive
from tests.support.tiny_hybrid_gguf import TinyHybridSpec, write_tiny_hybrid_model

PROMPT = [3, 80, 71, 72, 79, 79, 82, 3, 90, 82, 85, 79, 71, 1, 2, 150, 200, 260, 40, 41, 42]
NUM_NEW_TOKENS = 12


def prompts(n: int) -> list[list[int]]:
    return [PROMPT[i % len(PROMPT) :] + PROMPT[: i % len(PROMPT)] + [100 + i] for i in range(n)]


def greedy_requests(n: int, num_new_tokens: int = NUM_NEW_TOKENS) -> list[NewRequest]:
    return [NewRequest(f"r{i}", p, SamplingParams(), num_new_tokens, ignore_eos=True) for i, p in enumerate(prompts(n))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch → (transformers model, GGUF path)."""
    root = tmp_path_factory.mktemp("models")
    return {
        arch: write_tiny_hybrid_model(root / f"{arch}.gguf", TinyHybridSpec(arch))
        for arch in ("qwen35", "qwen35moe", "qwen3moe")
    }


def make_engine(path, **overrides) -> Engine:
    config = dict(model=str(path), kv_cache_bytes=4 << 20, kernels="torch", num_state_slots=8)
    return Engine(EngineConfig(**{**config, **overrides}))


@pytest.fixture(scope="module")
def engine(models):
    return make_engine(models["qwen35"][1])


@pytest.fixture(scope="module")
def baseline(engine):
    """One request at a time, whole prompts, no speculation."""
    return {r.request_id: drive(engine, [r]).tokens[r.request_id] for r in greedy_requests(8)}


# ------------------------------------------------------------------ correctness


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,kernels",
    [("qwen35", "torch"), ("qwen35", "cpu"), ("qwen35moe", "torch"), ("qwen35moe", "cpu"), ("qwen3moe", "torch")],
)
def test_greedy_tokens_match_transformers(models, arch, kernels):
    hf, path = models[arch]
    engine = make_engine(path, kernels=kernels)
    run = drive(engine, greedy_requests(2, 8), chunk_size=7)
    for request in greedy_requests(2, 8):
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([request.prompt_token_ids]), max_new_tokens=8, do_sample=False)
        assert run.tokens[request.request_id] == expected[0, len(request.prompt_token_ids) :].tolist(), (
            request.request_id
        )


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [1, 5, None])
def test_batching_and_chunking_change_no_token(engine, baseline, chunk_size):
    reqs = greedy_requests(8)
    arrivals = {r.request_id: 3 * i for i, r in enumerate(reqs)}  # batch sizes sweep 1..8 and back
    run = drive(engine, reqs, chunk_size=chunk_size, arrival_steps=arrivals)
    assert run.max_batch_size >= 4
    assert run.tokens == baseline
    assert engine.kv.state_pool.num_free_slots == engine.kv.state_pool.num_slots


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "partial", "none"])
def test_speculation_changes_no_token(engine, baseline, mode):
    """Greedy at B = 1..8 with drafts kept fully, partly and not at all; the recurrent state
    restored to the one after the last kept token each time."""
    continuations = dict(baseline)
    engine.drafter, saved = ScriptedDrafter(continuations, mode, engine.model_config.vocab_size), engine.drafter
    try:
        for batch_size in (1, 3, 8):
            reqs = greedy_requests(batch_size)
            run = drive(engine, reqs, chunk_size=6, draft_budget=4)
            assert run.tokens == {r.request_id: baseline[r.request_id] for r in reqs}, (mode, batch_size)
            assert run.num_drafted > 0
            if mode == "full":
                assert run.num_accepted == run.num_drafted
            elif mode == "partial":
                assert 0 < run.num_accepted < run.num_drafted
            else:
                assert run.num_accepted == 0
    finally:
        engine.drafter = saved


@pytest.mark.slow
def test_seeded_sampling_is_the_same_with_speculation_on_and_off(engine):
    reqs = [
        NewRequest(f"s{seed}", PROMPT, SamplingParams(temperature=1.5, seed=seed), 10, ignore_eos=True)
        for seed in range(6)
    ]
    off = drive(engine, reqs).tokens
    engine.drafter, saved = ScriptedDrafter(off, "partial", engine.model_config.vocab_size), engine.drafter
    try:
        on = drive(engine, reqs, chunk_size=5, draft_budget=3)
    finally:
        engine.drafter = saved
    assert len({tuple(t) for t in off.values()}) > 1, "the seeds should sample different tokens"
    assert on.num_accepted > 0
    assert on.tokens == off


@pytest.mark.slow
def test_preemption_and_recompute_change_no_token(engine, baseline):
    """A preempted request gives its slot back and rebuilds its state from token 0."""
    reqs = greedy_requests(3)
    tokens = {r.request_id: [] for r in reqs}
    known = {r.request_id: len(r.token_ids) for r in reqs}
    computed = {r.request_id: 0 for r in reqs}
    new, preempted, step = list(reqs), [], 0
    while known:
        if step in (4, 9) and "r1" in known:
            preempted, computed["r1"] = ["r1"], 0
        scheduled = [ScheduledRequest(rid, min(known[rid] - computed[rid], 4)) for rid in known if rid not in preempted]
        result = engine.step(StepRequest(scheduled=scheduled, new_requests=new, preempted=preempted))
        if preempted:
            assert engine.kv.state_slot("r1") == -1
        new, preempted = [], []
        for out in result.outputs:
            tokens[out.request_id] += out.new_token_ids
            known[out.request_id] += len(out.new_token_ids)
            computed[out.request_id] = out.num_computed_tokens
            if out.finish_reason is not None:
                del known[out.request_id]
        step += 1
    assert tokens == {r.request_id: baseline[r.request_id] for r in reqs}
    assert engine.kv.state_pool.num_free_slots == engine.kv.state_pool.num_slots


# ------------------------------------------------------------------ back-pressure


def test_running_out_of_state_slots_refuses_the_plan_and_changes_nothing(models):
    engine = make_engine(models["qwen35"][1], num_state_slots=2)
    a, b, c = greedy_requests(3)
    with pytest.raises(OutOfStateSlotsError, match="recurrent-state slots"):
        engine.step(
            StepRequest(new_requests=[a, b, c], scheduled=[ScheduledRequest(r.request_id, 5) for r in (a, b, c)])
        )
    assert engine.request_ids == [] and engine.kv.state_pool.num_free_slots == 2
    engine.step(StepRequest(new_requests=[a, b], scheduled=[ScheduledRequest(r.request_id, 5) for r in (a, b)]))
    assert engine.kv.state_pool.num_free_slots == 0
    with pytest.raises(OutOfKVBlocksError):  # the same back-pressure class: RESOURCE_EXHAUSTED
        engine.step(StepRequest(new_requests=[c], scheduled=[ScheduledRequest(c.request_id, 5)]))
    assert engine.request_ids == ["r0", "r1"]
    # Preempting one in the same plan frees the slot the newcomer takes.
    engine.step(StepRequest(new_requests=[c], preempted=["r1"], scheduled=[ScheduledRequest(c.request_id, 5)]))
    assert engine.kv.state_slot("r2") >= 0 and engine.kv.state_slot("r1") == -1


def test_state_memory_comes_out_of_the_kv_budget(models):
    small = make_engine(models["qwen35"][1], num_state_slots=2)
    large = make_engine(models["qwen35"][1], num_state_slots=32)
    per_slot = small.kv.state_pool.bytes_per_slot
    # 3 DeltaNet layers × (conv 3 × 128 floats + state 4 heads × 16 × 16 floats)
    assert per_slot == 3 * (3 * 128 * 4 + 4 * 16 * 16 * 4)
    assert large.kv.num_usable_blocks < small.kv.num_usable_blocks
    # KV only for the one full-attention layer of four.
    assert small.kv.cache.tensor.shape[0] == 1


def test_calibration_runs_on_a_hybrid_model(engine):
    samples = engine.model_runner.calibrate(token_counts=(1, 4), context_lens=(0,), batch_sizes=(2,))
    assert samples and all(s.forward_s > 0 for s in samples)
    assert engine.kv.state_pool.num_free_slots == engine.kv.state_pool.num_slots


@pytest.mark.slow
def test_long_prefills_take_the_chunked_delta_rule_when_batch_invariance_is_off(models, engine, monkeypatch):
    """With batch_invariant off, a prefill of ≥ 64 tokens runs the chunked form (rounding then depends
    on chunk boundaries, so only closeness is promised); decodes verifying drafts beside it still roll
    back exactly. On this model the tokens come out the same as the invariant engine's."""
    fast = make_engine(models["qwen35"][1], batch_invariant=False)
    long_prompt = (PROMPT * 6)[:100]
    reqs = [NewRequest("long", long_prompt, SamplingParams(), 8, ignore_eos=True), *greedy_requests(3, 8)]
    expected = drive(engine, reqs).tokens
    fast.drafter = ScriptedDrafter(expected, "partial", fast.model_config.vocab_size)
    calls = []
    chunked = gated_delta_net.chunked_gated_delta_rule
    monkeypatch.setattr(
        gated_delta_net, "chunked_gated_delta_rule", lambda *a, **k: calls.append(1) or chunked(*a, **k)
    )
    arrivals = {"long": 3}  # arrives while the others decode with drafts
    run = drive(fast, reqs, arrival_steps=arrivals, draft_budget=3)
    assert len(calls) == 3  # the long prompt's one step, in each of the 3 DeltaNet layers
    assert 0 < run.num_accepted < run.num_drafted
    assert run.tokens == expected


# ------------------------------------------------------------------ services


@pytest.mark.e2e
def test_services_run_more_requests_than_state_slots_without_refusals(models):
    """GetInfo reports the state pool; the scheduler caps running requests at its slots, so
    six concurrent requests on two slots all finish, with the tokens they get alone."""
    import asyncio

    from clients import AsyncSwarmClient
    from executor_svc.server import serve as serve_executor
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.server import serve as serve_scheduler
    from swarmserve.executor.v1 import executor_pb2, executor_pb2_grpc
    from tests.support.stack import free_port, stop_scheduler

    engine = make_engine(models["qwen35"][1], num_state_slots=2)
    reqs = greedy_requests(6, 6)
    alone = {r.request_id: drive(engine, [r]).tokens[r.request_id] for r in reqs}

    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address)
        try:
            async with grpc.aio.insecure_channel(executor_address) as channel:
                info = await executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(
                    executor_pb2.GetInfoRequest(), timeout=10
                )
            config = SchedulerConfig(
                listen=f"127.0.0.1:{free_port()}", executor=executor_address, max_running_requests=16
            )
            server, loop, tasks = await serve_scheduler(config)
            try:
                await loop.wait_connected(5)
                async with AsyncSwarmClient(config.listen) as client:
                    completions = await asyncio.gather(
                        *(
                            client.complete(
                                token_ids=r.prompt_token_ids, max_new_tokens=6, ignore_eos=True, temperature=0.0
                            )
                            for r in reqs
                        )
                    )
            finally:
                await stop_scheduler(server, loop, tasks)
            return info, completions
        finally:
            await executor.stop(None)

    info, completions = asyncio.run(main())
    assert (info.num_state_slots, info.num_free_state_slots) == (2, 2)
    assert info.state_bytes_per_request == engine.kv.state_pool.bytes_per_slot
    assert info.kv_bytes_per_block == engine.kv.cache.tensor[0].numel() // engine.kv.cache.allocator.num_blocks * 4
    assert [list(c.token_ids) for c in completions] == [alone[r.request_id] for r in reqs]
