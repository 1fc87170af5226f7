"""The soak's workload: a swarm of chat agents over the HTTP API, and side traffic that gives up.

Agents (the official `openai` SDK, streaming): each has a long system prompt shared by
all, and several turns in one session (`x-session-id`), each turn's prompt the whole
conversation so far. Turns rotate through kinds: plain greedy, stop strings, structured
output (a JSON schema, seeded sampling under the grammar), seeded sampling. Every turn is
reproducible (greedy, or sampling keyed by its seed), so a run disturbed by faults must
give each agent exactly the tokens of an undisturbed run.

A turn whose attempt fails in a documented way is tried again, as a client of a restarting
service does: 503 (the scheduler drains, or waits for its executor), no connection (the
scheduler is down), or a stream cut short (the scheduler stopped with the request in
flight). Any other error fails the soak. Every attempt is kept for the report: its outcome,
the scheduler process that served it, the tokens it received and, when it finished, the
tokens the scheduler counted for it (the stream's usage).

Side requests give up on purpose: an HTTP stream closed after a few chunks (a client
that disconnects), a gRPC stream cancelled by its client, and a gRPC request stopped by
Abort (its stream ends with finish reason "aborted").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx
import openai

from clients import AsyncSwarmClient, SwarmServeError
from clients.events import FinishEvent, TokenEvent

SHARED_SYSTEM = "You are one of a swarm of coding agents working in one repository. Its files:\n" + "\n".join(
    f"src/pkg_{i}/module_{i}.py: def handler_{i}(request): return request.value * {i} + {i * i}" for i in range(10)
)  # ~650 tokens of the tiny byte-level tokenizer: prefilled in chunks, then a prefix hit for every other request
STOP_STRINGS = list("etaoinsrh")  # one of them soon turns up in the tiny model's text
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "file": {"type": "string", "maxLength": 4},
        "line": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["file", "line"],
    "additionalProperties": False,
    # Compact and bounded, so that the grammar ends it: sampled, this random model fills every
    # gap the default JSON whitespace allows, and an unbounded integer never ends.
    "x-guidance": {"whitespace_flexible": False},
}
JSON_MAX_TOKENS = 64  # the longest object the schema allows is ~40 tokens of bytes
JSON_TEMPERATURE = 1.0
SAMPLED_TEMPERATURE = 0.8
TURN_KINDS = ("plain", "stop", "json", "sampled")
SIDE_KINDS = ("disconnect", "cancel", "abort")
SIDE_MAX_NEW_TOKENS = 2000  # far more than a side request lives for: none ends by length
RETRY_PAUSE_S = 0.2
MAX_RETRY_S = 180.0  # a service that comes back takes seconds; this long is a failure


@dataclass(frozen=True)
class SoakSize:
    num_agents: int
    num_turns: int
    max_tokens: int  # per turn (JSON turns: JSON_MAX_TOKENS, the grammar ends them)
    num_side_requests: int  # each gives up: an HTTP disconnect, a gRPC cancel, or a gRPC Abort


@dataclass(frozen=True)
class Attempt:
    outcome: str  # "ok", or the documented failure it met: "503", "no connection", "stream cut"
    incarnation: int  # of the scheduler process that served it
    num_tokens: int  # tokens it received
    num_counted_tokens: int | None = None  # the usage the scheduler reported at its end (None: no end)
    end_s: float = 0.0  # time.monotonic() when it ended


@dataclass
class TurnResult:
    agent: int
    turn: int
    kind: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    attempts: list[Attempt] = field(default_factory=list)


@dataclass
class SideResult:
    kind: str  # one of SIDE_KINDS
    outcome: str  # "disconnected", "cancelled", "aborted"; or "503", "unavailable", "no connection"
    incarnation: int


@dataclass
class SoakProgress:
    """Tokens streamed so far (the fault schedule's clock), and which scheduler process serves
    (the fault injector counts its restarts)."""

    num_tokens: int = 0
    incarnation: int = 0
    on_tokens: Callable[[int], None] | None = None

    def streamed(self, n: int) -> None:
        self.num_tokens += n
        if self.on_tokens is not None:
            self.on_tokens(self.num_tokens)


class DocumentedFailure(Exception):
    """An attempt ended in one of the documented ways a restarting service answers; try again."""

    def __init__(self, outcome: str, num_tokens: int) -> None:
        super().__init__(outcome)
        self.outcome = outcome
        self.num_tokens = num_tokens


def turn_kind(agent: int, turn: int) -> str:
    return TURN_KINDS[(agent + turn) % len(TURN_KINDS)]


def turn_request(agent: int, turn: int, messages: list[dict], max_tokens: int) -> dict:
    kind = turn_kind(agent, turn)
    body: dict = dict(
        model="swarmserve", messages=messages, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        extra_headers={"x-session-id": f"agent-{agent}"},
    )  # fmt: skip
    if kind == "stop":
        body["stop"] = STOP_STRINGS
    elif kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "location", "schema": JSON_SCHEMA}}
        body["extra_body"] = {"return_token_ids": True}  # the grammar ends it
        body["max_tokens"], body["temperature"], body["seed"] = JSON_MAX_TOKENS, JSON_TEMPERATURE, 1000 * agent + turn
    elif kind == "sampled":
        body["temperature"], body["seed"] = SAMPLED_TEMPERATURE, 1000 * agent + turn
    return body


async def stream_turn(
    client: openai.AsyncOpenAI, body: dict, progress: SoakProgress
) -> tuple[str, list[int], str, int | None]:
    """(text, token ids, finish reason, tokens the usage counted) of one attempt;
    DocumentedFailure if it met a restart."""
    text, token_ids, finish, num_counted = [], [], "", None
    try:
        stream = await client.chat.completions.create(**body)
        async for chunk in stream:
            if chunk.usage is not None:
                num_counted = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                new = (choice.model_extra or {}).get("token_ids") or []
                token_ids.extend(new)
                progress.streamed(len(new))
                finish = choice.finish_reason or finish
    except openai.APIStatusError as error:
        if error.status_code == 503:
            raise DocumentedFailure("503", len(token_ids)) from error
        raise
    except openai.APIConnectionError as error:
        raise DocumentedFailure("no connection", len(token_ids)) from error
    except (openai.APIError, httpx.TransportError) as error:  # an error event, or the connection cut mid-stream
        raise DocumentedFailure("stream cut" if token_ids else "no connection", len(token_ids)) from error
    if not finish:
        raise DocumentedFailure("stream cut", len(token_ids))
    return "".join(text), token_ids, finish, num_counted


async def run_turn(client: openai.AsyncOpenAI, result: TurnResult, body: dict, progress: SoakProgress) -> None:
    """Attempts until one succeeds; each kept in `result.attempts`."""
    failing_since = None
    while True:
        incarnation = progress.incarnation
        try:
            result.text, result.token_ids, result.finish_reason, num_counted = await stream_turn(client, body, progress)
        except DocumentedFailure as failure:
            result.attempts.append(Attempt(failure.outcome, incarnation, failure.num_tokens, end_s=time.monotonic()))
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > MAX_RETRY_S:
                raise AssertionError(f"{result}: failing for {MAX_RETRY_S:g} s") from failure
            await asyncio.sleep(RETRY_PAUSE_S)
            continue
        # A scheduler that answered to the end was up from the attempt's start to its end.
        assert progress.incarnation == incarnation, f"{result}: served across a scheduler restart"
        result.attempts.append(Attempt("ok", incarnation, len(result.token_ids), num_counted, time.monotonic()))
        return


async def run_agent(client: openai.AsyncOpenAI, agent: int, size: SoakSize, progress: SoakProgress) -> list[TurnResult]:
    messages = [{"role": "system", "content": SHARED_SYSTEM}]
    results = []
    for turn in range(size.num_turns):
        messages.append(
            {"role": "user", "content": f"Agent {agent}, turn {turn}: fix handler_{agent} in module_{agent}."}
        )
        result = TurnResult(agent, turn, turn_kind(agent, turn))
        await run_turn(client, result, turn_request(agent, turn, list(messages), size.max_tokens), progress)
        if result.kind == "json" and result.finish_reason == "stop":
            json.loads(result.text)  # the grammar's output parses (validated against the schema by the test)
        messages.append({"role": "assistant", "content": result.text})
        results.append(result)
    return results


async def side_request(i: int, http_url: str, grpc_address: str, progress: SoakProgress, start_at: int) -> SideResult:
    """One request that gives up after a few tokens, sent once the run has streamed `start_at`
    tokens (so side requests meet the faults too)."""
    while progress.num_tokens < start_at:
        await asyncio.sleep(0.05)
    kind = SIDE_KINDS[i % len(SIDE_KINDS)]
    incarnation = progress.incarnation
    prompt = f"{SHARED_SYSTEM}\nSide task {i}: summarize module_{i % 10}."
    try:
        if kind == "disconnect":
            outcome = await disconnect(http_url, prompt, num_chunks=4 + i % 5)
        else:
            outcome = await give_up(grpc_address, f"side-{i}", prompt, kind)
    except SwarmServeError as error:
        if error.code != grpc.StatusCode.UNAVAILABLE:
            raise
        outcome = "unavailable"
    except httpx.TransportError:
        outcome = "no connection"
    return SideResult(kind, outcome, incarnation)


async def disconnect(http_url: str, prompt: str, num_chunks: int) -> str:
    """An HTTP stream the client closes after `num_chunks` lines."""
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": SIDE_MAX_NEW_TOKENS,
            "ignore_eos": True, "temperature": 0.0, "stream": True}  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{http_url}/v1/chat/completions", json=body) as response:
            if response.status_code == 503:
                return "503"
            response.raise_for_status()
            lines = 0
            async for line in response.aiter_lines():
                lines += bool(line)
                if lines >= num_chunks:
                    return "disconnected"  # hang up mid-stream
    return "stream cut"


async def give_up(grpc_address: str, request_id: str, prompt: str, kind: str) -> str:
    """A gRPC stream its client cancels ("cancel") or stops with Abort ("abort") at its first token."""
    async with AsyncSwarmClient(grpc_address) as client:
        first_token = asyncio.Event()

        async def consume() -> str:
            async for event in client.generate(
                prompt, max_new_tokens=SIDE_MAX_NEW_TOKENS, ignore_eos=True, request_id=request_id
            ):
                if isinstance(event, TokenEvent) and event.token_ids:
                    first_token.set()
                elif isinstance(event, FinishEvent):
                    return event.finish_reason
            return "stream cut"

        stream = asyncio.create_task(consume())
        waiting = asyncio.create_task(first_token.wait())
        try:
            await asyncio.wait({stream, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not stream.done():
                if kind == "cancel":
                    stream.cancel()
                else:
                    await client.abort(request_id)
            return await stream  # "aborted"
        except asyncio.CancelledError:
            if not stream.cancelled():
                raise
            return "cancelled"
        finally:
            waiting.cancel()
            stream.cancel()
