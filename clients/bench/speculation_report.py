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
BUSY_CORES = 0.25  # other processes' CPU above which a run is flagged as shared
SWARMSERVE = "swarmserve"
LLAMA_CPP = "llama.cpp"
# Issue #28's target: trees at least 2x llama.cpp's plain decode at one agent on the branchy workload.
TARGET_WORKLOAD, TARGET_BATCH_SIZE, TARGET_RATIO = "branchy", 1, 2.0


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
    prompt_tokens: tuple[int | None, ...] = ()  # per request, as the engine counted them (first repeat)
    num_prompt_tokens: int = 0  # over the repeats
    num_cached_tokens: int = 0  # of them, served from a prefix (prompt) cache
    other_cores: tuple[float, ...] = ()  # per repeat: processes outside the benchmark (cpu_share.py)
    idle_engine_cpu_s: tuple[float, ...] = ()  # per repeat: the engines not measured

    @property
    def cached_fraction(self) -> float | None:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else None

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
            "prompt_tokens": list(self.prompt_tokens),
            "cached_fraction": self.cached_fraction,
            "other_cores": list(self.other_cores),
            "idle_engine_cpu_s": list(self.idle_engine_cpu_s),
        }


def _total(values) -> int:
    return sum(v for v in values or () if v is not None)


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
                prompt_tokens=tuple(group[0].get("prompt_tokens", ())),
                num_prompt_tokens=sum(_total(run.get("prompt_tokens")) for run in group),
                num_cached_tokens=sum(_total(run.get("cached_tokens")) for run in group),
                other_cores=tuple(run.get("other_cores", 0.0) for run in group),
                idle_engine_cpu_s=tuple(run.get("idle_engine_cpu_s", 0.0) for run in group),
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


def vs_llama_cpp(config: ConfigResult, configs: Sequence[ConfigResult]) -> Spread | None:
    """Our configuration's tokens/s over llama.cpp's on the same workload and B, repeat r over
    repeat r; None without a llama.cpp run there (or for llama.cpp itself)."""
    if config.engine == LLAMA_CPP:
        return None
    for llama in configs:
        if llama.engine == LLAMA_CPP and (llama.workload, llama.batch_size) == (config.workload, config.batch_size):
            return paired_ratio(config.tokens_per_s, llama.tokens_per_s)
    return None


def target_lines(configs: Sequence[ConfigResult]) -> list[str]:
    """Issue #28's target for each tree configuration at its workload and B, where llama.cpp ran."""
    lines = []
    for c in configs:
        if c.engine != SWARMSERVE or c.shape != "tree":
            continue
        if (c.workload, c.batch_size) != (TARGET_WORKLOAD, TARGET_BATCH_SIZE):
            continue
        ratio = vs_llama_cpp(c, configs)
        if ratio is None:
            continue
        if ratio.low >= TARGET_RATIO:
            verdict = "met in every repeat"
        elif ratio.median >= TARGET_RATIO:
            verdict = "met at the median, not in every repeat"
        else:
            verdict = "NOT met"
        lines.append(
            f"issue #28's target, trees >= {TARGET_RATIO:g}x llama.cpp's plain decode at B={TARGET_BATCH_SIZE} on "
            f"{TARGET_WORKLOAD}: {c.policy} {ratio.text(2, 'x')}: {verdict}"
        )
    return ["", *lines] if lines else []


def _counts_text(counts: Sequence[int | None]) -> str:
    present = [n for n in counts if n is not None]
    if not present:
        return "not reported"
    return f"{sum(present) / len(present):.1f} a request ({min(present)}–{max(present)})"


def prompt_lines(configs: Sequence[ConfigResult]) -> list[str]:
    """Per workload, at its largest B: the prompts' lengths as each engine counted them (each
    rendered the GGUF's chat template itself), and how much of them came from a prompt cache."""
    llama = {(c.workload, c.batch_size): c for c in configs if c.engine == LLAMA_CPP}
    if not llama:
        return []
    lines = ["", "prompt tokens as each engine counted them (its own chat template rendering), largest B:"]
    for kind in dict.fromkeys(c.workload for c in configs):
        b = max(c.batch_size for c in configs if c.workload == kind)
        ours = next((c for c in configs if c.engine == SWARMSERVE and (c.workload, c.batch_size) == (kind, b)), None)
        theirs = llama.get((kind, b))
        if ours is None or theirs is None:
            continue
        differences = [
            abs(a - t) for a, t in zip(ours.prompt_tokens, theirs.prompt_tokens) if a is not None and t is not None
        ]
        cached = " / ".join("–" if c.cached_fraction is None else f"{c.cached_fraction:.0%}" for c in (ours, theirs))
        lines.append(
            f"  {kind:>7} B={b:<2}: swarmserve {_counts_text(ours.prompt_tokens)}, llama.cpp "
            f"{_counts_text(theirs.prompt_tokens)}; largest difference for one request "
            f"{max(differences) if differences else '–'}; cached (swarmserve / llama.cpp) {cached}"
        )
    return lines


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
    has_llama = any(c.engine == LLAMA_CPP for c in configs)
    header = (
        f"{'workload':>8} {'B':>3} {'config':>14} | {'tok/s median (min–max)':>24} | "
        f"{'accepted/step':>13} | {'acceptance':>10} | {'waste':>5} | {'preempted':>9} | {'others':>6}"
    )
    if has_llama:
        header += f" | {'over llama.cpp':>20}"
    repeats = f"{num_repeats} repeat{'s' if num_repeats != 1 else ''}"
    lines = [
        f"tokens/s over {repeats} (each: all B requests sent at once, until the last one's last token)",
        header,
        "-" * len(header),
    ]
    for c in sorted(configs, key=lambda c: (c.workload, c.batch_size)):
        if c.engine == LLAMA_CPP:
            cells = f"{'–':>13} | {'–':>10} | {'–':>5} | {'–':>9}"
        else:
            cells = (
                f"{Spread.of(c.accepted_per_step).median:>13.2f} | {c.acceptance:>10.0%} | "
                f"{c.waste_per_token:>5.2f} | {c.num_preemptions:>9}"
            )
        others = max(c.other_cores, default=0.0)
        line = f"{c.workload:>8} {c.batch_size:>3} {c.policy:>14} | {c.speed.text():>24} | {cells} | {others:>6.2f}"
        if has_llama:
            line += f" | {_ratio_text(vs_llama_cpp(c, configs)):>20}"
        lines.append(line)
    lines.append("others: the most cores processes outside this benchmark used during one of its repeats")
    if has_llama:
        lines.append("over llama.cpp: the median of the per-repeat ratios (min–max), llama.cpp's plain decode = 1")
    return lines


def sharing_lines(configs: Sequence[ConfigResult]) -> list[str]:
    """Warnings: runs that shared the machine with other processes, or during which an engine
    that was not measured used the CPU."""
    lines = []
    shared = [(c, x) for c in configs for x in c.other_cores if x > BUSY_CORES]
    if shared:
        worst, cores = max(shared, key=lambda item: item[1])
        lines.append(
            f"WARNING: in {len(shared)} of {sum(len(c.other_cores) for c in configs)} runs, processes outside this "
            f"benchmark used more than {BUSY_CORES:g} cores (up to {cores:.2f}, {worst.policy} B={worst.batch_size} "
            f"{worst.workload}): those runs lost cores to them, llama.cpp's most (its threads wait for each other "
            "after every op). Compare within a repeat, or rerun on a quiet machine."
        )
    idle = max((x for c in configs for x in c.idle_engine_cpu_s), default=0.0)
    if idle > 0.1:
        lines.append(f"WARNING: an engine that was not being measured used {idle:.2f} CPU-s during a run")
    return ["", *lines] if lines else []


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


def machine_lines(machine: dict) -> list[str]:
    start, end = ("/".join(f"{x:.1f}" for x in machine[key]) for key in ("load_avg_start", "load_avg_end"))
    cpu = f"cpu: {machine['cpu']}, {machine['cpu_count']} cores"
    return [
        f"model {Path(machine['model']).name}, greedy, EOS ignored, {machine['threads']} threads per engine",
        f"{cpu}; load average (1/5/15 min) {start} at the start, {end} at the end",
        f"llama.cpp: {machine['llama_server_version'] or 'not run (no --llama-server)'}",
        "",
    ]


def format_report(configs: Sequence[ConfigResult], num_repeats: int, machine: dict | None = None) -> str:
    comparisons = tree_vs_chain(configs)
    lines = [
        *(machine_lines(machine) if machine else []),
        *config_table(configs, num_repeats),
        *sharing_lines(configs),
        *tree_vs_chain_lines(comparisons),
        *target_lines(configs),
        *prompt_lines(configs),
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
        for policy in dict.fromkeys(c.policy for c in configs):  # llama.cpp's plain decode too
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
