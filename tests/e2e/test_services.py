"""Both real services on loopback with the embedded model: continuous and static batching
give every stream its solo tokens; cancellations free everything; text deltas are exact.
All of it with one step in flight (where decodes run several times per Step call, by
default) and with overlapped scheduling (once per call), which must agree."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from clients import AsyncSwarmClient, SwarmServeError
from clients.timeline import fetch_timeline
from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.tokenizer import load_tokenizer
from swarmserve.executor.v1 import executor_pb2, executor_pb2_grpc
from tests.support.prompts import CHAT_MESSAGES, PLAIN_PROMPTS
from tests.support.stack import Stack

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EXECUTOR_ARGS = ["--kv-cache-gb", "0.25"]


def start_stack(tmp_path_factory, *scheduler_args):
    return Stack(EXECUTOR_ARGS, list(scheduler_args), log_dir=tmp_path_factory.mktemp("logs")).start()


SCHEDULING_MODES = {"sync": "--no-async-scheduling", "overlapped": "--async-scheduling"}
SOLO_TOKENS_BY_MODE: dict[str, dict] = {}  # each mode's solo runs: the modes must agree with each other too


@pytest.fixture(scope="module", params=list(SCHEDULING_MODES))
def stack(request, tmp_path_factory):
    """Every test here runs with one step in flight and with overlapped scheduling (two)."""
    s = start_stack(
        tmp_path_factory,
        "--max-running-requests",
        "16",
        "--max-num-batched-tokens",
        "128",
        SCHEDULING_MODES[request.param],
    )
    s.scheduling_mode = request.param
    yield s
    s.stop()


def executor_kv(stack: Stack) -> tuple[int, int]:
    """(free, total) KV blocks, asked of the executor directly (without attaching)."""
    with grpc.insecure_channel(stack.executor_address) as channel:
        info = executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(executor_pb2.GetInfoRequest(), timeout=5)
    return info.num_free_kv_blocks, info.num_kv_blocks


async def wait_all_kv_free(stack: Stack, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        free, total = executor_kv(stack)
        if free == total:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"KV blocks still held: {total - free} of {total}")
        await asyncio.sleep(0.1)


def workload():
    """16 requests: varied prompts (plain and chat), mixed output lengths."""
    items = []
    for i in range(16):
        if i % 4 == 3:
            kwargs = {"messages": CHAT_MESSAGES[i % len(CHAT_MESSAGES)]}
        else:
            text = PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)]
            kwargs = {"prompt": text if i < 8 else f"# note {i}\n{text}"}
        items.append((f"w{i}", kwargs, 6 + (i * 7) % 30))
    return items


async def run_greedy(client, request_id, kwargs, max_new_tokens, delay=0.0):
    await asyncio.sleep(delay)
    completion = await client.complete(
        **kwargs, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, request_id=request_id
    )
    assert completion.finish_reason == "length"
    return list(completion.token_ids)


@pytest.fixture(scope="module")
def solo_tokens(stack):
    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            return {rid: await run_greedy(client, rid, kwargs, n) for rid, kwargs, n in workload()}

    tokens = asyncio.run(main())
    for mode, other in SOLO_TOKENS_BY_MODE.items():
        assert tokens == other, f"{stack.scheduling_mode} and {mode} scheduling disagree"
    SOLO_TOKENS_BY_MODE[stack.scheduling_mode] = tokens
    return tokens


async def concurrent_tokens(address):
    async with AsyncSwarmClient(address) as client:
        tasks = [
            asyncio.create_task(run_greedy(client, rid, kwargs, n, delay=0.15 * i))
            for i, (rid, kwargs, n) in enumerate(workload())
        ]
        return dict(zip((rid for rid, _, _ in workload()), await asyncio.gather(*tasks)))


def test_decodes_run_several_times_per_call_only_with_one_step_in_flight(stack, solo_tokens):
    """The solo runs (agreeing across the modes: see solo_tokens) made their decodes in calls of
    several runs with one step in flight (up to --max-decode-runs, default 4: as many as the cost
    model predicts within --decode-runs-window-ms, so fewer on a slow or busy machine), and one run
    per call overlapped."""
    steps = fetch_timeline(stack.scheduler_address).steps
    runs = {s.num_runs for s in steps}
    if stack.scheduling_mode == "sync":
        assert 1 < max(runs) <= 4, runs
        assert all(s.num_prefill_tokens == 0 for s in steps if s.num_runs > 1)
        assert sum(s.num_decode_tokens for s in steps if s.num_runs > 1) > sum(1 for s in steps if s.num_runs > 1)
    else:
        assert runs == {1}


def test_concurrent_streams_equal_their_solo_runs(stack, solo_tokens):
    tokens = asyncio.run(concurrent_tokens(stack.scheduler_address))
    for rid, expected in solo_tokens.items():
        assert tokens[rid] == expected, rid
    asyncio.run(wait_all_kv_free(stack))


def test_static_batching_streams_equal_their_solo_runs(tmp_path_factory, stack, solo_tokens):
    if stack.scheduling_mode != "sync":  # it starts its own stack, the same whatever the module's mode
        pytest.skip("the static-batching stack does not depend on the module's scheduling mode: run once, in sync")
    static = start_stack(tmp_path_factory, "--batching", "static", "--max-running-requests", "8")
    try:
        tokens = asyncio.run(concurrent_tokens(static.scheduler_address))
    finally:
        static.stop()
    for rid, expected in solo_tokens.items():
        assert tokens[rid] == expected, rid


def test_cancellations_under_load_free_all_kv_and_leave_other_streams_alone(stack, solo_tokens):
    rng = random.Random(5)
    long_prompt = "\n".join(PLAIN_PROMPTS) * 3  # several prefill chunks of 128 tokens

    async def cancelled_request(client, i):
        kwargs = {"prompt": long_prompt if i % 2 else PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)]}
        task = asyncio.create_task(
            client.complete(**kwargs, max_new_tokens=200, temperature=0.8, seed=i, ignore_eos=True)
        )
        await asyncio.sleep(rng.uniform(0.0, 2.5))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "finished"

    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            keepers = [
                asyncio.create_task(run_greedy(client, rid, kwargs, n, delay=0.3 * i))
                for i, (rid, kwargs, n) in enumerate(workload()[:4])
            ]
            outcomes = await asyncio.gather(*(cancelled_request(client, i) for i in range(100)))
            kept = await asyncio.gather(*keepers)
            info = await client.server_info()
        return outcomes, kept, info

    outcomes, kept, info = asyncio.run(main())
    assert outcomes.count("cancelled") >= 90
    for (rid, _, _), tokens in zip(workload()[:4], kept):
        assert tokens == solo_tokens[rid], rid
    asyncio.run(wait_all_kv_free(stack))
    assert info.is_executor_connected


def test_text_deltas_concatenate_to_the_decoded_output(stack, default_model_path):
    tokenizer = load_tokenizer(open_gguf(default_model_path)).tokenizer
    prompts = [
        "Répète exactement: «Ça va? Très bien!» puis 東京タワー 🗼🚀🎉 et naïve café.",
        "Emoji story: 🐍🔥💻🧠✨ then 日本語の文章を書いてください。",
    ]

    async def main():
        results = []
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            for seed, prompt in enumerate(prompts * 2):
                texts, ids = [], []
                async for event in client.generate(
                    prompt, max_new_tokens=48, temperature=1.0, seed=seed, ignore_eos=True
                ):
                    if hasattr(event, "token_ids"):
                        texts.append(event.text)
                        ids.extend(event.token_ids)
                results.append((texts, ids))
        return results

    split_chars = 0
    for texts, ids in asyncio.run(main()):
        assert "".join(texts) == tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in t for t in texts[:-1]) or "\ufffd" in tokenizer.decode(ids)
        split_chars += sum(1 for i in ids if "\ufffd" in tokenizer.decode([i]))
    assert split_chars > 0, "no output token held part of a character: the check above was not exercised"


def test_stop_strings_and_finish_reasons(stack, solo_tokens):
    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            full = await client.complete(PLAIN_PROMPTS[0], max_new_tokens=40, temperature=0.0, ignore_eos=True)
            words = [w for w in full.text.split() if len(w) >= 3]
            stop = words[len(words) // 2]
            stopped = await client.complete(
                PLAIN_PROMPTS[0], max_new_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]
            )
            eos = await client.complete(messages=CHAT_MESSAGES[0], max_new_tokens=400, temperature=0.0)
            return full, stop, stopped, eos

    full, stop, stopped, eos = asyncio.run(main())
    assert stopped.finish_reason == "stop_string" and stopped.stop_string == stop
    assert stopped.text == full.text[: full.text.index(stop)]
    assert eos.finish_reason == "eos" and eos.usage.completion_tokens < 400
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens == 40 and full.usage.ttft_s > 0


def test_duplicate_request_id_is_refused_while_in_flight(stack):
    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            # Long enough to outlast the sleep however fast the steps are.
            first = asyncio.create_task(
                client.complete("hello", max_new_tokens=300, ignore_eos=True, request_id="same")
            )
            await asyncio.sleep(0.5)
            with pytest.raises(SwarmServeError) as info:
                await client.complete("hello", max_new_tokens=5, request_id="same")
            await first
            return info.value

    error = asyncio.run(main())
    assert error.code == grpc.StatusCode.ALREADY_EXISTS and "'same'" in error.message


def run_cli(*args, timeout=120):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "clients.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_generate_json_and_errors(stack, solo_tokens):
    import json

    rid, kwargs, n = workload()[0]
    result = run_cli(
        "generate",
        kwargs["prompt"],
        "--server",
        stack.scheduler_address,
        "--max-new-tokens",
        str(n),
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert {"token_ids", "text", "finish_reason", "usage"} <= set(out)
    assert out["token_ids"] == solo_tokens[rid] and out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == n

    bad = run_cli("generate", "hi", "--server", stack.scheduler_address, "--temperature", "-1")
    assert bad.returncode != 0
    assert "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr

    streamed = run_cli(
        "generate",
        kwargs["prompt"],
        "--server",
        stack.scheduler_address,
        "--max-new-tokens",
        str(n),
        "--temperature",
        "0",
        "--ignore-eos",
    )
    assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == out["text"].rstrip("\n")


def test_server_info_reports_the_packed_weights_at_the_gguf_size(stack, default_model_path):
    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            return await client.server_info()

    info = asyncio.run(main())
    file_size = default_model_path.stat().st_size
    assert (info.dtype, info.device) == ("float32", "cpu")
    assert 0.9 * file_size <= info.weight_bytes <= 1.1 * file_size


SEEDED_TOKENS_BY_MODE: dict[str, list] = {}


def test_seeded_sampling_is_the_same_whatever_the_scheduling_mode(stack):
    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            completions = await asyncio.gather(
                *(
                    client.complete(
                        PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)],
                        max_new_tokens=24 + 3 * i,
                        temperature=0.8,
                        seed=100 + i,
                        ignore_eos=True,
                    )
                    for i in range(6)
                )
            )
        return [list(c.token_ids) for c in completions]

    tokens = asyncio.run(main())
    assert [len(t) for t in tokens] == [24 + 3 * i for i in range(6)]
    for mode, other in SEEDED_TOKENS_BY_MODE.items():
        assert tokens == other, f"{stack.scheduling_mode} and {mode} scheduling disagree"
    SEEDED_TOKENS_BY_MODE[stack.scheduling_mode] = tokens
