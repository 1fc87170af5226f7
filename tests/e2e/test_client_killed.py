"""Client processes SIGKILLed mid-stream (real servers in this process, real clients in
their own processes): the scheduler sees each connection drop, releases the requests, and
within 1 s the executor holds no request and every KV block is free; the server goes on."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

from clients import AsyncSwarmClient
from executor_svc.server import serve as serve_executor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from tests.support.engine_driver import num_held_requests
from tests.support.stack import ROOT, free_port, stop_scheduler
from tests.support.tiny_gguf import TinyModelSpec

CLIENT = """
import asyncio, sys
from clients import AsyncSwarmClient

async def main():
    async with AsyncSwarmClient(sys.argv[1]) as client:
        async def one(i):
            async for event in client.generate("the cat sat on the mat " * (i + 1), max_new_tokens=400, ignore_eos=True):
                print("token", flush=True)
        await asyncio.gather(*(one(i) for i in range(4)))

asyncio.run(main())
"""


def test_killed_clients_leave_no_request_and_no_kv_block(make_tiny_engine):
    engine = make_tiny_engine(TinyModelSpec(context_length=512), kv_cache_bytes=8 << 20)

    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address)
        config = SchedulerConfig(listen=f"127.0.0.1:{free_port()}", executor=executor_address)
        server, loop, tasks = await serve_scheduler(config)
        try:
            assert await loop.wait_connected(20)
            clients = [
                await asyncio.create_subprocess_exec(
                    sys.executable, "-c", CLIENT, config.listen, cwd=ROOT, stdout=asyncio.subprocess.PIPE
                )
                for _ in range(3)
            ]
            for process in clients:  # each is streaming
                assert (await asyncio.wait_for(process.stdout.readline(), 60)).startswith(b"token")
            assert num_held_requests(engine), "the clients' requests should be running"
            for process in clients:
                process.send_signal(signal.SIGKILL)
                await process.wait()
            killed = time.monotonic()
            while num_held_requests(engine) or engine.kv.num_free_blocks != engine.kv.num_usable_blocks:
                assert time.monotonic() - killed < 1.0, (
                    f"{num_held_requests(engine)} requests still held 1 s after the kill"
                )
                await asyncio.sleep(0.02)
            assert not loop.streams
            async with AsyncSwarmClient(config.listen) as client:
                return len((await client.complete("after", max_new_tokens=3, ignore_eos=True)).token_ids)
        finally:
            await stop_scheduler(server, loop, tasks)
            await executor.stop(None)

    assert asyncio.run(main()) == 3
