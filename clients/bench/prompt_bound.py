"""The prompt-bound rows of `swarmserve bench vs` (issue 23): measure one engine's OpenAI HTTP
server on the prefill and swarm workloads (clients/bench/workloads.py), summarize, compare.

- **prefill**: N requests sent at once, each `num_tokens` random token ids (the same ids to
  every engine) and `max_tokens` greedy tokens out. Output tok/s = output tokens / the wall
  time from the first request sent to the last token received; TTFT and TPOT (time per
  output token after the first) are per request, reported as medians.
- **swarm**: every agent's script run at once, turn after turn, over /v1/chat/completions
  with an `x-session-id` header per agent (swarmserve keeps the agent's KV over its tool
  pause; llama.cpp and vLLM ignore the header). Makespan = the last answer's end; TTFT
  p50/p90 over all turns.

Percentiles interpolate linearly between ranks (numpy's default, and `vllm bench serve`'s),
so a median of an even count is the mean of the middle two.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from clients.bench.openai_stream import StreamedRequest, chat_body, completion_body, stream_request
from clients.bench.workloads import AgentScript

SWARMSERVE = "swarmserve"
PEERS = ("llama.cpp", "vllm")  # in the order they run, before swarmserve
ENGINE_LABELS = {SWARMSERVE: "swarmserve", "llama.cpp": "llama.cpp", "vllm": "vLLM-CPU"}
MISSING = "–"
WARM_UP_TOKENS = 8


@dataclass(frozen=True)
class Endpoint:
    """An engine's OpenAI-compatible server and the model name it answers to."""

    engine: str
    base_url: str
    model: str

    @property
    def completions_url(self) -> str:
        return f"{self.base_url.rstrip('/')}/v1/completions"

    @property
    def chat_url(self) -> str:
        return f"{self.base_url.rstrip('/')}/v1/chat/completions"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0…100) with linear interpolation between ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _present(values) -> list[float]:
    return [v for v in values if v is not None]


# -- prefill ------------------------------------------------------------------------------


def prefill_summary(requests: Sequence[StreamedRequest], t0: float) -> dict:
    """Output tok/s over the whole wave, TTFT and TPOT medians (and TTFT p90), per-request rows."""
    duration = max(r.end_s for r in requests) - t0
    output = sum(r.output_tokens for r in requests)
    ttfts = _present(r.ttft_s for r in requests)
    tpots = _present(r.tpot_s for r in requests)
    return {
        "num_requests": len(requests),
        "output_tokens": output,
        "duration_s": duration,
        "output_tokens_per_s": output / duration if duration > 0 else 0.0,
        "ttft_median_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "tpot_median_s": percentile(tpots, 50),
        "prompt_tokens": sorted({r.prompt_tokens for r in requests if r.prompt_tokens is not None}),
        "load_avg_1m": os.getloadavg()[0],
        "requests": [r.to_json() | {"sent_s": r.sent_s - t0} for r in requests],
    }


async def warm_up(http: httpx.AsyncClient, endpoint: Endpoint, prompt: list[int]) -> None:
    """One short request, so that first-request costs (allocations, compilation) stay out of the measurement."""
    await stream_request(http, endpoint.completions_url, completion_body(endpoint.model, prompt, WARM_UP_TOKENS))


async def measure_prefill(endpoint: Endpoint, prompts: list[list[int]], max_tokens: int, warm_up_prompt) -> dict:
    """All `prompts` at once against `endpoint`, after one warm-up request."""
    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=len(prompts) + 1)
    async with httpx.AsyncClient(limits=limits) as http:
        await warm_up(http, endpoint, warm_up_prompt)
        t0 = time.monotonic()
        requests = await asyncio.gather(
            *(
                stream_request(http, endpoint.completions_url, completion_body(endpoint.model, p, max_tokens))
                for p in prompts
            )
        )
    return prefill_summary(requests, t0)


# -- swarm --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwarmTurn:
    agent: int
    turn: int
    request: StreamedRequest


def swarm_summary(turns: Sequence[SwarmTurn], t0: float, end_s: float) -> dict:
    ttfts = _present(t.request.ttft_s for t in turns)
    output = sum(t.request.output_tokens for t in turns)
    makespan = end_s - t0
    prompt = _present(t.request.prompt_tokens for t in turns)
    cached = _present(t.request.cached_tokens for t in turns)
    return {
        "num_turns": len(turns),
        "makespan_s": makespan,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "output_tokens": output,
        "output_tokens_per_s": output / makespan if makespan > 0 else 0.0,
        "prompt_tokens": sum(prompt) if len(prompt) == len(turns) else None,
        "cached_tokens": sum(cached) if len(cached) == len(turns) else None,
        "load_avg_1m": os.getloadavg()[0],
        "turns": [
            {"agent": t.agent, "turn": t.turn, **t.request.to_json(), "sent_s": t.request.sent_s - t0}
            for t in sorted(turns, key=lambda t: (t.agent, t.turn))
        ],
    }


async def run_agent(
    http: httpx.AsyncClient, endpoint: Endpoint, system_prompt: str, script: AgentScript, turns: list[SwarmTurn]
) -> None:
    """One agent's conversation: each turn appends its user message and the engine's own answer."""
    messages = [{"role": "system", "content": system_prompt}]
    for index, turn in enumerate(script.turns):
        messages.append({"role": "user", "content": turn.user_content})
        request = await stream_request(
            http,
            endpoint.chat_url,
            chat_body(endpoint.model, messages, turn.max_tokens),
            headers={"x-session-id": script.session_id},
        )
        turns.append(SwarmTurn(script.agent, index, request))
        messages.append({"role": "assistant", "content": request.text})
        await asyncio.sleep(turn.pause_s)


async def measure_swarm(endpoint: Endpoint, system_prompt: str, scripts: Sequence[AgentScript]) -> dict:
    """Every agent at once, after one short warm-up chat request."""
    limits = httpx.Limits(max_connections=len(scripts) + 1, max_keepalive_connections=len(scripts) + 1)
    async with httpx.AsyncClient(limits=limits) as http:
        warm_up_messages = [{"role": "user", "content": "Say hello."}]
        await stream_request(http, endpoint.chat_url, chat_body(endpoint.model, warm_up_messages, WARM_UP_TOKENS))
        turns: list[SwarmTurn] = []
        t0 = time.monotonic()
        await asyncio.gather(*(run_agent(http, endpoint, system_prompt, s, turns) for s in scripts))
        end = max(t.request.end_s for t in turns)
    return swarm_summary(turns, t0, end)


# -- comparison and report ------------------------------------------------------------------


def advantage(ours: float | None, theirs: float | None, *, higher_is_better: bool) -> float | None:
    """How many times better swarmserve is than a peer (> 1: swarmserve better), or None.

    A rate (tok/s) divides ours by theirs; a time (TTFT, TPOT, makespan) theirs by ours."""
    if not ours or not theirs:
        return None
    return ours / theirs if higher_is_better else theirs / ours


PREFILL_METRICS = (  # (key, label, higher is better)
    ("output_tokens_per_s", "out tok/s", True),
    ("ttft_median_s", "TTFT p50", False),
    ("tpot_median_s", "TPOT p50", False),
)
SWARM_METRICS = (
    ("makespan_s", "makespan", False),
    ("ttft_p50_s", "TTFT p50", False),
    ("ttft_p90_s", "TTFT p90", False),
)


def row_advantages(row: dict, metrics) -> dict:
    """{peer: {metric key: swarmserve's advantage}} for each peer that ran in the row."""
    ours = row["engines"].get(SWARMSERVE)
    result = {}
    for peer in PEERS:
        theirs = row["engines"].get(peer)
        if ours and theirs:
            result[peer] = {
                key: advantage(ours.get(key), theirs.get(key), higher_is_better=higher) for key, _, higher in metrics
            }
    return result


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
            expected = row["streams"] * row["max_tokens"]
            if summary["output_tokens"] != expected:
                lines.append(
                    f"  NOTE: {ENGINE_LABELS[engine]} generated {summary['output_tokens']} tokens in "
                    f"{prefill_label(row)}, not {expected}"
                )
    return lines
