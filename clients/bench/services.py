"""Benchmarks start their own services: an executor and a scheduler on free loopback ports.

Both come up as `swarmserve serve` brings them up (its Supervisor). Extra flags go straight
to each child (e.g. `--no-prefix-caching`, `--spec goodput`), their logs to one file, and
both are stopped on exit.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from clients.client import AsyncSwarmClient
from clients.serve import ServeConfig, Supervisor, flag_args, free_port, scheduler_command, stop_process

STOP_GRACE_S = 15.0


class PeerServer:
    """A peer's server (llama-server, vLLM) started for a run, at `url`. `pause` stops it (SIGSTOP;
    the whole process group with `group`, for a server that runs its engine in child processes)
    until `resume`, so that it keeps off the cores while another engine is measured: vLLM's CPU
    worker busy-waits at ~100% of a core even with no request (measured: `VLLM::Worker` at 99% of
    a core through the other engines' rows, which cost them 20-24% of their throughput on 2
    cores), and llama.cpp's threads poll for work after each batch. Both do nothing once the
    process has exited."""

    def __init__(self, url: str, process: asyncio.subprocess.Process, *, group: bool = False) -> None:
        self.url = url
        self._process = process
        self._group = group

    @property
    def pid(self) -> int:
        return self._process.pid

    def _signal(self, signum: int) -> None:
        if self._process.returncode is None:
            os.killpg(self.pid, signum) if self._group else self._process.send_signal(signum)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Resumed for the block, stopped again after it."""
        self.resume()
        try:
            yield
        finally:
            self.pause()


@dataclass(frozen=True)
class Services:
    executor_address: str
    scheduler_address: str
    executor_pid: int | None = None  # for reading its resident memory
    http_address: str = ""  # the scheduler's HTTP API, when asked for


@asynccontextmanager
async def start_scheduler(
    executor_address: str, log_file, *extra_args: str, max_running_requests: int | None = None, http_listen: str = ""
) -> AsyncIterator[str]:
    """A scheduler attached to a running executor (serving HTTP on `http_listen` if given); yields its address."""
    config = ServeConfig(
        executor_listen=executor_address,
        scheduler_listen=f"127.0.0.1:{free_port()}",
        http_listen=http_listen,
        scheduler_args=(
            *flag_args([("--max-running-requests", max_running_requests), ("--log-format", "json")]),
            *extra_args,
        ),
    )
    process = await asyncio.create_subprocess_exec(*scheduler_command(config), stdout=log_file, stderr=log_file)
    try:
        async with AsyncSwarmClient(config.scheduler_listen) as client:
            await client.wait_ready(120)
        yield config.scheduler_listen
    finally:
        await stop_process(process, STOP_GRACE_S)


@asynccontextmanager
async def start_services(
    log_file,
    *,
    model: str = "default",
    dtype: str | None = None,
    kv_cache_gb: float | None = None,
    executor_args: tuple[str, ...] = (),
    scheduler_args: tuple[str, ...] = (),
    max_running_requests: int | None = None,
    http: bool = False,
) -> AsyncIterator[Services]:
    """An executor and a scheduler; with `http`, the scheduler's HTTP API on a free port too."""
    http_listen = f"127.0.0.1:{free_port()}" if http else ""
    config = ServeConfig(
        executor_listen=f"127.0.0.1:{free_port()}",
        scheduler_listen=f"127.0.0.1:{free_port()}",
        http_listen=http_listen,
        executor_args=(
            *flag_args(
                [("--model", model), ("--dtype", dtype), ("--kv-cache-gb", kv_cache_gb), ("--log-format", "json")]
            ),
            *executor_args,
        ),
        scheduler_args=(
            *flag_args([("--max-running-requests", max_running_requests), ("--log-format", "json")]),
            *scheduler_args,
        ),
    )
    supervisor = Supervisor(config, log_file=log_file)
    try:
        ready = await supervisor.start()  # never None: nothing here asks it to stop
        yield Services(ready.executor_address, ready.scheduler_address, supervisor.pid("executor"), http_listen)
    finally:
        await supervisor.stop()
