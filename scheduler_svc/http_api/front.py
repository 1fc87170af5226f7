"""What every HTTP route needs from the scheduler: the step loop, the config, the model."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from starlette.requests import Request as HttpRequest
from tokenizers import Tokenizer

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.http_api.errors import ApiError, bad_field
from scheduler_svc.http_api.tool_calls import ToolCallParser, make_parser
from scheduler_svc.intake import ModelLimits
from scheduler_svc.step_loop import StepLoop
from scheduler_svc.template_fit import tool_syntax
from service_common.sampling_params import SamplingParams
from swarmserve.scheduler.v1 import scheduler_pb2 as pb

P = ParamSpec("P")
T = TypeVar("T")

# Where the session extension may come from: OpenAI-style clients set a header or a body
# field; Codex sends its conversation id as `session_id`.
SESSION_HEADERS = ("x-session-id", "session_id")

# Sampling options the HTTP bodies spell otherwise; every other one has its SamplingParams name
# there too (OpenAI's and vLLM's: temperature, top_p, top_k, min_p, seed), and passes through as is.
_RENAMED_SAMPLING = {"num_logprobs": "top_logprobs"}
_SAMPLING_PARAMS = {f.name: _RENAMED_SAMPLING.get(f.name, f.name) for f in dataclasses.fields(SamplingParams)}

# gRPC field names in intake's refusals → the HTTP API's field, for `param`.
_PARAMS = (
    ("max_new_tokens", "max_tokens"),
    *((f"sampling.{name}", param) for name, param in _SAMPLING_PARAMS.items()),
    ("session_id", "session_id"),
    ("stop", "stop"),
    ("chat.tools", "tools"),
    ("chat.", "messages"),
    ("text", "prompt"),
    ("token_ids", "prompt"),
    ("the prompt", "messages"),
    ("the chat template", "messages"),
)
_SAMPLING_RENAMES = tuple((f"sampling.{name}", param) for name, param in _SAMPLING_PARAMS.items())


def param_for_refusal(message: str, prompt_field: str = "messages", max_tokens_field: str = "max_tokens") -> str | None:
    for prefix, param in _PARAMS:
        if message.startswith(prefix):
            if param == "max_tokens":
                return max_tokens_field
            return prompt_field if param in ("messages", "prompt") else param
    return None


def http_refusal(
    message: str, prompt_field: str = "messages", max_tokens_field: str = "max_tokens"
) -> tuple[str, str | None]:
    """(intake's refusal worded for an HTTP client, the field it names): a message that starts
    with a gRPC field (`max_new_tokens=64000 ...`, `sampling.min_p ...`) starts with the body's
    field instead, as the client spelled it (`max_tokens`, `max_completion_tokens`, `min_p`)."""
    param = param_for_refusal(message, prompt_field, max_tokens_field)
    for grpc_name, http_name in (("max_new_tokens", max_tokens_field), *_SAMPLING_RENAMES):
        if message.startswith(grpc_name) and not message[len(grpc_name) : len(grpc_name) + 1].isalnum():
            return http_name + message[len(grpc_name) :], param
    return message, param


@dataclass
class Front:
    config: SchedulerConfig
    loop: StepLoop
    metrics: object | None = None  # SchedulerMetrics

    @property
    def limits(self) -> ModelLimits:
        limits = self.loop.view.limits
        if limits is None or not self.loop.is_connected:
            raise ApiError(503, f"the executor at {self.config.executor} is not connected; retry shortly")
        return limits

    @property
    def model_name(self) -> str:
        info = self.loop.view.info
        return info.model_name if info is not None and info.model_name else "swarmserve"

    @property
    def tokenizer(self) -> Tokenizer:
        return self.limits.tokenizer

    def tool_parser_name(self) -> str:
        """The tool-call syntax of this model's prompts: --tool-call-parser's, the template's, or the
        generic format the scheduler renders for a template without tools (template_fit)."""
        limits = self.limits
        return tool_syntax(limits.chat_template, self.config.tool_call_parser, limits.bos_token, limits.eos_token)[0]

    def output_parser(self, tool_choice: str) -> ToolCallParser | None:
        """A parser for one output under `tool_choice` (none | auto | required | a function's name):
        none reads it all as text; required or a name, forced by the grammar, as calls only."""
        if tool_choice == "none":
            return None
        return make_parser(self.tool_parser_name(), forced=tool_choice != "auto")

    def session_id(self, body_value: str | None, request: HttpRequest) -> str:
        if body_value:
            return body_value
        for header in SESSION_HEADERS:
            if request.headers.get(header):
                return request.headers[header]
        return ""

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def protobuf_values(build: Callable[P, T]) -> Callable[P, T]:
    """`build` (which fills GenerateRequests from a body) with protobuf's refusals as a 400:
    JSON can carry what a proto field cannot hold (a lone surrogate in a string, say)."""

    @functools.wraps(build)
    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return build(*args, **kwargs)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, f"the request holds a value this server cannot take: {exc}") from None

    return checked


def tools_json(tools: list[dict]) -> str:
    return json.dumps(tools, ensure_ascii=False) if tools else ""


def check_choices(n: int, config: SchedulerConfig) -> None:
    if n > config.max_choices:
        raise bad_field("n", f"at most {config.max_choices} completions per request (--max-choices), got {n}")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def structured_output(response_format) -> pb.StructuredOutput | None:
    """OpenAI's response_format → the grammar the executor enforces (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return pb.StructuredOutput(json_object=True)
    schema = response_format.json_schema.schema_
    if schema is None:
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(json_schema=json.dumps(schema))


def sampling(body, index: int = 0) -> pb.SamplingParams:
    """The sampling options a body sets under their own names (those it lacks or leaves unset take
    the server's defaults); choice `index` of n gets seed + index, so the choices differ but each
    stays reproducible. Renamed ones (_RENAMED_SAMPLING) are the route's to map."""
    s = pb.SamplingParams()
    for name in _SAMPLING_PARAMS.keys() - _RENAMED_SAMPLING.keys():
        value = getattr(body, name, None)
        if value is not None:
            setattr(s, name, value)
    if s.HasField("seed"):
        s.seed = (s.seed + index) % (1 << 64)
    return s


def refuse_unsupported(body, fields: tuple[str, ...]) -> None:
    """A 400 for a set field this server cannot honour."""
    for field in fields:
        value = getattr(body, field, None)
        if value not in (None, {}, [], 0, 0.0, False):
            raise bad_field(field, "is not supported by this server")
