"""The async client: one channel to the scheduler, typed events out, SwarmServeError on failure.

Requests are validated and built before anything is sent (`generate_request`), streamed
through `GenerateStream` (which owns cancellation), and every RPC failure surfaces as
`SwarmServeError` carrying the server's status code and message.

The channel is opened on first use rather than in `__init__`, because a grpc.aio
channel belongs to the event loop it is created on; creating the client needs no loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc

from clients.api_key import api_key_interceptors
from clients.completion import Completion, collect_completion
from clients.errors import SwarmServeError
from clients.generate_request import build_generate_request
from clients.generate_stream import GenerateStream
from clients.health import FAST_RECONNECT_OPTIONS, wait_serving
from clients.server_info import ServerInfo
from swarmserve.scheduler.v1 import scheduler_pb2 as pb
from swarmserve.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

DEFAULT_SCHEDULER_ADDRESS = "127.0.0.1:50051"


class AsyncSwarmClient:
    """`timeout` is the default deadline in seconds for every call (for Generate: the whole
    stream); None means no deadline. Each method's own `timeout` overrides it. `api_key`:
    for a scheduler started with --api-key-file. `tls_ca`: a CA file (PEM) to reach a
    scheduler serving TLS and verify its certificate."""

    def __init__(
        self,
        address: str = DEFAULT_SCHEDULER_ADDRESS,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        tls_ca: str | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._api_key = api_key
        self._tls_ca = tls_ca
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SchedulerServiceStub | None = None
        self._is_closed = False

    def _scheduler(self) -> pb_grpc.SchedulerServiceStub:
        if self._is_closed:
            raise RuntimeError("the client is closed")
        if self._stub is None:
            interceptors = api_key_interceptors(self._api_key) if self._api_key else None
            options = list(FAST_RECONNECT_OPTIONS)
            if self._tls_ca:
                with open(self._tls_ca, "rb") as f:
                    credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
                self._channel = grpc.aio.secure_channel(
                    self.address, credentials, options=options, interceptors=interceptors
                )
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options=options, interceptors=interceptors)
            self._stub = pb_grpc.SchedulerServiceStub(self._channel)
        return self._stub

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        stop: str | Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        num_logprobs: int = 0,
        include_special_tokens: bool = False,
        request_id: str | None = None,
        session_id: str | None = None,
        retention_s: float | None = None,
        structured_output: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateStream:
        """Stream TokenEvents, then one FinishEvent: `async for event in client.generate(...)`.

        Exactly one of `prompt` (raw text), `token_ids` or `messages` (chat, template
        applied by the server). Sampling arguments left None take the server's defaults.
        `session_id` names an agent's conversation: its KV stays cached in preference
        for `retention_s` seconds (server default 30) after the request, for the next turn.
        `structured_output` constrains the output: {"json_schema": dict or JSON text},
        {"json_object": True}, {"lark": grammar} or {"regex": pattern}.
        Raises ValueError here, before any RPC, for a malformed request; errors from the
        server are raised as SwarmServeError while iterating.
        """
        request = build_generate_request(
            prompt,
            token_ids=token_ids,
            messages=messages,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            num_logprobs=num_logprobs,
            include_special_tokens=include_special_tokens,
            request_id=request_id,
            session_id=session_id,
            retention_s=retention_s,
            structured_output=structured_output,
        )
        deadline = self._deadline(timeout)
        return GenerateStream(
            lambda: self._scheduler().Generate(request, timeout=deadline),
            request_id=request.request_id or None,
        )

    def chat(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> GenerateStream:
        """`generate(messages=messages, ...)`: the same keyword arguments, the same events."""
        return self.generate(messages=messages, **kwargs)

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run a whole request (any `generate` arguments) and return its Completion."""
        async with self.generate(prompt, **kwargs) as stream:
            events = [event async for event in stream]
        return collect_completion(stream.request_id or "", events)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Stop a request by id (its stream ends with finish_reason "aborted"); False if unknown."""
        try:
            response = await self._scheduler().Abort(
                pb.AbortRequest(request_id=request_id), timeout=self._deadline(timeout)
            )
        except grpc.aio.AioRpcError as error:
            raise SwarmServeError.from_rpc_error(error) from error
        return response.was_found

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        try:
            response = await self._scheduler().GetServerInfo(pb.GetServerInfoRequest(), timeout=self._deadline(timeout))
        except grpc.aio.AioRpcError as error:
            raise SwarmServeError.from_rpc_error(error) from error
        return ServerInfo.from_pb(response)

    async def wait_ready(self, timeout: float = 30.0, *, service: str = "") -> None:
        """Wait until the scheduler's standard health service reports SERVING; TimeoutError if not in time."""
        self._scheduler()
        try:
            await wait_serving(self._channel, timeout, service)
        except TimeoutError as error:
            raise TimeoutError(f"{self.address}: {error}") from None

    async def close(self) -> None:
        """Close the channel; streams still open are cancelled. Safe to call twice."""
        self._is_closed = True
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()

    async def __aenter__(self) -> AsyncSwarmClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
