"""Draft trees through the real services: an executor with `--draft-shape tree` streams the
same greedy tokens, and the same seeded samples, with speculation on as with it off."""

from __future__ import annotations

import asyncio

import pytest

from clients import AsyncSwarmClient
from tests.e2e.test_speculation import NUM_NEW_TOKENS, PROMPTS
from tests.executor.engine.test_tree_speculation import BRANCHY
from tests.support.stack import Stack

TREE_PROMPTS = [*PROMPTS[:3], [{"role": "user", "content": "Continue this file:\n\n" + BRANCHY}]]


@pytest.fixture(scope="module")
def tree_executor(tmp_path_factory):
    stack = Stack(["--kv-cache-gb", "0.25", "--draft-shape", "tree"], log_dir=tmp_path_factory.mktemp("logs"))
    stack.start_executor()
    yield stack
    stack.stop()


def run_policy(stack: Stack, policy: str, **sampling):
    stack.scheduler_args = ["--spec", policy, "--max-running-requests", "4"]
    stack.start_scheduler()
    try:

        async def main():
            async with AsyncSwarmClient(stack.scheduler_address) as client:
                return await asyncio.gather(
                    *(
                        client.complete(messages=m, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True, **sampling)
                        for m in TREE_PROMPTS
                    )
                )

        return asyncio.run(main())
    finally:
        stack.kill_scheduler()


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=11)], ids=["greedy", "seeded"])
def test_trees_stream_the_tokens_of_spec_off(tree_executor, sampling):
    baseline = [c.token_ids for c in run_policy(tree_executor, "off", **sampling)]
    completions = run_policy(tree_executor, "fixed:8", **sampling)
    assert [c.token_ids for c in completions] == baseline
    drafted = sum(c.usage.drafted_tokens for c in completions)
    accepted = sum(c.usage.accepted_tokens for c in completions)
    assert 0 < accepted <= drafted
