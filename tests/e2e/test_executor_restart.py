"""Streams survive an executor crash: the real services as subprocesses, the executor
SIGKILLed with 8 streams mid-decode and started again on the same address.

Every stream completes with no error and exactly the tokens and text of an undisturbed
run, greedy and seeded sampling alike; a request sent while the executor is down waits
for it instead of failing.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from clients import AsyncSwarmClient, SwarmServeError
from clients.events import FinishEvent, TokenEvent
from tests.support.stack import Stack
from tests.support.tiny_gguf import TinyModelSpec

NUM_NEW_TOKENS = 400
SAMPLED_TEMPERATURE = 20.0  # the tiny model is so sharp that lower temperatures are greedy in effect
REQUESTS = [
    dict(prompt=f"agent {i} reads the file and", temperature=0.0 if i < 4 else SAMPLED_TEMPERATURE, seed=100 + i)
    for i in range(8)
]


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf_path):
    return tiny_gguf_path(TinyModelSpec(context_length=512))


async def run(client: AsyncSwarmClient, request: dict, first_token: asyncio.Event | None = None):
    token_ids, text, finish = [], [], None
    async for event in client.generate(request["prompt"], max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                                       temperature=request["temperature"], seed=request["seed"]):  # fmt: skip
        if isinstance(event, TokenEvent):
            token_ids.extend(event.token_ids)
            text.append(event.text)
            if first_token is not None and event.token_ids:
                first_token.set()
        elif isinstance(event, FinishEvent):
            finish = event.finish_reason
    return token_ids, "".join(text), finish


def test_streams_survive_an_executor_kill_token_for_token(tiny_model, tmp_path_factory):
    stack = Stack(
        ["--model", str(tiny_model), "--kv-cache-gb", "0.02"], [], log_dir=tmp_path_factory.mktemp("logs")
    ).start()

    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            undisturbed = await asyncio.gather(*(run(client, r) for r in REQUESTS))
            started = [asyncio.Event() for _ in REQUESTS]
            streams = [asyncio.create_task(run(client, r, e)) for r, e in zip(REQUESTS, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            # Frozen, so every stream is certainly mid-decode when the executor dies.
            stack.executor.send_signal(signal.SIGSTOP)
            in_flight = (await client.server_info()).num_running_requests
            stack.kill_executor()
            late = asyncio.create_task(run(client, REQUESTS[0]))  # sent while the executor is down
            await asyncio.sleep(0.5)
            stack.start_executor(wait=False)
            t0 = time.monotonic()
            survived = await asyncio.wait_for(asyncio.gather(*streams), 120)
            waited = time.monotonic() - t0
            return undisturbed, survived, await asyncio.wait_for(late, 60), in_flight, waited

    try:
        undisturbed, survived, late, in_flight, waited = asyncio.run(main())
    finally:
        stack.stop()
    assert in_flight == len(REQUESTS), "every stream should have been in flight at the kill"
    assert all(len(tokens) == NUM_NEW_TOKENS and finish == "length" for tokens, _, finish in undisturbed)
    assert len({tuple(t) for t, _, _ in undisturbed[4:]}) > 1, "the seeded requests should sample different tokens"
    for i, (before, after) in enumerate(zip(undisturbed, survived)):
        assert after == before, f"stream {i} ({'greedy' if i < 4 else 'seeded'}) differs after the executor restart"
    assert late == undisturbed[0]
    print(f"{len(survived)} streams survived the executor kill; resumed within {waited:.1f} s")


def test_streams_fail_with_unavailable_once_the_executor_stays_away_too_long(tiny_model, tmp_path_factory):
    stack = Stack(
        ["--model", str(tiny_model), "--kv-cache-gb", "0.02"],
        ["--executor-reconnect-timeout-s", "2"],
        log_dir=tmp_path_factory.mktemp("logs"),
    ).start()

    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            first = asyncio.Event()
            stream = asyncio.create_task(run(client, REQUESTS[0], first))
            await asyncio.wait_for(first.wait(), 60)
            stack.kill_executor()
            t0 = time.monotonic()
            with pytest.raises(SwarmServeError) as lost:
                await asyncio.wait_for(stream, 30)
            return lost.value, time.monotonic() - t0

    try:
        error, elapsed = asyncio.run(main())
    finally:
        stack.stop()
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "has not come back" in error.message and "executor_reconnect_timeout_s=2" in error.message
    assert 1.5 < elapsed < 10
