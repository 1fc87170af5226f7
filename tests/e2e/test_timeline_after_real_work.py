"""The step timeline after real work: chat agents and long writers through the real services,
then GetTimeline and `swarmserve timeline` (the Chrome trace, the PNG and the printed summary).

The workload has every kind of step the history records: a long shared system prompt
(prefilled in chunks, then found in the prefix cache by the other agents and by each
agent's next turn), speculation (the tiny model repeats itself, so drafts are accepted),
decode runs (several runs in one Step call, which the cost model observes as a mean run:
13 tokens over 4 runs is 3.25, and even 8 tokens over 1 run is 8.0, the float that once
reached an integer field of TimelineStep and made GetTimeline fail with UNKNOWN), and
preemption (writers with short prompts and long answers, admitted together, outgrow a small
KV cache).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from clients import AsyncSwarmClient
from clients.cli import main as cli_main
from clients.timeline import fetch_timeline
from tests.support.stack import Stack
from tests.support.tiny_gguf import TinyModelSpec, tiny_kv_bytes_per_block

NUM_AGENTS = 6
NUM_TURNS = 2
NUM_NEW_TOKENS = 96
NUM_WRITERS = 6  # short prompts, long outputs, all at once: together they outgrow the KV cache
# 31 blocks each at full length: any 4 of the 6 running at once outgrow the cache on their own. With
# 320 tokens (21 blocks) all 6 had to overlap (126 of 120 blocks), and a loaded CI machine, where one
# writer finished (its drafts all accepted) before the last had grown, saw no preemption.
NUM_WRITER_TOKENS = 480
BLOCK = 16
BYTES_PER_BLOCK = tiny_kv_bytes_per_block(BLOCK)
NUM_KV_BLOCKS = 120  # ~1,900 tokens: the writers alone need more, so some are preempted
SYSTEM = "You are one of a swarm of coding agents. The repository:\n" + "\n".join(
    f"src/module_{i}.py: def handler_{i}(request): return request.value + {i}" for i in range(12)
)  # ~700 tokens of the tiny byte-level tokenizer: more than one step's 256-token prefill budget


@pytest.fixture(scope="module")
def swarm_stack(tiny_gguf_path, tmp_path_factory):
    model = tiny_gguf_path(TinyModelSpec(context_length=2048))
    kv_gb = NUM_KV_BLOCKS * BYTES_PER_BLOCK / (1 << 30)
    stack = Stack(
        ["--model", str(model), "--kv-cache-gb", repr(kv_gb)],
        [],  # defaults: goodput speculation, up to 4 decode runs per call, 256 tokens per step
        log_dir=tmp_path_factory.mktemp("logs"),
    ).start()
    yield stack
    stack.stop()


async def agent(client: AsyncSwarmClient, i: int) -> list:
    messages = [{"role": "system", "content": SYSTEM}]
    completions = []
    for turn in range(NUM_TURNS):
        messages.append({"role": "user", "content": f"Agent {i}, turn {turn}: fix handler_{i}."})
        completion = await client.complete(
            messages=messages, max_new_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, session_id=f"agent-{i}"
        )
        messages.append({"role": "assistant", "content": completion.text})
        completions.append(completion)
    return completions


async def writer(client: AsyncSwarmClient, i: int) -> list:
    """A short prompt and a long answer: admitted at once (its prompt fits), then its KV grows."""
    prompt = f"Writer {i}: write the changelog."
    return [await client.complete(prompt, max_new_tokens=NUM_WRITER_TOKENS, temperature=0.0, ignore_eos=True)]


@pytest.fixture(scope="module")
def swarm(swarm_stack):
    async def main():
        async with AsyncSwarmClient(swarm_stack.scheduler_address, timeout=300) as client:
            agents = [agent(client, i) for i in range(NUM_AGENTS)]
            return await asyncio.gather(*agents, *(writer(client, i) for i in range(NUM_WRITERS)))

    return [c for completions in asyncio.run(main()) for c in completions]


def test_get_timeline_reads_every_step_of_a_mixed_workload(swarm_stack, swarm):
    timeline = fetch_timeline(swarm_stack.scheduler_address)
    steps = timeline.steps
    assert steps and len(steps) < timeline.max_steps_kept, "the history should hold the whole workload"
    slices = [q for s in steps for q in s.requests]
    # Every kind of step the workload was built to produce.
    assert any(not q.is_decode and q.num_scheduled_tokens == 256 for q in slices), "no chunked prefill"
    assert sum(c.usage.cached_tokens for c in swarm) > NUM_AGENTS * len(SYSTEM) // 2, "too few prefix hits"
    assert any(s.num_runs > 1 for s in steps), "no decode runs"
    assert any(s.num_runs > 1 and s.num_drafted_tokens for s in steps), "no speculation inside decode runs"
    assert sum(s.num_accepted_tokens for s in steps) > 0, "no draft accepted"
    assert sum(s.num_preempted for s in steps) > 0, "no preemption"
    # What the timeline says each request got is what its client got.
    assert sum(q.num_new_tokens for q in slices) == sum(len(c.token_ids) for c in swarm)
    assert all(c.finish_reason == "length" for c in swarm)
    assert sorted(len(c.token_ids) for c in swarm) == sorted(
        [NUM_NEW_TOKENS] * NUM_AGENTS * NUM_TURNS + [NUM_WRITER_TOKENS] * NUM_WRITERS
    )
    for s in steps:
        assert s.duration_s > 0 and s.num_runs >= 1 and s.num_requests == len(s.requests)
    assert len(fetch_timeline(swarm_stack.scheduler_address, max_steps=10).steps) == 10


def test_swarmserve_timeline_draws_the_mixed_workload(swarm_stack, swarm, tmp_path, capsys):
    prefix = tmp_path / "steps"
    assert cli_main(["timeline", "--server", swarm_stack.scheduler_address, "--out", str(prefix)]) == 0
    trace = json.loads((tmp_path / "steps.json").read_text())
    assert trace["otherData"]["num_requests"] == len(swarm)
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert any(n.startswith("prefill ") for n in names) and any("drafts)" in n for n in names)
    assert (tmp_path / "steps.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    out = capsys.readouterr().out
    assert f"{trace['otherData']['num_steps']} steps, {len(swarm)} requests" in out
    assert "cost model |predicted - executor| / executor" in out and "scheduler overhead:" in out
    last_20 = ["timeline", "--server", swarm_stack.scheduler_address, "--out", str(prefix), "--max-steps", "20"]
    assert cli_main(last_20) == 0
    assert json.loads((tmp_path / "steps.json").read_text())["otherData"]["num_steps"] == 20
