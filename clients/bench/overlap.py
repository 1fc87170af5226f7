"""`swarmserve bench overlap`: what the scheduler side costs per step, with one step in flight
and with overlapped scheduling (`--async-scheduling`), and how well the cost model predicts.

One executor; for each scheduling mode a fresh scheduler attached to it; for each batch
size B, B concurrent greedy streams of `--tokens` tokens (EOS ignored). Reported per run,
over the run's own steps (GetTimeline): tokens/s, the step period (result to result),
the executor's busy time per step, the scheduler + RPC share of the step (period minus
executor time, see clients/step_stats.py), and the cost model's prediction error (median
and p90 of |predicted − executor| / executor over the steps after the scheduler's first 20).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from clients.bench.services import start_scheduler, start_services
from clients.client import AsyncSwarmClient
from clients.step_stats import prediction_error, scheduler_overhead
from clients.timeline import fetch_timeline

MODES = {"sync": "--no-async-scheduling", "overlapped": "--async-scheduling"}


async def run_batch(address: str, batch_size: int, num_tokens: int) -> dict:
    async with AsyncSwarmClient(address) as client:
        steps_before = (await client.server_info()).num_steps
        t0 = time.monotonic()
        completions = await asyncio.gather(
            *(
                client.complete(
                    f"Agent {i}: write a unit test for the payment service.",
                    max_new_tokens=num_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                )
                for i in range(batch_size)
            )
        )
        wall = time.monotonic() - t0
        num_steps = (await client.server_info()).num_steps - steps_before
    steps = list(await asyncio.to_thread(lambda: fetch_timeline(address, num_steps).steps))
    decode_steps = [s for s in steps if s.num_requests == batch_size and s.num_prefill_tokens == 0]
    overhead = scheduler_overhead(decode_steps)
    error = prediction_error(steps)
    tokens = sum(len(c.token_ids) for c in completions)
    return {
        "batch_size": batch_size,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "steps": num_steps,
        "period_ms": overhead.mean_period_s * 1e3 if overhead else None,
        "executor_ms": overhead.mean_executor_s * 1e3 if overhead else None,
        "overhead_share": overhead.overhead_share if overhead else None,
        "error_median": error.median if error else None,
        "error_p90": error.p90 if error else None,
        "token_ids": [list(c.token_ids) for c in completions],
    }


async def _main(args: argparse.Namespace) -> list[dict]:
    results = []
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    with open(args.log, "ab") as log_file:
        async with start_services(
            log_file, model=args.model, kv_cache_gb=args.kv_cache_gb, scheduler_args=(MODES["sync"],)
        ) as services:
            for repeat in range(args.repeats):
                for mode in args.modes.split(","):
                    async with start_scheduler(
                        services.executor_address,
                        log_file,
                        MODES[mode],
                        "--spec",
                        args.spec,
                        max_running_requests=max(batch_sizes),
                    ) as address:
                        async with AsyncSwarmClient(
                            address
                        ) as client:  # the model's first steps are slow: not measured
                            await client.complete("warm up", max_new_tokens=24, ignore_eos=True)
                        for batch_size in batch_sizes:
                            results.append(
                                {"mode": mode, "repeat": repeat, **await run_batch(address, batch_size, args.tokens)}
                            )
    return results


def print_report(results: list[dict]) -> None:
    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"

    print(
        f"{'mode':>10} | {'B':>3} | {'tok/s':>6} | {'steps':>5} | {'period ms':>9} | {'executor ms':>11} | {'sched+RPC':>9} | {'pred err p50/p90':>16}"
    )
    for r in results:
        print(
            f"{r['mode']:>10} | {r['batch_size']:3d} | {r['tokens_per_s']:6.1f} | {r['steps']:5d} | {fmt(r['period_ms'], '9.1f')} | "
            f"{fmt(r['executor_ms'], '11.1f')} | {fmt(r['overhead_share'], '9.0%')} | "
            f"{fmt(r['error_median'], '7.1%')} {fmt(r['error_p90'], '7.1%')}"
        )
    by_key = {(r["mode"], r["batch_size"], r["repeat"]): r for r in results}
    for (mode, batch_size, repeat), r in by_key.items():
        sync = by_key.get(("sync", batch_size, repeat))
        if mode == "overlapped" and sync is not None:
            same = "identical tokens" if sync["token_ids"] == r["token_ids"] else "TOKENS DIFFER"
            print(
                f"B={batch_size} (run {repeat}): overlapped / sync tokens/s {r['tokens_per_s'] / sync['tokens_per_s']:.2f}x, {same}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream (default %(default)s)")
    parser.add_argument("--modes", default="sync,overlapped")
    parser.add_argument(
        "--repeats", type=int, default=1, help="run every mode this many times, interleaved (default %(default)s)"
    )
    parser.add_argument("--spec", default="off", help="the scheduler's draft policy (default %(default)s)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--log", default="bench_overlap.log", help="where the services' logs go (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(_main(args))
    print_report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "token_ids"} for r in results], f, indent=2)
    return 0
