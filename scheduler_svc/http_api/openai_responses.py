"""POST /v1/responses: the subset of OpenAI's Responses API that Codex uses.

Input items become chat messages: `instructions` the system message, messages as
they are (developer → system), `function_call` items an assistant's tool_calls
(consecutive calls join one assistant turn), `function_call_output` items tool
messages; `reasoning` items are dropped. Nothing is stored, so
`previous_response_id` is refused: the client sends the whole conversation (Codex
does). `prompt_cache_key` (Codex sets it per conversation) names the session.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from scheduler_svc.http_api import generation
from scheduler_svc.http_api.choice import ChoiceOutput
from scheduler_svc.http_api.errors import ApiError, bad_field
from scheduler_svc.http_api.event_stream import EventStream, sse
from scheduler_svc.http_api.front import Front, protobuf_values, sampling, tools_json
from scheduler_svc.http_api.openai_chat import forced_tool_grammar, message_text
from scheduler_svc.http_api.openai_schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    OtherItem,
    ResponsesRequest,
)
from scheduler_svc.http_api.tool_calls import ToolCall
from swarmserve.scheduler.v1 import scheduler_pb2 as pb


def chat_messages(body: ResponsesRequest) -> list[pb.ChatMessage]:
    out = []
    if body.instructions:
        out.append(pb.ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        return [*out, pb.ChatMessage(role="user", content=body.input)]
    names: dict[str, str] = {}
    for i, item in enumerate(body.input):
        if isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            out.append(pb.ChatMessage(role=role, content=message_text(item.content, f"input[{i}]")))
        elif isinstance(item, FunctionCallItem):
            if not out or out[-1].role != "assistant":  # else the call joins the assistant's turn
                out.append(pb.ChatMessage(role="assistant"))
            out[-1].tool_calls.append(pb.ToolCall(id=item.call_id, name=item.name, arguments=item.arguments))
            names[item.call_id] = item.name
        elif isinstance(item, FunctionCallOutputItem):
            content = item.output if isinstance(item.output, str) else message_text(item.output, f"input[{i}].output")
            out.append(
                pb.ChatMessage(
                    role="tool", content=content, tool_call_id=item.call_id, name=names.get(item.call_id, "")
                )
            )
        elif isinstance(item, OtherItem):
            raise bad_field(f"input[{i}].type", f"items of type {item.type!r} are not supported")
        # ReasoningItem: dropped
    return out


def _functions(body: ResponsesRequest) -> list:
    return [t for t in body.tools or () if t.type == "function" and t.name]


@protobuf_values
def generate_request(front: Front, body: ResponsesRequest, request: HttpRequest) -> tuple[pb.GenerateRequest, str]:
    """(the GenerateRequest, the tool choice its output is parsed under: Front.output_parser)."""
    if body.previous_response_id:
        raise bad_field("previous_response_id", "responses are not stored here; send the whole conversation as input")
    functions = _functions(body)
    choice = (
        body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None else body.tool_choice.name
    )
    choice = choice or ("auto" if functions else "none")
    if choice != "none" and not functions:
        raise bad_field("tool_choice", f"is {choice!r} but no function tools are given")
    tools = functions if choice != "none" else []
    msg = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=chat_messages(body),
            tools=tools_json(
                [
                    {
                        "type": "function",
                        "function": {
                            "name": t.name,
                            "description": t.description or "",
                            "parameters": t.parameters or {"type": "object"},
                        },
                    }
                    for t in tools
                ]
            ),
        ),
        session_id=front.session_id(body.session_id or body.prompt_cache_key, request),
    )
    text_format = body.text.format if body.text is not None else None
    if choice not in ("none", "auto"):
        if text_format is not None and text_format.type != "text":
            raise bad_field("text.format", "cannot be combined with a forced tool_choice")
        grammar = forced_tool_grammar(
            front, [(t.name, t.parameters) for t in tools], choice, body.parallel_tool_calls, "tool_choice"
        )
        msg.structured_output.lark = grammar
    elif text_format is not None and text_format.type == "json_object":
        msg.structured_output.json_object = True
    elif text_format is not None and text_format.type == "json_schema":
        if text_format.schema_ is None:
            raise bad_field("text.format.schema", "is required for json_schema")
        msg.structured_output.json_schema = json.dumps(text_format.schema_)
    if body.max_output_tokens is not None:
        msg.max_new_tokens = body.max_output_tokens
    msg.sampling.CopyFrom(sampling(body))
    return msg, choice if tools else "none"


class _Ids:
    def __init__(self) -> None:
        self.response = "resp_" + uuid.uuid4().hex
        self._message = "msg_" + uuid.uuid4().hex

    def message(self, k: int) -> str:
        """The id of the output's k-th message item (text after a call starts another)."""
        return self._message if k == 0 else f"{self._message}_{k}"


def _message_item(message_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def _output_items(ids: _Ids, output: ChoiceOutput) -> list[dict]:
    """The output items in the order the stream gave them their output_index: a message item
    per run of text, a function_call item per call (an empty message when there is neither)."""
    items, num_messages = [], 0
    for item in output.items:
        if isinstance(item, str):
            items.append(_message_item(ids.message(num_messages), item, "completed"))
            num_messages += 1
        else:
            items.append(_call_item(item))
    return items or [_message_item(ids.message(0), "", "completed")]


def _call_item(call: ToolCall, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
        "status": status,
    }


def _response(front: Front, body: ResponsesRequest, ids: _Ids, created: int, output: ChoiceOutput | None) -> dict:
    """The response object; `output` None: just created (in progress)."""
    items, status, incomplete, usage = [], "in_progress", None, None
    if output is not None:
        items = _output_items(ids, output)
        status = "incomplete" if output.is_cut else "completed"  # calls or not: choice.py says why
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        u = output.final.usage
        usage = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }
    choice = (
        body.tool_choice
        if isinstance(body.tool_choice, str) or body.tool_choice is None
        else body.tool_choice.model_dump()
    )
    return {
        "id": ids.response,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": front.model_name,
        "output": items,
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": choice or "auto",
        "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in _functions(body)],
        "usage": usage,
        "metadata": {},
    }


async def responses(front: Front, body: ResponsesRequest, request: HttpRequest) -> Response:
    msg, tool_choice = generate_request(front, body, request)
    streams = await generation.admit_all(
        front.loop,
        front.config,
        [msg],
        request.headers.items(),
        prompt_field="input",
        max_tokens_field="max_output_tokens",
        clamp_max_tokens=front.config.clamp_max_tokens,
    )
    output = ChoiceOutput(front.output_parser(tool_choice))
    ids, created = _Ids(), int(time.time())
    if body.stream:
        events = _stream_events(front, body, ids, created, streams, output)
        return EventStream(events, on_close=lambda: generation.release_all(front.loop, streams))
    await generation.collect_all(front.loop, request, streams, [output])
    return JSONResponse(_response(front, body, ids, created, output))


async def _stream_events(front, body, ids: _Ids, created: int, streams, output: ChoiceOutput) -> AsyncIterator[str]:
    sequence = 0

    def event(kind: str, **fields) -> str:
        nonlocal sequence
        sequence += 1
        return sse({"type": kind, "sequence_number": sequence - 1, **fields}, kind)

    yield event("response.created", response=_response(front, body, ids, created, None))
    yield event("response.in_progress", response=_response(front, body, ids, created, None))
    output_index, text_open, num_messages, text = 0, False, 0, ""

    def close_text() -> list[str]:
        message_id = ids.message(num_messages)
        part = {"type": "output_text", "text": text, "annotations": []}
        where = dict(item_id=message_id, output_index=output_index, content_index=0)
        return [
            event("response.output_text.done", **where, text=text),
            event("response.content_part.done", **where, part=part),
            event(
                "response.output_item.done",
                output_index=output_index,
                item=_message_item(message_id, text, "completed"),
            ),
        ]

    try:
        async for _, update in generation.events(streams):
            parsed = output.add(update)
            if parsed.text:
                if not text_open:
                    text_open, text = True, ""
                    yield event(
                        "response.output_item.added",
                        output_index=output_index,
                        item=_message_item(ids.message(num_messages), "", "in_progress"),
                    )
                    part = {"type": "output_text", "text": "", "annotations": []}
                    yield event(
                        "response.content_part.added",
                        item_id=ids.message(num_messages),
                        output_index=output_index,
                        content_index=0,
                        part=part,
                    )
                text += parsed.text
                yield event(
                    "response.output_text.delta",
                    item_id=ids.message(num_messages),
                    output_index=output_index,
                    content_index=0,
                    delta=parsed.text,
                )
            for call in parsed.calls:
                if text_open:
                    for line in close_text():
                        yield line
                    text_open, output_index, num_messages = False, output_index + 1, num_messages + 1
                item = _call_item(call)
                yield event(
                    "response.output_item.added", output_index=output_index, item=_call_item(call, "in_progress")
                )
                where = dict(item_id=item["id"], output_index=output_index)
                yield event("response.function_call_arguments.delta", **where, delta=call.arguments)
                yield event("response.function_call_arguments.done", **where, arguments=call.arguments)
                yield event("response.output_item.done", output_index=output_index, item=item)
                output_index += 1
    except ApiError as exc:
        error = {"code": exc.openai_body()["error"]["type"], "message": exc.message}
        failed = {**_response(front, body, ids, created, None), "status": "failed", "error": error}
        yield event("response.failed", response=failed)
        return
    if not text_open and output_index == 0:  # nothing at all: the final's one empty message, streamed too
        text_open, text = True, ""
        yield event("response.output_item.added", output_index=0, item=_message_item(ids.message(0), "", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": []}
        yield event("response.content_part.added", item_id=ids.message(0), output_index=0, content_index=0, part=part)
    if text_open:
        for line in close_text():
            yield line
    final = _response(front, body, ids, created, output)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
