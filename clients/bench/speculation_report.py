"""`swarmserve bench spec`'s report: every run folded into one result per configuration
(engine, policy and shape, workload, B) over its repeats, tree over chain, the summary per
workload, the printed tables and the plot.

A configuration's tokens/s is the median of its repeats with their min–max; tree over chain
pairs repeat r of each (they ran back to back), and "trees below chains by more than noise"
is repeats.py's rule: the tree's best repeat below the chain's worst.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from clients.bench.repeats import Spread, is_below_beyond_noise, paired_ratio, verdict_text

NOISE = 0.10  # "within noise" of the best policy: within 10% of its median
SWARMSERVE = "swarmserve"


@dataclass(frozen=True)
class ConfigResult:
    """One configuration's runs, in repeat order."""

    engine: str
    policy: str  # the policy's label: `goodput`, `goodput+tree`
    shape: str
    workload: str
    batch_size: int
    tokens_per_s: tuple[float, ...]  # per repeat
    accepted_per_step: tuple[float, ...]
    drafted: int  # over the repeats
    accepted: int
    tokens: int
    num_preemptions: int

    @property
    def speed(self) -> Spread:
        return Spread.of(self.tokens_per_s)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def waste_per_token(self) -> float:
        """Drafted tokens rejected, per useful token."""
        return (self.drafted - self.accepted) / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict:
        return {
            "engine": self.engine,
            "policy": self.policy,
            "shape": self.shape,
            "workload": self.workload,
            "batch_size": self.batch_size,
            "tokens_per_s": self.speed.to_json(),
            "tokens_per_s_by_repeat": list(self.tokens_per_s),
            "accepted_per_step": Spread.of(self.accepted_per_step).to_json(),
            "acceptance": self.acceptance,
            "waste_per_token": self.waste_per_token,
            "num_preemptions": self.num_preemptions,
        }


def config_results(runs: Sequence[dict]) -> list[ConfigResult]:
    """The runs grouped by configuration (in the order each first ran), each in repeat order."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        key = (run.get("engine", SWARMSERVE), run["policy"], run["workload"], run["batch_size"])
        groups.setdefault(key, []).append(run)
    results = []
    for (engine, policy, workload, batch_size), group in groups.items():
        group = sorted(group, key=lambda run: run.get("repeat", 0))
        results.append(
            ConfigResult(
                engine=engine,
                policy=policy,
                shape=group[0].get("shape", "chain"),
                workload=workload,
                batch_size=batch_size,
                tokens_per_s=tuple(run["tokens_per_s"] for run in group),
                accepted_per_step=tuple(run.get("accepted_per_step", 0.0) for run in group),
                drafted=sum(run.get("drafted", 0) for run in group),
                accepted=sum(run.get("accepted", 0) for run in group),
                tokens=sum(run.get("tokens", 0) for run in group),
                num_preemptions=sum(run.get("num_preemptions", 0) for run in group),
            )
        )
    return results


@dataclass(frozen=True)
class TreeVsChain:
    workload: str
    batch_size: int
    policy: str
    tree: ConfigResult
    chain: ConfigResult
    tokens_per_s_ratio: Spread | None  # per-repeat tree / chain
    accepted_per_step_ratio: Spread | None  # None where the chain accepted nothing

    @property
    def is_tree_below(self) -> bool | None:
        """Trees below chains by more than noise (repeats.py's rule); None with one repeat."""
        return is_below_beyond_noise(self.tree.tokens_per_s, self.chain.tokens_per_s)

    def to_json(self) -> dict:
        return {
            "workload": self.workload,
            "batch_size": self.batch_size,
            "policy": self.policy,
            "tokens_per_s": {"chain": self.chain.speed.to_json(), "tree": self.tree.speed.to_json()},
            "tokens_per_s_ratio": self.tokens_per_s_ratio.to_json() if self.tokens_per_s_ratio else None,
            "accepted_per_step_ratio": (
                self.accepted_per_step_ratio.to_json() if self.accepted_per_step_ratio else None
            ),
            "is_tree_below_chain_beyond_noise": self.is_tree_below,
        }


def tree_vs_chain(configs: Sequence[ConfigResult]) -> list[TreeVsChain]:
    """Per workload, B and policy with both shapes (and drafts: not off): tree over chain."""
    chains = {(c.workload, c.batch_size, c.policy): c for c in configs if c.engine == SWARMSERVE and c.shape == "chain"}
    comparisons = []
    for tree in configs:
        if tree.engine != SWARMSERVE or tree.shape == "chain":
            continue
        policy = tree.policy.split("+")[0]
        chain = chains.get((tree.workload, tree.batch_size, policy))
        if chain is None or policy == "off":
            continue
        comparisons.append(
            TreeVsChain(
                workload=tree.workload,
                batch_size=tree.batch_size,
                policy=policy,
                tree=tree,
                chain=chain,
                tokens_per_s_ratio=paired_ratio(tree.tokens_per_s, chain.tokens_per_s),
                accepted_per_step_ratio=paired_ratio(tree.accepted_per_step, chain.accepted_per_step),
            )
        )
    return comparisons


def summarize(configs: Sequence[ConfigResult]) -> dict:
    """Per workload and B, over our policies' medians: the best, goodput's ratio to it and to off."""
    ours = [c for c in configs if c.engine == SWARMSERVE]
    summary: dict = {}
    for kind in dict.fromkeys(c.workload for c in ours):
        rows = [c for c in ours if c.workload == kind]
        for b in sorted({c.batch_size for c in rows}):
            at_b = {c.policy: c.speed.median for c in rows if c.batch_size == b}
            best = max(at_b, key=at_b.get)
            entry = {"best_policy": best, "tokens_per_s": at_b}
            if "goodput" in at_b:
                entry["goodput_vs_best"] = at_b["goodput"] / at_b[best]
                if "off" in at_b:
                    entry["goodput_vs_off"] = at_b["goodput"] / at_b["off"]
            summary.setdefault(kind, {})[b] = entry
    return summary


def _ratio_text(ratio: Spread | None) -> str:
    return "–" if ratio is None else ratio.text(2, "x")


def config_table(configs: Sequence[ConfigResult], num_repeats: int) -> list[str]:
    header = (
        f"{'workload':>8} {'B':>3} {'config':>14} | {'tok/s median (min–max)':>24} | "
        f"{'accepted/step':>13} | {'acceptance':>10} | {'waste':>5} | {'preempted':>9}"
    )
    repeats = f"{num_repeats} repeat{'s' if num_repeats != 1 else ''}"
    lines = [
        f"tokens/s over {repeats} (each: all B requests sent at once, until the last one's last token)",
        header,
        "-" * len(header),
    ]
    for c in sorted(configs, key=lambda c: (c.workload, c.batch_size)):
        lines.append(
            f"{c.workload:>8} {c.batch_size:>3} {c.policy:>14} | {c.speed.text():>24} | "
            f"{Spread.of(c.accepted_per_step).median:>13.2f} | {c.acceptance:>10.0%} | "
            f"{c.waste_per_token:>5.2f} | {c.num_preemptions:>9}"
        )
    return lines


def tree_vs_chain_lines(comparisons: Sequence[TreeVsChain]) -> list[str]:
    if not comparisons:
        return []
    lines = [
        "",
        "tree vs chain (repeat r of each back to back): median of the per-repeat ratios (min–max);",
        "'trees below chains by more than noise': the tree's best repeat below the chain's worst",
    ]
    for q in comparisons:
        lines.append(
            f"  {q.workload:>7} B={q.batch_size:<2} {q.policy:>8}: {q.tree.speed.median:6.1f} vs "
            f"{q.chain.speed.median:6.1f} tok/s, tree/chain {_ratio_text(q.tokens_per_s_ratio)}, "
            f"accepted/step {_ratio_text(q.accepted_per_step_ratio)}; "
            f"trees below chains by more than noise: {verdict_text(q.is_tree_below)}"
        )
    return lines


def summary_lines(configs: Sequence[ConfigResult], summary: dict) -> list[str]:
    ours = [c for c in configs if c.engine == SWARMSERVE]
    policies = list(dict.fromkeys(c.policy for c in ours))
    widths = [max(8, len(p)) for p in policies]
    lines = []
    for kind, by_b in summary.items():
        lines += ["", f"{kind}: accepted tokens/s (medians)"]
        lines.append(
            f"{'B':>3} | " + " | ".join(f"{p:>{w}}" for p, w in zip(policies, widths)) + " | goodput/best | goodput/off"
        )
        for b, entry in by_b.items():
            cells = " | ".join(f"{entry['tokens_per_s'].get(p, float('nan')):{w}.1f}" for p, w in zip(policies, widths))
            lines.append(
                f"{b:>3} | {cells} | {entry.get('goodput_vs_best', float('nan')):12.2f} | "
                f"{entry.get('goodput_vs_off', float('nan')):11.2f}"
            )
        if "goodput" in policies:
            has_off = "off" in policies
            ok = all(
                entry.get("goodput_vs_best", 0) >= 1 - NOISE
                and (not has_off or entry.get("goodput_vs_off", 0) >= 1 - NOISE)
                for entry in by_b.values()
            )
            claim = f"goodput within {NOISE:.0%} of the best policy" + (" and not below off" if has_off else "")
            lines.append(f"{kind}: {claim} at every B: {'yes' if ok else 'NO'}")
    return lines


def format_report(configs: Sequence[ConfigResult], num_repeats: int) -> str:
    comparisons = tree_vs_chain(configs)
    lines = [
        *config_table(configs, num_repeats),
        *tree_vs_chain_lines(comparisons),
        *summary_lines(configs, summarize(configs)),
    ]
    return "\n".join(lines)


def plot(configs: Sequence[ConfigResult], path: Path) -> None:
    """Median tokens/s against B per workload, the min–max of the repeats as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(c.workload for c in configs))
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for policy in dict.fromkeys(c.policy for c in configs):
            rows = sorted((c for c in configs if c.workload == kind and c.policy == policy), key=lambda c: c.batch_size)
            if not rows:
                continue
            medians = [c.speed.median for c in rows]
            errors = [
                [m - c.speed.low for m, c in zip(medians, rows)],
                [c.speed.high - m for m, c in zip(medians, rows)],
            ]
            ax.errorbar([c.batch_size for c in rows], medians, yerr=errors, marker="o", capsize=3, label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("live batch size B")
        ax.set_ylabel("accepted tokens/s")
        ax.set_title(f"{kind} workload")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
