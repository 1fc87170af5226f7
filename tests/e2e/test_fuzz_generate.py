"""Fuzzing Generate on real servers (in this process, on loopback): arbitrary requests,
sent raw (the client library's own checks bypassed), get only defined status codes; the
servers stay up, and once idle no request and no KV block is held.

1,000 cases by default; SWARMSERVE_LONG_TESTS=1 runs 10,000.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_svc.server import serve as serve_executor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from swarmserve.scheduler.v1 import scheduler_pb2 as pb
from swarmserve.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from tests.support.engine_driver import num_held_requests
from tests.support.stack import free_port
from tests.support.tiny_gguf import TinyModelSpec

NUM_CASES = 10_000 if os.environ.get("SWARMSERVE_LONG_TESTS") == "1" else 1_000
DEFINED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@pytest.fixture(scope="module")
def servers(make_tiny_engine):
    """Executor and scheduler on an event loop of their own thread; yields (address, engine)."""
    engine = make_tiny_engine(TinyModelSpec(context_length=128), kv_cache_bytes=4 << 20)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address)
        config = SchedulerConfig(
            listen=f"127.0.0.1:{free_port()}", executor=executor_address, max_stop_strings=4, max_stop_string_chars=16
        )
        scheduler, step_loop, tasks = await serve_scheduler(config)
        assert await step_loop.wait_connected(30)
        return executor, scheduler, step_loop, tasks, config.listen

    executor, scheduler, step_loop, tasks, address = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    yield address, engine, step_loop

    async def stop():
        await scheduler.stop(None)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await step_loop.link.close()
        await executor.stop(None)

    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def mostly(valid, wild):
    """Usually a value the server accepts, sometimes anything: both paths get exercised."""
    return st.one_of(*[valid] * 9, wild)


wild_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = mostly(st.text(min_size=1, max_size=40), st.text(max_size=40))
ids = mostly(st.text(alphabet="abcxyz0123-_.:", max_size=12), st.text(max_size=140))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        request_id=draw(ids),
        session_id=draw(ids),
        ignore_eos=draw(st.booleans()),
        include_special_tokens=draw(st.booleans()),
        num_logprobs=draw(mostly(st.integers(0, 3), st.integers(0, 2**32 - 1))),
        stop=draw(
            mostly(st.lists(st.text(min_size=1, max_size=8), max_size=3), st.lists(st.text(max_size=30), max_size=8))
        ),
        stop_token_ids=draw(
            mostly(st.lists(st.integers(0, 250), max_size=3), st.lists(st.integers(0, 2**32 - 1), max_size=4))
        ),
    )
    kind = draw(st.sampled_from(["text", "text", "token_ids", "chat", "none"]))
    if kind == "text":
        msg.text = draw(texts)
    elif kind == "token_ids":
        msg.token_ids.ids.extend(
            draw(
                mostly(
                    st.lists(st.integers(0, 250), min_size=1, max_size=20),
                    st.lists(st.integers(0, 2**32 - 1), max_size=140),
                )
            )
        )
    elif kind == "chat":
        roles = mostly(st.sampled_from(["system", "user", "assistant", "tool"]), st.text(max_size=8))
        for role, content in draw(
            st.lists(st.tuples(roles, texts), min_size=draw(st.sampled_from([0, 1, 1, 1])), max_size=4)
        ):
            msg.chat.messages.add(role=role, content=content)
    if draw(st.booleans()):
        msg.max_new_tokens = draw(mostly(st.integers(1, 8), st.integers(0, 2**32 - 1)))
    for name, valid in (("temperature", st.floats(0, 2)), ("top_p", st.floats(0.01, 1)), ("min_p", st.floats(0, 1))):
        if draw(st.booleans()):
            setattr(msg.sampling, name, draw(mostly(valid, wild_floats)))
    if draw(st.booleans()):
        msg.sampling.top_k = draw(mostly(st.integers(0, 50), st.integers(-(2**31), 2**31 - 1)))
    if draw(st.booleans()):
        msg.sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        msg.retention_s = draw(mostly(st.floats(0, 100), wild_floats))
    return msg


def test_fuzzed_generate_requests_get_defined_codes_and_leak_nothing(servers):
    address, engine, step_loop = servers
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.SchedulerServiceStub(channel)
    seen: dict[grpc.StatusCode, int] = {}

    @settings(max_examples=NUM_CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(generate_requests())
    def case(msg):
        if msg.HasField("max_new_tokens") and msg.max_new_tokens > 8 and msg.ignore_eos:
            msg.max_new_tokens = 8  # keep each accepted case short
        try:
            for _ in stub.Generate(msg, timeout=30):
                pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
            assert code in DEFINED, f"{code.name}: {error.details()} for {msg}"
            assert error.details(), "a refusal must say why"
        seen[code] = seen.get(code, 0) + 1

    try:
        case()
    finally:
        channel.close()
    assert not step_loop.stopped_reason and step_loop.is_connected
    deadline = time.monotonic() + 10
    while num_held_requests(engine) or engine.kv.num_free_blocks != engine.kv.num_usable_blocks:
        assert time.monotonic() < deadline, "requests or KV blocks are still held after going idle"
        time.sleep(0.05)
    assert seen.get(grpc.StatusCode.OK, 0) > 0 and seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 0, seen
    print({code.name: n for code, n in seen.items()})
