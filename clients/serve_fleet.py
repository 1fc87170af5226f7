"""`swarmserve serve --replicas N --gateway smg`: N executor+scheduler pairs behind SMG.

The scale-out topology of deploy/docker-compose.scale.yml on one machine, without Docker:
each pair is a `Supervisor` (serve.py) on its own loopback ports, and the Shepherd Model
Gateway (`smg launch`, from the `smg` package) listens on the one entry address in front
of the pairs' HTTP fronts, routing with its cache-aware policy by default, so an agent's
turns go back to the pair that holds its prefix in KV.

Ports: replica i takes each port of the single-pair layout plus 2*i (the scheduler
50051, 50053, ...; the executor 50052, 50054, ...; with --metrics-port P, the scheduler's
metrics on P+2i and the executor's on P+2i+1); its HTTP front listens on the entry
port + 1 + i, and the gateway itself on the entry address (--http-listen, 8000 by
default), with its own Prometheus endpoint on P+2N when --metrics-port is given.

Startup: all pairs at once (each as `swarmserve serve` starts one), then the gateway, which
is ready once its /readiness counts every pair healthy. Shutdown: the gateway first (no
new requests), then every pair (the scheduler, then its executor), SIGTERM then SIGKILL
after the grace period, each child in its own process group so a terminal's Ctrl-C
reaches only this supervisor. A pair whose server dies while serving is stopped and
reported; the gateway's health checks take it out of rotation and the others go on.
serve ends, with failure, when the gateway exits or the last pair is down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from dataclasses import dataclass

import httpx

from clients.serve import (
    ChildExit,
    ServeConfig,
    ServeError,
    ServeReady,
    Supervisor,
    cancel_all,
    connect_address,
    free_port,
    is_listening,
    stop_process,
)

GATEWAYS = ("smg",)
# smg launch --policy choices that route HTTP workers (the PD-only "bucket" and the
# externally driven "manual" are left out).
GATEWAY_POLICIES = (
    "cache_aware",
    "round_robin",
    "random",
    "power_of_two",
    "least_load",
    "prefix_hash",
    "consistent_hashing",
)
READINESS_POLL_S = 0.2


def _with_port(listen: str, offset: int) -> str:
    host, _, port = listen.rpartition(":")
    return f"{host}:{int(port) + offset}"


@dataclass(frozen=True)
class FleetConfig:
    """`base` is the single-pair layout (its http_listen is the gateway's entry address)."""

    base: ServeConfig
    num_replicas: int = 2
    gateway: str = "smg"
    gateway_policy: str = "cache_aware"
    gateway_health_check_interval_s: int = 5  # smg's default is 60: a dead pair would get traffic for a minute
    gateway_args: tuple[str, ...] = ()  # any other `smg launch` flag, after ours (so it wins)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.num_replicas}")
        if self.gateway not in GATEWAYS:
            raise ValueError(f"gateway must be one of {', '.join(GATEWAYS)}, got {self.gateway!r}")
        if self.gateway_policy not in GATEWAY_POLICIES:
            raise ValueError(
                f"gateway policy must be one of {', '.join(GATEWAY_POLICIES)}, got {self.gateway_policy!r}"
            )
        if not self.base.http_listen:
            raise ValueError("the gateway needs an entry address: --http-listen cannot be off with --gateway")
        if self.gateway_health_check_interval_s < 1:
            raise ValueError(
                f"the gateway's health-check interval must be at least 1 s, got {self.gateway_health_check_interval_s}"
            )
        if self.base.metrics_port is not None and self.gateway_metrics_port > 65535:
            raise ValueError(
                f"--metrics-port {self.base.metrics_port} leaves no room for {self.num_replicas} replicas and the gateway"
            )
        addresses = [connect_address(self.base.http_listen)]
        for replica in self.replicas:
            addresses += [
                connect_address(a) for a in (replica.executor_listen, replica.scheduler_listen, replica.http_listen)
            ]
        taken = {a for a in addresses if addresses.count(a) > 1}
        if taken:
            raise ValueError(
                f"the replicas' ports overlap ({', '.join(sorted(taken))}); pick listen ports further apart"
            )

    @property
    def replicas(self) -> list[ServeConfig]:
        base = self.base
        return [
            dataclasses.replace(
                base,
                executor_listen=_with_port(base.executor_listen, 2 * i),
                scheduler_listen=_with_port(base.scheduler_listen, 2 * i),
                http_listen=_with_port(base.http_listen, 1 + i),
                metrics_port=None if base.metrics_port is None else base.metrics_port + 2 * i,
            )
            for i in range(self.num_replicas)
        ]

    @property
    def gateway_metrics_port(self) -> int | None:
        return None if self.base.metrics_port is None else self.base.metrics_port + 2 * self.num_replicas


# What the README tells agents to send as `model`: a pair's front takes any name, SMG routes by
# name, so the launcher makes this one an alias of the served model.
MODEL_ALIAS = "swarmserve"


def gateway_command(
    config: FleetConfig, metrics_port: int, model_name: str = "", python: str = sys.executable
) -> list[str]:
    """`smg launch` in front of the replicas; with the served `model_name`, `swarmserve` is an alias of it."""
    host, _, port = config.base.http_listen.rpartition(":")
    alias = ["--model-alias", f"{MODEL_ALIAS}={model_name}"] if model_name and model_name != MODEL_ALIAS else []
    return [
        python, "-m", "smg", "launch",
        "--host", host.strip("[]"),
        "--port", port,
        "--policy", config.gateway_policy,
        "--worker-urls", *(f"http://{connect_address(r.http_listen)}" for r in config.replicas),
        "--prometheus-host", host.strip("[]"),
        "--prometheus-port", str(metrics_port),
        "--health-check-interval-secs", str(config.gateway_health_check_interval_s),
        "--shutdown-grace-period-secs", str(max(1, round(config.base.shutdown_grace_s))),
        "--log-level", "warn",
        *alias,
        *config.gateway_args,
    ]  # fmt: skip


async def wait_gateway_ready(entry_url: str, num_workers: int) -> None:
    """Until the gateway at `entry_url` counts `num_workers` healthy workers (its /readiness)."""
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            try:
                answer = await client.get(f"{entry_url}/readiness")
                if answer.status_code == 200 and answer.json().get("healthy_workers") == num_workers:
                    return
            except (httpx.HTTPError, ValueError):
                pass  # not listening yet, or not answering JSON yet
            await asyncio.sleep(READINESS_POLL_S)


@dataclass(frozen=True)
class FleetReady:
    entry_url: str  # the gateway's base URL: what agents talk to
    model_name: str
    replicas: list[ServeReady]
    gateway_metrics_port: int

    def addresses(self, config: FleetConfig) -> list[tuple[str, str]]:
        host = connect_address(config.base.http_listen).rpartition(":")[0]
        listed = [(f"OpenAI/Anthropic HTTP API (SMG, {config.gateway_policy})", f"{self.entry_url}/v1")]
        for i, (ready, replica) in enumerate(zip(self.replicas, config.replicas)):
            listed += [(f"replica {i} {what}", where) for what, where in ready.addresses(replica)]
        listed.append(("gateway metrics", f"http://{host}:{self.gateway_metrics_port}/metrics"))
        return listed


class Fleet:
    """start() -> wait() -> stop(), like Supervisor, for N pairs and the gateway."""

    def __init__(self, config: FleetConfig, *, python: str = sys.executable, log_file=None, report=None) -> None:
        self.config = config
        self._python = python
        self._log_file = log_file
        self._report = report or (lambda message: print(message, file=sys.stderr, flush=True))
        self.pairs = [Supervisor(replica, python=python, log_file=log_file) for replica in config.replicas]
        self.gateway: asyncio.subprocess.Process | None = None
        self._stop_requested = asyncio.Event()

    def request_stop(self) -> None:
        self._stop_requested.set()
        for pair in self.pairs:
            pair.request_stop()

    async def start(self) -> FleetReady | None:
        """Every pair, then the gateway once they all serve; None if a stop was requested meanwhile."""
        entry = connect_address(self.config.base.http_listen)
        if await is_listening(entry):
            raise ServeError(
                f"something already listens on {entry}; is another swarmserve running? (needed by the gateway)"
            )
        started = await asyncio.gather(*(pair.start() for pair in self.pairs), return_exceptions=True)
        for i, result in enumerate(started):
            if isinstance(result, BaseException):
                raise ServeError(f"replica {i}: {result}") from result
        if any(result is None for result in started):
            return None
        metrics_port = self.config.gateway_metrics_port or free_port()
        self.gateway = await asyncio.create_subprocess_exec(
            *gateway_command(self.config, metrics_port, started[0].model_name, self._python),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file or sys.stderr,  # its ASCII-art banner is a log, not our banner on stdout
            stderr=self._log_file,
            process_group=0,
        )
        entry_url = f"http://{entry}"
        if not await self._wait_gateway_ready(entry_url):
            return None
        return FleetReady(entry_url, started[0].model_name, list(started), metrics_port)

    async def _wait_gateway_ready(self, entry_url: str) -> bool:
        """True once the gateway counts every pair healthy; False if a stop was requested first."""
        ready = asyncio.ensure_future(wait_gateway_ready(entry_url, self.config.num_replicas))
        exited = asyncio.ensure_future(self.gateway.wait())
        stopped = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait(
                {ready, exited, stopped},
                timeout=self.config.base.startup_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            await cancel_all([ready, exited, stopped])
        if self._stop_requested.is_set():
            return False
        if self.gateway.returncode is not None:
            raise ServeError(
                f"the gateway (smg) exited with code {self.gateway.returncode} during startup (its log is above)"
            )
        if ready.cancelled() or ready.exception() is not None:
            raise ServeError(
                f"the gateway did not count all {self.config.num_replicas} replicas healthy within {self.config.base.startup_timeout_s:g}s"
            )
        return True

    async def wait(self) -> ChildExit | None:
        """Until the gateway exits or the last pair is down (returned), or a stop is requested (None).

        A pair one of whose servers dies is stopped and reported; the others go on serving.
        """
        live = {asyncio.ensure_future(pair.wait()): i for i, pair in enumerate(self.pairs)}
        gateway = asyncio.ensure_future(self.gateway.wait())
        stopped = asyncio.ensure_future(self._stop_requested.wait())
        try:
            while True:
                done, _ = await asyncio.wait({*live, gateway, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if stopped in done:
                    return None
                if gateway in done:
                    return ChildExit("gateway", self.gateway.returncode)
                for task in done:
                    i = live.pop(task)
                    child_exit = task.result()
                    if child_exit is None:  # the pair saw the stop request first
                        return None
                    await self.pairs[i].stop()
                    self._report(
                        f"error: replica {i}'s {child_exit.describe()}; stopped its other server, the gateway routes around it"
                    )
                    if not live:
                        return ChildExit(f"last replica ({i}): its {child_exit.name}", child_exit.returncode)
        finally:
            await cancel_all([*live, gateway, stopped])

    async def stop(self) -> None:
        """The gateway, then every pair at once (each its scheduler, then its executor)."""
        if self.gateway is not None:
            await stop_process(self.gateway, self.config.base.shutdown_grace_s)
        await asyncio.gather(*(pair.stop() for pair in self.pairs))
