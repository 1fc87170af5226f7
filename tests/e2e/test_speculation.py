"""Speculation through the real services: every `--spec` policy streams the same greedy
tokens as `--spec off`, and the drafting policies do draft and accept on copy-heavy prompts,
with one step in flight and with overlapped scheduling (drafts budgeted a step ahead)."""

from __future__ import annotations

import asyncio

import pytest

from clients import AsyncSwarmClient
from tests.executor.engine.test_speculation_equivalence import COPY_SOURCE
from tests.support.stack import Stack

PROMPTS = [
    [{"role": "user", "content": "Repeat this code exactly:\n\n" + COPY_SOURCE}],
    [{"role": "user", "content": "Copy this class, renaming rate to speed:\n\n" + COPY_SOURCE}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
]
NUM_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    stack = Stack(["--kv-cache-gb", "0.25"], log_dir=tmp_path_factory.mktemp("logs"))
    stack.start_executor()
    yield stack
    stack.stop()


def run_policy(stack: Stack, policy: str, *extra_args: str, prompts=PROMPTS):
    stack.scheduler_args = ["--spec", policy, "--max-running-requests", "4", *extra_args]
    stack.start_scheduler()
    try:

        async def main():
            async with AsyncSwarmClient(stack.scheduler_address) as client:
                return await asyncio.gather(
                    *(
                        client.complete(messages=m, max_new_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
                        for m in prompts
                    )
                )

        return asyncio.run(main())
    finally:
        stack.kill_scheduler()


@pytest.mark.parametrize("scheduling", ["--no-async-scheduling", "--async-scheduling"], ids=["sync", "overlapped"])
def test_every_policy_streams_the_tokens_of_spec_off(executor, scheduling):
    baseline = [c.token_ids for c in run_policy(executor, "off", "--no-async-scheduling")]
    for policy in (
        ("off", "fixed:4", "even", "goodput") if scheduling == "--async-scheduling" else ("fixed:4", "even", "goodput")
    ):
        completions = run_policy(executor, policy, scheduling)
        assert [c.token_ids for c in completions] == baseline, policy
        drafted = sum(c.usage.drafted_tokens for c in completions)
        accepted = sum(c.usage.accepted_tokens for c in completions)
        assert accepted <= drafted
        # The budgeted policies may find no slack at batch size 4 on this CPU (a verify row costs
        # nearly a decode row here): they must stay lossless, and fixed:K must draft regardless.
        if policy == "fixed:4":
            assert accepted > 0, f"{policy}: no draft was accepted on copy prompts"


def test_goodput_speculates_for_a_lone_copying_agent(executor):
    """Alone, a copying agent leaves the step slack that goodput spends on drafts."""
    copy_prompt = PROMPTS[:1]
    baseline = run_policy(executor, "off", prompts=copy_prompt)
    completions = run_policy(executor, "goodput", prompts=copy_prompt)
    assert [c.token_ids for c in completions] == [c.token_ids for c in baseline]
    assert completions[0].usage.accepted_tokens > NUM_NEW_TOKENS // 4
