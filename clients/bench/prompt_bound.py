"""The prompt-bound rows of `swarmserve bench vs`: each engine's OpenAI HTTP server
measured on the prefill and swarm workloads (clients/bench/workloads.py) by the same client
code, one engine after another, summarized and compared (the report: prompt_bound_report.py).

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
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import httpx

from clients.bench.llama_server import LlamaServerError
from clients.bench.openai_stream import StreamedRequest, StreamError, chat_body, completion_body, stream_request
from clients.bench.workloads import AgentScript, workload_fingerprint

SWARMSERVE = "swarmserve"
PEERS = ("llama.cpp", "vllm")  # in the order they run, before swarmserve
ENGINE_LABELS = {SWARMSERVE: "swarmserve", "llama.cpp": "llama.cpp", "vllm": "vLLM-CPU"}
WARM_UP_TOKENS = 8
SLOT_MARGIN = 64  # llama-server KV tokens a slot holds beyond its request's prompt and output


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
    """All `prompts` at once against `endpoint`, after one warm-up request.

    The warm-up has a connection of its own. A measured request that reused the warm-up's
    kept-alive connection is the suspect (not proven) in llama.cpp's lost N = 1 row of an earlier
    run ("Server disconnected without sending a response"): its server may close a kept-alive
    connection just as the client reuses it."""
    async with httpx.AsyncClient() as http:
        await warm_up(http, endpoint, warm_up_prompt)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(limits=limits) as http:
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


def ttft_medians_by_turn(turns: Sequence[SwarmTurn]) -> list[float | None]:
    """The median TTFT of each turn index (0: every agent arrives at once, behind one another's
    prompts; later turns: one prompt at thousands of tokens of context, beside the others' decodes)."""
    num_turns = 1 + max((t.turn for t in turns), default=-1)
    return [percentile(_present(t.request.ttft_s for t in turns if t.turn == i), 50) for i in range(num_turns)]


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
        "ttft_p50_s_by_turn": ttft_medians_by_turn(turns),
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
    """Every agent at once, after one short warm-up chat request (on a connection of its own, as
    measure_prefill's)."""
    async with httpx.AsyncClient() as http:
        warm_up_messages = [{"role": "user", "content": "Say hello."}]
        await stream_request(http, endpoint.chat_url, chat_body(endpoint.model, warm_up_messages, WARM_UP_TOKENS))
    limits = httpx.Limits(max_connections=len(scripts), max_keepalive_connections=len(scripts))
    async with httpx.AsyncClient(limits=limits) as http:
        turns: list[SwarmTurn] = []
        t0 = time.monotonic()
        await asyncio.gather(*(run_agent(http, endpoint, system_prompt, s, turns) for s in scripts))
        end = max(t.request.end_s for t in turns)
    return swarm_summary(turns, t0, end)


# -- comparison ---------------------------------------------------------------------------


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


# -- rows: every engine on one workload ----------------------------------------------------


@dataclass(frozen=True)
class Peers:
    """The peers of a run. llama.cpp is a fresh llama-server per row, sized for the row:
    `llama(num_slots, slot_context)` starts one; vLLM is one server for the whole run."""

    llama: Callable[[int, int], AbstractAsyncContextManager[Endpoint]] | None = None
    vllm: Endpoint | None = None
    # Entered while vLLM is measured: a vLLM started for the run is stopped between its turns (its
    # worker busy-waits on a core when idle, services.PeerServer); None for one already running.
    vllm_running: Callable[[], AbstractAsyncContextManager[None]] | None = None


async def measure_engines(peers: Peers, swarmserve: Endpoint, measure, *, num_slots: int, slot_context: int):
    """`measure(endpoint)` on llama.cpp, vLLM, then swarmserve, one after another (the cores are
    shared). An engine that fails gets None and its error, not the run's end."""
    engines: list[tuple[str, Callable[[], AbstractAsyncContextManager[Endpoint]] | Endpoint]] = []
    if peers.llama:
        engines.append(("llama.cpp", lambda: peers.llama(num_slots, slot_context)))
    if peers.vllm:
        engines.append(("vllm", peers.vllm))
    engines.append((SWARMSERVE, swarmserve))
    summaries, errors = {}, {}
    for engine, endpoint in engines:
        try:
            if engine == "vllm" and peers.vllm_running:
                async with peers.vllm_running():
                    summaries[engine] = await measure(endpoint)
            elif isinstance(endpoint, Endpoint):
                summaries[engine] = await measure(endpoint)
            else:
                async with endpoint() as fresh:
                    summaries[engine] = await measure(fresh)
        except (StreamError, LlamaServerError, httpx.HTTPError) as error:
            summaries[engine], errors[engine] = None, f"{type(error).__name__}: {error}"
            print(f"  {ENGINE_LABELS[engine]} failed: {errors[engine]}", flush=True)
    return summaries, errors


def prefill_waves_summary(waves: Sequence[dict]) -> dict:
    """An engine's prefill row over its waves (each a prefill_summary): the median wave's output
    tok/s, and TTFT and TPOT over every request of every wave. A lone request's TTFT is one
    sample, and on these shared machines vLLM-CPU's swung 0.77-0.86 s between runs: the median of
    several keeps one wave's noise from deciding the row."""
    requests = [r | {"wave": w} for w, wave in enumerate(waves) for r in wave["requests"]]
    rates = [wave["output_tokens_per_s"] for wave in waves]
    return {
        "num_requests": len(requests),
        "waves": len(waves),
        "output_tokens": sum(wave["output_tokens"] for wave in waves),
        "duration_s": sum(wave["duration_s"] for wave in waves),
        "output_tokens_per_s": percentile(rates, 50),
        "output_tokens_per_s_by_wave": rates,
        "ttft_median_s": percentile(_present(r["ttft_s"] for r in requests), 50),
        "ttft_p90_s": percentile(_present(r["ttft_s"] for r in requests), 90),
        "tpot_median_s": percentile(_present(r["tpot_s"] for r in requests), 50),
        "prompt_tokens": sorted({n for wave in waves for n in wave["prompt_tokens"]}),
        "load_avg_1m": max(wave["load_avg_1m"] for wave in waves),
        "requests": requests,
    }


async def prefill_row(
    peers: Peers, swarmserve: Endpoint, prompt_waves: list[list[list[int]]], warm_up_prompt: list[int], max_tokens: int
) -> dict:
    """One prefill row: every engine on each wave's prompts at once, the engines taking turns wave
    by wave (so that a slow spell of the machine falls on both); llama.cpp with one slot per
    prompt. An engine that fails a wave gets None and that wave's error for the row."""
    streams, num_tokens = len(prompt_waves[0]), len(prompt_waves[0][0])
    waves: dict[str, list[dict]] = {}
    errors: dict[str, str] = {}
    for prompts in prompt_waves:
        summaries, wave_errors = await measure_engines(
            peers,
            swarmserve,
            functools.partial(measure_prefill, prompts=prompts, max_tokens=max_tokens, warm_up_prompt=warm_up_prompt),
            num_slots=streams,
            slot_context=num_tokens + max_tokens + SLOT_MARGIN,
        )
        for engine, summary in summaries.items():
            if summary is None:
                errors.setdefault(engine, wave_errors[engine])
            else:
                waves.setdefault(engine, []).append(summary)
    engines = {engine: None if engine in errors else prefill_waves_summary(waves[engine]) for engine in summaries}
    row = {
        "kind": "prefill",
        "streams": streams,
        "prompt_tokens": num_tokens,
        "max_tokens": max_tokens,
        "waves": len(prompt_waves),
        "fingerprint": workload_fingerprint(prompt_waves),
        "engines": engines,
        "errors": errors,
    }
    row["advantage"] = row_advantages(row, PREFILL_METRICS)
    return row


async def swarm_row(
    peers: Peers, swarmserve: Endpoint, system_prompt: str, scripts: Sequence[AgentScript], *, slot_context: int
) -> dict:
    """The swarm row: every engine runs the agents' scripts; llama.cpp with one slot per agent."""
    summaries, errors = await measure_engines(
        peers,
        swarmserve,
        lambda endpoint: measure_swarm(endpoint, system_prompt, scripts),
        num_slots=len(scripts),
        slot_context=slot_context,
    )
    row = {
        "kind": "swarm",
        "num_agents": len(scripts),
        "num_turns": max(len(s.turns) for s in scripts),
        "fingerprint": workload_fingerprint(system_prompt, *scripts),
        "engines": summaries,
        "errors": errors,
    }
    row["advantage"] = row_advantages(row, SWARM_METRICS)
    return row
