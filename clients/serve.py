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

Every other flag is the services' own, passed on to the one that defines it (to both when
both do), so each flag is defined once and each server's defaults stay the only ones.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from clients.client import AsyncSwarmClient
from clients.errors import SwarmServeError
from clients.health import FAST_RECONNECT_OPTIONS, wait_serving
from executor_svc.config import EngineConfig
from executor_svc.flags import build_parser as executor_parser
from scheduler_svc.config import DEFAULT_HTTP_LISTEN
from scheduler_svc.main import build_parser as scheduler_parser

# The servers bind with SO_REUSEPORT (gRPC's default), so a leftover server on the same
# port would answer our health checks; refuse to start instead of probing the wrong one.
_PORT_PROBE_TIMEOUT_S = 0.5

# Service flags serve sets itself, or cannot honour (its health checks and the scheduler's
# link to the executor run in the clear on this machine).
_NOT_PASSED = {
    "--listen": "serve sets it from --executor-listen and --scheduler-listen",
    "--executor": "serve points the scheduler at its own executor",
    "--tls-cert": "serve runs both services in the clear; start them one by one for TLS",
    "--tls-key": "serve runs both services in the clear; start them one by one for TLS",
    "--executor-ca": "serve runs both services in the clear; start them one by one for TLS",
}


def _check_listen_address(flag: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")


@dataclass(frozen=True)
class ServeConfig:
    """Any other flag of either service rides in executor_args / scheduler_args, so each
    flag is defined once, by its service, and its default is the service's own."""

    executor_listen: str = "127.0.0.1:50052"
    scheduler_listen: str = "127.0.0.1:50051"
    http_listen: str = DEFAULT_HTTP_LISTEN  # the scheduler's OpenAI/Anthropic HTTP API; empty: off
    executor_args: tuple[str, ...] = ()  # e.g. ("--model", "m.gguf", "--kv-cache-gb", "2")
    scheduler_args: tuple[str, ...] = ()  # e.g. ("--spec", "off")
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
        if self.metrics_port is not None and not 0 < self.metrics_port < 65535:
            raise ValueError(
                f"metrics_port must be in 1..65534 (the executor takes the next port), got {self.metrics_port}"
            )
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be positive, got {self.startup_timeout_s}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")

    @property
    def model(self) -> str:
        return flag_value(self.executor_args, "--model") or EngineConfig.model


def free_port() -> int:
    """A port nothing on this machine's loopback listens on now (for tests and benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect_address(listen: str) -> str:
    """Where to reach a server listening on `listen`: a wildcard host means this machine."""
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", "*"):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value given for `flag` in a child's command line (`--f v` or `--f=v`)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def flag_args(pairs: Sequence[tuple[str, object]]) -> list[str]:
    """`--flag value` for each pair whose value is not None."""
    return [arg for flag, value in pairs if value is not None for arg in (flag, str(value))]


def split_service_flags(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(executor args, scheduler args): each flag, with its value, goes to the service that
    defines it, or to both when both do (e.g. --log-format, --max-num-batched-tokens).

    Raises ValueError for a flag neither service has, one serve sets itself, or a stray value.
    """
    # argparse has no public lookup from an option string to its action.
    known = {
        name: parser._option_string_actions
        for name, parser in (("executor", executor_parser()), ("scheduler", scheduler_parser()))
    }
    routed: dict[str, list[str]] = {"executor": [], "scheduler": []}
    i = 0
    while i < len(args):
        flag, has_value, _ = args[i].partition("=")
        if not flag.startswith("--"):
            raise ValueError(f"unexpected argument {args[i]!r}")
        if flag in _NOT_PASSED:
            raise ValueError(f"{flag} is not passed on: {_NOT_PASSED[flag]}")
        owners = [name for name, actions in known.items() if flag in actions]
        if not owners:
            raise ValueError(f"{flag} is a flag of neither swarmserve-executor nor swarmserve-scheduler")
        takes_value = not has_value and known[owners[0]][flag].nargs != 0
        if takes_value and i + 1 >= len(args):
            raise ValueError(f"{flag} needs a value")
        item = args[i : i + 2] if takes_value else args[i : i + 1]
        for owner in owners:
            routed[owner] += item
        i += len(item)
    return routed["executor"], routed["scheduler"]


def _metrics_port_args(port: int | None) -> list[str]:
    return [] if port is None else ["--metrics-port", str(port)]


def executor_command(config: ServeConfig, python: str = sys.executable) -> list[str]:
    return [
        python, "-m", "executor_svc.main",
        "--listen", config.executor_listen,
        *_metrics_port_args(None if config.metrics_port is None else config.metrics_port + 1),
        *config.executor_args,
    ]  # fmt: skip


def scheduler_command(config: ServeConfig, python: str = sys.executable) -> list[str]:
    return [
        python, "-m", "scheduler_svc.main",
        "--listen", config.scheduler_listen,
        *(["--http-listen", config.http_listen] if config.http_listen else []),
        "--executor", connect_address(config.executor_listen),
        *_metrics_port_args(config.metrics_port),
        *config.scheduler_args,
    ]  # fmt: skip


def describe_exit(returncode: int) -> str:
    """`exited with code 1`, or `was killed by SIGKILL` for a negative (signal) return code."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


async def stop_process(process: asyncio.subprocess.Process, grace_s: float, *, group: bool = False) -> None:
    """SIGTERM (the services' "stop gracefully"), then SIGKILL if it is still there after `grace_s`.

    `group`: the process leads its own process group (started with `start_new_session`), and the
    signals go to the whole group: a peer such as vLLM runs its engine in child processes, which
    must not outlive it (they get SIGKILL once the leader is gone)."""

    def signal_it(signum: int) -> None:
        try:
            os.killpg(process.pid, signum) if group else process.send_signal(signum)
        except ProcessLookupError:
            pass

    if process.returncode is None:
        signal_it(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace_s)
        except TimeoutError:
            signal_it(signal.SIGKILL)
            await process.wait()
    if group:
        signal_it(signal.SIGKILL)  # children that outlived their leader


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

    def addresses(self, config: ServeConfig) -> list[tuple[str, str]]:
        """(what, where) for everything serve listens on: both gRPC services, the scheduler's
        HTTP front when it has one, and the Prometheus endpoints when they are on."""
        listed = [("executor", f"grpc://{self.executor_address}"), ("scheduler", f"grpc://{self.scheduler_address}")]
        if self.http_url:
            listed.append(("OpenAI/Anthropic HTTP API", f"{self.http_url}/v1"))
        if config.metrics_port is not None:
            for name, listen, port in (
                ("scheduler", config.scheduler_listen, config.metrics_port),
                ("executor", config.executor_listen, config.metrics_port + 1),
            ):
                host = connect_address(listen).rpartition(":")[0]
                listed.append((f"{name} metrics", f"http://{host}:{port}/metrics"))
        return listed


async def is_listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), _PORT_PROBE_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def cancel_all(tasks: list[asyncio.Future]) -> None:
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

    def pid(self, name: str) -> int | None:
        """The process id of a started child ("executor" | "scheduler"), else None."""
        process = self._children.get(name)
        return None if process is None else process.pid

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
            if await is_listening(address):
                raise ServeError(
                    f"something already listens on {address}; is another swarmserve running? (needed by the {name})"
                )

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
                await cancel_all([serving, exited, stopped])
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
            await cancel_all([*exits, stopped])
        if stopped in done:
            return None
        for name, process in self._children.items():
            if process.returncode is not None:
                return ChildExit(name, process.returncode)
        return None

    async def stop(self) -> None:
        """Stop the children, the last started first: SIGTERM, then SIGKILL after the grace period."""
        for name in reversed(list(self._children)):
            await stop_process(self._children[name], self.config.shutdown_grace_s)
