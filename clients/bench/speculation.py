"""`swarmserve bench spec`: draft policies × draft shapes × live batch size × workload, in one run.

One executor per draft shape (`--draft-shape chain|tree`) serves every configuration of
it; each (policy, B) gets a fresh scheduler (`--spec POLICY`, batch capped at B), and each
workload runs B greedy requests at once with the batch capped at B, so the live batch is B
throughout (EOS ignored, equal lengths).

- copy: agent turns that repeat or lightly edit code from their context, where a
  suffix-match drafter finds long runs;
- branchy: the same context followed by different continuations (several near-identical
  functions, and the agent writes more of them), where a chain bets on one branch and a
  tree on several;
- free: free-form text, where drafts are mostly rejected;
- spread: the seeds' eight agents' output lengths (40, 90, 150, 220, 300, 480, 650 and 900
  tokens), scaled so that the longest is `--num-new-tokens`: request i gets
  round(SPREAD[i % 8] * num_new_tokens / 900) tokens, at least 1, and asks the copy,
  branchy and free prompts in turn (request i: the (i % 3)-th of them, its i-th variant).
  All B start together and tokens/s is over the makespan (the last one's end), as the
  batch drains; at B < 8 it is the B shortest lengths.

With several shapes, the tree rows are labelled `POLICY+tree`, and the report gives tree
over chain for tokens/s and for accepted tokens per decode step (accepted / (tokens -
accepted): every decode step emits its accepted drafts plus one token), from the same run.

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
from clients.bench.workloads import SEED_OUTPUT_LENGTHS
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
# Near-identical functions: after each shared prefix the file continues in several ways.
BRANCHY_FILES = [
    "".join(f"def scale_{i}(x):\n    return x * {i} + {i % 3}\n\n" for i in range(1, 9)),
    "".join(
        f"def check_{name}(value):\n    if value is None:\n        raise ValueError('{name} is missing')\n"
        f"    return {kind}(value)\n\n"
        for name, kind in [("port", "int"), ("host", "str"), ("ratio", "float"), ("name", "str"), ("retries", "int")]
    ),
    "".join(
        f"    def get_{field}(self):\n        return self._data.get('{field}', {default})\n\n"
        for field, default in [("id", 0), ("name", "''"), ("tags", "[]"), ("owner", "None"), ("size", 0)]
    ),
]
SPREAD_CONTENT = ("copy", "branchy", "free")  # spread's request i asks the (i % 3)-th
WORKLOADS = ("copy", "branchy", "free", "spread")

FREE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a new engineer why code review matters, in your own words.",
    "Describe a walk through a busy market in a city you imagine.",
    "What are the trade-offs between microservices and a monolith?",
]


def workload_messages(kind: str, index: int) -> list[dict]:
    if kind == "spread":
        return workload_messages(SPREAD_CONTENT[index % len(SPREAD_CONTENT)], index)
    if kind == "branchy":
        file = BRANCHY_FILES[index % len(BRANCHY_FILES)]
        ask = "Write this file out again, then add three more functions in the same style"
        return [{"role": "user", "content": f"{ask}:\n\n{file}"}]
    if kind == "copy":
        snippet = SNIPPETS[index % len(SNIPPETS)]
        ask = "Repeat this code exactly" if index % 2 == 0 else "Rewrite this code with the same logic, keeping names"
        return [{"role": "user", "content": f"{ask}:\n\n{snippet}"}]
    return [{"role": "user", "content": FREE_PROMPTS[index % len(FREE_PROMPTS)]}]


def max_new_tokens(kind: str, index: int, num_new_tokens: int) -> int:
    """Request `index`'s output length: `num_new_tokens`, or in spread the seeds' length
    SPREAD[index % 8] scaled so that their longest (900) is `num_new_tokens`."""
    if kind != "spread":
        return num_new_tokens
    length = SEED_OUTPUT_LENGTHS[index % len(SEED_OUTPUT_LENGTHS)]
    return max(1, round(length * num_new_tokens / max(SEED_OUTPUT_LENGTHS)))


async def run_config(address: str, kind: str, batch_size: int, num_new_tokens: int) -> dict:
    async with AsyncSwarmClient(address) as client:
        await client.complete("warm up", max_new_tokens=2, ignore_eos=True)
        t0 = time.monotonic()
        completions = await asyncio.gather(
            *(
                client.complete(
                    messages=workload_messages(kind, i),
                    max_new_tokens=max_new_tokens(kind, i, num_new_tokens),
                    temperature=0.0,
                    ignore_eos=True,
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
        "accepted_per_step": accepted / (tokens - accepted),
    }


async def _main(args: argparse.Namespace) -> list[dict]:
    results = []
    with open(args.log, "ab") as log_file:
        for shape in args.shapes.split(","):
            # One executor per shape for every configuration; each (policy, B) gets a fresh scheduler,
            # which takes the executor over from the one before (an executor serves one scheduler).
            async with start_services(
                log_file,
                model=args.model,
                dtype=args.dtype,
                kv_cache_gb=args.kv_cache_gb,
                executor_args=("--draft-shape", shape),
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
                            for kind in args.workloads:
                                row = await run_config(address, kind, batch_size, args.num_new_tokens)
                                row["policy"] = policy if shape == "chain" else f"{policy}+{shape}"
                                row["shape"] = shape
                                results.append(row)
                                print(
                                    f"{row['policy']:>13} B={batch_size:<2} {kind:>7}: "
                                    f"{row['tokens_per_s']:6.1f} tok/s, acceptance {row['acceptance']:.0%}, "
                                    f"{row['accepted_per_step']:.2f} accepted/step, "
                                    f"waste {row['waste_per_token']:.2f}/token",
                                    flush=True,
                                )
    return results


def tree_vs_chain(results: list[dict]) -> list[dict]:
    """Per workload, B and policy with both shapes: tree over chain, tokens/s and accepted per step."""
    chains = {(r["workload"], r["batch_size"], r["policy"]): r for r in results if r.get("shape", "chain") == "chain"}
    ratios = []
    for r in results:
        if r.get("shape", "chain") == "chain":
            continue
        policy = r["policy"].split("+")[0]
        chain = chains.get((r["workload"], r["batch_size"], policy))
        if chain is None or policy == "off":
            continue
        ratios.append(
            {
                "workload": r["workload"],
                "batch_size": r["batch_size"],
                "policy": policy,
                "tokens_per_s": (chain["tokens_per_s"], r["tokens_per_s"]),
                "accepted_per_step": (chain["accepted_per_step"], r["accepted_per_step"]),
                "tokens_per_s_ratio": r["tokens_per_s"] / chain["tokens_per_s"],
                "accepted_per_step_ratio": (
                    r["accepted_per_step"] / chain["accepted_per_step"] if chain["accepted_per_step"] else float("inf")
                ),
            }
        )
    return ratios


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
    ratios = tree_vs_chain(results)
    if ratios:
        print("\ntree vs chain (same run): tokens/s and accepted tokens per decode step")
        for q in ratios:
            print(
                f"  {q['workload']:>7} B={q['batch_size']:<2} {q['policy']:>8}: "
                f"{q['tokens_per_s'][1]:6.1f} vs {q['tokens_per_s'][0]:6.1f} tok/s ({q['tokens_per_s_ratio']:.2f}x), "
                f"{q['accepted_per_step'][1]:.2f} vs {q['accepted_per_step'][0]:.2f} accepted/step "
                f"({q['accepted_per_step_ratio']:.2f}x)"
            )
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


def workload_names(text: str) -> tuple[str, ...]:
    """`branchy,spread` -> ("branchy", "spread"); an argparse type."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in WORKLOADS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(WORKLOADS)}, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--shapes", default="chain", help="draft shapes, one executor each: chain,tree")
    parser.add_argument("--workloads", type=workload_names, default=("copy", "free"), help=f"of {','.join(WORKLOADS)}")
    parser.add_argument(
        "--num-new-tokens", type=int, default=48, help="tokens per request (spread: its longest request's)"
    )
    parser.add_argument("--out", default="bench_results/spec", help="prefix of the .json and .png written")
    parser.add_argument("--log", default="bench_spec.log", help="where the services' logs go")


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(_main(args))
    summary = summarize(results)
    print_report(results, summary)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"results": results, "summary": summary, "tree_vs_chain": tree_vs_chain(results)}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0
