"""The step loop under faults, on real servers in this process (the scheduler's link is
wrapped so a test can hold a step's answer, and planner methods raise where a test says).

- A client id reused right after an abort, while a step that carried the old request is
  in flight, never receives the old request's results.
- A step that raises ends only its own requests, with INTERNAL; the loop goes on.
- A step loop that dies anyway fails every stream and turns health NOT_SERVING.
- A long prompt is tokenized off the event loop: other calls are answered meanwhile.

The first three run with and without overlapped scheduling (two steps in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import AsyncSwarmClient, SwarmServeError
from executor_svc.engine.engine import Engine
from executor_svc.server import serve as serve_executor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from swarmserve.executor.v1 import executor_pb2 as epb
from tests.support.engine_driver import num_held_requests
from tests.support.stack import free_port, stop_scheduler

TIMEOUT_S = 10.0  # any wait here is milliseconds when things work; this only turns a hang into a failure
PROMPT = "the cat sat on the mat, the cat sat on"


class StepGate:
    """Wraps the scheduler's link: records every StepRequest, and can hold one step's answer
    after the executor has run it, so a test acts while that step is in flight."""

    def __init__(self, link) -> None:
        self._step = link.step
        link.step = self._gated_step
        self.sent: list[epb.StepRequest] = []
        self.held = asyncio.Event()
        self._is_armed = False
        self._release = asyncio.Event()

    def hold_next(self) -> None:
        self._is_armed = True

    def release(self) -> None:
        self._release.set()

    async def _gated_step(self, request: epb.StepRequest) -> epb.StepResponse:
        self.sent.append(request)
        response = await self._step(request)
        if self._is_armed:
            self._is_armed = False
            self.held.set()
            await self._release.wait()
        return response


@contextlib.asynccontextmanager
async def servers(engine: Engine, **scheduler_config):
    executor_address = f"127.0.0.1:{free_port()}"
    executor = await serve_executor(engine, executor_address)
    config = SchedulerConfig(listen=f"127.0.0.1:{free_port()}", executor=executor_address, **scheduler_config)
    scheduler, loop, tasks = await serve_scheduler(config)
    try:
        assert await loop.wait_connected(TIMEOUT_S)
        yield config.listen, loop
    finally:
        await stop_scheduler(scheduler, loop, tasks)
        await executor.stop(None)


def executor_is_empty(engine: Engine) -> bool:
    return num_held_requests(engine) == 0


async def wait_for_health(address: str, status) -> None:
    """Health is polled by the server every 0.1 s: wait for it to say `status`."""
    deadline = time.monotonic() + TIMEOUT_S
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)).status != status:
            assert time.monotonic() < deadline, (
                f"health did not turn {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
            )
            await asyncio.sleep(0.05)


async def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def first_token(stream) -> None:
    async for event in stream:
        if getattr(event, "token_ids", None):
            return
    raise AssertionError("the stream ended before its first token")


OVERLAPPED = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])


@OVERLAPPED
def test_reused_request_id_mid_step_never_gets_the_old_requests_results(engine, async_scheduling):
    async def main():
        async with (
            servers(engine, spec="off", async_scheduling=async_scheduling) as (address, loop),
            AsyncSwarmClient(address) as client,
        ):
            gate = StepGate(loop.link)
            reference = await client.complete(
                "hi", max_new_tokens=8, temperature=0.0, ignore_eos=True, request_id="ref"
            )
            old = client.generate(PROMPT, max_new_tokens=200, temperature=0.0, ignore_eos=True, request_id="X")
            await asyncio.wait_for(first_token(old), TIMEOUT_S)  # X is decoding
            gate.hold_next()
            await asyncio.wait_for(gate.held.wait(), TIMEOUT_S)  # a step carrying X has run; its answer is held
            assert await client.abort("X")
            reuse = asyncio.create_task(
                client.complete(
                    "hi", max_new_tokens=8, temperature=0.0, ignore_eos=True, request_id="X", timeout=TIMEOUT_S
                )
            )
            await wait_until(lambda: reuse.done() or "X" in loop.streams, "the reused id to be refused or queued")
            gate.release()
            with pytest.raises(SwarmServeError) as refused:
                await reuse
            assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
            assert "not released it yet" in refused.value.message
            old_events = [e async for e in old]
            assert old_events[-1].finish_reason == "aborted"
            # Once the release has gone through, the id is free again, and means a new request.
            await wait_until(lambda: not loop.planner.is_releasing("X"), "X's release")
            again = await asyncio.wait_for(
                client.complete("hi", max_new_tokens=8, temperature=0.0, ignore_eos=True, request_id="X"), TIMEOUT_S
            )
            return reference, again, gate.sent

    reference, again, sent = asyncio.run(main())
    assert again.token_ids == reference.token_ids
    assert any(step.planned_after_step_id for step in sent) == async_scheduling
    # The executor only ever saw per-submission ids: never a client's, and never one twice.
    new_ids = [r.request_id for step in sent for r in step.new_requests]
    assert len(new_ids) == len(set(new_ids)) == 3
    assert not {"X", "ref"} & {s.request_id for step in sent for s in step.scheduled}


@OVERLAPPED
@pytest.mark.parametrize("where", ["before_send", "after_step"])
def test_a_step_that_raises_ends_only_its_own_requests(engine, where, async_scheduling):
    async def main():
        async with (
            servers(engine, spec="off", max_running_requests=1, async_scheduling=async_scheduling) as (address, loop),
            AsyncSwarmClient(address) as client,
        ):
            broken = client.generate(PROMPT, max_new_tokens=200, temperature=0.0, ignore_eos=True, request_id="A")
            await asyncio.wait_for(first_token(broken), TIMEOUT_S)
            # B waits in the queue (one running request at most): it is in no plan while A runs.
            queued = asyncio.create_task(
                client.complete("hi", max_new_tokens=8, temperature=0.0, ignore_eos=True, request_id="B")
            )
            await wait_until(lambda: loop.planner.num_waiting == 1, "B to queue")
            planner = loop.planner
            target, name = (loop.link, "step") if where == "before_send" else (planner, "update_from_output")
            original = getattr(target, name)

            def fail_once(*args, **kwargs):
                setattr(target, name, original)
                raise RuntimeError("injected fault")

            setattr(target, name, fail_once)
            with pytest.raises(SwarmServeError) as failed:
                await asyncio.wait_for(_drain(broken), TIMEOUT_S)
            survivor = await asyncio.wait_for(queued, TIMEOUT_S)
            reference = await client.complete("hi", max_new_tokens=8, temperature=0.0, ignore_eos=True, request_id="C")
            assert loop.planner is planner, "the loop should not have re-attached"
            await wait_for_health(address, health_pb2.HealthCheckResponse.SERVING)
            await wait_until(lambda: executor_is_empty(engine), "the executor to release every request")
            return failed.value, survivor, reference

    error, survivor, reference = asyncio.run(main())
    assert error.code == grpc.StatusCode.INTERNAL
    assert "RuntimeError: injected fault" in error.message and "the request was ended" in error.message
    assert survivor.token_ids == reference.token_ids and len(survivor.token_ids) == 8


async def _drain(stream) -> list:
    return [event async for event in stream]


@OVERLAPPED
def test_a_dead_step_loop_fails_every_stream_and_reports_not_serving(engine, async_scheduling):
    async def main():
        async with (
            servers(engine, spec="off", async_scheduling=async_scheduling) as (address, loop),
            AsyncSwarmClient(address) as client,
        ):
            stream = client.generate(PROMPT, max_new_tokens=200, temperature=0.0, ignore_eos=True)
            await asyncio.wait_for(first_token(stream), TIMEOUT_S)
            await wait_for_health(address, health_pb2.HealthCheckResponse.SERVING)

            def broken(*args, **kwargs):
                raise RuntimeError("injected fault")

            # The planner fails, and so does the supervisor's recovery: nothing can contain it.
            loop.planner.schedule = broken
            loop._step_crashed = broken
            with pytest.raises(SwarmServeError) as in_flight:
                await asyncio.wait_for(_drain(stream), TIMEOUT_S)
            await wait_until(lambda: loop.stopped_reason != "", "the loop to stop")
            await wait_for_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)
            with pytest.raises(SwarmServeError) as new:
                await asyncio.wait_for(client.complete("hi", max_new_tokens=3), TIMEOUT_S)
            return in_flight.value, new.value

    in_flight, new = asyncio.run(main())
    assert in_flight.code == grpc.StatusCode.INTERNAL and "step loop stopped" in in_flight.message
    assert new.code == grpc.StatusCode.UNAVAILABLE and "step loop stopped" in new.message


def test_a_long_prompt_is_tokenized_without_stalling_the_event_loop(engine):
    """Issue 12, item 4: a 900 KB prompt held the scheduler's event loop for 1.3 s."""
    text = "the quick brown fox jumps over the lazy dog, " * 20_000  # ~900 KB, under --max-prompt-bytes

    async def main():
        async with servers(engine) as (address, loop), AsyncSwarmClient(address) as client:
            gaps = []

            async def ticker():
                last = time.monotonic()
                while True:
                    await asyncio.sleep(0.005)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            ticking = asyncio.create_task(ticker())
            t0 = time.monotonic()
            with pytest.raises(SwarmServeError) as refused:
                await asyncio.wait_for(client.complete(text, max_new_tokens=1), 60)
            elapsed = time.monotonic() - t0
            ticking.cancel()
            return refused.value, elapsed, max(gaps)

    error, elapsed, max_gap = asyncio.run(main())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "the model's context is 256 tokens" in error.message
    assert max_gap < 0.5 and max_gap < elapsed / 2, f"the event loop stalled {max_gap:.2f} s of {elapsed:.2f} s"
