"""API keys on real servers in this process: without --api-key-file nothing changes; with it,
a call without a key or with a wrong one is UNAUTHENTICATED, the right key works, and
health checks stay open for probes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import AsyncSwarmClient, SwarmServeError
from executor_svc.server import serve as serve_executor
from scheduler_svc.api_keys import load_api_keys
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from tests.support.stack import free_port, stop_scheduler


def test_api_keys_are_required_when_configured(engine, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nold-key-1\n\nnew-key-2\n")

    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address)
        config = SchedulerConfig(
            listen=f"127.0.0.1:{free_port()}", executor=executor_address, api_key_file=str(key_file)
        )
        server, loop, tasks = await serve_scheduler(config)
        try:
            assert await loop.wait_connected(20)
            outcomes = {}
            for name, key in (("none", None), ("wrong", "old-key"), ("old", "old-key-1"), ("new", "new-key-2")):
                async with AsyncSwarmClient(config.listen, api_key=key) as client:
                    try:
                        completion = await client.complete("hi", max_new_tokens=2, ignore_eos=True)
                        info = await client.server_info()
                        outcomes[name] = (len(completion.token_ids), info.model_name)
                    except SwarmServeError as error:
                        outcomes[name] = error
            async with grpc.aio.insecure_channel(config.listen) as channel:  # no key at all
                stub = health_pb2_grpc.HealthStub(channel)
                for _ in range(100):  # the server updates health every 0.1 s
                    health = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    if health.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                    await asyncio.sleep(0.05)
            return outcomes, health.status
        finally:
            await stop_scheduler(server, loop, tasks)
            await executor.stop(None)

    outcomes, health_status = asyncio.run(main())
    for name in ("none", "wrong"):
        assert isinstance(outcomes[name], SwarmServeError), name
        assert outcomes[name].code == grpc.StatusCode.UNAUTHENTICATED and "--api-key-file" in outcomes[name].message
    assert not isinstance(outcomes["old"], SwarmServeError), outcomes["old"]
    assert outcomes["old"][0] == outcomes["new"][0] == 2
    assert health_status == health_pb2.HealthCheckResponse.SERVING


def test_an_empty_key_file_is_refused_at_start(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(str(empty))
