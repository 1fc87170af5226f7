"""A lost executor that is starting again keeps the streams waiting, however long its start takes.

Real servers in this process: the executor's gRPC server stops (its process died), and a new
one comes up on the same address listening before its engine exists (health NOT_SERVING,
every call UNAVAILABLE), as `swarmserve-executor` does while it loads and calibrates. It
stays so for several times the scheduler's reconnect window; the streams must survive it
token for token, where an address nobody listens on ends them after the window
(tests/e2e/test_executor_restart.py).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import AsyncSwarmClient, SwarmServeError
from executor_svc.server import engine_thread_pool, serve, start_server
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from swarmserve.executor.v1 import executor_pb2 as epb
from swarmserve.executor.v1 import executor_pb2_grpc as epb_grpc
from tests.support.stack import free_port, stop_scheduler
from tests.support.tiny_gguf import TinyModelSpec

RECONNECT_TIMEOUT_S = 1.0
STARTING_S = 4.0  # the new executor's start: four reconnect windows
NUM_NEW_TOKENS = 1000  # enough that every stream is mid-decode when the executor stops
REQUESTS = [
    dict(prompt=f"agent {i} reads the file and", temperature=0.0 if i < 2 else 5.0, seed=7 + i) for i in range(4)
]


@pytest.fixture(scope="module")
def spec():
    return TinyModelSpec(context_length=1280)


async def run(client, request, first: asyncio.Event | None = None) -> tuple[list[int], str]:
    token_ids, finish = [], ""
    async for event in client.generate(request["prompt"], max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                                       temperature=request["temperature"], seed=request["seed"]):  # fmt: skip
        if getattr(event, "token_ids", None):
            token_ids.extend(event.token_ids)
            if first is not None:
                first.set()
        elif hasattr(event, "finish_reason"):
            finish = event.finish_reason
    return token_ids, finish


async def health_of(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="swarmserve.executor.v1.ExecutorService"), timeout=2
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def test_a_starting_executor_answers_unavailable_and_says_not_serving(make_tiny_engine, spec):
    async def main():
        address = f"127.0.0.1:{free_port()}"
        starting = await start_server(address)
        try:
            assert await health_of(address) == "NOT_SERVING"
            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await epb_grpc.ExecutorServiceStub(channel).GetInfo(epb.GetInfoRequest(scheduler_id="s"), timeout=2)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "starting" in refused.value.details()
                await starting.ready(make_tiny_engine(spec, kv_cache_bytes=8 << 20))
                assert await health_of(address) == "SERVING"
                info = await epb_grpc.ExecutorServiceStub(channel).GetInfo(epb.GetInfoRequest(), timeout=2)
                assert info.vocab_size > 0
        finally:
            await starting.server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("comes_back_starting", [True, False], ids=["starting", "unreachable"])
def test_streams_wait_for_an_executor_that_is_starting(make_tiny_engine, spec, comes_back_starting):
    """Starting: the streams wait through four reconnect windows and finish token-identical.
    Unreachable for as long: they end with UNAVAILABLE after one window."""

    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve(make_tiny_engine(spec, kv_cache_bytes=8 << 20), executor_address)
        config = SchedulerConfig(
            listen=f"127.0.0.1:{free_port()}", executor=executor_address, spec="off",
            executor_reconnect_timeout_s=RECONNECT_TIMEOUT_S,
        )  # fmt: skip
        scheduler, loop, tasks = await serve_scheduler(config)
        restarted = None
        try:
            assert await loop.wait_connected(10)
            async with AsyncSwarmClient(config.listen) as client:
                undisturbed = await asyncio.gather(*(run(client, r) for r in REQUESTS))
                started = [asyncio.Event() for _ in REQUESTS]
                streams = [asyncio.create_task(run(client, r, e)) for r, e in zip(REQUESTS, started)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
                await executor.stop(None)  # the executor's process dies mid-stream
                assert not any(s.done() for s in streams), "every stream should be mid-decode at the stop"
                t0 = time.monotonic()
                if comes_back_starting:
                    restarted = await start_server(executor_address, engine_thread=engine_thread_pool())
                    await asyncio.sleep(STARTING_S)
                    assert not any(s.done() for s in streams), "a stream ended while the executor was starting"
                    await restarted.ready(make_tiny_engine(spec, kv_cache_bytes=8 << 20))
                results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)
                return undisturbed, results, time.monotonic() - t0
        finally:
            await stop_scheduler(scheduler, loop, tasks)
            if restarted is not None:
                await restarted.server.stop(None)

    undisturbed, results, elapsed = asyncio.run(main())
    if comes_back_starting:
        assert results == undisturbed, "the streams should go on token for token once the executor serves"
        assert all(finish == "length" and len(tokens) == NUM_NEW_TOKENS for tokens, finish in results)
    else:
        assert all(isinstance(r, SwarmServeError) and r.code == grpc.StatusCode.UNAVAILABLE for r in results)
        assert elapsed < STARTING_S
