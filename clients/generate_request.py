"""Client keyword arguments -> a GenerateRequest, checked before anything is sent.

Only what the protobuf types cannot express is checked here (one prompt source,
well-formed chat messages); value ranges such as "temperature must be >= 0" are the
server's to judge, so every client gets the same rule and the same message.
Sampling arguments left as None stay unset in the message, so the server's defaults
apply -- and `temperature=0.0` is sent, because it is set, not falsy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from swarmserve.scheduler.v1 import scheduler_pb2 as pb

CHAT_MESSAGE_KEYS = frozenset({"role", "content"})
STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "lark", "regex")


def chat_messages_to_pb(messages: Sequence[Mapping[str, str]]) -> pb.ChatMessages:
    """Dicts of `role` and `content` -> ChatMessages; other keys have no field to go to."""
    out = pb.ChatMessages()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        missing = CHAT_MESSAGE_KEYS - message.keys()
        extra = message.keys() - CHAT_MESSAGE_KEYS
        if missing or extra:
            raise ValueError(
                f"messages[{i}] must have exactly the keys 'role' and 'content'"
                + (f"; missing {sorted(missing)}" if missing else "")
                + (f"; unsupported {sorted(extra)}" if extra else "")
            )
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"messages[{i}]: 'role' and 'content' must be strings")
        out.messages.add(role=role, content=content)
    return out


def structured_output_to_pb(spec: Mapping[str, Any]) -> pb.StructuredOutput:
    """One of {"json_schema": dict or JSON text}, {"json_object": True}, {"lark": grammar}, {"regex": pattern}."""
    if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in STRUCTURED_OUTPUT_KINDS:
        raise ValueError(
            f"structured_output must be a dict with exactly one of the keys {', '.join(STRUCTURED_OUTPUT_KINDS)}"
        )
    kind, value = next(iter(spec.items()))
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "json_object" and value is not True:
        raise ValueError("structured_output json_object must be True")
    if kind in ("lark", "regex") and not isinstance(value, str):
        raise ValueError(f"structured_output {kind} must be a string, got {type(value).__name__}")
    return pb.StructuredOutput(**{kind: value})


def build_generate_request(
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
) -> pb.GenerateRequest:
    """Exactly one of `prompt` (raw text), `token_ids` or `messages` (chat) is the prompt.

    `structured_output` constrains the output to a grammar (see structured_output_to_pb).

    A single string for `stop` is one stop string, not a sequence of characters.
    Raises ValueError (or protobuf's TypeError/ValueError for a value its field cannot
    hold, such as a negative `max_new_tokens`) without contacting the server.
    """
    sources = {"prompt": prompt, "token_ids": token_ids, "messages": messages}
    given = [name for name, value in sources.items() if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, token_ids or messages (got {', '.join(given) or 'none'})")
    if isinstance(stop, str):
        stop = (stop,)

    request = pb.GenerateRequest(
        request_id=request_id or "",
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        num_logprobs=num_logprobs,
        include_special_tokens=include_special_tokens,
    )
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
        # An empty list must still select its arm of the oneof, so the server
        # answers "empty prompt" rather than "no prompt".
        request.token_ids.SetInParent()
    else:
        request.chat.CopyFrom(chat_messages_to_pb(messages))
        request.chat.SetInParent()

    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "seed": seed}
    sampling = {name: value for name, value in sampling.items() if value is not None}
    if sampling:
        request.sampling.CopyFrom(pb.SamplingParams(**sampling))
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    if session_id:
        request.session_id = session_id
    if retention_s is not None:
        request.retention_s = retention_s
    if structured_output is not None:
        request.structured_output.CopyFrom(structured_output_to_pb(structured_output))
    return request
