"""One streamed OpenAI request, timed: the client side every engine of `bench vs`'s prompt-bound
workloads gets (swarmserve's HTTP front, llama.cpp's llama-server, vLLM), so that each is
measured by the same code over the same protocol.

A token "arrives" with the first chunk whose text is not empty: chat streams open with a
role-only chunk, which is no token. Output tokens are counted from the final usage chunk
(`stream_options.include_usage`), or as the non-empty chunks where a server sends none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from clients.bench.swarm import parse_sse_line


class StreamError(RuntimeError):
    """The server refused a request or its stream broke off."""


@dataclass(frozen=True)
class StreamedRequest:
    """One request's timeline (time.monotonic() seconds) and what the server reported."""

    sent_s: float
    first_token_s: float | None  # None: no text came back
    end_s: float
    output_tokens: int
    prompt_tokens: int | None  # None: the server did not report usage
    cached_tokens: int | None  # prompt tokens served from a prefix cache, where reported
    text: str

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT): None for fewer than 2 tokens."""
        if self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return {
            "sent_s": self.sent_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "latency_s": self.end_s - self.sent_s,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }


def completion_body(model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    """/v1/completions, greedy, exactly `max_tokens` tokens (EOS ignored), streamed with usage."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """/v1/chat/completions, greedy, exactly `max_tokens` tokens (EOS ignored), streamed with usage."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:  # chat
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def stream_request(
    http: httpx.AsyncClient, url: str, body: dict, *, headers: dict | None = None
) -> StreamedRequest:
    """POST `body` to `url` (a /v1/completions or /v1/chat/completions route) and time its stream."""
    sent = time.monotonic()
    first, texts, num_chunks = None, [], 0
    usage: dict = {}
    async with http.stream("POST", url, json=body, headers=headers, timeout=None) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:500]
            raise StreamError(f"POST {url} answered {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            chunk = parse_sse_line(line)
            if chunk is None:
                continue
            if "error" in chunk:
                raise StreamError(f"POST {url}: the stream carried an error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                text = _chunk_text(choice)
                if text:
                    if first is None:
                        first = time.monotonic()
                    texts.append(text)
                    num_chunks += 1
            usage = chunk.get("usage") or usage
    end = time.monotonic()
    details = usage.get("prompt_tokens_details") or {}
    return StreamedRequest(
        sent_s=sent,
        first_token_s=first,
        end_s=end,
        output_tokens=int(usage.get("completion_tokens", num_chunks)),
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        text="".join(texts),
    )
