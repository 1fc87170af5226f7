"""Fuzzing the executor's Step on a real server (in this process, on loopback): arbitrary
plans from the attached scheduler get only defined status codes (OK, INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, each with a message), never INTERNAL; the server stays up, and once
the scheduler re-attaches (releasing everything) no KV block is held.

Plans draw on a small pool of request ids so that they name known requests, new ones,
released and preempted ones, and conflicting mixes of these. 1,000 cases by default;
SWARMSERVE_LONG_TESTS=1 runs 10,000.
"""

from __future__ import annotations

import asyncio
import os
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_svc.server import serve as serve_executor
from swarmserve.executor.v1 import executor_pb2 as epb
from swarmserve.executor.v1 import executor_pb2_grpc as epb_grpc
from tests.support.stack import free_port
from tests.support.tiny_gguf import TinyModelSpec

NUM_CASES = 10_000 if os.environ.get("SWARMSERVE_LONG_TESTS") == "1" else 1_000
SCHEDULER_ID = "fuzzing-scheduler"
DEFINED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
IDS = ["a", "b", "c", "d", ""]


@pytest.fixture(scope="module")
def executor(make_tiny_engine):
    engine = make_tiny_engine(TinyModelSpec(context_length=128), kv_cache_bytes=1 << 20, max_num_batched_tokens=256)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    address = f"127.0.0.1:{free_port()}"
    server = asyncio.run_coroutine_threadsafe(serve_executor(engine, address), loop).result(60)
    yield address, engine
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


small = st.integers(0, 40)
wild = st.integers(0, 2**32 - 1)


@st.composite
def new_requests(draw):
    return epb.NewRequest(
        request_id=draw(st.sampled_from(IDS)),
        prompt_token_ids=draw(st.lists(st.one_of(st.integers(0, 270), wild), max_size=40)),
        output_token_ids=draw(st.lists(st.integers(0, 270), max_size=draw(st.sampled_from([0, 0, 5])))),
        sampling=epb.SamplingParams(
            temperature=draw(st.one_of(st.sampled_from([0.0, 1e-38, 1.0, 20.0]), st.floats(width=32))),
            top_p=draw(st.one_of(st.sampled_from([1.0, 0.5]), st.floats(width=32))),
            top_k=draw(st.integers(-5, 300)),
            min_p=draw(st.one_of(st.just(0.0), st.floats(width=32))),
            num_logprobs=draw(st.integers(0, 25)),
        ),
        max_new_tokens=draw(st.one_of(st.integers(0, 8), wild)),
        stop_token_ids=draw(st.lists(st.one_of(st.integers(0, 270), wild), max_size=3)),
        ignore_eos=draw(st.booleans()),
        session_id=draw(st.sampled_from(["", "s"])),
        retention_s=draw(st.one_of(st.sampled_from([0.0, 5.0]), st.floats(width=32))),
    )


@st.composite
def plans(draw):
    return epb.StepRequest(
        step_id=draw(wild),
        scheduler_id=SCHEDULER_ID,
        new_requests=draw(st.lists(new_requests(), max_size=3)),
        scheduled=[
            epb.ScheduledRequest(
                request_id=rid, num_tokens=draw(st.one_of(small, wild)), draft_budget=draw(st.one_of(small, wild))
            )
            for rid in draw(st.lists(st.sampled_from(IDS), max_size=4))
        ],
        released=draw(st.lists(st.sampled_from(IDS), max_size=2)),
        preempted=draw(st.lists(st.sampled_from(IDS), max_size=2)),
    )


def test_fuzzed_plans_get_defined_codes_and_leak_nothing(executor):
    address, engine = executor
    channel = grpc.insecure_channel(address)
    stub = epb_grpc.ExecutorServiceStub(channel)
    stub.GetInfo(epb.GetInfoRequest(scheduler_id=SCHEDULER_ID), timeout=10)
    seen: dict[grpc.StatusCode, int] = {}

    @settings(max_examples=NUM_CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(plans())
    def case(plan):
        try:
            stub.Step(plan, timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
            assert code in DEFINED, f"{code.name}: {error.details()} for {plan}"
            assert error.details()
        seen[code] = seen.get(code, 0) + 1

    try:
        case()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub.GetInfo(epb.GetInfoRequest(scheduler_id=SCHEDULER_ID), timeout=10)  # re-attach: release everything
        info = stub.GetInfo(epb.GetInfoRequest(), timeout=10)
        assert info.num_free_kv_blocks == info.num_kv_blocks, "KV blocks are held after every request was released"
    finally:
        channel.close()
    assert seen.get(grpc.StatusCode.OK, 0) > 10 and seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 10, seen
    print({code.name: n for code, n in seen.items()})
