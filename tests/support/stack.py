"""The real services as subprocesses on loopback ports, for end-to-end tests.

Started with the command lines `swarmserve serve` uses, one at a time and synchronously,
so a test can kill and restart either; readiness is the same health check as serve's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from clients import health
from clients.serve import ServeConfig, executor_command, free_port, scheduler_command

ROOT = Path(__file__).resolve().parents[2]
PROCESS_POLL_S = 0.1


def wait_serving(address: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Block until `address` is SERVING (clients.health.wait_serving); RuntimeError if `proc` exits first."""

    async def wait() -> None:
        async with grpc.aio.insecure_channel(address, options=list(health.FAST_RECONNECT_OPTIONS)) as channel:
            serving = asyncio.ensure_future(health.wait_serving(channel, timeout))
            while not serving.done():
                if proc is not None and proc.poll() is not None:
                    serving.cancel()
                    raise RuntimeError(f"process for {address} exited with {proc.returncode}")
                await asyncio.wait({serving}, timeout=PROCESS_POLL_S)
            serving.result()

    asyncio.run(wait())


@dataclass
class Stack:
    executor_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    executor_address: str = ""
    scheduler_address: str = ""
    executor: subprocess.Popen | None = None
    scheduler: subprocess.Popen | None = None
    serve_http: bool = False  # the scheduler's HTTP API on http_address too
    http_address: str = ""

    def __post_init__(self) -> None:
        self.executor_address = f"127.0.0.1:{free_port()}"
        self.scheduler_address = f"127.0.0.1:{free_port()}"
        if self.serve_http:
            self.http_address = f"127.0.0.1:{free_port()}"

    @property
    def http_url(self) -> str:
        return f"http://{self.http_address}"

    def _spawn(self, command: list[str], name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else subprocess.DEVNULL
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def config(self) -> ServeConfig:
        return ServeConfig(
            executor_listen=self.executor_address,
            scheduler_listen=self.scheduler_address,
            http_listen=self.http_address,
            executor_args=tuple(self.executor_args),
            scheduler_args=tuple(self.scheduler_args),
        )

    def start_executor(self, wait: bool = True) -> None:
        self.executor = self._spawn(executor_command(self.config), "executor")
        if wait:
            wait_serving(self.executor_address, 120, self.executor)

    def start_scheduler(self, wait: bool = True) -> None:
        self.scheduler = self._spawn(scheduler_command(self.config), "scheduler")
        if wait:
            wait_serving(self.scheduler_address, 60, self.scheduler)

    def start(self) -> "Stack":
        self.start_executor()
        self.start_scheduler()
        return self

    @staticmethod
    def _stop(proc: subprocess.Popen | None, sig=signal.SIGTERM) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill_scheduler(self) -> None:
        self._stop(self.scheduler, signal.SIGKILL)

    def kill_executor(self) -> None:
        self._stop(self.executor, signal.SIGKILL)

    def stop(self) -> None:
        self._stop(self.scheduler)
        self._stop(self.executor)


async def stop_scheduler(server, loop, tasks) -> None:
    """Stop an in-process scheduler started with `scheduler_svc.server.serve`: the server,
    its step-loop tasks, and its link to the executor."""
    if getattr(server, "http_server", None) is not None:
        await server.http_server.stop()
    await server.stop(None)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await loop.link.close()
