"""Overlapped scheduling, without sockets: the real planner and the real engine in one process.

The step loop's pipeline is emulated exactly: plan N is sent, plan N+1 is built
ahead (from the state N is expected to leave) and sent, then N runs and its
result is applied, then N+2 is built ahead of N+1, and so on. Every request must
get the very tokens it gets with one step in flight (greedy and seeded
sampling, with drafts, chunked prefills, finishes at max_new_tokens, stops
decided by the scheduler, and KV pressure that forces preemptions), and the
executor must end holding nothing.

The executor's side of the contract (Engine.rebase) is tested on its own too: a
plan built ahead may name a request the previous step finished, and may ask
for more prompt tokens than a prefix hit left; a plan not built ahead may not.
"""

from __future__ import annotations

import pytest

from executor_svc.engine.engine import ScheduledRequest, StepRequest
from executor_svc.engine.request_state import NewRequest
from executor_svc.errors import UnknownRequestError
from service_common.errors import InvalidRequestError
from tests.support.planner_driver import run, workload
from tests.support.tiny_gguf import TinyModelSpec


@pytest.fixture(scope="module")
def engine(make_tiny_engine):
    return make_tiny_engine(TinyModelSpec(context_length=512), kv_cache_bytes=4 << 20, max_draft_tokens=8)


@pytest.mark.parametrize("spec", ["off", "fixed:4"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_two_plans_in_flight_give_the_tokens_of_one(engine, spec, temperature):
    sync, _ = run(engine, workload(temperature=temperature), max_in_flight=1, spec=spec)
    overlapped, counters = run(engine, workload(temperature=temperature), max_in_flight=2, spec=spec)
    assert overlapped == sync
    assert counters["ahead"] > counters["steps"] // 2, counters  # most plans really were built ahead
    assert all(len(t) == 6 + 5 * i for i, t in enumerate(sync.values()))
    if spec != "off":
        assert counters["drafted"] > 0


def test_chunked_prefills_planned_ahead_become_decodes(engine):
    sync, _ = run(engine, workload(), max_in_flight=1, budget=8)
    overlapped, counters = run(engine, workload(), max_in_flight=2, budget=8)
    assert overlapped == sync
    assert counters["ahead"] > 0


def test_stops_decided_by_the_scheduler_discard_what_the_plan_in_flight_made(engine):
    stops = {"r1": 3, "r4": 1, "r7": 10}
    sync, _ = run(engine, workload(), max_in_flight=1, spec="fixed:4", stop_after=stops)
    overlapped, _ = run(engine, workload(), max_in_flight=2, spec="fixed:4", stop_after=stops)
    assert overlapped == sync
    assert {rid: len(sync[rid]) for rid in stops} == stops


def test_kv_pressure_falls_back_to_planning_after_the_result(engine):
    """Too few KV blocks for everyone: preemptions are planned only with nothing in flight."""
    sync, sync_counters = run(engine, workload(), max_in_flight=1, num_kv_blocks=14)
    overlapped, counters = run(engine, workload(), max_in_flight=2, num_kv_blocks=14)
    assert overlapped == sync
    assert sync_counters["preempted"] > 0 and counters["not_ahead"] > 0, (sync_counters, counters)


# ------------------------------------------------------------------ the executor's side


def test_a_plan_built_ahead_skips_a_request_the_previous_step_finished(engine):
    new = NewRequest("done", [5, 6, 7], max_new_tokens=1, ignore_eos=True)
    first = engine.step(StepRequest(scheduled=[ScheduledRequest("done", 3)], new_requests=[new]))
    assert first.outputs[0].finish_reason is not None and not engine.has_request("done")
    # Built before that result was known: "done" was expected to decode once more.
    ahead = StepRequest(scheduled=[ScheduledRequest("done", 1, draft_budget=2)], planned_after_step_id=1)
    output = engine.step(ahead)
    assert output.outputs == [] and output.num_computed_tokens == 0
    assert engine.step(StepRequest(preempted=["done"], planned_after_step_id=2)).outputs == []
    # A plan not built ahead that names it is a scheduler bug, and says so.
    with pytest.raises(UnknownRequestError):
        engine.step(StepRequest(scheduled=[ScheduledRequest("done", 1)]))
    with pytest.raises(UnknownRequestError):
        engine.step(StepRequest(scheduled=[ScheduledRequest("never-seen", 1)], planned_after_step_id=3))


def test_a_plan_built_ahead_computes_at_most_what_is_left(engine):
    prompt = list(range(3, 3 + 40))
    engine.step(
        StepRequest(scheduled=[ScheduledRequest("a", 32)], new_requests=[NewRequest("a", prompt, max_new_tokens=4)])
    )
    # 8 prompt tokens are left; a plan built ahead may ask for more (a prefix hit went further than planned).
    output = engine.step(StepRequest(scheduled=[ScheduledRequest("a", 16)], planned_after_step_id=1))
    assert output.num_computed_tokens == 8 and len(output.outputs[0].new_token_ids) == 1
    # ... and a decode planned ahead is one token: the one the previous step sampled.
    output = engine.step(StepRequest(scheduled=[ScheduledRequest("a", 3)], planned_after_step_id=2))
    assert output.num_computed_tokens == 1
    with pytest.raises(InvalidRequestError, match="not yet in KV"):
        engine.step(StepRequest(scheduled=[ScheduledRequest("a", 3)]))
    engine.step(StepRequest(released=["a"]))


# ------------------------------------------------------------------ the executor's servicer


@pytest.mark.e2e
def test_the_servicer_runs_a_plan_built_ahead_only_after_the_step_it_follows(engine):
    import asyncio

    import grpc

    from executor_svc.server import serve
    from swarmserve.executor.v1 import executor_pb2 as pb
    from swarmserve.executor.v1 import executor_pb2_grpc as pb_grpc
    from tests.support.stack import free_port

    async def main():
        address = f"127.0.0.1:{free_port()}"
        server = await serve(engine, address)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.ExecutorServiceStub(channel)
                await stub.GetInfo(pb.GetInfoRequest(scheduler_id="s"))
                new = pb.NewRequest(request_id="q", prompt_token_ids=[4, 5, 6, 7], max_new_tokens=8, ignore_eos=True,
                                    sampling=pb.SamplingParams(top_p=1.0))  # fmt: skip
                # Step 2 arrives first: it must wait for step 1 (it decodes the token step 1 samples).
                second = asyncio.ensure_future(
                    stub.Step(
                        pb.StepRequest(
                            step_id=2,
                            scheduler_id="s",
                            planned_after_step_id=1,
                            scheduled=[pb.ScheduledRequest(request_id="q", num_tokens=1)],
                        )
                    )  # fmt: skip
                )
                await asyncio.sleep(0.3)
                assert not second.done()
                first = await stub.Step(pb.StepRequest(step_id=1, scheduler_id="s", new_requests=[new],
                                                       scheduled=[pb.ScheduledRequest(request_id="q", num_tokens=4)]))  # fmt: skip
                second = await second
                assert len(first.results[0].new_token_ids) == len(second.results[0].new_token_ids) == 1
                # A step that fails takes the plan built ahead of it down too: that plan assumed a state that never was.
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await stub.Step(pb.StepRequest(step_id=3, scheduler_id="s",
                                                   scheduled=[pb.ScheduledRequest(request_id="q", num_tokens=9)]))  # fmt: skip
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.aio.AioRpcError) as aborted:
                    await stub.Step(pb.StepRequest(step_id=4, scheduler_id="s", planned_after_step_id=3,
                                                   scheduled=[pb.ScheduledRequest(request_id="q", num_tokens=1)]))  # fmt: skip
                assert aborted.value.code() == grpc.StatusCode.ABORTED and "failed" in aborted.value.details()
                await stub.Step(pb.StepRequest(step_id=5, scheduler_id="s", released=["q"]))
        finally:
            await server.stop(None)

    asyncio.run(main())
