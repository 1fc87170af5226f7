"""Client keyword arguments -> a GenerateRequest, checked before anything is sent.

Only what the protobuf types cannot express is checked here (one prompt source,
well-formed chat messages); value ranges such as "temperature must be >= 0" are the
server's to judge, so every client gets the same rule and the same message.
Sampling arguments left as None stay unset in the message, so the server's defaults
apply -- and `temperature=0.0` is sent, because it is set, not falsy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from swarmserve.scheduler.v1 import scheduler_pb2 as pb

CHAT_MESSAGE_KEYS = frozenset({"role", "content"})


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
) -> pb.GenerateRequest:
    """Exactly one of `prompt` (raw text), `token_ids` or `messages` (chat) is the prompt.

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
    return request
