"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API onto a GenerateRequest.

Anthropic's turns become the template's messages: `system` a system message,
`tool_use` blocks an assistant's tool_calls, each `tool_result` block a `tool`
message (in block order, so a user turn that answers calls and then says more
keeps that order). Usage follows Anthropic's convention: `input_tokens` counts the
prompt tokens that were not read from the cache, `cache_read_input_tokens` those
that were.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from scheduler_svc.http_api import generation
from scheduler_svc.http_api.anthropic_schema import (
    CountTokensRequest,
    MediaBlock,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from scheduler_svc.http_api.choice import ChoiceOutput
from scheduler_svc.http_api.errors import ApiError, bad_field
from scheduler_svc.http_api.event_stream import EventStream, sse
from scheduler_svc.http_api.front import Front, http_refusal, protobuf_values, sampling, tools_json
from scheduler_svc.http_api.openai_chat import forced_tool_grammar
from scheduler_svc.http_api.tool_calls import ToolCall
from scheduler_svc.intake import prompt_token_ids
from scheduler_svc.request_limits import check_request_limits
from service_common.errors import InvalidRequestError
from swarmserve.scheduler.v1 import scheduler_pb2 as pb


def _text(blocks, where: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, block in enumerate(blocks):
        if isinstance(block, MediaBlock):
            raise bad_field(f"{where}[{j}]", f"{block.type} blocks are not supported; this server reads text only")
        texts.append(block.text)
    return "\n".join(texts) if where == "system" else "".join(texts)


def chat_messages(body: CountTokensRequest) -> list[pb.ChatMessage]:
    out = []
    if body.system:
        out.append(pb.ChatMessage(role="system", content=_text(body.system, "system")))
    names: dict[str, str] = {}  # tool_use id -> name, for the tool messages answering it
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            out.append(pb.ChatMessage(role=message.role, content=message.content))
            continue
        current = pb.ChatMessage(role=message.role)
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if message.role == "system" and not isinstance(block, (TextBlock, ThinkingBlock)):
                raise bad_field(where, f"a system message holds text blocks only, not {block.type}")
            if isinstance(block, TextBlock):
                current.content += block.text
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise bad_field(where, "tool_use blocks belong in assistant turns")
                current.tool_calls.append(pb.ToolCall(id=block.id, name=block.name, arguments=json.dumps(block.input)))
                names[block.id] = block.name
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise bad_field(where, "tool_result blocks belong in user turns")
                if current.content or current.tool_calls:
                    out.append(current)
                    current = pb.ChatMessage(role=message.role)
                content = _text(block.content, f"{where}.content")
                out.append(
                    pb.ChatMessage(
                        role="tool",
                        content=("Error: " + content) if block.is_error else content,
                        tool_call_id=block.tool_use_id,
                        name=names.get(block.tool_use_id, ""),
                    )
                )
            elif isinstance(block, MediaBlock):
                raise bad_field(where, f"{block.type} blocks are not supported; this server reads text only")
            # thinking blocks: the model's earlier reasoning (a frontier model's), not part of the prompt
        if current.content or current.tool_calls or message.role == "assistant":
            out.append(current)
    return out


def _tool_choice(body: CountTokensRequest) -> tuple[str, bool]:
    """(OpenAI-style choice: none | auto | required | a name, whether several calls are allowed)."""
    choice = body.tool_choice
    if choice is None:
        return ("auto" if body.tools else "none"), True
    several = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise bad_field("tool_choice.name", "is required when tool_choice.type is 'tool'")
        return choice.name, False
    return {"any": "required"}.get(choice.type, choice.type), several


@protobuf_values
def generate_request(
    front: Front, body: CountTokensRequest, request: HttpRequest | None
) -> tuple[pb.GenerateRequest, str]:
    """(the GenerateRequest, the tool choice its output is parsed under: Front.output_parser)."""
    choice, several = _tool_choice(body)
    if choice != "none" and not body.tools:
        raise bad_field("tool_choice", f"is {body.tool_choice.type!r} but no tools are given")
    tools = body.tools if choice != "none" else []
    msg = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=chat_messages(body),
            tools=tools_json(
                [
                    {
                        "type": "function",
                        "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
                    }
                    for t in tools
                ]
            ),
        )
    )
    if choice not in ("none", "auto"):
        functions = [(t.name, t.input_schema) for t in tools]
        msg.structured_output.lark = forced_tool_grammar(front, functions, choice, several, "tool_choice")
    if isinstance(body, MessagesRequest):
        output_format = body.output_config.format if body.output_config is not None else None
        if output_format is not None:
            if msg.HasField("structured_output"):
                raise bad_field("output_config.format", "cannot be combined with a forced tool_choice")
            msg.structured_output.json_schema = json.dumps(output_format.schema_)
        msg.max_new_tokens = body.max_tokens
        msg.stop.extend(body.stop_sequences or ())
        msg.sampling.CopyFrom(sampling(body))
        if request is not None:
            msg.session_id = front.session_id(body.session_id, request)
    return msg, choice if tools else "none"


async def count_tokens(front: Front, body: CountTokensRequest) -> Response:
    msg, _ = generate_request(front, body, None)
    limits = front.limits

    def count() -> int:
        check_request_limits(msg, front.config)
        return len(prompt_token_ids(msg, limits, front.config.tool_call_parser))

    try:
        return JSONResponse({"input_tokens": await asyncio.to_thread(count)})
    except InvalidRequestError as exc:  # LimitExceeded is one
        raise ApiError(400, *http_refusal(str(exc))) from None


def _stop_reason(output: ChoiceOutput) -> tuple[str, str | None]:
    """Cut by the length limit is `max_tokens`, calls or not (choice.py says why)."""
    if output.is_cut:
        return "max_tokens", None
    if output.calls:
        return "tool_use", None
    if output.final.finish_reason == pb.FINISH_REASON_STOP_STRING:
        return "stop_sequence", output.final.stop_string
    return "end_turn", None


def _usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict:
    return {
        "input_tokens": num_prompt_tokens - num_cached_tokens,
        "output_tokens": num_output_tokens,
        "cache_read_input_tokens": num_cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _final_usage(final: pb.GenerateFinal) -> dict:
    u = final.usage
    return _usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)


def _content(output: ChoiceOutput) -> list[dict]:
    """The content blocks in the order the stream gives them (an empty text block when there is
    nothing else, as Anthropic answers)."""
    blocks = [{"type": "text", "text": item} if isinstance(item, str) else _tool_use(item) for item in output.items]
    return blocks or [{"type": "text", "text": ""}]


def _tool_use(call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


async def messages(front: Front, body: MessagesRequest, request: HttpRequest) -> Response:
    msg, tool_choice = generate_request(front, body, request)
    # Clamped always: Claude Code asks for max_tokens 64000 (32000 on older models) whatever the model.
    streams = await generation.admit_all(
        front.loop, front.config, [msg], request.headers.items(), clamp_max_tokens=True
    )
    output = ChoiceOutput(front.output_parser(tool_choice))
    message_id = "msg_" + uuid.uuid4().hex
    if body.stream:
        events = _stream_events(front, message_id, streams, output)
        return EventStream(events, on_close=lambda: generation.release_all(front.loop, streams))
    await generation.collect_all(front.loop, request, streams, [output])
    content = _content(output)
    stop_reason, stop_sequence = _stop_reason(output)
    return JSONResponse(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": front.model_name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _final_usage(output.final),
        }
    )


async def _stream_events(front: Front, message_id: str, streams, output: ChoiceOutput) -> AsyncIterator[str]:
    """message_start, ping, then content blocks (text deltas; each tool_use with its input
    as one input_json_delta), message_delta with the stop reason and usage, message_stop.

    message_start waits for the first event: by then the request is scheduled and its prefix
    cache hit known, so message_start and message_delta give the same input_tokens (the SDKs
    take message_delta's over message_start's; Claude Code sums them per turn)."""
    request = streams[0].request
    events = generation.events(streams)
    try:
        first = await anext(events)
    except ApiError as exc:
        yield sse(exc.anthropic_body(), "error")
        return
    num_prompt, num_cached = request.num_prompt_tokens, min(request.num_cached_tokens, request.num_prompt_tokens)
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": front.model_name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(num_prompt, num_cached, 0),
    }
    yield sse({"type": "message_start", "message": start}, "message_start")
    yield sse({"type": "ping"}, "ping")
    index, text_open = 0, False

    def stop_block() -> str:
        return sse({"type": "content_block_stop", "index": index}, "content_block_stop")

    async def all_events():
        yield first
        async for item in events:
            yield item

    try:
        async for _, event in all_events():
            parsed = output.add(event)
            if parsed.text:
                if not text_open:
                    block = {"type": "text", "text": ""}
                    yield sse(
                        {"type": "content_block_start", "index": index, "content_block": block}, "content_block_start"
                    )
                    text_open = True
                delta = {"type": "text_delta", "text": parsed.text}
                yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            for call in parsed.calls:
                if text_open:
                    yield stop_block()
                    index, text_open = index + 1, False
                block = {**_tool_use(call), "input": {}}
                yield sse(
                    {"type": "content_block_start", "index": index, "content_block": block}, "content_block_start"
                )
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
                yield stop_block()
                index += 1
    except ApiError as exc:
        yield sse(exc.anthropic_body(), "error")
        return
    if text_open:
        yield stop_block()
    stop_reason, stop_sequence = _stop_reason(output)
    delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    usage = _usage(num_prompt, num_cached, output.final.usage.completion_tokens)
    yield sse({"type": "message_delta", "delta": delta, "usage": usage}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
