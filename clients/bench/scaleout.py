"""`swarmserve bench scaleout`: one pair vs two pairs vs two pairs behind SMG.

Two executor+scheduler pairs start once (as `serve --replicas 2` lays them out). Each
run sends the same multi-turn agent workload, every agent at once: `--agents` agents x
`--turns` turns, each agent's conversation unique from its first token (a run tag and
its index lead the system prompt), `--tokens` output tokens per turn (EOS ignored).
The runs:

- `1 pair`: every agent talks to pair 0's HTTP front;
- `2 pairs, pinned`: agent i talks to pair i % 2 directly (ideal stickiness, no gateway);
- `SMG cache_aware`, `SMG round_robin`: every agent talks to `smg launch` in front of
  both pairs, with that policy (the gateway restarted between them).

Reported per run: requests/s (turns / makespan), mean turn latency, and the prefix hit
rate (cached / prompt tokens over the later turns, where the conversation so far could
be cached). The gateway's added latency: `--probes` sequential one-token requests
straight to a pair vs through the gateway, mean of each. Writes `<out>.json` and
`<out>.png` (the topology and the numbers). On a small CPU machine the pairs share the
cores, so two pairs cannot double throughput there: the numbers say what they say.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from clients.serve import ServeConfig, Supervisor, free_port, stop_process
from clients.serve_fleet import FleetConfig, gateway_command, wait_gateway_ready

POLICIES = ("cache_aware", "round_robin")


async def agent(
    client: httpx.AsyncClient, url: str, model: str, tag: str, index: int, turns: int, tokens: int
) -> list[dict]:
    """One agent's turns: [{latency_s, prompt_tokens, cached_tokens}] per turn."""
    messages = [
        {"role": "system", "content": f"{tag}/{index:03d}: you are agent {index}, refactoring module {index}. " * 6}
    ]
    turns_done = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: continue with step {turn} of the plan."})
        t0 = time.monotonic()
        answer = await client.post(
            f"{url}/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
        )
        answer.raise_for_status()
        body = answer.json()
        usage = body["usage"]
        turns_done.append(
            {
                "latency_s": time.monotonic() - t0,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            }
        )
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return turns_done


async def run_swarm(urls: list[str], model: str, tag: str, args: argparse.Namespace) -> dict:
    """Agent i talks to urls[i % len(urls)]."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.agents)) as client:
        t0 = time.monotonic()
        agents = await asyncio.gather(
            *(agent(client, urls[i % len(urls)], model, tag, i, args.turns, args.tokens) for i in range(args.agents))
        )
        makespan = time.monotonic() - t0
    turns = [t for a in agents for t in a]
    later = [t for a in agents for t in a[1:]]
    return {
        "requests_per_s": len(turns) / makespan,
        "makespan_s": makespan,
        "mean_latency_s": statistics.mean(t["latency_s"] for t in turns),
        "prefix_hit_rate": sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later),
    }


async def mean_latency(url: str, model: str, tag: str, num: int) -> float:
    """Mean of `num` sequential one-token requests, each a prompt of its own."""
    async with httpx.AsyncClient(timeout=60) as client:
        latencies = []
        for i in range(num):
            body = {"model": model, "messages": [{"role": "user", "content": f"{tag} probe {i}"}], "max_tokens": 1}
            t0 = time.monotonic()
            (await client.post(f"{url}/v1/chat/completions", json=body)).raise_for_status()
            latencies.append(time.monotonic() - t0)
    return statistics.mean(latencies)


async def _main(args: argparse.Namespace) -> dict:
    base = ServeConfig(
        executor_listen=f"127.0.0.1:{args.base_port + 12}",  # replica i adds 2*i; HTTP fronts on base+1, base+2
        scheduler_listen=f"127.0.0.1:{args.base_port + 11}",
        http_listen=f"127.0.0.1:{args.base_port}",
        executor_args=(
            "--model",
            args.model,
            "--kv-cache-gb",
            str(args.kv_cache_gb),
            "--no-calibration",
            *(("--threads", str(args.threads)) if args.threads else ()),
        ),  # fmt: skip
        scheduler_args=("--spec", "off"),
    )
    fleet = FleetConfig(base, num_replicas=2)
    log = open(args.log, "ab")
    pairs = [Supervisor(replica, log_file=log) for replica in fleet.replicas]
    results: dict = {
        "agents": args.agents,
        "turns": args.turns,
        "tokens": args.tokens,
        "threads": args.threads,
        "runs": {},
    }
    try:
        ready = await asyncio.gather(*(pair.start() for pair in pairs))
        model = ready[0].model_name
        pair_urls = [r.http_url for r in ready]
        results["runs"]["1 pair"] = await run_swarm(pair_urls[:1], model, "one", args)
        results["runs"]["2 pairs, pinned"] = await run_swarm(pair_urls, model, "pinned", args)
        entry = f"http://{base.http_listen}"
        for policy in POLICIES:
            command = gateway_command(dataclasses.replace(fleet, gateway_policy=policy), free_port(), model)
            gateway = await asyncio.create_subprocess_exec(*command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            try:
                await asyncio.wait_for(wait_gateway_ready(entry, 2), 60)
                results["runs"][f"SMG {policy}"] = await run_swarm([entry], model, policy, args)
                if policy == "cache_aware":
                    direct = await mean_latency(pair_urls[0], model, "direct", args.probes)
                    through = await mean_latency(entry, model, "gateway", args.probes)
                    results["gateway_latency"] = {
                        "direct_s": direct,
                        "through_gateway_s": through,
                        "added_s": through - direct,
                    }
            finally:
                await stop_process(gateway, 10)
    finally:
        await asyncio.gather(*(pair.stop() for pair in pairs))
        log.close()
    return results


def plot(results: dict, path: Path) -> None:
    """Left: the topology, drawn from the run's shape. Right: requests/s and prefix hit rate per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, (topology, bars) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.1, 1]})
    topology.set_xlim(0, 10)
    topology.set_ylim(0, 10)
    topology.axis("off")

    def box(x, y, w, h, text, color):
        topology.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.1", fc=color, ec="#333"))
        topology.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)

    def arrow(x0, y0, x1, y1, text=""):
        topology.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops={"arrowstyle": "->", "color": "#333"})
        if text:
            topology.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.25, text, ha="center", fontsize=7, color="#555")

    box(0.2, 4.2, 1.9, 1.6, "agents\n(OpenAI /\nAnthropic SDKs)", "#f2f2f2")
    box(2.9, 3.9, 2.5, 2.2, "SMG\nsmg launch\n--policy cache_aware\n(one entry point)", "#dbe9f6")
    arrow(2.2, 5.0, 2.8, 5.0, "HTTP")
    for i, y in enumerate((6.6, 1.4)):
        box(
            6.0,
            y,
            3.7,
            2.0,
            f"pair {i}\nscheduler (HTTP front, /v1/loads,\nvllm:* gauges)  +  executor (KV)",
            "#e3f1dc",
        )
        arrow(5.5, 5.0, 5.95, y + 1.0)
    topology.text(5.0, 0.1, "cache_aware: a prefix tree per pair sends an agent's turns back to the pair\nholding its prefix in KV; load from /v1/loads, health from /health",
                  ha="center", fontsize=8, color="#333")  # fmt: skip
    topology.set_title("swarmserve scale-out")

    runs = results["runs"]
    names = list(runs)
    x = range(len(names))
    bars.bar(
        [i - 0.2 for i in x], [runs[n]["requests_per_s"] for n in names], width=0.4, label="requests/s", color="#4c78a8"
    )
    bars.set_ylabel("requests/s")
    bars.set_xticks(list(x), names, rotation=15, fontsize=8)
    hits = bars.twinx()
    hits.bar(
        [i + 0.2 for i in x],
        [runs[n]["prefix_hit_rate"] for n in names],
        width=0.4,
        label="prefix hit rate",
        color="#f58518",
    )
    hits.set_ylim(0, 1)
    hits.set_ylabel("prefix hit rate (later turns)")
    latency = results.get("gateway_latency")
    subtitle = f", gateway adds {latency['added_s'] * 1000:.1f} ms/request" if latency else ""
    threads = f", {results['threads']} thread(s) per executor" if results.get("threads") else ""
    bars.set_title(
        f"{results['agents']} agents x {results['turns']} turns x {results['tokens']} tokens{threads}{subtitle}",
        fontsize=9,
    )
    handles = bars.get_legend_handles_labels()[0] + hits.get_legend_handles_labels()[0]
    bars.legend(
        handles, ["requests/s", "prefix hit rate"], loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(results: dict) -> None:
    print(f"{'run':<20} {'req/s':>7} {'makespan s':>10} {'mean latency s':>14} {'prefix hits':>11}")
    for name, run in results["runs"].items():
        print(
            f"{name:<20} {run['requests_per_s']:>7.2f} {run['makespan_s']:>10.2f} {run['mean_latency_s']:>14.3f} {run['prefix_hit_rate']:>11.1%}"
        )
    latency = results.get("gateway_latency")
    if latency:
        print(
            f"gateway: {latency['direct_s'] * 1000:.1f} ms direct, {latency['through_gateway_s'] * 1000:.1f} ms through SMG "
            f"(+{latency['added_s'] * 1000:.1f} ms per request)"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the executors' --model (a small GGUF on a CPU machine)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.05)
    parser.add_argument(
        "--threads", type=int, default=None, help="each executor's torch threads (default: torch's choice)"
    )
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per turn (default %(default)s)")
    parser.add_argument(
        "--probes", type=int, default=20, help="sequential requests for the gateway's latency (default %(default)s)"
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=18000,
        help="the gateway's port; the pairs take the next ones (default %(default)s)",
    )
    parser.add_argument("--out", default="scale-out", help="prefix of the .json and .png written (default %(default)s)")
    parser.add_argument("--log", default="bench_scaleout.log", help="where the services' logs go (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(_main(args))
    print_report(results)
    Path(args.out + ".json").write_text(json.dumps(results, indent=2))
    plot(results, Path(args.out + ".png"))
    print(f"wrote {args.out}.json and {args.out}.png", file=sys.stderr)
    return 0
