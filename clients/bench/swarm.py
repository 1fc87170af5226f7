"""`swarmserve bench swarm`: a swarm of coding agents, turn after turn, against one server.

Each agent runs `--turns` turns of a conversation that starts with a system prompt
every agent shares (~`--system-tokens` tokens). A turn sends the whole conversation
so far; the reply's length is one of eight, 40 … 900 tokens (AGENT_OUTPUT_LENGTHS,
EOS ignored so lengths are exact); then the agent "runs a tool" for a pause drawn
from an exponential distribution and pastes the tool's output back: code that the
next reply is asked to repeat with a change — the copy-heavy traffic real agents
make. gRPC targets get one `session_id` per agent, so the server keeps the
conversation's KV over the tool call.

Reports aggregate useful tokens/s (output tokens / makespan), per-agent completion
time, TTFT and inter-token latency p50/p99, prefix-hit rate (cached / prompt tokens),
draft acceptance and KV use; writes `<out>.json` and `<out>.png` (throughput over
time, live batch size over time, TTFT distribution).

Targets: `grpc://HOST:PORT` (a swarmserve scheduler), `http://HOST:PORT` (any
OpenAI-compatible server — llama.cpp's `llama-server`, vLLM, Ollama — through
/v1/chat/completions with streaming), or `--start` to bring up swarmserve itself;
`--compare-prefix-caching` runs the swarm twice on fresh services, with prefix
caching on and off, and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clients.client import AsyncSwarmClient
from clients.events import FinishEvent, TokenEvent

# What eight coding agents write per turn: a tool-call check (40 tokens) … a long refactor plan (900).
AGENT_OUTPUT_LENGTHS = (40, 90, 150, 220, 300, 480, 650, 900)

GUIDELINES = [
    "Prefer small, well-named functions; one idea per file.",
    "Every public function has a docstring that says why, not what.",
    "Tests assert the real behaviour: no mocks standing in for real parts.",
    "Errors carry a message a person can act on, naming the bad field.",
    "Never swallow an exception without logging it with its context.",
    "Configuration is a frozen dataclass validated once, built from flags.",
    "Use structured logs with bound request ids; no print in library code.",
    "Keep the hot path free of allocations you can hoist out of the loop.",
]

TOOL_FILES = [
    """def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users
""",
    """class Retry:
    def __init__(self, attempts=3, delay=0.5):
        self.attempts = attempts
        self.delay = delay

    def run(self, fn):
        for i in range(self.attempts):
            try:
                return fn()
            except ConnectionError:
                time.sleep(self.delay * (2 ** i))
        raise RuntimeError("gave up")
""",
    """def summarize(orders):
    totals = {}
    for order in orders:
        totals.setdefault(order.customer, 0)
        totals[order.customer] += order.amount
    return sorted(totals.items(), key=lambda kv: kv[1], reverse=True)
""",
]

TASKS = [
    "Add input validation to the data loader and explain the change.",
    "Refactor the retry helper so the delay is configurable per call.",
    "Write unit tests for the order summary function.",
    "Review the module for error handling gaps and fix them.",
]


def system_prompt(num_tokens: int) -> str:
    """A coding-guidelines document of roughly num_tokens tokens (about 4 characters a token)."""
    lines = ["You are a coding agent in a team of agents working on one repository.", "House rules:"]
    i = 0
    while sum(len(x) for x in lines) < num_tokens * 4:
        lines.append(f"{i + 1}. {GUIDELINES[i % len(GUIDELINES)]}")
        i += 1
    return "\n".join(lines)


@dataclass(frozen=True)
class SwarmConfig:
    num_agents: int = 8
    num_turns: int = 4
    system_tokens: int = 1000
    length_scale: float = 1.0  # multiply the agents' output lengths (e.g. 0.1 for a quick run)
    mean_tool_pause_s: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_agents <= 0 or self.num_turns <= 0:
            raise ValueError("num_agents and num_turns must be positive")
        if self.length_scale <= 0 or self.mean_tool_pause_s < 0 or self.system_tokens < 0:
            raise ValueError("length_scale must be positive; mean_tool_pause_s and system_tokens >= 0")


@dataclass
class TurnRecord:
    agent: int
    turn: int
    start_s: float  # since the swarm started
    first_token_s: float | None
    end_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int | None  # None: the target does not say
    drafted_tokens: int | None
    accepted_tokens: int | None
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token (see spread_arrivals)


# ------------------------------------------------------------------ targets


@dataclass(frozen=True)
class StreamResult:
    token_times: list[float]  # monotonic arrival time of each output token
    text: str
    prompt_tokens: int
    cached_tokens: int | None
    drafted_tokens: int | None
    accepted_tokens: int | None


class GrpcTarget:
    def __init__(self, address: str) -> None:
        self.address = address
        self.client = AsyncSwarmClient(address)

    async def complete(self, messages: list[dict], max_new_tokens: int, session_id: str) -> StreamResult:
        times, texts, usage = [], [], None
        async with self.client.generate(
            messages=messages, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, session_id=session_id
        ) as stream:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    times.extend(spread_arrivals(times[-1] if times else None, time.monotonic(), len(event.token_ids)))
                    texts.append(event.text)
                elif isinstance(event, FinishEvent):
                    usage = event.usage
        return StreamResult(
            times, "".join(texts), usage.prompt_tokens, usage.cached_tokens, usage.drafted_tokens, usage.accepted_tokens
        )

    async def kv_use(self) -> float | None:
        info = await self.client.server_info()
        return 1.0 - info.num_free_kv_blocks / info.num_kv_blocks if info.num_kv_blocks else None

    async def close(self) -> None:
        await self.client.close()


def spread_arrivals(previous: float | None, now: float, count: int) -> list[float]:
    """Arrival times for `count` tokens that came in one message at `now`: spread evenly since the
    previous token (the first message's all at `now`). A step that brings several tokens (accepted
    drafts, decode runs) then shows its wait as several short gaps, not one long gap and zeros: a
    GPU swarm's inter-token latency p50 read 0.0 ms when every gap inside a message counted as 0."""
    if previous is None or count <= 1:
        return [now] * count
    return [previous + (now - previous) * (i + 1) / count for i in range(count)]


def parse_sse_line(line: str) -> dict | None:
    """One `data: {...}` line of an OpenAI streaming response → the chunk; None for others and [DONE]."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


class OpenAITarget:
    """Any server speaking OpenAI's /v1/chat/completions with `stream: true`."""

    def __init__(self, base_url: str, model: str) -> None:
        import httpx  # only this target needs it

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.http = httpx.AsyncClient(timeout=None)

    async def complete(self, messages: list[dict], max_new_tokens: int, session_id: str) -> StreamResult:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,  # llama.cpp and vLLM honour it; others ignore unknown fields
            "cache_prompt": True,  # llama.cpp: reuse the slot's KV for a shared prefix
        }
        times, texts, prompt_tokens, cached = [], [], 0, None
        async with self.http.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is None:
                    continue
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        times.append(time.monotonic())
                        texts.append(text)
                usage = chunk.get("usage")
                if usage:
                    prompt_tokens = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens", cached)
                    num_output = usage.get("completion_tokens", len(times))
                    if num_output > len(times) and times:  # several tokens per chunk: spread them
                        times.extend([times[-1]] * (num_output - len(times)))
        return StreamResult(times, "".join(texts), prompt_tokens, cached, None, None)

    async def kv_use(self) -> float | None:
        return None

    async def close(self) -> None:
        await self.http.aclose()


# ------------------------------------------------------------------- the swarm


async def run_agent(agent: int, config: SwarmConfig, target, t0: float, records: list[TurnRecord], live: list) -> None:
    rng = random.Random(config.seed * 1000 + agent)
    messages = [{"role": "system", "content": system_prompt(config.system_tokens)}]
    tool_file = TOOL_FILES[agent % len(TOOL_FILES)]
    messages.append({"role": "user", "content": TASKS[agent % len(TASKS)] + "\n\nHere is the file:\n\n" + tool_file})
    for turn in range(config.num_turns):
        length = max(
            1, round(AGENT_OUTPUT_LENGTHS[(agent + turn * 3) % len(AGENT_OUTPUT_LENGTHS)] * config.length_scale)
        )
        start = time.monotonic()
        live.append((start - t0, +1))
        result = await target.complete(messages, length, f"agent-{agent}")
        end = time.monotonic()
        live.append((end - t0, -1))
        records.append(
            TurnRecord(
                agent=agent,
                turn=turn,
                start_s=start - t0,
                first_token_s=(result.token_times[0] - t0) if result.token_times else None,
                end_s=end - t0,
                output_tokens=len(result.token_times),
                prompt_tokens=result.prompt_tokens,
                cached_tokens=result.cached_tokens,
                drafted_tokens=result.drafted_tokens,
                accepted_tokens=result.accepted_tokens,
                token_times_s=[t - t0 for t in result.token_times],
            )
        )
        if turn + 1 == config.num_turns:
            break
        messages.append({"role": "assistant", "content": result.text})
        pause = (
            min(rng.expovariate(1 / config.mean_tool_pause_s), 3 * config.mean_tool_pause_s)
            if config.mean_tool_pause_s
            else 0.0
        )
        await asyncio.sleep(pause)
        # The tool's output comes back: the file as it is now, to be repeated with one change.
        messages.append(
            {
                "role": "user",
                "content": f"Tool output (exit 0):\n\n{tool_file}\nRepeat the whole file with the fix applied.",
            }
        )


async def sample_kv(target, t0: float, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            use = await target.kv_use()
        except Exception:  # noqa: BLE001 - a missed sample is not worth failing the run
            use = None
        if use is not None:
            samples.append((time.monotonic() - t0, use))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def summarize(records: list[TurnRecord], kv_samples: list, makespan_s: float, num_agents: int) -> dict:
    ttfts = [r.first_token_s - r.start_s for r in records if r.first_token_s is not None]
    itls = []
    for r in records:
        itls.extend(b - a for a, b in zip(r.token_times_s, r.token_times_s[1:]))
    output = sum(r.output_tokens for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    cached = [r.cached_tokens for r in records if r.cached_tokens is not None]
    drafted = [r.drafted_tokens for r in records if r.drafted_tokens is not None]
    accepted = [r.accepted_tokens for r in records if r.accepted_tokens is not None]
    completion = [max(r.end_s for r in records if r.agent == a) for a in range(num_agents)]
    return {
        "useful_tokens": output,
        "makespan_s": makespan_s,
        "useful_tokens_per_s": output / makespan_s if makespan_s else 0.0,
        "agent_completion_s": completion,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "itl_p50_s": _percentile(itls, 50),
        "itl_p99_s": _percentile(itls, 99),
        "prompt_tokens": prompt,
        "prefix_hit_rate": (sum(cached) / prompt) if cached and prompt else None,
        "draft_acceptance": (sum(accepted) / sum(drafted)) if drafted and sum(drafted) else None,
        "kv_use_mean": statistics.fmean(u for _, u in kv_samples) if kv_samples else None,
        "kv_use_max": max((u for _, u in kv_samples), default=None),
    }


async def run_swarm(target, config: SwarmConfig) -> dict:
    records: list[TurnRecord] = []
    live: list = []
    kv_samples: list = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_kv(target, t0, kv_samples, stop))
    try:
        await asyncio.gather(*(run_agent(a, config, target, t0, records, live) for a in range(config.num_agents)))
    finally:
        stop.set()
        await sampler
    makespan = time.monotonic() - t0
    records.sort(key=lambda r: (r.agent, r.turn))
    return {
        "config": asdict(config),
        "summary": summarize(records, kv_samples, makespan, config.num_agents),
        "turns": [asdict(r) for r in records],
        "live_batch": sorted(live),
        "kv_use": kv_samples,
    }


# --------------------------------------------------------------------- output


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tput, ax_batch, ax_ttft) = plt.subplots(1, 3, figsize=(17, 4.5))
    for name, run in runs.items():
        times = sorted(t for turn in run["turns"] for t in turn["token_times_s"])
        if times:
            width = max(1, math.ceil(times[-1]))
            counts = [0] * (width + 1)
            for t in times:
                counts[int(t)] += 1
            ax_tput.plot(range(len(counts)), counts, label=name)
        level, xs, ys = 0, [0.0], [0]
        for t, delta in run["live_batch"]:
            xs.append(t)
            ys.append(level)
            level += delta
            xs.append(t)
            ys.append(level)
        ax_batch.plot(xs, ys, label=name)
        ttfts = sorted(t["first_token_s"] - t["start_s"] for t in run["turns"] if t["first_token_s"] is not None)
        ax_ttft.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
    ax_tput.set(title="throughput over time", xlabel="s", ylabel="output tokens / s")
    ax_batch.set(title="live batch (agents generating)", xlabel="s", ylabel="agents")
    ax_ttft.set(title="TTFT distribution", xlabel="TTFT (s)", ylabel="fraction of turns")
    for ax in (ax_tput, ax_batch, ax_ttft):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_summary(runs: dict[str, dict]) -> None:
    keys = [
        "useful_tokens_per_s",
        "makespan_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_s",
        "itl_p99_s",
        "prefix_hit_rate",
        "draft_acceptance",
        "kv_use_max",
    ]
    print(f"{'':>22} | " + " | ".join(f"{name:>14}" for name in runs))
    for key in keys:
        cells = []
        for run in runs.values():
            value = run["summary"][key]
            cells.append(f"{value:14.3f}" if isinstance(value, float) else f"{str(value):>14}")
        print(f"{key:>22} | " + " | ".join(cells))
    for name, run in runs.items():
        completion = ", ".join(f"{t:.1f}" for t in run["summary"]["agent_completion_s"])
        print(f"{name}: per-agent completion (s): {completion}")
    names = list(runs)
    if len(names) == 2:
        a, b = (runs[n]["summary"] for n in names)
        if a["useful_tokens_per_s"] and b["useful_tokens_per_s"]:
            print(
                f"\n{names[0]} / {names[1]} useful tokens/s: {a['useful_tokens_per_s'] / b['useful_tokens_per_s']:.2f}x"
            )


# ------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=None, help="grpc://HOST:PORT (swarmserve) or http://HOST:PORT (OpenAI-compatible)"
    )
    parser.add_argument("--start", action="store_true", help="start swarmserve's own services for the run")
    parser.add_argument(
        "--compare-prefix-caching", action="store_true", help="with --start: run with prefix caching on, then off"
    )
    parser.add_argument("--openai-model", default="default", help="the model name sent to an OpenAI-compatible target")
    parser.add_argument("--model", default="default", help="with --start: the executor's --model")
    parser.add_argument("--dtype", default=None, help="with --start: the executor's --dtype")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="with --start")
    parser.add_argument("--spec", default=None, help="with --start: the scheduler's --spec")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--length-scale", type=float, default=1.0)
    parser.add_argument("--tool-pause-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_results/swarm", help="prefix of the .json and .png written")
    parser.add_argument("--log", default="bench_swarm.log", help="with --start: where the services' logs go")


async def _main(args: argparse.Namespace) -> dict[str, dict]:
    from clients.bench.services import start_services

    config = SwarmConfig(args.agents, args.turns, args.system_tokens, args.length_scale, args.tool_pause_s, args.seed)
    runs: dict[str, dict] = {}
    if args.start:
        variants = {"prefix-cache-on": ()}
        if args.compare_prefix_caching:
            variants["prefix-cache-off"] = ("--no-prefix-caching",)
        scheduler_args = ("--spec", args.spec) if args.spec else ()
        with open(args.log, "ab") as log_file:
            for name, executor_args in variants.items():
                async with start_services(
                    log_file,
                    model=args.model,
                    dtype=args.dtype,
                    kv_cache_gb=args.kv_cache_gb,
                    executor_args=executor_args,
                    scheduler_args=scheduler_args,
                    max_running_requests=max(args.agents, 1),
                ) as services:
                    target = GrpcTarget(services.scheduler_address)
                    try:
                        runs[name] = await run_swarm(target, config)
                    finally:
                        await target.close()
                print(f"{name}: {runs[name]['summary']['useful_tokens_per_s']:.1f} tokens/s", flush=True)
        return runs
    if not args.target:
        raise ValueError("give --target grpc://HOST:PORT or http://HOST:PORT, or --start")
    if args.target.startswith("grpc://"):
        target = GrpcTarget(args.target.removeprefix("grpc://"))
    elif args.target.startswith(("http://", "https://")):
        target = OpenAITarget(args.target, args.openai_model)
    else:
        raise ValueError(f"--target must start with grpc:// or http://, got {args.target!r}")
    try:
        runs[args.target] = await run_swarm(target, config)
    finally:
        await target.close()
    return runs


def run(args: argparse.Namespace) -> int:
    runs = asyncio.run(_main(args))
    print_summary(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(runs, indent=2))
    plot(runs, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0
