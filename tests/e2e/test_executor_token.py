"""The executor's shared token on real servers in this process: with --scheduler-token-file
the executor refuses GetInfo and Step from a caller without the token (UNAUTHENTICATED, so
a scheduler without it never attaches and says why), serves the scheduler that has it,
and keeps health checks open."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import AsyncSwarmClient, SwarmServeError
from executor_svc.server import serve as serve_executor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from swarmserve.executor.v1 import executor_pb2, executor_pb2_grpc
from tests.support.stack import free_port, stop_scheduler


def test_the_executor_serves_only_a_scheduler_with_its_token(engine, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")

    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address, scheduler_token_file=str(token))
        results = {}
        try:
            async with grpc.aio.insecure_channel(executor_address) as channel:
                stub = executor_pb2_grpc.ExecutorServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as raw:
                    await stub.GetInfo(executor_pb2.GetInfoRequest(scheduler_id="stray"), timeout=5)
                results["raw"] = raw.value
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                results["health"] = health.status
            for name, token_file in (("wrong", str(wrong)), ("right", str(token))):
                config = SchedulerConfig(
                    listen=f"127.0.0.1:{free_port()}", executor=executor_address, executor_token_file=token_file
                )
                server, loop, tasks = await serve_scheduler(config)
                try:
                    connected = await loop.wait_connected(3)
                    async with AsyncSwarmClient(config.listen) as client:
                        try:
                            results[name] = len(
                                (await client.complete("hi", max_new_tokens=3, ignore_eos=True)).token_ids
                            )
                        except SwarmServeError as error:
                            results[name] = error
                    results[name + "_connected"] = connected
                finally:
                    await stop_scheduler(server, loop, tasks)
            return results
        finally:
            await executor.stop(None)

    results = asyncio.run(main())
    assert results["raw"].code() == grpc.StatusCode.UNAUTHENTICATED and "scheduler token" in results["raw"].details()
    assert results["health"] == health_pb2.HealthCheckResponse.SERVING
    assert not results["wrong_connected"]
    assert results["wrong"].code == grpc.StatusCode.UNAVAILABLE and "UNAUTHENTICATED" in results["wrong"].message
    assert results["right_connected"] and results["right"] == 3
