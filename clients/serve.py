"""`swarmserve serve`: run the executor and the scheduler as child processes, as one service.

Startup is ordered because the scheduler needs a live executor: start the executor, wait
for SERVING on its standard health service, then the same for the scheduler. A child
that exits during startup is reported with its exit status (its own log, on the shared
stderr, says why); one that never becomes ready is stopped after `startup_timeout_s`.

Shutdown runs the other way: the scheduler first, so no new steps reach the executor,
then the executor. Each gets SIGTERM (both treat it as "stop gracefully") and SIGKILL
after `shutdown_grace_s`. The children run in their own process group, so a terminal's
Ctrl-C reaches only this supervisor, which then stops them in that order; if either
child dies while serving, the other is stopped too and the supervisor reports failure.

Flags left unset are not passed on, so each server's own defaults stay the only ones.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from dataclasses import dataclass

import grpc

from clients.client import AsyncSwarmClient
from clients.errors import SwarmServeError
from clients.health import FAST_RECONNECT_OPTIONS, wait_serving
from scheduler_svc.config import BATCHING_MODES, DEFAULT_HTTP_LISTEN
from service_common.observability.logs import LOG_FORMATS

# The servers bind with SO_REUSEPORT (gRPC's default), so a leftover server on the same
# port would answer our health checks; refuse to start instead of probing the wrong one.
_PORT_PROBE_TIMEOUT_S = 0.5


def _check_listen_address(flag: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")


def _check_positive(flag: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{flag} must be positive, got {value}")


@dataclass(frozen=True)
class ServeConfig:
    """None means "not given": the flag is not passed and the child's default applies."""

    executor_listen: str = "127.0.0.1:50052"
    scheduler_listen: str = "127.0.0.1:50051"
    http_listen: str = DEFAULT_HTTP_LISTEN  # the scheduler's OpenAI/Anthropic HTTP API; empty: off
    model: str = "default"
    dtype: str | None = None
    device: str | None = None
    kv_cache_gb: float | None = None
    block_size: int | None = None
    threads: int | None = None
    batching: str | None = None
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    max_num_batched_tokens: int | None = None  # given to both: the scheduler's budget must fit the executor's
    default_max_new_tokens: int | None = None
    log_format: str | None = None
    otlp_endpoint: str | None = None  # both send traces here (the OTEL_* variables reach them anyway)
    trace_sample_ratio: float | None = None
    metrics_port: int | None = None  # the scheduler's Prometheus port; the executor's is the next one
    startup_timeout_s: float = 300.0
    shutdown_grace_s: float = 10.0

    def __post_init__(self) -> None:
        _check_listen_address("executor_listen", self.executor_listen)
        _check_listen_address("scheduler_listen", self.scheduler_listen)
        if self.http_listen:
            _check_listen_address("http_listen", self.http_listen)
        if connect_address(self.executor_listen) == connect_address(self.scheduler_listen):
            raise ValueError(f"the executor and the scheduler cannot both listen on {self.executor_listen}")
        if not self.model:
            raise ValueError("model must not be empty")
        if self.batching is not None and self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {self.batching!r}")
        if self.log_format is not None and self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        positive = (
            "kv_cache_gb",
            "block_size",
            "threads",
            "max_running_requests",
            "max_num_batched_tokens",
            "default_max_new_tokens",
        )
        for flag in positive:
            _check_positive(flag, getattr(self, flag))
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.trace_sample_ratio is not None and not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65535:
            raise ValueError(f"metrics_port must be in 1..65534 (the executor takes the next port), got {self.metrics_port}")
        _check_positive("startup_timeout_s", self.startup_timeout_s)
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")


def connect_address(listen: str) -> str:
    """Where to reach a server listening on `listen`: a wildcard host means this machine."""
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", "*"):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"


def _optional_flags(pairs: list[tuple[str, object]]) -> list[str]:
    return [arg for flag, value in pairs if value is not None for arg in (flag, str(value))]


def executor_command(config: ServeConfig, python: str = sys.executable) -> list[str]:
    return [
        python, "-m", "executor_svc.main",
        "--listen", config.executor_listen,
        "--model", config.model,
        *_optional_flags([
            ("--dtype", config.dtype),
            ("--device", config.device),
            ("--kv-cache-gb", config.kv_cache_gb),
            ("--block-size", config.block_size),
            ("--max-num-batched-tokens", config.max_num_batched_tokens),
            ("--threads", config.threads),
            ("--log-format", config.log_format),
            ("--otlp-endpoint", config.otlp_endpoint),
            ("--trace-sample-ratio", config.trace_sample_ratio),
            ("--metrics-port", None if config.metrics_port is None else config.metrics_port + 1),
        ]),
    ]  # fmt: skip


def scheduler_command(config: ServeConfig, python: str = sys.executable) -> list[str]:
    return [
        python, "-m", "scheduler_svc.main",
        "--listen", config.scheduler_listen,
        *(["--http-listen", config.http_listen] if config.http_listen else []),
        "--executor", connect_address(config.executor_listen),
        *_optional_flags([
            ("--max-running-requests", config.max_running_requests),
            ("--max-queued-requests", config.max_queued_requests),
            ("--max-num-batched-tokens", config.max_num_batched_tokens),
            ("--batching", config.batching),
            ("--default-max-new-tokens", config.default_max_new_tokens),
            ("--log-format", config.log_format),
            ("--otlp-endpoint", config.otlp_endpoint),
            ("--trace-sample-ratio", config.trace_sample_ratio),
            ("--metrics-port", config.metrics_port),
        ]),
    ]  # fmt: skip


def describe_exit(returncode: int) -> str:
    """`exited with code 1`, or `was killed by SIGKILL` for a negative (signal) return code."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class ServeError(Exception):
    """The service could not be started (a child died, never became ready, or the port is taken)."""


@dataclass(frozen=True)
class ChildExit:
    name: str  # "executor" | "scheduler"
    returncode: int

    def describe(self) -> str:
        return f"{self.name} {describe_exit(self.returncode)}"


@dataclass(frozen=True)
class ServeReady:
    executor_address: str
    scheduler_address: str
    model_name: str
    http_url: str = ""  # the OpenAI/Anthropic HTTP API's base URL; empty: off


async def _is_listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), _PORT_PROBE_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def _finish(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Supervisor:
    """start() -> wait() -> stop(); request_stop() (e.g. from a signal handler) ends start or wait early."""

    def __init__(self, config: ServeConfig, *, python: str = sys.executable, log_file=None) -> None:
        self.config = config
        self._python = python
        self._log_file = log_file  # children's output; None shares this process's stdout/stderr
        self._children: dict[str, asyncio.subprocess.Process] = {}  # in start order
        self._stop_requested = asyncio.Event()

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def start(self) -> ServeReady | None:
        """Start the executor, then the scheduler, each once the one before is SERVING.

        Returns None if a stop was requested meanwhile; raises ServeError if startup failed.
        The caller runs stop() in either case.
        """
        config = self.config
        executor_address = connect_address(config.executor_listen)
        scheduler_address = connect_address(config.scheduler_listen)
        addresses = [("executor", executor_address), ("scheduler", scheduler_address)]
        if config.http_listen:
            addresses.append(("scheduler's HTTP API", connect_address(config.http_listen)))
        for name, address in addresses:
            if await _is_listening(address):
                raise ServeError(f"something already listens on {address}; is another swarmserve running? (needed by the {name})")

        steps = (
            ("executor", executor_command(config, self._python), executor_address),
            ("scheduler", scheduler_command(config, self._python), scheduler_address),
        )
        for name, command, address in steps:
            self._children[name] = await asyncio.create_subprocess_exec(
                *command, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=self._log_file, process_group=0
            )
            if not await self._wait_serving(name, address):
                return None
        http_url = f"http://{connect_address(config.http_listen)}" if config.http_listen else ""
        return ServeReady(executor_address, scheduler_address, await self._model_name(scheduler_address), http_url)

    async def _wait_serving(self, name: str, address: str) -> bool:
        """True once `name` is SERVING; False if a stop was requested first."""
        process = self._children[name]
        async with grpc.aio.insecure_channel(address, options=list(FAST_RECONNECT_OPTIONS)) as channel:
            serving = asyncio.ensure_future(wait_serving(channel, self.config.startup_timeout_s))
            exited = asyncio.ensure_future(process.wait())
            stopped = asyncio.ensure_future(self._stop_requested.wait())
            try:
                await asyncio.wait({serving, exited, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await _finish([serving, exited, stopped])
        if self._stop_requested.is_set():
            return False
        if process.returncode is not None:
            raise ServeError(f"the {name} {describe_exit(process.returncode)} during startup (its log is above)")
        if serving.cancelled() or serving.exception() is not None:
            raise ServeError(
                f"the {name} was not SERVING on {address} within {self.config.startup_timeout_s:g}s "
                f"({serving.exception() if not serving.cancelled() else 'cancelled'})"
            )
        return True

    async def _model_name(self, scheduler_address: str) -> str:
        """The served model's name, from the scheduler; the --model given if it cannot say."""
        async with AsyncSwarmClient(scheduler_address, timeout=10.0) as client:
            try:
                info = await client.server_info()
            except SwarmServeError:
                return self.config.model
        return info.model_name or self.config.model

    async def wait(self) -> ChildExit | None:
        """Block until a child exits (returned) or a stop is requested (None)."""
        exits = {asyncio.ensure_future(process.wait()): name for name, process in self._children.items()}
        stopped = asyncio.ensure_future(self._stop_requested.wait())
        try:
            done, _ = await asyncio.wait({*exits, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _finish([*exits, stopped])
        if stopped in done:
            return None
        for name, process in self._children.items():
            if process.returncode is not None:
                return ChildExit(name, process.returncode)
        return None

    async def stop(self) -> None:
        """Stop the children, the last started first: SIGTERM, then SIGKILL after the grace period."""
        for name in reversed(list(self._children)):
            process = self._children[name]
            if process.returncode is not None:
                continue
            try:
                process.terminate()
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(process.wait(), self.config.shutdown_grace_s)
            except TimeoutError:
                process.kill()
                await process.wait()
