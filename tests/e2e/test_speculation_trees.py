"""Draft trees through the real services: an executor with `--draft-shape tree` streams the
same greedy tokens, and the same seeded samples, with speculation on as with it off."""

from __future__ import annotations

import asyncio

import pytest

from clients import AsyncSwarmClient
from clients.timeline import fetch_timeline
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


def run_policy(stack: Stack, policy: str, timelines: list | None = None, **sampling):
    """The completions of TREE_PROMPTS under `policy`; the scheduler's timeline is appended to
    `timelines` when given."""
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

        completions = asyncio.run(main())
        if timelines is not None:
            timelines.append(fetch_timeline(stack.scheduler_address))
        return completions
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


def test_the_timeline_shows_each_requests_trees(tree_executor):
    """Each request's slice of each step: its tree's nodes (num_drafted_tokens), depth, leaves
    and accepted length, from the real executor; the step's sums over its requests."""
    timelines: list = []
    run_policy(tree_executor, "fixed:8", timelines, temperature=0.0)
    (timeline,) = timelines
    slices = [q for step in timeline.steps for q in step.requests if q.num_drafted_tokens]
    assert slices, "nothing was drafted"
    for q in slices:
        assert q.num_accepted_tokens <= q.draft_depth <= q.num_drafted_tokens
        assert 1 <= q.num_draft_leaves <= q.num_drafted_tokens
    assert any(q.draft_depth < q.num_drafted_tokens and q.num_draft_leaves > 1 for q in slices), "no tree branched"
    for step in timeline.steps:
        assert step.draft_depth == sum(q.draft_depth for q in step.requests)
        assert step.num_draft_leaves == sum(q.num_draft_leaves for q in step.requests)
