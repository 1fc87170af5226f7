"""`swarmserve bench restart`: how fast the executor comes back, on a quiet machine and a busy one.

Two measurements per round, on the model given (default: the embedded one):

- **start**: a fresh executor process, from spawn to its port accepting connections
  (`listen_s`) and to its health saying SERVING (`serving_s`), with when its log says
  each start-up event happened and the phase times `executor_ready` reports (engine,
  calibration and whether it was measured or reused).
- **kill**: a scheduler with streams mid-decode (half greedy, half seeded sampling); the
  executor is SIGKILLed and started again at once on the same address, as a supervisor's
  restart policy does. `first_token_s`: from the kill to the first token any stream
  receives after it; `all_streams_s`: until every stream has had one. The streams are
  compared with an undisturbed run of the same requests (they must be token-identical).

`--load N` runs N busy-loop processes beside everything for the whole bench (the
machine's load average goes up by about N), which is when a restart that needs more
than the scheduler's reconnect window would end every stream with UNAVAILABLE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from clients.bench.services import start_scheduler
from clients.client import AsyncSwarmClient
from clients.events import TokenEvent
from clients.health import FAST_RECONNECT_OPTIONS, probe
from clients.serve import ServeConfig, executor_command, free_port, is_listening

POLL_S = 0.02
SAMPLED_TEMPERATURE = 0.8


@contextmanager
def busy_loops(n: int):
    """`n` processes spinning on a core each, for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def spawn_executor(address: str, executor_args: list[str], log_path: Path) -> subprocess.Popen:
    config = ServeConfig(executor_listen=address, executor_args=("--log-format", "json", *executor_args))
    with open(log_path, "ab") as log:
        return subprocess.Popen(executor_command(config), stdout=log, stderr=subprocess.STDOUT)


async def wait_started(address: str, process: subprocess.Popen, t0: float, timeout: float) -> tuple[float, float]:
    """(seconds to listen, seconds to SERVING) from `t0`; RuntimeError if the process exits first."""
    import grpc

    listen_s = None
    async with grpc.aio.insecure_channel(address, options=list(FAST_RECONNECT_OPTIONS)) as channel:
        while time.monotonic() - t0 < timeout:
            if process.poll() is not None:
                raise RuntimeError(f"the executor exited with {process.returncode} while starting")
            if listen_s is None and await is_listening(address):
                listen_s = time.monotonic() - t0
            if listen_s is not None and await probe(channel, timeout=1.0) == "SERVING":
                return listen_s, time.monotonic() - t0
            await asyncio.sleep(POLL_S)
    raise TimeoutError(f"the executor was not SERVING after {timeout:g} s")


STARTUP_EVENTS = ("executor_listening", "calibrated", "executor_ready")


def startup_events(log_path: Path, spawned_unix_s: float) -> dict:
    """Seconds from the spawn to each start-up event of the executor's JSON log (the last start's),
    and the phase times its `executor_ready` line reports (absent from older executors)."""
    events: dict = {}
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            at = datetime.fromisoformat(record["timestamp"]).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        if record.get("event") in STARTUP_EVENTS and at >= spawned_unix_s:
            events[record["event"]] = round(at - spawned_unix_s, 3)
            if record["event"] == "executor_ready":
                events.update({k: v for k, v in record.items() if k.endswith("_s") or k == "calibration"})
    return events


async def measure_start(executor_args: list[str], log_path: Path, timeout: float) -> dict:
    address = f"127.0.0.1:{free_port()}"
    t0, spawned = time.monotonic(), time.time()
    process = spawn_executor(address, executor_args, log_path)
    try:
        listen_s, serving_s = await wait_started(address, process, t0, timeout)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait()
    return {"listen_s": listen_s, "serving_s": serving_s, "events": startup_events(log_path, spawned)}


def stream_requests(num_streams: int) -> list[dict]:
    return [
        dict(
            prompt=f"Agent {i}: read the failing test, then fix the function it covers.",
            temperature=0.0 if i % 2 == 0 else SAMPLED_TEMPERATURE,
            seed=1000 + i,
        )
        for i in range(num_streams)
    ]


async def run_stream(client, request: dict, num_tokens: int, times: list | None = None) -> list[int]:
    """The stream's token ids; appends (monotonic time, token count) per event to `times`."""
    token_ids = []
    async for event in client.generate(
        request["prompt"], max_new_tokens=num_tokens, ignore_eos=True, temperature=request["temperature"],
        seed=request["seed"],
    ):  # fmt: skip
        if isinstance(event, TokenEvent) and event.token_ids:
            token_ids.extend(event.token_ids)
            if times is not None:
                times.append((time.monotonic(), len(token_ids)))
    return token_ids


async def measure_kill(args, executor_args: list[str], log_path: Path) -> dict:
    address = f"127.0.0.1:{free_port()}"
    processes = [spawn_executor(address, executor_args, log_path)]
    try:
        await wait_started(address, processes[0], time.monotonic(), args.timeout)
        requests = stream_requests(args.streams)
        with open(log_path, "ab") as log_file:
            async with start_scheduler(address, log_file, "--log-format", "json") as scheduler:
                async with AsyncSwarmClient(scheduler) as client:
                    undisturbed = await asyncio.gather(*(run_stream(client, r, args.tokens) for r in requests))
                    times = [[] for _ in requests]
                    streams = [
                        asyncio.create_task(run_stream(client, r, args.tokens, t)) for r, t in zip(requests, times)
                    ]
                    while not all(len(t) and t[-1][1] >= args.kill_after for t in times):
                        if any(s.done() for s in streams):
                            raise RuntimeError("a stream ended before the kill: raise --tokens")
                        await asyncio.sleep(POLL_S)
                    processes[0].kill()
                    killed_at, killed_unix = time.monotonic(), time.time()
                    processes[0].wait()
                    processes.append(spawn_executor(address, executor_args, log_path))
                    results = await asyncio.gather(*streams, return_exceptions=True)
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait()
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    resumed = [min((at for at, _ in t if at > killed_at), default=None) for t in times]
    return {
        "first_token_s": None if errors or None in resumed else min(resumed) - killed_at,
        "all_streams_s": None if errors or None in resumed else max(resumed) - killed_at,
        "identical": not errors and all(a == b for a, b in zip(results, undisturbed)),
        "errors": errors,
        "restart": startup_events(log_path, killed_unix),
    }


def summarize(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


async def _main(args: argparse.Namespace) -> dict:
    executor_args = ["--model", args.model, *args.executor_args]
    log_dir = Path(tempfile.mkdtemp(prefix="bench_restart_"))
    starts, kills = [], []
    with busy_loops(args.load):
        await asyncio.sleep(2.0 if args.load else 0.0)  # let the loops take their cores
        load_before = os.getloadavg()[0]
        for i in range(args.rounds):
            starts.append(await measure_start(executor_args, log_dir / f"start{i}.log", args.timeout))
            print(f"start {i}: {json.dumps(starts[-1])}", file=sys.stderr)
        for i in range(args.kills):
            kills.append(await measure_kill(args, executor_args, log_dir / f"kill{i}.log"))
            print(f"kill {i}: {json.dumps(kills[-1])}", file=sys.stderr)
        load_after = os.getloadavg()[0]
    return {
        "load": args.load,
        "loadavg_1min": [round(load_before, 2), round(load_after, 2)],
        "listen_s": summarize([s["listen_s"] for s in starts]),
        "serving_s": summarize([s["serving_s"] for s in starts]),
        "first_resumed_token_s": summarize([k["first_token_s"] for k in kills]),
        "all_streams_resumed_s": summarize([k["all_streams_s"] for k in kills]),
        "streams_identical": sum(k["identical"] for k in kills),
        "kills": len(kills),
        "starts": starts,
        "kill_rounds": kills,
        "logs": str(log_dir),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="the executor's --model (default %(default)s)")
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes beside the services (default 0)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh starts to time (default %(default)s)")
    parser.add_argument("--kills", type=int, default=2, help="kill-and-restart rounds (default %(default)s)")
    parser.add_argument("--streams", type=int, default=4, help="streams in flight at each kill (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream (default %(default)s)")
    parser.add_argument("--kill-after", type=int, default=16, help="tokens every stream has before the kill")
    parser.add_argument("--timeout", type=float, default=300.0, help="the most one start may take (s)")
    parser.add_argument(
        "--executor-args", nargs=argparse.REMAINDER, default=[], help="the rest goes to the executor as is"
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_main(args))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"load {result['load']} busy loops (1-min load average {result['loadavg_1min']})")
    for name in ("listen_s", "serving_s", "first_resumed_token_s", "all_streams_resumed_s"):
        s = result[name]
        print(
            f"  {name:24} "
            + (f"median {s['median']:.2f}  min {s['min']:.2f}  max {s['max']:.2f}  (n={s['n']})" if s else "-")
        )
    print(f"  streams identical after the kill: {result['streams_identical']}/{result['kills']} rounds")
    print(f"  logs: {result['logs']}")
    return 0 if result["streams_identical"] == result["kills"] else 1
