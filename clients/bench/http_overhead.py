"""`swarmserve bench http`: what the HTTP front costs per token, against gRPC.

One executor and one scheduler serving both gRPC and HTTP. For each batch size B,
B concurrent greedy streams of `--tokens` tokens (EOS ignored, the same chat prompt)
go through gRPC (Generate) and through HTTP (/v1/chat/completions, streamed as
server-sent events), alternating, `--repeats` times. Reported per transport: the
median wall time of a round and the time per token of one stream (wall / tokens), and
the HTTP overhead: the difference per token, absolute and relative. The clients are
Python in this process for both transports, so client costs count on both sides.
Use a tiny model to see the front's overhead; with a real model it hides under the step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from clients.bench.services import start_services
from clients.client import AsyncSwarmClient
from clients.events import TokenEvent

MESSAGES = [{"role": "user", "content": "Write a unit test for the payment service."}]


async def grpc_stream(client: AsyncSwarmClient, num_tokens: int) -> int:
    num = 0
    async with client.generate(
        messages=MESSAGES, max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True
    ) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                num += len(event.token_ids)
    return num


async def http_stream(client: httpx.AsyncClient, url: str, num_tokens: int) -> int:
    body = {
        "model": "m", "messages": MESSAGES, "max_tokens": num_tokens, "temperature": 0.0, "stream": True,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    num = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                num += sum(len(c.get("token_ids", [])) for c in chunk["choices"])
    return num


async def run_round(transport: str, services, batch_size: int, num_tokens: int) -> float:
    """Wall seconds for `batch_size` concurrent streams; checks every stream got its tokens."""
    if transport == "grpc":
        async with AsyncSwarmClient(services.scheduler_address) as client:
            t0 = time.monotonic()
            counts = await asyncio.gather(*(grpc_stream(client, num_tokens) for _ in range(batch_size)))
            wall = time.monotonic() - t0
    else:
        limits = httpx.Limits(max_connections=batch_size)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            url = f"http://{services.http_address}"
            t0 = time.monotonic()
            counts = await asyncio.gather(*(http_stream(client, url, num_tokens) for _ in range(batch_size)))
            wall = time.monotonic() - t0
    if counts != [num_tokens] * batch_size:
        raise RuntimeError(f"{transport}: streams got {counts} tokens, expected {num_tokens} each")
    return wall


async def _main(args: argparse.Namespace) -> list[dict]:
    results = []
    with open(args.log, "ab") as log_file:
        async with start_services(
            log_file, model=args.model, kv_cache_gb=args.kv_cache_gb, scheduler_args=("--spec", "off"), http=True,
            max_running_requests=max(int(b) for b in args.batch_sizes.split(",")),
        ) as services:  # fmt: skip
            for batch_size in (int(b) for b in args.batch_sizes.split(",")):
                await run_round("grpc", services, batch_size, 4)  # warm up both paths
                await run_round("http", services, batch_size, 4)
                walls: dict[str, list[float]] = {"grpc": [], "http": []}
                for _ in range(args.repeats):
                    for transport in walls:
                        walls[transport].append(await run_round(transport, services, batch_size, args.tokens))
                row = {"batch_size": batch_size, "tokens_per_stream": args.tokens}
                for transport, values in walls.items():
                    row[f"{transport}_wall_s"] = statistics.median(values)
                    row[f"{transport}_ms_per_token"] = 1e3 * statistics.median(values) / args.tokens
                row["http_overhead_ms_per_token"] = row["http_ms_per_token"] - row["grpc_ms_per_token"]
                row["http_overhead_pct"] = 100 * row["http_overhead_ms_per_token"] / row["grpc_ms_per_token"]
                results.append(row)
    return results


def print_report(results: list[dict]) -> None:
    print(f"{'B':>3} {'gRPC ms/tok':>12} {'HTTP ms/tok':>12} {'overhead ms/tok':>16} {'overhead':>9}")
    for r in results:
        print(
            f"{r['batch_size']:>3} {r['grpc_ms_per_token']:>12.3f} {r['http_ms_per_token']:>12.3f} "
            f"{r['http_overhead_ms_per_token']:>16.3f} {r['http_overhead_pct']:>8.1f}%"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="default", help="'default' or a .gguf (a tiny one shows the front's cost best)"
    )
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream (default %(default)s)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds per transport, interleaved (default %(default)s)"
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--log", default="bench_http.log", help="where the services' logs go (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(_main(args))
    print_report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
