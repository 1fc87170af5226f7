"""`swarmserve bench batching`: eight coding agents under static vs continuous batching.

Eight agents with output lengths 40, 90, 150, 220, 300, 480, 650 and 900 tokens
(EOS ignored, so the lengths are exact), and `--waves - 1` more groups like them
queued behind, so a slot freed by a short agent can be refilled. The batch holds
8 requests. Both modes run in one invocation, each on a fresh pair of services
(same model, same flags), and the ratio is printed. Speculation is off by default
(`--spec`), so the number measures batching alone: with drafts on, a draining
static batch spends its idle slack on drafts and the gap narrows.

- useful tokens/s: output tokens / wall time from the first request to the last token;
- slot utilization: output tokens / (8 slots × steps): the share of batch slots that
  carried a token (prefill steps count as steps);
- TTFT: arrival to first token, as the server measured it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from clients.bench.services import start_services
from clients.bench.swarm import AGENT_OUTPUT_LENGTHS
from clients.client import AsyncSwarmClient

BATCH_SLOTS = 8
TOPICS = (
    "a unit test",
    "a refactor plan",
    "a grep result",
    "a file rewrite",
    "a code review",
    "a bug report",
    "an API doc",
    "a design note",
)


async def run_mode(mode: str, args: argparse.Namespace, log_file) -> dict:
    scheduler_args = ["--batching", mode, "--spec", args.spec]
    if args.max_num_batched_tokens:
        scheduler_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    async with start_services(
        log_file,
        model=args.model,
        dtype=args.dtype,
        kv_cache_gb=args.kv_cache_gb,
        scheduler_args=tuple(scheduler_args),
        max_running_requests=BATCH_SLOTS,
    ) as services:
        async with AsyncSwarmClient(services.scheduler_address) as client:
            await client.complete("warm up", max_new_tokens=4, ignore_eos=True)
            steps_before = (await client.server_info()).num_steps
            lengths = [max(1, round(n * args.scale)) for n in AGENT_OUTPUT_LENGTHS] * args.waves
            t0 = time.monotonic()
            completions = await asyncio.gather(
                *(
                    client.complete(
                        f"Agent {i}: write {TOPICS[i % len(TOPICS)]} for the payment service.",
                        max_new_tokens=n,
                        temperature=0.0,
                        ignore_eos=True,
                    )
                    for i, n in enumerate(lengths)
                )
            )
            wall = time.monotonic() - t0
            num_steps = (await client.server_info()).num_steps - steps_before
    tokens = sum(len(c.token_ids) for c in completions)
    ttfts = sorted(c.usage.ttft_s for c in completions)
    return {
        "mode": mode,
        "requests": len(completions),
        "useful_tokens": tokens,
        "wall_s": wall,
        "useful_tokens_per_s": tokens / wall,
        "steps": num_steps,
        "slot_utilization": tokens / (BATCH_SLOTS * num_steps),
        "mean_step_s": wall / num_steps,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_max_s": ttfts[-1],
    }


def print_report(results: list[dict]) -> None:
    print(
        f"{'mode':>10} | {'tokens':>6} | {'wall s':>7} | {'tok/s':>6} | {'steps':>5} | {'step ms':>7} | {'slot util':>9} | {'TTFT mean/p50/max s':>20}"
    )
    for r in results:
        print(
            f"{r['mode']:>10} | {r['useful_tokens']:6d} | {r['wall_s']:7.1f} | {r['useful_tokens_per_s']:6.1f} | "
            f"{r['steps']:5d} | {r['mean_step_s'] * 1e3:7.1f} | {r['slot_utilization']:9.0%} | "
            f"{r['ttft_mean_s']:6.1f} {r['ttft_p50_s']:6.1f} {r['ttft_max_s']:6.1f}"
        )
    by_mode = {r["mode"]: r for r in results}
    if {"static", "continuous"} <= set(by_mode):
        ratio = by_mode["continuous"]["useful_tokens_per_s"] / by_mode["static"]["useful_tokens_per_s"]
        print(f"\ncontinuous / static useful tokens/s: {ratio:.2f}x")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=None, help="executor dtype (default: the executor's)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--waves", type=int, default=4, help="groups of 8 agents (default %(default)s: one queued behind the first)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every output length (e.g. 0.25 for a quick run)"
    )
    parser.add_argument("--modes", default="static,continuous")
    parser.add_argument(
        "--spec", default="off", help="the scheduler's draft policy (default %(default)s: batching alone is measured)"
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--log", default="bench_batching.log", help="where the services' logs go (default %(default)s)")


async def _main(args: argparse.Namespace) -> list[dict]:
    results = []
    with open(args.log, "ab") as log_file:
        for mode in args.modes.split(","):
            results.append(await run_mode(mode, args, log_file))
    return results


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(_main(args))
    print_report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
