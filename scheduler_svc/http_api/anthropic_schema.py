"""Request bodies of the Anthropic-compatible routes (/v1/messages, /v1/messages/count_tokens).

Unknown fields are accepted and ignored, at every level: what Claude Code sends besides the
conversation (`thinking`, `context_management`, `output_config.effort`, `metadata`,
`cache_control`, fields of betas this server has not heard of) steers a frontier model's
extras, which a local model has none of. Thinking blocks sent back in assistant turns are
dropped from the prompt. A `system` message inside `messages` (Claude Code's
mid-conversation system beta) is a system turn (see scheduler_svc/template_fit.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class MediaBlock(_Body):
    """Images and documents: refused (this server reads text only)."""

    type: Literal["image", "document", "search_result"]


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = {}


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


ContentBlock = Annotated[
    TextBlock | MediaBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class Message(_Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    input_schema: dict[str, Any] = {"type": "object"}


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Body):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None


class JsonOutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: JsonOutputFormat | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1, lt=1 << 31)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, lt=1 << 31)] | None = None
    stream: bool = False
    output_config: OutputConfig | None = None  # format: structured output (a JSON schema)
    session_id: str | None = None  # extension, as on the OpenAI routes
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None  # extension: reproducible sampling
