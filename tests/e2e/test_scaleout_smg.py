"""Scale-out through a real gateway: `swarmserve serve --replicas 2 --gateway smg` (two
executor+scheduler pairs on a tiny model behind `smg launch --policy cache_aware`), driven
through its one entry address by the official `openai` SDK.

- 16 agents x 3 turns all complete; every later turn reports cached prompt tokens covering
  the earlier turn's prompt (the gateway sent it back to the pair holding that prefix:
  each agent's prompt is unique from its first block), and both pairs served agents;
- a W3C `traceparent` sent to the gateway reaches the pair, whose request span (exported
  over OTLP to a receiver on loopback) is a child of it;
- a session-id header as SMG's routing key pins a conversation to one pair (round_robin);
- failover: one pair's scheduler is killed mid-run; the launcher stops that pair's executor
  and goes on, the gateway marks it unhealthy and new agents keep completing on the other;
- Ctrl-C stops the gateway and every server: no process left, every port free.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from clients.bench.otlp_sink import OtlpSinkServer  # noqa: E402
from tests.support.stack import ROOT, free_port  # noqa: E402
from tests.support.tiny_gguf import TinyModelSpec, tiny_kv_bytes_per_block, write_tiny_model  # noqa: E402

BLOCK = 16
NUM_AGENTS = 16
NUM_TURNS = 3
NUM_KV_BLOCKS = 768  # every agent's conversation stays cached on its pair
BYTES_PER_BLOCK = tiny_kv_bytes_per_block(BLOCK)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def smg_can_run() -> str | None:
    """Why the smg binary cannot run here (None: it can). Not installed is a failure under CI,
    whose test extra installs it; a binary that will not start on this platform is a skip."""
    if importlib.util.find_spec("smg") is None:
        if os.environ.get("CI"):
            pytest.fail("the smg package is not installed, but the test extra installs it (pip install -e '.[test]')")
        return "the smg package is not installed (pip install smg; it is in the test extra)"
    try:
        probe = subprocess.run([sys.executable, "-m", "smg", "launch", "--help"], capture_output=True, timeout=60)
    except OSError as error:
        return f"smg cannot start on this platform: {error}"
    if probe.returncode != 0:
        return f"smg cannot run on this platform: {probe.stderr.decode(errors='replace')[-300:]}"
    return None


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                children.append(int(entry.name))
    return children


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


class Fleet:
    def __init__(self, proc: subprocess.Popen, banner: str, log: Path) -> None:
        self.proc = proc
        self.banner = banner
        self.log = log
        self.entry_url = re.search(r"\(SMG, cache_aware\)\s+(http://\S+)/v1", banner).group(1)
        self.replica_urls = [
            m.group(1) for m in re.finditer(r"replica \d OpenAI/Anthropic HTTP API\s+(http://\S+)/v1", banner)
        ]
        self.replica_schedulers = re.findall(r"replica \d scheduler\s+grpc://(\S+)", banner)
        self.replica_executors = re.findall(r"replica \d executor\s+grpc://(\S+)", banner)
        self.model = re.search(r"serving (\S+)", banner).group(1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    reason = smg_can_run()
    if reason is not None:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("scaleout")
    model = write_tiny_model(workdir / "tiny.gguf", TinyModelSpec(context_length=1024))
    kv_gb = NUM_KV_BLOCKS * BYTES_PER_BLOCK / (1 << 30)
    http, scheduler, executor = free_port(), free_port(), free_port()
    log = workdir / "serve.log"
    with OtlpSinkServer() as receiver:
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        for name in ("OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER_ARG"):
            env.pop(name, None)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clients.cli",
                "serve",
                "--replicas",
                "2",
                "--gateway",
                "smg",
                "--http-listen",
                f"127.0.0.1:{http}",
                # Far apart: replica i adds 2*i to each.
                "--scheduler-listen",
                f"127.0.0.1:{scheduler}",
                "--executor-listen",
                f"127.0.0.1:{executor}",
                "--gateway-arg=--health-check-interval-secs",
                "--gateway-arg=1",
                # cache_aware's spill gate sends a request away from the pair holding its prefix
                # when that pair has over 1.5x the mean load in flight; 16 agents starting at once
                # on two pairs trip it. With two pairs no load exceeds 2x the mean: never spill.
                "--gateway-arg=--balance-rel-threshold",
                "--gateway-arg=2",
                "--gateway-arg=--health-failure-threshold",
                "--gateway-arg=1",
                "--model",
                str(model),
                "--kv-cache-gb",
                repr(kv_gb),
                "--no-calibration",
                "--spec",
                "off",
                "--default-max-new-tokens",
                "8",
            ],  # fmt: skip
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(log, "wb"),
            text=True,
        )
        try:
            banner = ""
            deadline = time.monotonic() + 120
            while "gateway metrics" not in banner and time.monotonic() < deadline and proc.poll() is None:
                banner += proc.stdout.readline()
            assert "gateway metrics" in banner, f"no banner: {banner}\n{log.read_text()[-3000:]}"
            yield Fleet(proc, banner, log), receiver
        finally:
            if proc.poll() is None:  # a test failed before Ctrl-C: stop it the same way, its children too
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _agent(entry_url: str, model: str, index: int) -> list:
    """One agent's conversation: a system prompt unique from its first token, three turns."""
    with openai.OpenAI(base_url=entry_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        messages = [
            {
                "role": "system",
                "content": f"{index:02d}#{index * 7919:08x} You are agent {index}; you refactor module {index}. " * 6,
            }
        ]
        usages = []
        for turn in range(NUM_TURNS):
            messages.append({"role": "user", "content": f"Turn {turn}: continue with step {turn} of the plan."})
            reply = client.chat.completions.create(model=model, messages=messages, temperature=0.0)
            usages.append(reply.usage)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        return usages


def _finished(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("swarmserve_scheduler_requests_finished_total")
    )


def test_agents_stick_to_the_pair_holding_their_prefix(fleet):
    fleet, _ = fleet
    assert len(fleet.replica_urls) == 2
    with ThreadPoolExecutor(NUM_AGENTS) as pool:
        conversations = list(pool.map(lambda i: _agent(fleet.entry_url, fleet.model, i), range(NUM_AGENTS)))
    for index, usages in enumerate(conversations):
        assert [u.completion_tokens for u in usages] == [8] * NUM_TURNS
        for before, after in zip(usages, usages[1:]):
            # The earlier turn's prompt, to its last full block, came from this pair's cache.
            assert after.prompt_tokens_details.cached_tokens >= before.prompt_tokens // BLOCK * BLOCK, (index, usages)
    served = [_finished(url) for url in fleet.replica_urls]
    assert sum(served) == NUM_AGENTS * NUM_TURNS and all(n >= NUM_TURNS for n in served), served


def test_trace_context_crosses_the_gateway(fleet):
    fleet, receiver = fleet
    with openai.OpenAI(base_url=fleet.entry_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        client.chat.completions.create(  # "swarmserve", the README's model name: an alias at the gateway
            model="swarmserve",
            messages=[{"role": "user", "content": "traced"}],
            extra_headers={"traceparent": TRACEPARENT},
        )
    trace_id, parent_id = TRACEPARENT.split("-")[1:3]
    deadline = time.monotonic() + 20
    spans = []
    while not spans and time.monotonic() < deadline:
        spans = [s for s in receiver.sink.spans if s.name == "request" and s.trace_id == trace_id]
        time.sleep(0.1)
    assert len(spans) == 1, "no request span in the client's trace"
    assert spans[0].parent_span_id == parent_id and spans[0].service_name == "swarmserve-scheduler"


def test_a_session_header_pins_a_conversation_under_round_robin(fleet):
    """The documented alternative to cache_aware: SMG's routing key from `x-session-id` (which
    our front also takes as the session id). A second gateway, round_robin, in front of the
    same pairs: six requests of one session land on one pair, where plain round robin would
    alternate."""
    fleet, _ = fleet
    port = free_port()
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smg",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--routing-key-override",
            "--routing-key-headers",
            "x-session-id",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
            "--worker-urls",
            *fleet.replica_urls,
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    entry = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(entry + "/readiness", timeout=2).json().get("healthy_workers") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        with openai.OpenAI(base_url=entry + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            for session in ("session-a", "session-b"):
                before = [_finished(url) for url in fleet.replica_urls]
                for turn in range(6):
                    client.chat.completions.create(
                        model=fleet.model,
                        messages=[{"role": "user", "content": f"{session} turn {turn}"}],
                        extra_headers={"x-session-id": session},
                    )
                served = [_finished(url) - b for url, b in zip(fleet.replica_urls, before)]
                assert sorted(served) == [0, 6], (session, served)
    finally:
        gateway.terminate()
        gateway.wait(30)


def test_a_dead_pair_is_routed_around_and_ctrl_c_leaves_nothing_behind(fleet):
    fleet, _ = fleet
    children = _children(fleet.proc.pid)
    pids = {_cmdline(pid): pid for pid in children}
    victim = next(pid for line, pid in pids.items() if f"--listen {fleet.replica_schedulers[1]} " in line)
    victim_executor = next(pid for line, pid in pids.items() if f"--listen {fleet.replica_executors[1]} " in line)
    dead_url = fleet.replica_urls[1]

    # Mid-run: agents are talking to both pairs when one pair's scheduler dies. Those whose turn
    # was on it may fail (their conversation's KV died with it); that is not asserted.
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(_agent, fleet.entry_url, fleet.model, i) for i in range(200, 208)]
        served_before = _finished(dead_url)
        deadline = time.monotonic() + 30
        while _finished(dead_url) < served_before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _finished(dead_url) >= served_before + 2, "no agent's turn reached the pair to kill"
        os.kill(victim, signal.SIGKILL)
        for future in running:
            future.exception()  # wait; a failure here is the dead pair's in-flight turn

    # The launcher stops the dead pair's executor and goes on serving; the gateway takes the
    # pair out of rotation, and new agents complete on the other.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_is_alive(victim_executor) or _is_healthy(fleet.entry_url, dead_url)):
        time.sleep(0.2)
    assert not _is_alive(victim_executor), "the dead pair's executor is still running"
    assert not _is_healthy(fleet.entry_url, dead_url), "the gateway still counts the dead pair healthy"
    assert fleet.proc.poll() is None, "serve stopped when one of two pairs died"
    before = _finished(fleet.replica_urls[0])
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _agent(fleet.entry_url, fleet.model, i), range(100, 104)))
    assert _finished(fleet.replica_urls[0]) == before + 4 * NUM_TURNS

    fleet.proc.send_signal(signal.SIGINT)
    assert fleet.proc.wait(60) == 0, fleet.log.read_text()[-2000:]
    assert [pid for pid in children if _is_alive(pid)] == []
    for url in [fleet.entry_url, *fleet.replica_urls]:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger in TIME_WAIT
            s.bind((host, int(port)))  # fails while anything still listens there


def _is_healthy(entry_url: str, worker_url: str) -> bool:
    workers = httpx.get(entry_url + "/workers", timeout=5).json()["workers"]
    return any(w["url"] == worker_url and w["is_healthy"] for w in workers)


def test_fleet_flags_lay_out_ports_and_refuse_what_cannot_work():
    from clients.cli import parse_args
    from clients.serve_fleet import FleetConfig, gateway_command

    config = parse_args(
        [
            "serve",
            "--replicas",
            "3",
            "--gateway",
            "smg",
            "--metrics-port",
            "9100",
            "--gateway-arg=--log-level",
            "--gateway-arg=info",
        ]
    ).config
    assert isinstance(config, FleetConfig)
    layout = [(r.scheduler_listen, r.executor_listen, r.http_listen, r.metrics_port) for r in config.replicas]
    assert layout == [
        ("127.0.0.1:50051", "127.0.0.1:50052", "127.0.0.1:8001", 9100),
        ("127.0.0.1:50053", "127.0.0.1:50054", "127.0.0.1:8002", 9102),
        ("127.0.0.1:50055", "127.0.0.1:50056", "127.0.0.1:8003", 9104),
    ]
    command = gateway_command(config, config.gateway_metrics_port, "tiny")
    assert command[command.index("--port") + 1] == "8000" and command[command.index("--prometheus-port") + 1] == "9106"
    assert command[command.index("--worker-urls") + 1 :][:3] == [
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8002",
        "http://127.0.0.1:8003",
    ]
    assert command[-2:] == ["--log-level", "info"]  # after ours, so it wins
    assert command[command.index("--model-alias") + 1] == "swarmserve=tiny"

    for argv, message in (
        (["--replicas", "2"], "needs a gateway"),
        (["--replicas", "2", "--gateway", "smg", "--http-listen", ""], "entry address"),
        (
            [
                "--replicas",
                "2",
                "--gateway",
                "smg",
                "--scheduler-listen",
                "127.0.0.1:7000",
                "--executor-listen",
                "127.0.0.1:7002",
            ],
            "overlap",
        ),
    ):
        with pytest.raises(SystemExit):
            parse_args(["serve", *argv])
        with pytest.raises(ValueError, match=message):
            from clients.cli import build_parser, serve_config

            args, rest = build_parser().parse_known_args(["serve", *argv])
            serve_config(args, rest)


def test_scaleout_bench_draws_its_picture(tmp_path):
    """`bench scaleout`'s PNG (deploy/scale-out.png is one) from a result of its shape."""
    from clients.bench.scaleout import plot

    run = {"requests_per_s": 10.0, "makespan_s": 4.8, "mean_latency_s": 1.2, "prefix_hit_rate": 0.8}
    results = {
        "agents": 16,
        "turns": 3,
        "tokens": 16,
        "runs": {"1 pair": run, "SMG cache_aware": run},
        "gateway_latency": {"added_s": 0.002},
    }
    plot(results, tmp_path / "scale-out.png")
    assert (tmp_path / "scale-out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
