"""vLLM's OpenAI server as a benchmark peer: one already running (`--vllm-server URL`), or one
started from a command line for the run (`--vllm-command`, with `{port}` where its port
goes), waited for on /health, and stopped with everything it started on the way out.

vLLM is not part of this project. ../shared/anchors/vllm-cpu.sh builds its CPU backend and
serves the embedded model's weights as a bf16 checkpoint under the name
`smollm2-135m-instruct`; start-up takes minutes (torch.compile on every start).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from clients.serve import free_port

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
    """Poll `url`/health until it answers 200; fail early if `process` exits."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if process is not None and process.returncode is not None:
                raise VllmServerError(f"the vLLM command exited with code {process.returncode} (see its log)")
            try:
                if (await http.get(f"{url}/health", timeout=5.0)).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            await asyncio.sleep(HEALTH_POLL_S)
    raise VllmServerError(f"vLLM was not healthy on {url} within {timeout_s:g}s")


async def _stop_group(process: asyncio.subprocess.Process) -> None:
    """SIGTERM to the process group the command leads (vLLM's API server and its engine core),
    then SIGKILL to what is left after the grace period."""
    if process.returncode is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        except TimeoutError:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # children that outlived their parent
    except ProcessLookupError:
        pass
    await process.wait()


@asynccontextmanager
async def start_vllm_server(template: str, log_file, *, startup_timeout_s: float = 1200.0) -> AsyncIterator[str]:
    """Run `template` on a free loopback port in its own process group; yield its URL once healthy."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        *vllm_command(template, port),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=log_file,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, timeout_s=startup_timeout_s, process=process)
        yield url
    finally:
        await _stop_group(process)


async def served_version(url: str) -> str | None:
    """vLLM's /version, if the server has that route."""
    async with httpx.AsyncClient() as http:
        try:
            response = await http.get(f"{url}/version", timeout=10.0)
        except httpx.TransportError:
            return None
    return response.json().get("version") if response.status_code == 200 else None
