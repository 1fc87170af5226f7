"""POST /v1/completions: OpenAI (legacy) text completions onto GenerateRequests.

The prompt is a string (tokenized as is, with the model's BOS if it adds one) or
token ids. `echo` and `suffix` are not supported; `logprobs` is the legacy format
(tokens, token_logprobs, top_logprobs as {token: logprob} maps, text_offset).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from scheduler_svc.http_api import generation
from scheduler_svc.http_api.choice import ChoiceOutput, openai_finish_reason
from scheduler_svc.http_api.errors import ApiError, bad_field
from scheduler_svc.http_api.event_stream import EventStream, openai_chunks, sse
from scheduler_svc.http_api.front import (
    Front,
    check_choices,
    protobuf_values,
    refuse_unsupported,
    sampling,
    stop_list,
    structured_output,
)
from scheduler_svc.http_api.openai_chat import usage
from scheduler_svc.http_api.openai_schema import CompletionRequest
from swarmserve.scheduler.v1 import scheduler_pb2 as pb

UNSUPPORTED = ("logit_bias", "presence_penalty", "frequency_penalty", "echo", "suffix")


@protobuf_values
def generate_requests(front: Front, body: CompletionRequest, request: HttpRequest) -> list[pb.GenerateRequest]:
    refuse_unsupported(body, UNSUPPORTED)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_field("best_of", "must equal n when given (candidates are not ranked)")
    check_choices(body.n, front.config)
    grammar = structured_output(body.response_format)
    msgs = []
    for index in range(body.n):
        msg = pb.GenerateRequest(
            sampling=sampling(body, index),
            stop=stop_list(body.stop),
            num_logprobs=body.logprobs or 0,
            ignore_eos=body.ignore_eos,
            session_id=front.session_id(body.session_id, request),
        )
        if isinstance(body.prompt, str):
            msg.text = body.prompt
        else:
            msg.token_ids.ids.extend(body.prompt)
        if body.max_tokens is not None:
            msg.max_new_tokens = body.max_tokens
        else:
            msg.max_new_tokens = 16  # OpenAI's default for this endpoint
        if grammar is not None:
            msg.structured_output.CopyFrom(grammar)
        msgs.append(msg)
    return msgs


async def completions(front: Front, body: CompletionRequest, request: HttpRequest) -> Response:
    msgs = generate_requests(front, body, request)
    streams = await generation.admit_all(
        front.loop,
        front.config,
        msgs,
        request.headers.items(),
        prompt_field="prompt",
        clamp_max_tokens=front.config.clamp_max_tokens,
    )
    outputs = [ChoiceOutput(None) for _ in streams]
    completion_id = "cmpl-" + uuid.uuid4().hex
    if body.stream:
        chunks = _stream_chunks(front, body, completion_id, streams, outputs)
        return EventStream(chunks, on_close=lambda: generation.release_all(front.loop, streams))
    await generation.collect_all(front.loop, request, streams, outputs)
    choices = [_choice(front, body, i, out, out.text, out.logprobs, out.token_ids, 0) for i, out in enumerate(outputs)]
    for choice in choices:
        choice["finish_reason"] = openai_finish_reason(outputs[choice["index"]])
    return JSONResponse(
        {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": front.model_name,
            "choices": choices,
            "usage": usage([out.final for out in outputs]),
        }
    )


def _legacy_logprobs(front: Front, logprobs: list[pb.TokenLogprob], text_offset: int) -> dict:
    tokens = [front.token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{front.token_text(t.token_id): t.logprob for t in lp.top_logprobs} for lp in logprobs],
        "text_offset": offsets,
    }


def _choice(front, body, index, out, text, logprobs, token_ids, text_offset) -> dict:
    choice = {
        "index": index,
        "text": text,
        "logprobs": _legacy_logprobs(front, logprobs, text_offset) if body.logprobs is not None else None,
        "finish_reason": None,
    }
    if body.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return choice


async def _stream_chunks(front, body: CompletionRequest, completion_id: str, streams, outputs) -> AsyncIterator[str]:
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunk = openai_chunks("text_completion", completion_id, front.model_name, include_usage)

    try:
        async for index, event in generation.events(streams):
            out = outputs[index]
            offset, num_logprobs = len(out.text), len(out.logprobs)
            parsed = out.add(event)
            new_ids = list(event.token_ids) if isinstance(event, pb.TokenDelta) else []
            choice = _choice(front, body, index, out, parsed.text, out.logprobs[num_logprobs:], new_ids, offset)
            if out.is_finished:
                choice["finish_reason"] = openai_finish_reason(out)
            if parsed.text or choice["finish_reason"] or new_ids:
                yield chunk([choice])
    except ApiError as exc:
        yield sse(exc.openai_body())
        return
    if include_usage:
        yield chunk([], usage=usage([out.final for out in outputs]))
    yield sse("[DONE]")
