"""A Generate call → a validated scheduler `Request`, or a message naming the bad field.

Everything the executor would refuse is refused here first, with a message a
person can act on, so a bad request never reaches a step plan: the checks of a
request's contents are the executor's own (service_common.request_checks,
SamplingParams, StructuredOutput), worded the same. A refusal is an
InvalidRequestError, which the servers answer with INVALID_ARGUMENT (HTTP 400).

The server's limits on sizes (request_limits) are checked before anything is
tokenized or rendered. Tokenizing a long prompt takes seconds, so the server runs
`intake` on a worker thread, and encodes through `encode_batch`, which releases the
GIL (`encode` holds it: a 900 KB prompt stalled the event loop, and every stream,
for 1.3 s).
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from dataclasses import dataclass

from tokenizers import Tokenizer

from scheduler_svc.chat_template import ChatTemplateError, InvalidMessagesError
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.grammar_checker import GrammarChecker
from scheduler_svc.request import Request
from scheduler_svc.request_limits import check_request_limits
from scheduler_svc.template_fit import render_prompt
from service_common.errors import InvalidRequestError
from service_common.request_checks import check_new_request, check_retention_s, check_room_to_generate
from service_common.sampling_params import SamplingParams
from service_common.structured_output import StructuredOutput
from swarmserve.scheduler.v1 import scheduler_pb2 as pb

DEFAULT_TEMPERATURE = 1.0
DEFAULT_SESSION_RETENTION_S = 30.0  # an agent's tool call usually returns well within this (capped by max_retention_s)


@dataclass(frozen=True)
class ModelLimits:
    """What intake needs to know about the model behind the executor."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str
    eos_token: str
    context_length: int
    vocab_size: int

    @functools.cached_property
    def grammar_checker(self) -> GrammarChecker:
        return GrammarChecker(self.tokenizer, self.vocab_size, self.eos_token)


@dataclass(frozen=True)
class Intake:
    request: Request
    stop_strings: list[str]
    include_special_tokens: bool


def _sampling(msg: pb.GenerateRequest) -> SamplingParams:
    # The public API's num_logprobs beside the sampling message is what an unset sampling.num_logprobs takes.
    return SamplingParams.from_pb(
        msg.sampling, SamplingParams(temperature=DEFAULT_TEMPERATURE, num_logprobs=msg.num_logprobs)
    )


def _structured_output(msg: pb.GenerateRequest, limits: ModelLimits) -> StructuredOutput | None:
    spec = StructuredOutput.from_pb(msg.structured_output)
    if spec is not None:
        limits.grammar_checker.check(spec)
    return spec


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch, not encode: only the batch call releases the GIL while it works.
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _json_object(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field} must be a JSON object, got {type(value).__name__}")
    return value


def _chat_message(index: int, m: pb.ChatMessage) -> dict:
    """A message as transformers' templates expect it: tool calls with their arguments as a
    mapping (templates write `tool_call.arguments | tojson`), optional keys only when set."""
    message: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": _json_object(
                        call.arguments or "{}", f"chat.messages[{index}].tool_calls[{j}].arguments"
                    ),
                },
            }
            for j, call in enumerate(m.tool_calls)
        ]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    return message


def _tools(text: str) -> list[dict] | None:
    """chat.tools (a JSON array of tool definitions), or None when there are none."""
    if not text:
        return None
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"chat.tools is not valid JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequestError("chat.tools must be a JSON array of tool definitions (objects)")
    return tools or None


def prompt_token_ids(msg: pb.GenerateRequest, limits: ModelLimits, tool_call_parser: str = "auto") -> list[int]:
    """The prompt's token ids: text tokenized, or chat rendered by the template (fitted to it:
    template_fit, which `tool_call_parser`, --tool-call-parser, steers) and tokenized."""
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt is missing: set one of text, chat or token_ids")
    if kind == "text":
        if not msg.text:
            raise InvalidRequestError("text is empty")
        return _encode(limits.tokenizer, msg.text, add_special_tokens=True)
    if kind == "token_ids":
        check_room_to_generate(len(msg.token_ids.ids), limits.context_length)  # before reading them
        if not msg.token_ids.ids:
            raise InvalidRequestError("token_ids is empty")
        return list(msg.token_ids.ids)  # in the vocabulary: check_new_request's to say
    messages = [_chat_message(i, m) for i, m in enumerate(msg.chat.messages)]
    if not messages:
        raise InvalidRequestError("chat.messages is empty")
    if not limits.chat_template:
        raise InvalidRequestError("this model has no chat template; send text or token_ids")
    try:
        text = render_prompt(
            limits.chat_template,
            messages,
            _tools(msg.chat.tools),
            tool_call_parser,
            bos_token=limits.bos_token,
            eos_token=limits.eos_token,
        )
    except InvalidMessagesError as exc:
        raise InvalidRequestError(f"chat.{exc}") from None
    except ChatTemplateError as exc:
        raise InvalidRequestError(f"the chat template failed on these messages: {exc}") from None
    # The template already wrote any BOS it wants.
    return _encode(limits.tokenizer, text, add_special_tokens=False)


def intake(
    msg: pb.GenerateRequest, limits: ModelLimits, config: SchedulerConfig, clamp_to_tokens: int | None = None
) -> Intake:
    """Validate a Generate call against the model and the server's limits (`config`): the
    cheap checks first, then the grammar (compiled), the prompt (tokenized) and the rest.

    With `clamp_to_tokens` (the most tokens one request can hold: LoopView.max_request_tokens),
    a max_new_tokens beyond what the prompt leaves of it is cut to fit instead of refused, as
    llama.cpp's server cuts it to its slot: agent clients ask for far more than any small
    model's context (Claude Code: 64000) and have no setting to ask for less."""
    check_request_limits(msg, config)
    sampling = _sampling(msg)
    structured_output = _structured_output(msg, limits)
    if any(not s for s in msg.stop):
        raise InvalidRequestError("stop strings must not be empty")
    prompt = prompt_token_ids(msg, limits, config.tool_call_parser)
    check_room_to_generate(len(prompt), limits.context_length)
    request = Request(
        request_id=msg.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling=sampling,
        max_new_tokens=_max_new_tokens(msg, len(prompt), limits.context_length, config, clamp_to_tokens),
        stop_token_ids=frozenset(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        arrival_time=time.monotonic(),
        session_id=msg.session_id,
        retention_s=_retention_s(msg, config),
        executor_request_id=uuid.uuid4().hex,  # never the client's id: see Request
        structured_output=structured_output,
    )
    check_new_request(request, limits.context_length, limits.vocab_size)
    return Intake(request=request, stop_strings=list(msg.stop), include_special_tokens=msg.include_special_tokens)


def _max_new_tokens(
    msg: pb.GenerateRequest,
    num_prompt_tokens: int,
    context_length: int,
    config: SchedulerConfig,
    clamp_to_tokens: int | None = None,
) -> int:
    """The client's, if it fits the context (0 is check_new_request's to refuse); else the server's
    default, cut to fit. With `clamp_to_tokens`, the client's is cut to fit that too; a prompt that
    leaves no room there is refused (the prompt alone beyond the KV cache is admission's to say)."""
    room = context_length - num_prompt_tokens
    if not msg.HasField("max_new_tokens"):
        return min(config.default_max_new_tokens, room)
    if clamp_to_tokens is not None:
        kv_room = min(context_length, clamp_to_tokens) - num_prompt_tokens
        if kv_room <= 0:
            raise InvalidRequestError(
                f"the prompt is {num_prompt_tokens} tokens; one request can hold at most {clamp_to_tokens} tokens "
                f"here (the model's context is {context_length}), which leaves no room to generate"
            )
        return min(msg.max_new_tokens, kv_room) if msg.max_new_tokens > 0 else msg.max_new_tokens
    if msg.max_new_tokens > room:
        raise InvalidRequestError(
            f"max_new_tokens={msg.max_new_tokens} is beyond the context: the prompt is {num_prompt_tokens} tokens "
            f"and the context {context_length}, so at most {room} new tokens fit"
        )
    return msg.max_new_tokens


def _retention_s(msg: pb.GenerateRequest, config: SchedulerConfig) -> float:
    """How long the session's KV is preferred after the request: asked for or the default, at most
    the server's limit."""
    if msg.HasField("retention_s"):
        check_retention_s(msg.retention_s)
        if not msg.session_id:
            raise InvalidRequestError("retention_s needs a session_id")
        # Clamped, not refused: a hint asking for too long still gets the longest the server allows.
        return min(msg.retention_s, config.max_retention_s)
    if msg.session_id:
        return min(DEFAULT_SESSION_RETENTION_S, config.max_retention_s)
    return 0.0
