"""`swarmserve bench spec`: draft policies × live batch size × workload, in one run.

One executor serves every configuration; each (policy, B) gets a fresh scheduler
(`--spec POLICY`, batch capped at B), and each workload runs B greedy requests at once with the
batch capped at B, so the live batch is B throughout (EOS ignored, equal lengths).

- copy: agent turns that repeat or lightly edit code from their context, where a
  suffix-match drafter finds long runs;
- free: free-form text, where drafts are mostly rejected.

Reports accepted (useful) tokens/s, acceptance rate (accepted / drafted) and waste
(drafted tokens rejected, per useful token) per policy, the speed-up of goodput over
off at B = 1 and B = 16, and whether goodput is within noise of the best policy at
every B. Writes a JSON file and a PNG plot of tokens/s vs B per workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from clients.bench.services import start_scheduler, start_services
from clients.client import AsyncSwarmClient

POLICIES = ("off", "fixed:2", "fixed:4", "fixed:8", "even", "goodput")
BATCH_SIZES = (1, 2, 4, 8, 16)
NOISE = 0.10  # "within noise": within 10% of the best policy at that B

SNIPPETS = [
    """def parse_config(path):
    with open(path) as f:
        data = json.load(f)
    if "version" not in data:
        raise ValueError("missing version")
    return Config(version=data["version"], name=data.get("name", "default"), debug=data.get("debug", False))
""",
    """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = OrderedDict()

    def get(self, key):
        if key not in self.items:
            return None
        self.items.move_to_end(key)
        return self.items[key]
""",
    """async def fetch_all(session, urls):
    results = []
    for url in urls:
        async with session.get(url) as response:
            response.raise_for_status()
            results.append(await response.json())
    return results
""",
    """SELECT users.id, users.email, COUNT(orders.id) AS num_orders
FROM users
LEFT JOIN orders ON orders.user_id = users.id
WHERE users.created_at > '2024-01-01'
GROUP BY users.id, users.email
ORDER BY num_orders DESC;
""",
]
FREE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a new engineer why code review matters, in your own words.",
    "Describe a walk through a busy market in a city you imagine.",
    "What are the trade-offs between microservices and a monolith?",
]


def workload_messages(kind: str, index: int) -> list[dict]:
    if kind == "copy":
        snippet = SNIPPETS[index % len(SNIPPETS)]
        ask = "Repeat this code exactly" if index % 2 == 0 else "Rewrite this code with the same logic, keeping names"
        return [{"role": "user", "content": f"{ask}:\n\n{snippet}"}]
    return [{"role": "user", "content": FREE_PROMPTS[index % len(FREE_PROMPTS)]}]


async def run_config(address: str, kind: str, batch_size: int, num_new_tokens: int) -> dict:
    async with AsyncSwarmClient(address) as client:
        await client.complete("warm up", max_new_tokens=2, ignore_eos=True)
        t0 = time.monotonic()
        completions = await asyncio.gather(
            *(
                client.complete(
                    messages=workload_messages(kind, i), max_new_tokens=num_new_tokens, temperature=0.0, ignore_eos=True
                )
                for i in range(batch_size)
            )
        )
        wall = time.monotonic() - t0
    tokens = sum(len(c.token_ids) for c in completions)
    drafted = sum(c.usage.drafted_tokens for c in completions)
    accepted = sum(c.usage.accepted_tokens for c in completions)
    return {
        "workload": kind,
        "batch_size": batch_size,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "waste_per_token": (drafted - accepted) / tokens,
    }


async def _main(args: argparse.Namespace) -> list[dict]:
    results = []
    with open(args.log, "ab") as log_file:
        # One executor for every configuration; each (policy, B) gets a fresh scheduler, which
        # takes the executor over from the one before (an executor serves one scheduler).
        async with start_services(
            log_file, model=args.model, dtype=args.dtype, kv_cache_gb=args.kv_cache_gb
        ) as services:
            for policy in args.policies.split(","):
                for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
                    async with start_scheduler(
                        services.executor_address,
                        log_file,
                        "--spec",
                        policy,
                        "--take-over",
                        max_running_requests=batch_size,
                    ) as address:
                        for kind in args.workloads.split(","):
                            row = await run_config(address, kind, batch_size, args.num_new_tokens)
                            row["policy"] = policy
                            results.append(row)
                            print(
                                f"{policy:>8} B={batch_size:<2} {kind:>4}: {row['tokens_per_s']:6.1f} tok/s, "
                                f"acceptance {row['acceptance']:.0%}, waste {row['waste_per_token']:.2f}/token",
                                flush=True,
                            )
    return results


def summarize(results: list[dict]) -> dict:
    """Per workload and B: the best policy, goodput's ratio to it and to off."""
    summary: dict = {}
    for kind in sorted({r["workload"] for r in results}):
        rows = [r for r in results if r["workload"] == kind]
        for b in sorted({r["batch_size"] for r in rows}):
            at_b = {r["policy"]: r["tokens_per_s"] for r in rows if r["batch_size"] == b}
            best = max(at_b, key=at_b.get)
            entry = {"best_policy": best, "tokens_per_s": at_b}
            if "goodput" in at_b:
                entry["goodput_vs_best"] = at_b["goodput"] / at_b[best]
                if "off" in at_b:
                    entry["goodput_vs_off"] = at_b["goodput"] / at_b["off"]
            summary.setdefault(kind, {})[b] = entry
    return summary


def print_report(results: list[dict], summary: dict) -> None:
    policies = list(dict.fromkeys(r["policy"] for r in results))
    for kind, by_b in summary.items():
        print(f"\n{kind}: accepted tokens/s")
        print(f"{'B':>3} | " + " | ".join(f"{p:>8}" for p in policies) + " | goodput/best | goodput/off")
        for b, entry in by_b.items():
            cells = " | ".join(f"{entry['tokens_per_s'].get(p, float('nan')):8.1f}" for p in policies)
            print(
                f"{b:>3} | {cells} | {entry.get('goodput_vs_best', float('nan')):12.2f} | {entry.get('goodput_vs_off', float('nan')):11.2f}"
            )
        print(f"{kind}: acceptance and waste (drafted-but-rejected tokens per useful token), averaged over B")
        for p in policies:
            rows = [r for r in results if r["workload"] == kind and r["policy"] == p]
            drafted = sum(r["drafted"] for r in rows)
            accepted = sum(r["accepted"] for r in rows)
            tokens = sum(r["tokens"] for r in rows)
            rate = accepted / drafted if drafted else 0.0
            print(f"  {p:>8}: acceptance {rate:5.0%}, waste {(drafted - accepted) / tokens:.2f}")
        ok = all(
            entry.get("goodput_vs_best", 0) >= 1 - NOISE and entry.get("goodput_vs_off", 0) >= 1 - NOISE
            for entry in by_b.values()
        )
        print(
            f"{kind}: goodput within {NOISE:.0%} of the best policy and not below off at every B: {'yes' if ok else 'NO'}"
        )


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for policy in dict.fromkeys(r["policy"] for r in results):
            rows = sorted(
                (r for r in results if r["workload"] == kind and r["policy"] == policy), key=lambda r: r["batch_size"]
            )
            ax.plot([r["batch_size"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("live batch size B")
        ax.set_ylabel("accepted tokens/s")
        ax.set_title(f"{kind} workload")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--workloads", default="copy,free")
    parser.add_argument("--num-new-tokens", type=int, default=48)
    parser.add_argument("--out", default="bench_results/spec", help="prefix of the .json and .png written")
    parser.add_argument("--log", default="bench_spec.log", help="where the services' logs go")


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(_main(args))
    summary = summarize(results)
    print_report(results, summary)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"results": results, "summary": summary}, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0
