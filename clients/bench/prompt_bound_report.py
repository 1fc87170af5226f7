"""The report of `bench vs`'s prompt-bound rows: a table per workload, a line per engine and
one per peer with swarmserve's advantage, and notes where a row did not compare like for like."""

from __future__ import annotations

from collections.abc import Sequence

from clients.bench.prompt_bound import ENGINE_LABELS, PEERS, PREFILL_METRICS, SWARM_METRICS, SWARMSERVE

MISSING = "–"


def metric_text(summary: dict | None, key: str) -> str:
    if summary is None or summary.get(key) is None:
        return MISSING
    value = summary[key]
    if key.endswith("_per_s"):
        return f"{value:.1f}"
    return f"{value * 1000:.0f} ms" if key.startswith("tpot") else f"{value:.2f} s"


def _times(value: float | None) -> str:
    return MISSING if value is None else f"{value:.2f}x"


def format_rows(rows: Sequence[dict], metrics, title: str, label) -> list[str]:
    """One table: a line per (row, engine) with the metrics, then swarmserve's advantage per peer."""
    if not rows:
        return []
    engines = [e for e in (*PEERS, SWARMSERVE) if any(e in row["engines"] for row in rows)]
    head = f"{'run':<22} | {'engine':<12} | " + " | ".join(f"{name:>10}" for _, name, _ in metrics) + " | load 1m"
    lines = [title, head, "-" * len(head)]
    for row in rows:
        for engine in engines:
            summary = row["engines"].get(engine)
            cells = " | ".join(f"{metric_text(summary, key):>10}" for key, _, _ in metrics)
            load = MISSING if summary is None else f"{summary['load_avg_1m']:.1f}"
            lines.append(f"{label(row):<22} | {ENGINE_LABELS[engine]:<12} | {cells} | {load:>7}")
        for peer, ratios in row.get("advantage", {}).items():
            cells = " | ".join(f"{_times(ratios[key]):>10}" for key, _, _ in metrics)
            lines.append(f"{'':<22} | {'vs ' + ENGINE_LABELS[peer]:<12} | {cells} |")
    lines.append("  vs X: swarmserve's advantage over X (> 1: swarmserve better; tok/s ours/theirs, times theirs/ours)")
    return lines


def prefill_label(row: dict) -> str:
    return f"N={row['streams']} {row['prompt_tokens']}+{row['max_tokens']}"


def swarm_label(row: dict) -> str:
    return f"{row['num_agents']} agents x {row['num_turns']} turns"


def ttft_by_turn_lines(row: dict) -> list[str]:
    """A swarm row's median TTFT per turn, per engine: turn 1 is the agents queueing behind one
    another's prompts, later turns one prompt at long context; the overall p50 mixes the two."""
    lines = []
    for engine in (*PEERS, SWARMSERVE):
        by_turn = (row["engines"].get(engine) or {}).get("ttft_p50_s_by_turn")
        if by_turn:
            cells = " / ".join(MISSING if t is None else f"{t:.2f}" for t in by_turn)
            lines.append(f"  TTFT p50 by turn, {ENGINE_LABELS[engine]}: {cells} s")
    return lines


def workload_checks(rows: Sequence[dict]) -> list[str]:
    """Where an engine counted a different prompt than the ids sent, or generated fewer tokens
    than asked: the comparison is then not like for like."""
    lines = []
    for row in rows:
        if row["kind"] != "prefill":
            continue
        for engine, summary in row["engines"].items():
            if summary is None:
                continue
            counted = summary["prompt_tokens"]
            if counted and counted != [row["prompt_tokens"]]:
                lines.append(
                    f"  NOTE: {ENGINE_LABELS[engine]} counted {counted} prompt tokens in {prefill_label(row)} "
                    f"(sent {row['prompt_tokens']} ids)"
                )
            expected = summary.get("waves", 1) * row["streams"] * row["max_tokens"]
            if summary["output_tokens"] != expected:
                lines.append(
                    f"  NOTE: {ENGINE_LABELS[engine]} generated {summary['output_tokens']} tokens in "
                    f"{prefill_label(row)}, not {expected}"
                )
    return lines


def format_prompt_bound(rows: Sequence[dict]) -> list[str]:
    """The prefill table, a table per swarm row, the failures and the workloads' fingerprints."""
    prefill = [row for row in rows if row["kind"] == "prefill"]
    swarm = [row for row in rows if row["kind"] == "swarm"]
    lines = []
    if prefill:
        lines += [
            "",
            *format_rows(
                prefill,
                PREFILL_METRICS,
                f"prefill: N requests at once, {prefill[0].get('waves', 1)} wave(s) of them, the engines taking turns; "
                "random token ids in, greedy tokens out (/v1/completions, streamed); out tok/s: the median wave's",
                prefill_label,
            ),
            *workload_checks(prefill),
        ]
    for row in swarm:
        tokens = row["workload_tokens"]
        lines += [
            "",
            *format_rows(
                [row],
                SWARM_METRICS,
                f"swarm: {row['num_agents']} agents x {row['num_turns']} turns, shared system prompt "
                f"{tokens['system_prompt']} tokens, {tokens['user_turn_mean']:.0f} tokens of a source file a turn, "
                f"{tokens['output']} tokens out in all (/v1/chat/completions, streamed)",
                swarm_label,
            ),
        ]
        lines += ttft_by_turn_lines(row)
        for engine, summary in row["engines"].items():
            if summary and summary.get("prompt_tokens") is not None:
                cached = summary.get("cached_tokens")
                lines.append(
                    f"  {ENGINE_LABELS[engine]}: {summary['prompt_tokens']} prompt tokens over the turns"
                    + (f", {cached} of them cached" if cached is not None else "")
                    + f", {summary['output_tokens']} out ({summary['output_tokens_per_s']:.1f} tok/s over the makespan)"
                )
    for row in prefill + swarm:
        for engine, error in row.get("errors", {}).items():
            lines.append(f"  {ENGINE_LABELS[engine]} failed in {row['kind']}: {error}")
    if prefill or swarm:
        fingerprints = ", ".join(
            f"{row['kind']} {prefill_label(row) if row['kind'] == 'prefill' else swarm_label(row)} {row['fingerprint']}"
            for row in prefill + swarm
        )
        lines.append(f"  workloads (same fingerprint, same requests): {fingerprints}")
    return lines
