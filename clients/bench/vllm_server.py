"""vLLM's OpenAI server as a benchmark peer: one already running (`--vllm-server URL`), or one
started from a command line for the run (`--vllm-command`, with `{port}` where its port
goes), waited for on /health, and stopped with everything it started on the way out.

vLLM is not part of this project. ../shared/anchors/vllm-cpu.sh builds its CPU backend and
serves the embedded model's weights as a bf16 checkpoint under the name
`smollm2-135m-instruct`; start-up takes minutes (torch.compile on every start).
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from clients.bench.services import PeerServer
from clients.health import wait_http_healthy
from clients.serve import free_port, stop_process

HEALTH_POLL_S = 1.0
STOP_GRACE_S = 30.0  # vLLM stops its engine core process before it exits


class VllmServerError(RuntimeError):
    """The vLLM command exited, or its server never became healthy."""


def vllm_command(template: str, port: int) -> list[str]:
    """The command line of `template` with its `{port}` filled in."""
    if "{port}" not in template:
        raise ValueError(f"--vllm-command must say where the port goes with {{port}}, got {template!r}")
    return shlex.split(template.replace("{port}", str(port)))


async def wait_healthy(url: str, *, timeout_s: float, process: asyncio.subprocess.Process | None = None) -> None:
    """vLLM's /health answers 200 (VllmServerError if `process` exits first or after `timeout_s`)."""
    await wait_http_healthy(
        url, timeout_s=timeout_s, name="the vLLM command", error=VllmServerError, process=process, poll_s=HEALTH_POLL_S
    )


@asynccontextmanager
async def start_vllm_server(template: str, log_file, *, startup_timeout_s: float = 1200.0) -> AsyncIterator[PeerServer]:
    """Run `template` on a free loopback port in its own process group; yield it once healthy,
    paused (see PeerServer)."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        *vllm_command(template, port),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=log_file,
        start_new_session=True,
    )
    server = PeerServer(f"http://127.0.0.1:{port}", process, group=True)
    try:
        await wait_healthy(server.url, timeout_s=startup_timeout_s, process=process)
        server.pause()
        yield server
    finally:
        server.resume()  # a stopped process would not act on the SIGTERM
        await stop_process(process, STOP_GRACE_S, group=True)


async def served_version(url: str) -> str | None:
    """vLLM's /version, if the server has that route."""
    async with httpx.AsyncClient() as http:
        try:
            response = await http.get(f"{url}/version", timeout=10.0)
        except httpx.TransportError:
            return None
    return response.json().get("version") if response.status_code == 200 else None
