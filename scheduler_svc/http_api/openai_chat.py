"""POST /v1/chat/completions: OpenAI chat completions onto GenerateRequests (one per choice)."""

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
    tools_json,
)
from scheduler_svc.http_api.openai_schema import ChatCompletionRequest, ChatMessageIn, TextPart
from scheduler_svc.http_api.tool_calls import ToolCall
from scheduler_svc.http_api.tool_grammar import forced_call_grammar
from swarmserve.scheduler.v1 import scheduler_pb2 as pb

UNSUPPORTED = ("logit_bias", "presence_penalty", "frequency_penalty", "audio")


def message_text(content, where: str) -> str:
    """A message's content as text: a string, or text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, TextPart):
            raise bad_field(
                f"{where}.content[{j}]", f"{part.type} parts are not supported; this server reads text only"
            )
        texts.append(part.text)
    return "".join(texts)


def chat_messages(messages: list[ChatMessageIn]) -> list[pb.ChatMessage]:
    """OpenAI messages → the scheduler's; a tool message without a name gets its call's."""
    call_names: dict[str, str] = {}
    out = []
    for i, m in enumerate(messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        msg = pb.ChatMessage(role=role, content=message_text(m.content, f"messages[{i}]"))
        for call in m.tool_calls or ():
            msg.tool_calls.append(pb.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments))
            call_names[call.id] = call.function.name
        if role == "tool":
            msg.tool_call_id = m.tool_call_id or ""
            msg.name = m.name or call_names.get(msg.tool_call_id, "")
        out.append(msg)
    return out


def forced_tool_grammar(
    front: Front, functions: list[tuple[str, dict | None]], tool_choice, allow_several: bool, param: str
) -> str:
    """The grammar for tool_choice required / named; 400 if the model's syntax is unknown."""
    parser = front.tool_parser_name()
    if parser == "none":
        raise bad_field(
            param,
            "cannot force a tool call: this model's chat template renders tools in a syntax this server does not "
            "read, or the scheduler runs with --tool-call-parser none (start it with --tool-call-parser "
            "hermes|llama3)",
        )
    if tool_choice != "required":
        named = [f for f in functions if f[0] == tool_choice]
        if not named:
            raise bad_field(param, f"names the function {tool_choice!r}, which is not among the tools")
        return forced_call_grammar(parser, named, allow_several=False)
    return forced_call_grammar(parser, functions, allow_several)


def _tool_choice_name(tool_choice) -> str | None:
    """'none' | 'auto' | 'required' | a function's name."""
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice
    return tool_choice.function.name


@protobuf_values
def generate_requests(
    front: Front, body: ChatCompletionRequest, request: HttpRequest
) -> tuple[list[pb.GenerateRequest], str]:
    """(one GenerateRequest per choice, the tool choice its output is parsed under: Front.output_parser)."""
    refuse_unsupported(body, UNSUPPORTED)
    if body.modalities and body.modalities != ["text"]:
        raise bad_field("modalities", "only text output is supported")
    check_choices(body.n, front.config)
    choice = _tool_choice_name(body.tool_choice) or ("auto" if body.tools else "none")
    if choice != "none" and not body.tools:
        raise bad_field("tool_choice", f"is {choice!r} but no tools are given")
    tools = [t.function for t in body.tools or ()] if choice != "none" else []
    chat = pb.ChatMessages(
        messages=chat_messages(body.messages),
        tools=tools_json([{"type": "function", "function": f.model_dump(exclude_none=True)} for f in tools]),
    )
    grammar = structured_output(body.response_format)
    if choice not in ("none", "auto"):
        if grammar is not None:
            raise bad_field("response_format", "cannot be combined with a forced tool_choice")
        functions = [(f.name, f.parameters) for f in tools]
        grammar = pb.StructuredOutput(
            lark=forced_tool_grammar(front, functions, choice, body.parallel_tool_calls, "tool_choice")
        )
    max_tokens = body.max_completion_tokens or body.max_tokens
    num_logprobs = max(body.top_logprobs or 0, 1) if body.logprobs else 0
    msgs = []
    for index in range(body.n):
        msg = pb.GenerateRequest(
            chat=chat,
            sampling=sampling(body, index),
            stop=stop_list(body.stop),
            num_logprobs=num_logprobs,
            ignore_eos=body.ignore_eos,
            session_id=front.session_id(body.session_id, request),
        )
        if max_tokens is not None:
            msg.max_new_tokens = max_tokens
        if grammar is not None:
            msg.structured_output.CopyFrom(grammar)
        msgs.append(msg)
    return msgs, choice if tools else "none"


async def chat_completions(front: Front, body: ChatCompletionRequest, request: HttpRequest) -> Response:
    msgs, tool_choice = generate_requests(front, body, request)
    streams = await generation.admit_all(
        front.loop,
        front.config,
        msgs,
        request.headers.items(),
        max_tokens_field="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
        clamp_max_tokens=front.config.clamp_max_tokens,
    )
    outputs = [ChoiceOutput(front.output_parser(tool_choice)) for _ in streams]
    completion_id = "chatcmpl-" + uuid.uuid4().hex
    if body.stream:
        chunks = _stream_chunks(front, body, completion_id, streams, outputs)
        return EventStream(chunks, on_close=lambda: generation.release_all(front.loop, streams))
    await generation.collect_all(front.loop, request, streams, outputs)
    return JSONResponse(_completion(front, body, completion_id, outputs))


def usage(finals: list[pb.GenerateFinal]) -> dict:
    prompt = finals[0].usage.prompt_tokens
    completion = sum(f.usage.completion_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": finals[0].usage.cached_tokens},
    }


def logprob_entries(front: Front, logprobs: list[pb.TokenLogprob], num_top: int) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        token = front.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return [
        {
            **entry(lp.token_id, lp.logprob),
            "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top_logprobs[:num_top]],
        }
        for lp in logprobs
    ]


def tool_call_dicts(calls: list[ToolCall], start: int = 0, with_index: bool = False) -> list[dict]:
    return [
        {
            **({"index": start + k} if with_index else {}),
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for k, call in enumerate(calls)
    ]


def _completion(front: Front, body: ChatCompletionRequest, completion_id: str, outputs: list[ChoiceOutput]) -> dict:
    choices = []
    for index, out in enumerate(outputs):
        message: dict = {"role": "assistant", "content": out.text if (out.text or not out.calls) else None}
        if out.calls:
            message["tool_calls"] = tool_call_dicts(out.calls)
        choice = {
            "index": index,
            "message": message,
            "logprobs": {"content": logprob_entries(front, out.logprobs, body.top_logprobs or 0)}
            if body.logprobs
            else None,
            "finish_reason": openai_finish_reason(out),
        }
        if body.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": front.model_name,
        "choices": choices,
        "usage": usage([out.final for out in outputs]),
        "system_fingerprint": None,
    }


async def _stream_chunks(
    front: Front, body: ChatCompletionRequest, completion_id: str, streams, outputs: list[ChoiceOutput]
) -> AsyncIterator[str]:
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunk = openai_chunks("chat.completion.chunk", completion_id, front.model_name, include_usage)

    for index in range(len(streams)):
        yield chunk(
            [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )
    try:
        async for index, event in generation.events(streams):
            out = outputs[index]
            num_calls, num_logprobs = len(out.calls), len(out.logprobs)
            parsed = out.add(event)
            delta: dict = {}
            if parsed.text:
                delta["content"] = parsed.text
            if parsed.calls:
                delta["tool_calls"] = tool_call_dicts(parsed.calls, num_calls, with_index=True)
            choice: dict = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            if body.logprobs and len(out.logprobs) > num_logprobs:
                choice["logprobs"] = {
                    "content": logprob_entries(front, out.logprobs[num_logprobs:], body.top_logprobs or 0)
                }
            if body.return_token_ids and isinstance(event, pb.TokenDelta):
                choice["token_ids"] = list(event.token_ids)
            if out.is_finished:
                choice["finish_reason"] = openai_finish_reason(out)
            if delta or choice["finish_reason"] or choice["logprobs"] or choice.get("token_ids"):
                yield chunk([choice])
    except ApiError as exc:  # the status line is sent: the error goes in the stream
        yield sse(exc.openai_body())
        return
    if include_usage:
        yield chunk([], usage=usage([out.final for out in outputs]))
    yield sse("[DONE]")
