"""The real services as subprocesses on loopback ports, for end-to-end tests."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Block until the standard health service says SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not become SERVING within {timeout}s")


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

    def _spawn(self, module: str, args: list[str], name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else subprocess.DEVNULL
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start_executor(self, wait: bool = True) -> None:
        self.executor = self._spawn(
            "executor_svc.main", ["--listen", self.executor_address, *self.executor_args], "executor"
        )
        if wait:
            wait_serving(self.executor_address, 120, self.executor)

    def start_scheduler(self, wait: bool = True) -> None:
        self.scheduler = self._spawn(
            "scheduler_svc.main",
            [
                "--listen", self.scheduler_address,
                "--executor", self.executor_address,
                *(["--http-listen", self.http_address] if self.serve_http else []),
                *self.scheduler_args,
            ],  # fmt: skip
            "scheduler",
        )
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
