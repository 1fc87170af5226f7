"""Agent sessions over real gRPC: the second turn finds the first turn's tokens cached; once a
session's retention hint expires, its blocks are the first retained ones evicted under pressure."""

from __future__ import annotations

import asyncio
import time

import pytest

from clients import AsyncSwarmClient
from tests.support.stack import Stack
from tests.support.tiny_gguf import TinyModelSpec, tiny_kv_bytes_per_block

BLOCK = 16
NUM_KV_BLOCKS = 40  # 39 usable
BYTES_PER_BLOCK = tiny_kv_bytes_per_block(BLOCK)


@pytest.fixture(scope="module")
def stack(tiny_gguf_path, tmp_path_factory):
    model = tiny_gguf_path(TinyModelSpec(context_length=1024))
    kv_gb = NUM_KV_BLOCKS * BYTES_PER_BLOCK / (1 << 30)
    s = Stack(
        ["--model", str(model), "--kv-cache-gb", repr(kv_gb), "--no-calibration"],
        ["--spec", "off"],
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    s.start()
    yield s
    s.stop()


def test_session_turns_reuse_kv_and_expired_sessions_are_evicted_first(stack):
    async def turn(client, session, token_ids, retention):
        completion = await client.complete(
            token_ids=token_ids,
            max_new_tokens=8,
            temperature=0.0,
            ignore_eos=True,
            session_id=session,
            retention_s=retention,
        )
        return list(completion.token_ids), completion.usage.cached_tokens

    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            info = await client.server_info()
            assert info.num_kv_blocks == NUM_KV_BLOCKS - 1
            a_prompt = [40 + i % 50 for i in range(64)]
            b_prompt = [120 + i % 60 for i in range(64)]
            a1_out, a1_cached = await turn(client, "agent-a", a_prompt, 1.0)
            a2_prompt = a_prompt + a1_out + [7, 8, 9]
            a2_out, a2_cached = await turn(client, "agent-a", a2_prompt, 1.0)
            _, b1_cached = await turn(client, "agent-b", b_prompt, 60.0)
            await asyncio.sleep(1.5)  # agent a's hint expires; agent b's holds
            # Another request needs all but about four of the blocks: something cached must go.
            pressure = [200 + i % 40 for i in range(34 * BLOCK)]
            await client.complete(token_ids=pressure, max_new_tokens=2, temperature=0.0, ignore_eos=True)
            _, a3_cached = await turn(client, "agent-a", a2_prompt + a2_out, 1.0)
            _, b2_cached = await turn(client, "agent-b", b_prompt + [9, 9], 60.0)
            return a1_cached, a2_cached, b1_cached, a3_cached, b2_cached

    a1_cached, a2_cached, b1_cached, a3_cached, b2_cached = asyncio.run(main())
    assert a1_cached == 0 and b1_cached == 0
    assert a2_cached == 64, "the second turn should reuse the first turn's 4 full blocks"
    assert a3_cached == 0, "agent a's blocks outlived its expired hint under memory pressure"
    assert b2_cached == 64, "agent b's retained blocks were evicted before the expired ones"


def test_a_shared_system_prompt_is_stored_once_and_counted_as_cached(stack):
    system = [30 + i % 70 for i in range(80)]

    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            first = await client.complete(
                token_ids=system + [1, 2, 3], max_new_tokens=4, temperature=0.0, ignore_eos=True
            )
            others = await asyncio.gather(
                *(
                    client.complete(
                        token_ids=system + [10 + i, 11, 12], max_new_tokens=4, temperature=0.0, ignore_eos=True
                    )
                    for i in range(4)
                )
            )
        return first, others

    first, others = asyncio.run(main())
    assert first.usage.cached_tokens == 0
    assert all(c.usage.cached_tokens == 80 for c in others), [c.usage.cached_tokens for c in others]


def test_retention_without_a_session_is_refused(stack):
    from clients import SwarmServeError

    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            with pytest.raises(SwarmServeError) as info:
                await client.complete(token_ids=[5, 6, 7], max_new_tokens=2, retention_s=5.0)
        return info.value

    error = asyncio.run(main())
    assert "retention_s needs a session_id" in error.message


def test_stack_leaves_no_kv_in_use(stack):
    time.sleep(0.2)
    from tests.e2e.test_services_errors import executor_free_blocks

    free, total = executor_free_blocks(stack.executor_address)
    assert free == total
