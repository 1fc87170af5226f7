"""Bad input, a full queue, an executor that goes away and comes back, a scheduler that
restarts: each a clear status code, never a hang, and the server keeps serving.

A tiny random model keeps these fast; what is checked here is the plumbing."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from clients import AsyncSwarmClient, SwarmServeError
from swarmserve.executor.v1 import executor_pb2, executor_pb2_grpc
from tests.support.stack import Stack, wait_serving
from tests.support.tiny_gguf import TinyModelSpec

CONTEXT = 256


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf_path):
    return tiny_gguf_path(TinyModelSpec(context_length=CONTEXT))


def tiny_stack(tiny_model, tmp_path_factory, *scheduler_args) -> Stack:
    return Stack(
        ["--model", str(tiny_model), "--kv-cache-gb", "0.01"],
        list(scheduler_args),
        log_dir=tmp_path_factory.mktemp("logs"),
    )


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    s = tiny_stack(tiny_model, tmp_path_factory).start()
    yield s
    s.stop()


async def error_of(coro) -> SwarmServeError:
    with pytest.raises(SwarmServeError) as info:
        await coro
    return info.value


def executor_free_blocks(address: str) -> tuple[int, int]:
    with grpc.insecure_channel(address) as channel:
        info = executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(executor_pb2.GetInfoRequest(), timeout=5)
    return info.num_free_kv_blocks, info.num_kv_blocks


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"prompt": ""}, "text is empty"),
        ({"token_ids": []}, "token_ids is empty"),
        ({"messages": []}, "chat.messages is empty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "wizard"),
        ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens must be > 0"),
        ({"prompt": "hi", "max_new_tokens": CONTEXT + 1}, "max_new_tokens=257 is beyond the context"),
        ({"prompt": "a " * CONTEXT}, "leaves no room to generate"),
        ({"prompt": "hi", "temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"prompt": "hi", "top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"prompt": "hi", "top_k": -3}, "top_k must be >= 0"),
        ({"token_ids": [5, 100000]}, "outside the vocabulary"),
        ({"prompt": "hi", "stop_token_ids": [100000]}, "stop_token_ids"),
        ({"prompt": "hi", "request_id": "x" * 129}, "request_id is 129 bytes; the limit is 128"),
        ({"prompt": "hi", "session_id": "agent 7"}, "session_id 'agent 7' has characters outside"),
        ({"prompt": "hi", "session_id": "s", "retention_s": float("inf")}, "retention_s must be a finite number"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(stack, kwargs, field):
    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            error = await error_of(client.complete(**kwargs))
            still_fine = await client.complete("hello", max_new_tokens=3, ignore_eos=True)
        return error, still_fine

    error, still_fine = asyncio.run(main())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.message
    assert len(still_fine.token_ids) == 3


def test_queue_full_is_resource_exhausted(tiny_model, tmp_path_factory):
    s = tiny_stack(tiny_model, tmp_path_factory, "--max-running-requests", "1", "--max-queued-requests", "2").start()

    async def main():
        async with AsyncSwarmClient(s.scheduler_address) as client:
            # A frozen executor holds the one running request, so the queue stays full however fast steps are.
            s.executor.send_signal(signal.SIGSTOP)
            running = [
                asyncio.create_task(client.complete("x", max_new_tokens=250, ignore_eos=True, temperature=0.0))
                for _ in range(3)
            ]
            deadline = time.monotonic() + 10
            while (info := await client.server_info()).num_queued_requests != 2 or info.num_running_requests != 1:
                assert time.monotonic() < deadline, "the queue never filled"
                await asyncio.sleep(0.01)
            error = await error_of(client.complete("y", max_new_tokens=3))
            s.executor.send_signal(signal.SIGCONT)
            done = await asyncio.gather(*running)
            after = await client.complete("z", max_new_tokens=3, ignore_eos=True)
        return error, done, after

    try:
        error, done, after = asyncio.run(main())
    finally:
        s.stop()
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in error.message and "max_queued_requests=2" in error.message
    assert all(len(c.token_ids) == 250 for c in done) and len(after.token_ids) == 3


SCHEDULING = pytest.mark.parametrize(
    "scheduling", ["--no-async-scheduling", "--async-scheduling"], ids=["sync", "overlapped"]
)


@SCHEDULING
def test_executor_down_is_unavailable_within_seconds_and_service_resumes(tiny_model, tmp_path_factory, scheduling):
    # Without waiting for the executor to come back (e2e/test_executor_restart covers the wait).
    s = tiny_stack(tiny_model, tmp_path_factory, "--executor-reconnect-timeout-s", "0", scheduling).start()

    async def in_flight_then_down():
        async with AsyncSwarmClient(s.scheduler_address) as client:
            # Frozen first, so the request is certainly in flight (its step sent, never answered)
            # when the executor dies: a request that finished before the kill would prove nothing.
            s.executor.send_signal(signal.SIGSTOP)
            task = asyncio.create_task(client.complete("x", max_new_tokens=200, ignore_eos=True))
            deadline = time.monotonic() + 10
            while (await client.server_info()).num_running_requests != 1:  # scheduled: its step is in flight
                assert time.monotonic() < deadline and not task.done(), "the request never reached a step"
                await asyncio.sleep(0.01)
            s.kill_executor()
            t0 = time.monotonic()
            in_flight = await error_of(task)
            new = await error_of(client.complete("y", max_new_tokens=3))
            return in_flight, new, time.monotonic() - t0

    try:
        in_flight, new, elapsed = asyncio.run(in_flight_then_down())
        assert in_flight.code == grpc.StatusCode.UNAVAILABLE and "executor" in in_flight.message
        assert new.code == grpc.StatusCode.UNAVAILABLE and "unreachable" in new.message
        assert elapsed < 10
        s.start_executor()  # same address
        wait_serving(s.scheduler_address, 30)

        async def again():
            async with AsyncSwarmClient(s.scheduler_address) as client:
                return await client.complete("back", max_new_tokens=4, ignore_eos=True)

        assert len(asyncio.run(again()).token_ids) == 4
    finally:
        s.stop()


@SCHEDULING
def test_no_kv_survives_a_scheduler_restart(tiny_model, tmp_path_factory, scheduling):
    s = tiny_stack(tiny_model, tmp_path_factory, scheduling).start()

    async def start_long_requests():
        client = AsyncSwarmClient(s.scheduler_address)
        tasks = [asyncio.create_task(client.complete("x " * 20, max_new_tokens=200, ignore_eos=True)) for _ in range(3)]
        for _ in range(200):  # kill it mid-generation, as soon as the requests hold KV
            free, total = executor_free_blocks(s.executor_address)
            if free < total:
                break
            await asyncio.sleep(0.01)
        s.kill_scheduler()
        for task in tasks:
            error = await error_of(task)
            assert error.code == grpc.StatusCode.UNAVAILABLE, error
        await client.close()
        return free, total

    try:
        held_free, total = asyncio.run(start_long_requests())
        assert held_free < total, "the requests should hold KV before the restart"
        assert executor_free_blocks(s.executor_address)[0] < total, "the dead scheduler's requests still hold KV"
        s.start_scheduler()
        free, total = executor_free_blocks(s.executor_address)
        assert free == total, f"{total - free} KV blocks survived the scheduler restart"
    finally:
        s.stop()


def test_sigterm_drains_requests_in_flight_then_exits_zero(tiny_model, tmp_path_factory):
    s = tiny_stack(tiny_model, tmp_path_factory, "--drain-timeout-s", "60").start()

    async def main():
        async with AsyncSwarmClient(s.scheduler_address) as client:
            first = asyncio.Event()

            async def stream():
                token_ids = []
                async for event in client.generate("x", max_new_tokens=200, ignore_eos=True, temperature=0.0):
                    token_ids.extend(getattr(event, "token_ids", ()))
                    first.set()
                return token_ids

            in_flight = asyncio.create_task(stream())
            await asyncio.wait_for(first.wait(), 30)
            s.executor.send_signal(signal.SIGSTOP)  # so the request is certainly still in flight at SIGTERM
            s.scheduler.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while True:
                try:
                    await client.complete("y", max_new_tokens=2, timeout=5)
                except SwarmServeError as error:
                    if "shutting down" in error.message:
                        refused = error
                        break
                assert time.monotonic() < deadline, "new requests should be refused while draining"
                await asyncio.sleep(0.05)
            assert s.scheduler.poll() is None, "the scheduler should wait for the request in flight"
            s.executor.send_signal(signal.SIGCONT)
            return refused, await asyncio.wait_for(in_flight, 60)

    try:
        refused, token_ids = asyncio.run(main())
        assert refused.code == grpc.StatusCode.UNAVAILABLE
        assert len(token_ids) == 200
        assert s.scheduler.wait(30) == 0
    finally:
        s.executor.send_signal(signal.SIGCONT)
        s.stop()
