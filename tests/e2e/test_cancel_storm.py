"""Cancel storm and soak on real servers in this process: mixed requests (sessions, stop
strings, greedy and seeded sampling, speculation) cancelled by the client going away or by
Abort while queued, mid-prefill, mid-decode and mid-speculation. Within 1 s of going idle
the executor holds no request, every KV block is free, and the scheduler's tables are empty.

200 requests by default; SWARMSERVE_LONG_TESTS=1 runs 2,000.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import grpc

from clients import AsyncSwarmClient, SwarmServeError
from executor_svc.server import serve as serve_executor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import serve as serve_scheduler
from tests.support.engine_driver import num_held_requests
from tests.support.stack import free_port, stop_scheduler
from tests.support.tiny_gguf import TinyModelSpec

NUM_REQUESTS = 2_000 if os.environ.get("SWARMSERVE_LONG_TESTS") == "1" else 200


def test_cancel_storm_leaves_no_request_and_no_kv_block(make_tiny_engine):
    engine = make_tiny_engine(
        TinyModelSpec(context_length=512), kv_cache_bytes=2 << 20
    )  # small: preemptions happen too
    rng = random.Random(0)

    async def main():
        executor_address = f"127.0.0.1:{free_port()}"
        executor = await serve_executor(engine, executor_address)
        config = SchedulerConfig(
            listen=f"127.0.0.1:{free_port()}", executor=executor_address, max_running_requests=8, spec="fixed:4",
            max_num_batched_tokens=64,
        )  # fmt: skip
        server, loop, tasks = await serve_scheduler(config)
        outcomes = {"finished": 0, "cancelled": 0, "aborted": 0, "refused": 0}
        try:
            assert await loop.wait_connected(20)
            async with AsyncSwarmClient(config.listen) as client:

                async def one(i: int) -> None:
                    # Repetitive prompts so the drafter proposes: cancels land mid-speculation too.
                    prompt = ("the cat sat on the mat " * rng.randint(1, 12)) + str(i)
                    kwargs = dict(max_new_tokens=rng.randint(1, 120), ignore_eos=True, request_id=f"r{i}",
                                  temperature=rng.choice([0.0, 20.0]), seed=i,
                                  session_id=rng.choice(["", "", f"agent-{i % 5}"]),
                                  stop=rng.choice([(), (), ("mat",), ("sat on", "\n")]))  # fmt: skip
                    how = rng.choice(["finish", "cancel", "abort"])
                    task = asyncio.create_task(client.complete(prompt, **kwargs))
                    await asyncio.sleep(rng.uniform(0, 0.3))
                    if how == "cancel":
                        task.cancel()
                    elif how == "abort":
                        await client.abort(f"r{i}")
                    try:
                        completion = await task
                        outcomes["aborted" if completion.finish_reason == "aborted" else "finished"] += 1
                    except asyncio.CancelledError:
                        outcomes["cancelled"] += 1
                    except SwarmServeError as error:
                        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                        outcomes["refused"] += 1

                for start in range(0, NUM_REQUESTS, 40):  # waves, so the queue fills and drains
                    await asyncio.gather(*(one(i) for i in range(start, min(start + 40, NUM_REQUESTS))))
            idle = time.monotonic()
            while num_held_requests(engine) or engine.kv.num_free_blocks != engine.kv.num_usable_blocks:
                assert time.monotonic() - idle < 1.0, (
                    f"{num_held_requests(engine)} requests and "
                    f"{engine.kv.num_usable_blocks - engine.kv.num_free_blocks} KV blocks still held 1 s after idle"
                )
                await asyncio.sleep(0.02)
            assert not loop.streams and not loop.planner.requests and loop.is_serving
            return outcomes
        finally:
            await stop_scheduler(server, loop, tasks)
            await executor.stop(None)

    outcomes = asyncio.run(main())
    assert outcomes["cancelled"] > 10 and outcomes["aborted"] > 10 and outcomes["finished"] > 10, outcomes
    print(outcomes)
