"""Request bodies of the OpenAI-compatible routes, as pydantic models.

Fields OpenAI defines that change nothing here (metadata, store, service_tier, ...)
are accepted and ignored, so existing clients work unchanged; fields whose meaning
we cannot honour (logit_bias, audio output, ...) are refused by the route with a
400 naming them. Extensions (as vLLM spells them): `session_id`, `top_k`, `min_p`,
`ignore_eos`, `return_token_ids`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from service_common.sampling_params import MAX_LOGPROBS

Seed = Annotated[int, Field(ge=0, lt=1 << 64)]
MaxTokens = Annotated[int, Field(ge=1, lt=1 << 31)]
TopK = Annotated[int, Field(ge=0, lt=1 << 31)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text", "input_text", "output_text"]
    text: str


class OtherPart(_Body):
    """An image, audio or file part: refused (this server serves text models)."""

    type: Literal["image_url", "input_audio", "file", "refusal", "input_image", "input_file"]


ContentPart = Annotated[TextPart | OtherPart, Field(discriminator="type")]


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"  # JSON text


class ToolCallIn(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What chat and text completions share."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    session_id: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    response_format: ResponseFormat | None = None


# ---- /v1/responses (the subset Codex uses)


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(_Body):
    """The model's earlier reasoning, sent back by clients: not part of the prompt."""

    type: Literal["reasoning"]


class OtherItem(_Body):
    """Item types this server cannot render (built-in tools' calls): refused by the route."""

    type: str


def _item_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "other"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


class ResponsesTool(_Body):
    """A function tool (flat, unlike chat's); other tool types (web_search, ...) are ignored."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedTool(_Body):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Body):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(_Body):
    model: str
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    text: ResponsesText | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    session_id: str | None = None
    user: str | None = None
