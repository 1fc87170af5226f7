"""What the `swarmserve` CLI writes, as pure functions of results (so tests need no server).

stdout carries the model's text (or, with --json, exactly one JSON object per turn);
everything about the text -- the summary line, errors -- goes to stderr.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from clients.completion import Completion
from clients.events import Usage


def completion_to_json(completion: Completion) -> dict[str, Any]:
    """The --json object: request_id, token_ids, text, finish_reason, stop_string, usage."""
    return {
        "request_id": completion.request_id,
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "stop_string": completion.stop_string,
        "usage": dataclasses.asdict(completion.usage),
    }


def decode_tokens_per_second(usage: Usage) -> float | None:
    """Tokens per second after the first one: the decode rate, which TTFT does not dilute.

    None when it cannot be measured (fewer than two tokens, or no time between them).
    """
    decode_time_s = usage.total_time_s - usage.ttft_s
    if usage.completion_tokens < 2 or decode_time_s <= 0:
        return None
    return (usage.completion_tokens - 1) / decode_time_s


def format_summary(completion: Completion) -> str:
    """One stderr line, key=value so it greps:
    `finish=length tokens=32 prompt_tokens=5 cached_tokens=0 ttft=0.123s tok/s=40.7 total=0.885s request_id=...`
    """
    usage = completion.usage
    finish = completion.finish_reason
    if completion.stop_string is not None:
        finish += f"({completion.stop_string!r})"
    parts = [
        f"finish={finish}",
        f"tokens={usage.completion_tokens}",
        f"prompt_tokens={usage.prompt_tokens}",
        f"cached_tokens={usage.cached_tokens}",
        f"ttft={usage.ttft_s:.3f}s",
    ]
    rate = decode_tokens_per_second(usage)
    if rate is not None:
        parts.append(f"tok/s={rate:.1f}")
    parts.append(f"total={usage.total_time_s:.3f}s")
    if usage.queue_time_s >= 0.001:
        parts.append(f"queued={usage.queue_time_s:.3f}s")
    if usage.drafted_tokens:
        parts.append(f"accepted={usage.accepted_tokens}/{usage.drafted_tokens}")
    if usage.num_preemptions:
        parts.append(f"preemptions={usage.num_preemptions}")
    if completion.request_id:
        parts.append(f"request_id={completion.request_id}")
    return " ".join(parts)


def format_error(error: BaseException) -> str:
    """`error: INVALID_ARGUMENT: temperature must be ...` for a server error; `error: <message>` otherwise."""
    # SwarmServeError's str is already "CODE: message".
    return f"error: {str(error) or type(error).__name__}"


def format_serve_banner(model_name: str, addresses: list[tuple[str, str]]) -> str:
    """`swarmserve serve`'s banner: the model, then one line per address it serves on."""
    width = max(len(what) for what, _ in addresses)
    return "\n".join(
        [f"swarmserve: serving {model_name}", *(f"  {what:<{width}}  {where}" for what, where in addresses)]
    )
