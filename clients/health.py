"""Waiting for a server to report SERVING on the standard grpc.health.v1 service, or, for the
peers the benchmarks start (llama.cpp's and vLLM's HTTP servers), for its `/health` to answer 200.

Both servers register it (the executor and the scheduler), so one loop serves the
client's `wait_ready` and `swarmserve serve`'s startup. Each probe waits for the
connection (`wait_for_ready`) with a short deadline, so a server that is still
loading its model, not yet listening, or listening but NOT_SERVING all read the same:
not ready yet.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Probes are cheap and local; short ones notice readiness soon after it happens.
PROBE_TIMEOUT_S = 1.0
PROBE_INTERVAL_S = 0.1

# Keep reconnect backoff short so a server that starts listening late is found
# within a second rather than after gRPC's default backoff (which grows to 2 min).
# Not "grpc.min_reconnect_backoff_ms": despite its name it is the minimum *connect
# timeout*, and lowering it makes a busy server's slow handshake fail the connection.
FAST_RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


async def probe(channel: grpc.aio.Channel, service: str = "", timeout: float = PROBE_TIMEOUT_S) -> str:
    """One health check: "SERVING", "NOT_SERVING", ... or why no answer came (e.g. "UNAVAILABLE")."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = await stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
        )
    except grpc.aio.AioRpcError as error:
        # NOT_FOUND: the server is up but has not registered `service` yet.
        return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def wait_serving(channel: grpc.aio.Channel, timeout: float, service: str = "") -> None:
    """Return once `service` ("" = the whole server) is SERVING; TimeoutError after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last = "no answer"
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError(f"not SERVING after {timeout:g}s (last health check: {last})")
        last = await probe(channel, service, timeout=min(PROBE_TIMEOUT_S, remaining))
        if last == "SERVING":
            return
        await asyncio.sleep(min(PROBE_INTERVAL_S, max(0.0, deadline - loop.time())))


async def wait_http_healthy(
    url: str,
    *,
    timeout_s: float,
    name: str,
    error: type[Exception],
    process: asyncio.subprocess.Process | None = None,
    poll_s: float = 0.2,
) -> None:
    """Return once `url`/health answers 200; `error` if `process` (the server, when this run started
    it) exits first, or after `timeout_s`. `name` names the server in the message."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if process is not None and process.returncode is not None:
                raise error(f"{name} exited with code {process.returncode} during startup (see its log)")
            try:
                if (await http.get(f"{url}/health", timeout=5.0)).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            await asyncio.sleep(poll_s)
    raise error(f"{name} was not healthy on {url} within {timeout_s:g}s")
