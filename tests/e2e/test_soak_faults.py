"""A soak of the real swarm with faults: the services as processes, agents over the HTTP API.

Agents with a long shared system prompt take several turns each in their sessions (plain
greedy, stop strings, structured output, seeded sampling; tests/support/soak.py), beside
side requests that give up (HTTP clients that disconnect, gRPC cancels and Aborts). First an
undisturbed run; then the same agents again while the executor is SIGKILLed (and restarted
at once, as a supervisor does) twice and the scheduler is sent SIGTERM once (it drains:
requests in flight finish, new ones get 503) and started again. Afterwards:

- every agent's every turn is token-identical to the undisturbed run, and every attempt
  that did not succeed met a documented status (503, no connection, a stream cut short);
  every side request ended as its client chose or with a documented status;
- each fault hit work in flight: each executor kill left streams waiting that were sent
  again, and streams in flight at the SIGTERM finished during the drain;
- the executor holds no request and every KV block is free, as at the start; the
  scheduler's request tables are empty and it counts every block free;
- the timeline reads, and `swarmserve timeline` draws it;
- the metrics add up (tokens streamed = tokens counted): each finished attempt received the
  tokens its usage counted, and on the scheduler that ran last, its counter, GetServerInfo
  and its requests' ends (its log) count the same tokens, those of its finished requests
  being the tokens its clients received.

The model is a tiny random one with its own output head: a tied head makes a random model
repeat the prompt's last token under greedy decoding, so identical streams would prove little.

CI size by default (under 2 minutes on two cores); SWARMSERVE_LONG_TESTS=1 runs the long one.
The figures (requests, faults, streams identical, blocks leaked) are printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections import Counter

import grpc
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import AsyncSwarmClient
from clients.cli import main as cli_main
from clients.timeline import fetch_timeline
from swarmserve.executor.v1 import executor_pb2 as epb
from swarmserve.executor.v1 import executor_pb2_grpc as epb_grpc
from tests.support.soak import JSON_SCHEMA, SoakProgress, SoakSize, run_agent, side_request
from tests.support.stack import Stack, free_port
from tests.support.tiny_gguf import TinyModelSpec, tiny_kv_bytes_per_block

openai = pytest.importorskip("openai")

IS_LONG = os.environ.get("SWARMSERVE_LONG_TESTS") == "1"
SIZE = SoakSize(num_agents=12, num_turns=6, max_tokens=96, num_side_requests=60) if IS_LONG else SoakSize(8, 3, 40, 15)
MODEL = TinyModelSpec(context_length=4096, tie_word_embeddings=False, seed=1)
BLOCK = 16
BYTES_PER_BLOCK = tiny_kv_bytes_per_block(BLOCK)
NUM_KV_BLOCKS = 192  # ~3,000 tokens: a small KV cache (the executor's default is far larger)
# Before each fault (kill, drain + restart, kill), the share of the undisturbed run's tokens streamed
# since the one before: the last kill's share is left whatever the drain streamed.
FAULT_SHARES = (0.15, 0.15, 0.15)
DOCUMENTED = {"ok", "503", "no connection", "stream cut"}
SIDE_DOCUMENTED = {"disconnected", "cancelled", "aborted", "503", "unavailable", "no connection", "stream cut"}
ENDED_UNFINISHED = ("aborted", "error")  # a request's end in the scheduler's log that its client did not see
IDLE_TIMEOUT_S = 10.0
RUN_TIMEOUT_S = 1800.0 if IS_LONG else 600.0  # turns a hang into a failure


@pytest.fixture(scope="module")
def stack(tiny_gguf_path, tmp_path_factory):
    model = tiny_gguf_path(MODEL)
    kv_gb = NUM_KV_BLOCKS * BYTES_PER_BLOCK / (1 << 30)
    executor_metrics_port = free_port()
    s = Stack(
        ["--model", str(model), "--kv-cache-gb", repr(kv_gb), "--metrics-port", str(executor_metrics_port)],
        ["--drain-timeout-s", "30"],
        log_dir=tmp_path_factory.mktemp("logs"),
        serve_http=True,
    )
    try:  # a start that fails must not leave a process behind
        s.start()
        s.executor_metrics_url = f"http://127.0.0.1:{executor_metrics_port}/metrics"
        yield s
    finally:
        s.stop()


async def executor_state(stack) -> tuple[int, int]:
    """(free KV blocks, KV blocks) as the executor says, read-only (GetInfo without a scheduler id)."""
    async with grpc.aio.insecure_channel(stack.executor_address) as channel:
        info = await epb_grpc.ExecutorServiceStub(channel).GetInfo(epb.GetInfoRequest(), timeout=5)
    return info.num_free_kv_blocks, info.num_kv_blocks


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


class Faults:
    """Kill the executor, drain and restart the scheduler, kill the executor again, each once the
    run has streamed its share of the undisturbed run's tokens since the fault before (since
    the new scheduler's start for the last kill: the drain lets streams in flight finish, which
    may stream more than a share). The progress's incarnation number tags each attempt with the
    scheduler that served it."""

    def __init__(self, stack, total_tokens: int, progress: SoakProgress) -> None:
        self.stack = stack
        self.progress = progress
        progress.on_tokens = self.on_tokens
        self.total_tokens = total_tokens
        self._next_at = 0  # the token count the next fault waits for
        self._reached = asyncio.Event()
        self.injected: list[str] = []
        self.drain_exit_code: int | None = None
        self.sigterm_s = 0.0  # time.monotonic() when the scheduler was sent SIGTERM

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens >= self._next_at:
            self._reached.set()

    async def _streamed(self, share: float) -> None:
        """Wait until the run has streamed `share` of the undisturbed run's tokens from now."""
        self._next_at = self.progress.num_tokens + int(share * self.total_tokens)
        self._reached.clear()
        await self._reached.wait()

    async def run(self) -> None:
        stack = self.stack
        await self._streamed(FAULT_SHARES[0])
        await asyncio.to_thread(self._kill_executor)
        await self._streamed(FAULT_SHARES[1])
        self.sigterm_s = time.monotonic()
        stack.scheduler.send_signal(signal.SIGTERM)
        self.drain_exit_code = await asyncio.to_thread(stack.scheduler.wait, 60)
        self.injected.append(f"scheduler SIGTERM (drained, exited in {time.monotonic() - self.sigterm_s:.1f} s)")
        self.progress.incarnation += 1  # attempts from now on reach the new scheduler (or fail and retry)
        await asyncio.to_thread(stack.start_scheduler)  # until it serves (it fails here if it cannot start)
        await self._streamed(FAULT_SHARES[2])
        await asyncio.to_thread(self._kill_executor)

    def _kill_executor(self) -> None:
        self.stack.kill_executor()
        self.injected.append("executor SIGKILL")
        self.stack.start_executor(wait=False)


async def run_swarm(stack, progress: SoakProgress, faults: Faults | None = None):
    """The agents (and, when disturbed, the side requests and the faults): (turns, side results)."""
    async with openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        agents = [run_agent(c, i, SIZE, progress) for i in range(SIZE.num_agents)]
        side = []
        if faults is not None:
            spacing = faults.total_tokens // SIZE.num_side_requests
            side = [
                side_request(i, stack.http_url, stack.scheduler_address, progress, i * spacing)
                for i in range(SIZE.num_side_requests)
            ]
        work = asyncio.ensure_future(asyncio.gather(*agents, *side))
        if faults is not None:  # a fault that fails ends the run at once
            fault_task = asyncio.create_task(faults.run())
            await asyncio.wait({work, fault_task}, timeout=RUN_TIMEOUT_S, return_when=asyncio.FIRST_EXCEPTION)
            if fault_task.done() and fault_task.exception() is not None:
                work.cancel()
                raise fault_task.exception()
            await asyncio.wait_for(fault_task, RUN_TIMEOUT_S)
        results = await asyncio.wait_for(work, RUN_TIMEOUT_S)
    return [t for turns in results[: SIZE.num_agents] for t in turns], results[SIZE.num_agents :]


def scheduler_logs(stack) -> list[list[dict]]:
    """Each scheduler process's JSON log lines, in the order they ran."""
    logs: list[list[dict]] = []
    for line in (stack.log_dir / "scheduler.log").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("event") == "scheduler_listening" or not logs:
            logs.append([])
        logs[-1].append(record)
    return logs


async def wait_idle(stack, start_free: int):
    """(GetServerInfo, the executor's free KV blocks, the last scheduler's log) once nothing runs
    or is queued, every block is back and every request's end is logged: a request's end reaches
    the executor with the next step, and the scheduler's log when its handler lets go of it,
    which may be after its client has read the end. AssertionError after IDLE_TIMEOUT_S."""
    async with AsyncSwarmClient(stack.scheduler_address) as client:
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            info = await client.server_info()
            free, _ = await executor_state(stack)
            executor_running = scrape(stack.executor_metrics_url).get("swarmserve_executor_running_requests")
            log = scheduler_logs(stack)[-1]
            num_ended_tokens = sum(r["completion_tokens"] for r in log if r.get("event") == "request_finished")
            held = (info.num_running_requests, info.num_queued_requests, start_free - free, executor_running)
            if held == (0, 0, 0, 0) and info.num_free_kv_blocks == info.num_kv_blocks:
                if num_ended_tokens == info.num_generated_tokens:
                    return info, free, log
            assert time.monotonic() < deadline, (
                f"not idle {IDLE_TIMEOUT_S:g} s after the run: {info.num_running_requests} running, "
                f"{info.num_queued_requests} queued, {start_free - free} KV blocks held, executor running "
                f"{executor_running}, the scheduler counts {info.num_free_kv_blocks}/{info.num_kv_blocks} free; "
                f"{info.num_generated_tokens} tokens output, {num_ended_tokens} in the requests ended"
            )
            await asyncio.sleep(0.1)


def test_the_swarm_survives_executor_kills_and_a_scheduler_drain(stack, tmp_path):
    async def main():
        start_free, num_blocks = await executor_state(stack)
        reference, _ = await run_swarm(stack, SoakProgress())
        total = sum(len(t.token_ids) for t in reference)
        progress = SoakProgress()
        faults = Faults(stack, total, progress)
        disturbed, side = await run_swarm(stack, progress, faults)
        info, end_free, last_log = await wait_idle(stack, start_free)
        return start_free, num_blocks, end_free, info, last_log, reference, disturbed, side, faults, progress

    t0 = time.monotonic()
    start_free, num_blocks, end_free, info, last_log, reference, disturbed, side, faults, progress = asyncio.run(main())
    run_s = time.monotonic() - t0

    # Faults: all injected; the drain ended the old scheduler cleanly.
    assert len(faults.injected) == 3 and faults.drain_exit_code == 0, faults.injected
    # Every turn identical to the undisturbed run; every failed attempt met a documented status.
    attempts = [a for t in disturbed for a in t.attempts]
    assert {a.outcome for a in attempts} <= DOCUMENTED, {a.outcome for a in attempts} - DOCUMENTED
    for a, b in zip(reference, disturbed, strict=True):
        assert (b.agent, b.turn) == (a.agent, a.turn)
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), (
            f"agent {a.agent} turn {a.turn} ({a.kind}) differs: {a} undisturbed, {b} disturbed"
        )
        if b.kind == "json":
            assert b.finish_reason == "stop", b.text  # the grammar ended it
            jsonschema.validate(json.loads(b.text), JSON_SCHEMA)
    assert ("stop", "stop") in {(t.kind, t.finish_reason) for t in disturbed}, "no turn ended on a stop string"
    assert {s.outcome for s in side} <= SIDE_DOCUMENTED, {s.outcome for s in side} - SIDE_DOCUMENTED
    # Each fault hit work in flight: each executor kill left requests waiting, sent again to the
    # next executor; requests in flight at the SIGTERM finished while the scheduler drained.
    logs = scheduler_logs(stack)
    assert len(logs) == 2 and logs[-1] == last_log
    lost = [r["requests_waiting"] for log in logs for r in log if r.get("event") == "executor_lost"]
    resubmitted = [r["num_requests"] for log in logs for r in log if r.get("event") == "requests_resubmitted"]
    assert len(lost) == len(resubmitted) == 2 and min(lost) > 0, (lost, resubmitted)
    drained = [t for t in disturbed if t.attempts[-1].incarnation == 0 and t.attempts[-1].end_s > faults.sigterm_s]
    assert drained, "no stream was in flight at the SIGTERM"
    # Blocks and tables as at the start.
    assert end_free == start_free == num_blocks
    assert info.num_running_requests == info.num_queued_requests == 0
    # The timeline reads, and draws.
    timeline = fetch_timeline(stack.scheduler_address)
    assert timeline.steps
    assert cli_main(["timeline", "--server", stack.scheduler_address, "--out", str(tmp_path / "soak")]) == 0
    # The metrics add up. Each finished attempt received what its usage counted.
    finished = [a for a in attempts if a.outcome == "ok"]
    assert all(a.num_tokens == a.num_counted_tokens for a in finished)
    # On the scheduler that ran last: its counter, GetServerInfo and its requests' ends agree, and
    # its finished requests' tokens are those its agents received.
    counted = scrape(stack.http_url + "/metrics")["swarmserve_scheduler_generated_tokens_total"]
    ended = [r for r in last_log if r.get("event") == "request_finished"]
    assert counted == info.num_generated_tokens == sum(r["completion_tokens"] for r in ended)
    last = progress.incarnation
    assert sum(a.num_tokens for a in finished if a.incarnation == last) == sum(
        r["completion_tokens"] for r in ended if r["finish_reason"] not in ENDED_UNFINISHED
    )
    assert len([a for a in finished if a.incarnation == last]) == len(
        [r for r in ended if r["finish_reason"] not in ENDED_UNFINISHED]
    )
    outcomes = Counter(a.outcome for a in attempts)
    identical = sum(a.token_ids == b.token_ids for a, b in zip(reference, disturbed))
    steps = timeline.steps  # the last scheduler's
    print(
        f"\nsoak ({'long' if IS_LONG else 'CI'}, {run_s:.0f} s): {SIZE.num_agents} agents x {SIZE.num_turns} turns, "
        f"{len(attempts)} attempts {dict(outcomes)}, {len(side)} side requests {dict(Counter(s.outcome for s in side))}"
        f"; faults: {', '.join(faults.injected)} (streams waiting at the kills {lost}, {len(drained)} finished "
        f"while draining); turns identical {identical}/{len(reference)}; KV blocks leaked {start_free - end_free}; "
        f"tokens streamed {sum(a.num_tokens for a in attempts)}, by the last scheduler's finished requests "
        f"{sum(a.num_tokens for a in finished if a.incarnation == last)} = counted "
        f"{sum(r['completion_tokens'] for r in ended if r['finish_reason'] not in ENDED_UNFINISHED)}; last scheduler's "
        f"{len(steps)} steps: {sum(s.num_preempted for s in steps)} preemptions, "
        f"{sum(s.num_accepted_tokens for s in steps)}/{sum(s.num_drafted_tokens for s in steps)} drafts accepted"
    )
