"""One executor serves one scheduler, on real servers in this process.

A second scheduler is refused (FAILED_PRECONDITION at attach, so it reports NOT_SERVING
and answers UNAVAILABLE naming --take-over) and no stream of the first is lost; one
started with --take-over replaces it, and the replaced one never takes it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import AsyncSwarmClient, SwarmServeError
from executor_svc.server import serve as serve_executor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from tests.support.stack import free_port, stop_scheduler

TIMEOUT_S = 20.0


@contextlib.asynccontextmanager
async def scheduler(executor_address: str, **config):
    config = SchedulerConfig(listen=f"127.0.0.1:{free_port()}", executor=executor_address, spec="off", **config)
    server, loop, tasks = await serve_scheduler(config)
    try:
        yield config.listen, loop
    finally:
        await stop_scheduler(server, loop, tasks)


async def health(address: str):
    async with grpc.aio.insecure_channel(address) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)).status


async def wait_for_health(address: str, status) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while await health(address) != status:
        assert time.monotonic() < deadline, f"{address} never turned {status}"
        await asyncio.sleep(0.05)


def test_a_second_scheduler_is_refused_and_a_take_over_is_never_taken_back(engine):
    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address)
        try:
            async with scheduler(executor_address) as (first, first_loop), AsyncSwarmClient(first) as client:
                await wait_for_health(first, health_pb2.HealthCheckResponse.SERVING)
                streams = [
                    asyncio.create_task(
                        client.complete(f"agent {i} says", max_new_tokens=120, temperature=0.0, ignore_eos=True)
                    )
                    for i in range(4)
                ]
                async with scheduler(executor_address) as (second, second_loop), AsyncSwarmClient(second) as intruder:
                    # It tries to attach (and keeps trying) while the first one's streams run.
                    for _ in range(3):
                        await asyncio.sleep(0.3)
                        assert await health(second) == health_pb2.HealthCheckResponse.NOT_SERVING
                    with pytest.raises(SwarmServeError) as refused:
                        await intruder.complete("hi", max_new_tokens=2)
                    completions = await asyncio.wait_for(asyncio.gather(*streams), TIMEOUT_S)
                    assert await health(first) == health_pb2.HealthCheckResponse.SERVING

                async with scheduler(executor_address, take_over=True) as (third, _), AsyncSwarmClient(third) as taker:
                    await wait_for_health(third, health_pb2.HealthCheckResponse.SERVING)
                    # The replaced scheduler learns it at its next step (or attach), and keeps out.
                    with pytest.raises(SwarmServeError) as replaced:
                        await client.complete("hi", max_new_tokens=2)
                    await wait_for_health(first, health_pb2.HealthCheckResponse.NOT_SERVING)
                    await asyncio.sleep(1.5)  # a few of its re-attach attempts
                    assert await health(third) == health_pb2.HealthCheckResponse.SERVING
                    after = await asyncio.wait_for(taker.complete("hi", max_new_tokens=4, ignore_eos=True), TIMEOUT_S)
                return refused.value, completions, replaced.value, after, first_loop.last_connect_error
        finally:
            await executor.stop(None)

    refused, completions, replaced, after, first_error = asyncio.run(main())
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    assert "FAILED_PRECONDITION" in refused.message and "--take-over" in refused.message
    assert [len(c.token_ids) for c in completions] == [120] * 4, "a stream of the first scheduler was lost"
    assert replaced.code == grpc.StatusCode.UNAVAILABLE and "replaced by scheduler" in replaced.message
    assert "replaced by scheduler" in first_error
    assert len(after.token_ids) == 4
