"""`swarmserve bench spec`: draft policies × draft shapes × live batch size × workload, in one run.

One executor per draft shape (`--draft-shape chain|tree`) runs for the whole benchmark (an
idle one costs no CPU); each (policy, B) gets one fresh scheduler per executor (`--spec
POLICY`, batch capped at B, taking the executor over from the one before), and each workload
runs B greedy requests at once, EOS ignored, so the live batch is B until the first finishes
(all together but in `spread`). tokens/s = tokens generated / the wall time from the first
request sent to the last one's last token.

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
  tokens/s is over the makespan, as the batch drains; at B < 8 it is the B shortest lengths.

Repeats (`--repeats N`) are interleaved so that drift on the machine touches every
configuration alike: repeat r runs each workload on the chain executor, then on the tree
executor, before repeat r + 1. Before the first repeat every prompt is sent once for one
token, so each repeat finds it in the prefix cache, as the ones after it do: the repeats
measure the same thing (decode, with the prompt cached), not a cold first and warm rest.
Each configuration reports its median tokens/s and the min–max over the repeats.

With `--llama-server PATH`, llama.cpp's plain decode (no speculation) runs the same B
requests of each workload and B: the same chat messages over its /v1/chat/completions
(llama-server renders the GGUF's chat template itself; the report prints both engines'
prompt token counts), greedy, EOS ignored, the same output lengths, on a llama-server of the
same GGUF with B slots and `--threads` threads, started per B. It takes its turn in each
repeat after our shapes (beside the first policy's runs: it has no policy). A llama.cpp slot
caches only the prompt it ran last, so request i runs in slot i (`id_slot`) and the slots are
primed with their prompts right before each measurement (its warm-up): without that, a warm-up
request or another workload took a slot over and the measured request prefilled its whole
prompt again (seen: 167 of 191 tokens), where ours found it in the prefix cache. One engine is measured at a time: the
llama-server is stopped (SIGSTOP) except while it is measured, and our executors have no
request while it is. Each of our rows reports its tokens/s over llama.cpp's (the median of
the per-repeat ratios, min–max), and the report checks issue #28's target: trees at least
2x llama.cpp's plain decode at B = 1 on the branchy workload.

With several shapes, the tree rows are labelled `POLICY+tree`, and the report gives tree
over chain for tokens/s and for accepted tokens per decode step (accepted / (tokens -
accepted): every decode step emits its accepted drafts plus one token): the median of the
per-repeat ratios (repeat r of each ran back to back) and their min–max, and whether trees
are below chains by more than noise: the tree's best repeat below the chain's worst, which
two equal distributions do by chance with probability 1 / C(2N, N), 1/20 at N = 3
(repeats.py). With one repeat there is no verdict.

Before anything is measured, the KV cache is checked against each workload's requests at
the largest B (prompt, output and one step's drafts each, none shared): a `--kv-cache-gb`
too small for them is an error naming the size to pass, since preempted requests would
measure the cache, not speculation. Each run records the CPU the engines not measured used
meanwhile (they should use none) and the cores processes outside the benchmark took
(cpu_share.py); the report flags runs that shared the machine.

Also reports the acceptance rate (accepted / drafted), waste (drafted tokens rejected, per
useful token) and preemptions per configuration, and per workload and B whether goodput is
within 10% of the best policy. Writes a JSON file (every run, and the per-configuration
results) and a PNG plot of tokens/s vs B per workload, the repeats' min–max as error bars.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from clients.bench.arguments import int_at_least, positive_ints
from clients.bench.cpu_share import CpuWatch
from clients.bench.llama_server import llama_server_version, start_llama_server
from clients.bench.openai_stream import chat_body, stream_request
from clients.bench.services import start_scheduler, start_services
from clients.bench.speculation_report import (
    LLAMA_CPP,
    SWARMSERVE,
    config_results,
    format_report,
    plot,
    summarize,
    tree_vs_chain,
)
from clients.bench.vs_llama_cpp import cpu_description, executor_info
from clients.bench.workloads import SEED_OUTPUT_LENGTHS
from clients.client import AsyncSwarmClient

POLICIES = ("off", "fixed:2", "fixed:4", "fixed:8", "even", "goodput")
BATCH_SIZES = (1, 2, 4, 8, 16)
DRAFT_SHAPES = ("chain", "tree")  # the executor's --draft-shape
SLOT_MARGIN = 64  # llama-server KV tokens a slot holds beyond its longest prompt and output

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


@dataclass(frozen=True)
class SpecRequest:
    messages: list[dict]
    max_new_tokens: int


def workload_requests(kind: str, batch_size: int, num_new_tokens: int) -> list[SpecRequest]:
    """The B requests of one configuration, the same for every engine and repeat."""
    return [SpecRequest(workload_messages(kind, i), max_new_tokens(kind, i, num_new_tokens)) for i in range(batch_size)]


async def prime_swarmserve(address: str, requests: Sequence[SpecRequest]) -> None:
    """Each prompt once, one token: its KV in the prefix cache before the first repeat, as in every later one."""
    async with AsyncSwarmClient(address) as client:
        await asyncio.gather(
            *(client.complete(messages=r.messages, max_new_tokens=1, temperature=0.0) for r in requests)
        )


async def measure_swarmserve(address: str, requests: Sequence[SpecRequest]) -> dict:
    """All `requests` at once after a warm-up request; tokens/s from the first sent to the last finished."""
    async with AsyncSwarmClient(address) as client:
        await client.complete("warm up", max_new_tokens=2, ignore_eos=True)
        t0 = time.monotonic()
        completions = await asyncio.gather(
            *(
                client.complete(messages=r.messages, max_new_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True)
                for r in requests
            )
        )
        wall = time.monotonic() - t0
    tokens = sum(len(c.token_ids) for c in completions)
    drafted = sum(c.usage.drafted_tokens for c in completions)
    accepted = sum(c.usage.accepted_tokens for c in completions)
    return {
        "tokens": tokens,
        "expected_tokens": sum(r.max_new_tokens for r in requests),
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "waste_per_token": (drafted - accepted) / tokens,
        "accepted_per_step": accepted / (tokens - accepted),
        "num_preemptions": sum(c.usage.num_preemptions for c in completions),
        "prompt_tokens": [c.usage.prompt_tokens for c in completions],
        "cached_tokens": [c.usage.cached_tokens for c in completions],
        "load_avg_1m": os.getloadavg()[0],
    }


def prompt_token_counts(info, requests: Sequence[SpecRequest]) -> list[int]:
    """Each request's prompt in the model's tokens, rendered as our scheduler renders it (the
    GGUF's chat template and tokenizer, from the executor's GetInfo)."""
    from tokenizers import Tokenizer

    from scheduler_svc.chat_template import render_chat_template

    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    counts = []
    for request in requests:
        text = render_chat_template(
            info.chat_template,
            request.messages,
            add_generation_prompt=True,
            bos_token=info.bos_token or None,
            eos_token=info.eos_token or None,
        )
        counts.append(len(tokenizer.encode(text, add_special_tokens=False).ids) + int(info.add_bos_token))
    return counts


class KvBudgetError(RuntimeError):
    """--kv-cache-gb cannot hold a configuration's requests at once: they would be preempted."""


def kv_blocks_needed(
    prompt_tokens: Sequence[int], output_tokens: Sequence[int], max_draft_tokens: int, block_size: int
) -> int:
    """KV blocks B requests hold at their longest, none shared: each its prompt, its output and
    one step's draft tokens (a tree's nodes, or a chain's)."""
    return sum(
        math.ceil((prompt + output + max_draft_tokens) / block_size)
        for prompt, output in zip(prompt_tokens, output_tokens)
    )


def check_kv_budget(info, prompt_tokens: dict[str, list[int]], batch_size: int, num_new_tokens: int) -> str:
    """What the executor's KV cache holds against what each workload's B requests may hold at
    once, as a line to print; KvBudgetError where it cannot hold them."""
    needs = {}
    for kind, counts in prompt_tokens.items():
        outputs = [max_new_tokens(kind, i, num_new_tokens) for i in range(batch_size)]
        needs[kind] = kv_blocks_needed(counts[:batch_size], outputs, info.max_draft_tokens, info.kv_block_size)
    kind = max(needs, key=needs.get)
    if needs[kind] > info.num_kv_blocks:
        gib = needs[kind] * info.kv_bytes_per_block / 2**30
        raise KvBudgetError(
            f"{kind} at B={batch_size} may hold {needs[kind]} KV blocks at once, the KV cache has "
            f"{info.num_kv_blocks}: pass --kv-cache-gb {math.ceil(gib * 100) / 100:g} or more, or its requests "
            "will be preempted"
        )
    return (
        f"KV cache: {info.num_kv_blocks} blocks of {info.kv_block_size} tokens; the most B={batch_size} requests "
        f"may hold at once, none shared: {needs[kind]} ({kind})"
    )


def _chat_url(server) -> str:
    return f"{server.url}/v1/chat/completions"


def llama_chat_body(request: SpecRequest, slot: int, max_tokens: int) -> dict:
    """Request i runs in slot i (`id_slot`): llama-server would pick a slot by prompt similarity,
    and one short request after another can land in the same slot, leaving the others empty."""
    return chat_body(LLAMA_CPP, request.messages, max_tokens) | {"id_slot": slot}


async def prime_llama_cpp(http: httpx.AsyncClient, server, requests: Sequence[SpecRequest]) -> None:
    """Each prompt for one token in its own slot, all at once: slot i holds request i's prompt
    in its prompt cache, as our prefix cache holds them all."""
    await asyncio.gather(
        *(stream_request(http, _chat_url(server), llama_chat_body(r, i, 1)) for i, r in enumerate(requests))
    )


async def measure_llama_cpp(server, requests: Sequence[SpecRequest]) -> dict:
    """The same requests over llama-server's /v1/chat/completions (its own rendering of the GGUF's
    chat template), greedy, EOS ignored, timed as measure_swarmserve, after priming the slots
    (the module docstring says why)."""
    # Fresh connections for the measured requests: a B = 8 run ended in "Server disconnected without
    # sending a response" on a measured request that reused a priming request's kept-alive
    # connection (the suspect, not proven: llama-server closing it just as it is reused).
    async with httpx.AsyncClient() as http:
        await prime_llama_cpp(http, server, requests)
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as http:
        t0 = time.monotonic()
        streams = await asyncio.gather(
            *(
                stream_request(http, _chat_url(server), llama_chat_body(r, i, r.max_new_tokens))
                for i, r in enumerate(requests)
            )
        )
        wall = time.monotonic() - t0
    tokens = sum(s.output_tokens for s in streams)
    return {
        "tokens": tokens,
        "expected_tokens": sum(r.max_new_tokens for r in requests),
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "prompt_tokens": [s.prompt_tokens for s in streams],
        "cached_tokens": [s.cached_tokens for s in streams],
        "load_avg_1m": os.getloadavg()[0],
    }


def policy_label(policy: str, shape: str) -> str:
    return policy if shape == "chain" else f"{policy}+{shape}"


def _progress(run: dict) -> str:
    line = (
        f"repeat {run['repeat'] + 1} {run['policy']:>14} B={run['batch_size']:<2} {run['workload']:>7}: "
        f"{run['tokens_per_s']:6.1f} tok/s"
    )
    if run["engine"] == SWARMSERVE:
        line += (
            f", acceptance {run['acceptance']:.0%}, {run['accepted_per_step']:.2f} accepted/step, "
            f"waste {run['waste_per_token']:.2f}/token"
        )
    return line + f"; other processes {run['other_cores']:.2f} cores, idle engines {run['idle_engine_cpu_s']:.2f} CPU-s"


class SpecBench:
    """The run's plan and what it measured; `runs` grows by one dict per measurement."""

    def __init__(self, args: argparse.Namespace) -> None:
        from executor_svc.weights.model_source import resolve_model_path  # the executor's own resolution of --model

        self.args = args
        self.model_path = str(resolve_model_path(args.model))
        self.runs: list[dict] = []
        self.prompt_tokens: dict[str, list[int]] = {}  # per workload, its largest B's requests

    def record(self, run: dict, **labels) -> None:
        run = {**labels, **run}
        self.runs.append(run)
        print(_progress(run), flush=True)
        if run["tokens"] != run["expected_tokens"]:
            print(f"  WARNING: {run['tokens']} tokens came back where {run['expected_tokens']} were asked", flush=True)

    async def run(self, log_file) -> None:
        args = self.args
        async with AsyncExitStack() as stack:
            # One executor per shape for the whole run (an idle one costs no CPU), so the repeats
            # of every configuration can take turns.
            executors = {}
            for shape in args.shapes:
                executors[shape] = await stack.enter_async_context(
                    start_services(
                        log_file,
                        model=self.model_path,
                        dtype=args.dtype,
                        kv_cache_gb=args.kv_cache_gb,
                        executor_args=("--draft-shape", shape, "--threads", str(args.threads)),
                    )
                )
            info = await executor_info(next(iter(executors.values())).executor_address)
            for kind in args.workloads:
                requests = workload_requests(kind, max(args.batch_sizes), args.num_new_tokens)
                self.prompt_tokens[kind] = prompt_token_counts(info, requests)
            print(check_kv_budget(info, self.prompt_tokens, max(args.batch_sizes), args.num_new_tokens), flush=True)
            for batch_size in args.batch_sizes:
                async with self.llama_cpp(batch_size, log_file) as llama:
                    for index, policy in enumerate(args.policies):
                        # llama.cpp has no policy: it takes its turns beside the first one's.
                        await self.run_policy(executors, policy, batch_size, log_file, llama if index == 0 else None)

    @asynccontextmanager
    async def llama_cpp(self, batch_size: int, log_file) -> AsyncIterator:
        """A llama-server with B slots, each large enough for any request, paused (SIGSTOP) but
        while it is measured; None without --llama-server."""
        if not self.args.llama_server:
            yield None
            return
        longest_prompt = max(max(counts[:batch_size]) for counts in self.prompt_tokens.values())
        slot_context = longest_prompt + self.args.num_new_tokens + SLOT_MARGIN
        async with start_llama_server(
            self.args.llama_server,
            self.model_path,
            log_file,
            num_slots=batch_size,
            context_length=batch_size * slot_context,
            threads=self.args.threads,
            extra_args=shlex.split(self.args.llama_args),
        ) as server:
            server.pause()
            try:
                yield server
            finally:
                server.resume()  # a stopped process would not act on the SIGTERM

    async def run_policy(self, executors: dict, policy: str, batch_size: int, log_file, llama=None) -> None:
        """Every repeat of (policy, B) with one scheduler per shape, each taking its executor over
        from the one before (an executor serves one scheduler); llama.cpp, if given, after them."""
        args = self.args
        async with AsyncExitStack() as stack:
            addresses = {}
            for shape, services in executors.items():
                addresses[shape] = await stack.enter_async_context(
                    start_scheduler(
                        services.executor_address,
                        log_file,
                        "--spec",
                        policy,
                        "--take-over",
                        max_running_requests=batch_size,
                    )
                )
            for kind in args.workloads:
                requests = workload_requests(kind, batch_size, args.num_new_tokens)
                for address in addresses.values():
                    await prime_swarmserve(address, requests)
            executor_pids = {shape: services.executor_pid for shape, services in executors.items()}
            for repeat in range(args.repeats):
                for kind in args.workloads:
                    requests = workload_requests(kind, batch_size, args.num_new_tokens)
                    at = dict(workload=kind, batch_size=batch_size, repeat=repeat)
                    for shape, address in addresses.items():
                        idle = [pid for other, pid in executor_pids.items() if other != shape]
                        idle += [llama.pid] if llama is not None else []
                        run = await watched(measure_swarmserve(address, requests), idle)
                        self.record(run, engine=SWARMSERVE, policy=policy_label(policy, shape), shape=shape, **at)
                    if llama is not None:
                        async with llama.running():
                            run = await watched(measure_llama_cpp(llama, requests), executor_pids.values())
                        self.record(run, engine=LLAMA_CPP, policy=LLAMA_CPP, shape="plain", **at)


async def watched(measurement: Awaitable[dict], idle_pids: Iterable[int | None]) -> dict:
    """The measurement's run, with the CPU the idle engines and the rest of the machine used meanwhile."""
    watch = CpuWatch(pid for pid in idle_pids if pid is not None)
    watch.start()
    run = await measurement
    return run | watch.stop().to_json()


def names(choices: Sequence[str] | None = None):
    """`a,b` -> ("a", "b"), each one of `choices` if given; an argparse type."""

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = [v for v in values if choices is not None and v not in choices]
        if not values or unknown:
            expected = f"some of {','.join(choices)}" if choices else "a comma-separated list"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return values

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument(
        "--threads", type=int_at_least(1), default=2, help="each executor's CPU threads (default %(default)s)"
    )
    parser.add_argument("--policies", type=names(), default=POLICIES)
    parser.add_argument("--batch-sizes", type=positive_ints, default=BATCH_SIZES)
    parser.add_argument(
        "--shapes", type=names(DRAFT_SHAPES), default=("chain",), help="draft shapes, one executor each: chain,tree"
    )
    parser.add_argument(
        "--workloads", type=names(WORKLOADS), default=("copy", "free"), help=f"of {','.join(WORKLOADS)}"
    )
    parser.add_argument(
        "--num-new-tokens", type=int, default=48, help="tokens per request (spread: its longest request's)"
    )
    parser.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=1,
        help="measurements of each configuration, interleaved with the others' (default %(default)s)",
    )
    parser.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="also run llama.cpp's plain decode (no speculation) on the same requests: the llama-server binary "
        "(../shared/anchors/llama-cpp.sh prints it), B slots, --threads threads",
    )
    parser.add_argument(
        "--llama-args",
        default="",
        metavar="ARGS",
        help="extra llama-server flags as one string: --llama-args '--cache-ram 0'",
    )
    parser.add_argument("--out", default="bench_results/spec", help="prefix of the .json and .png written")
    parser.add_argument("--log", default="bench_spec.log", help="where the services' logs go")


def run(args: argparse.Namespace) -> int:
    bench = SpecBench(args)
    load_start = os.getloadavg()
    with open(args.log, "ab") as log_file:
        try:
            asyncio.run(bench.run(log_file))
        except KvBudgetError as error:
            print(f"swarmserve bench spec: {error}", file=sys.stderr)
            return 2
    configs = config_results(bench.runs)
    machine = {
        "model": bench.model_path,
        "cpu": cpu_description(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "llama_server_version": llama_server_version(args.llama_server) if args.llama_server else None,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
    }
    print()
    print(format_report(configs, args.repeats, machine), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "args": {key: value for key, value in vars(args).items() if key != "run"},
        "machine": machine,
        "prompt_tokens": bench.prompt_tokens,
        "runs": bench.runs,
        "configs": [c.to_json() for c in configs],
        "summary": summarize(configs),
        "tree_vs_chain": [q.to_json() for q in tree_vs_chain(configs)],
    }
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str))
    plot(configs, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0
