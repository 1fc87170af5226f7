"""Intake, the pure function: a Generate call against the model's and the server's limits.

No server: the tiny model's real tokenizer and chat template, and a SchedulerConfig."""

from __future__ import annotations

import math
import re

import pytest

from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.tokenizer import load_tokenizer
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.intake import ModelLimits, intake
from service_common.errors import InvalidRequestError
from swarmserve.scheduler.v1 import scheduler_pb2 as pb
from tests.support.tiny_gguf import TinyModelSpec


@pytest.fixture(scope="module")
def limits(tiny_gguf_path) -> ModelLimits:
    path = tiny_gguf_path(TinyModelSpec(context_length=256))
    info = load_tokenizer(open_gguf(path))
    return ModelLimits(
        tokenizer=info.tokenizer,
        chat_template=info.chat_template,
        bos_token=info.bos_token or "",
        eos_token=info.eos_token or "",
        context_length=256,
        vocab_size=info.tokenizer.get_vocab_size(),
    )


def generate(**fields) -> pb.GenerateRequest:
    fields.setdefault("text", "hi")
    return pb.GenerateRequest(**fields)


# ------------------------------------------------------------- retention (item 8)


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0])
def test_retention_must_be_a_finite_number(limits, value):
    with pytest.raises(InvalidRequestError, match="retention_s must be a finite number >= 0"):
        intake(generate(session_id="s", retention_s=value), limits, SchedulerConfig())


def test_retention_is_clamped_to_the_server_maximum(limits):
    config = SchedulerConfig(max_retention_s=120.0)
    assert intake(generate(session_id="s", retention_s=1e9), limits, config).request.retention_s == 120.0
    assert intake(generate(session_id="s", retention_s=5.0), limits, config).request.retention_s == 5.0
    assert intake(generate(session_id="s"), limits, SchedulerConfig(max_retention_s=10.0)).request.retention_s == 10.0


def test_the_server_maximum_must_be_finite():
    with pytest.raises(ValueError, match="max_retention_s"):
        SchedulerConfig(max_retention_s=math.inf)


# ------------------------------------------------------------------ ids (item 6)


@pytest.mark.parametrize("field", ["request_id", "session_id"])
def test_ids_are_capped_in_bytes(limits, field):
    config = SchedulerConfig()
    intake(generate(**{field: "a" * 128}), limits, config)
    with pytest.raises(InvalidRequestError, match=f"{field} is 129 bytes; the limit is 128"):
        intake(generate(**{field: "a" * 129}), limits, config)
    with pytest.raises(InvalidRequestError, match=f"{field} is 4000000 bytes"):
        intake(generate(**{field: "a" * 4_000_000}), limits, config)
    with pytest.raises(InvalidRequestError, match=f"{field} is 129 bytes"):
        intake(generate(**{field: "é" * 64 + "a"}), limits, config)  # bytes, not characters


@pytest.mark.parametrize("value", ["agent 7", "a\nb", "a\x00b", "tab\there", "naïve", "a;b", "<b>"])
def test_ids_are_restricted_to_plain_characters(limits, value):
    with pytest.raises(InvalidRequestError, match="has characters outside"):
        intake(generate(request_id=value), limits, SchedulerConfig())


def test_ordinary_ids_pass(limits):
    for value in ("agent-7/turn-3", "9f86d081884c7d65", "swarm.a_1:2@host+x=y~z"):
        accepted = intake(generate(request_id=value, session_id=value), limits, SchedulerConfig())
        assert accepted.request.request_id == value and accepted.request.session_id == value


# ---------------------------------------------------------- stop strings (item 3)


def test_stop_strings_are_capped_in_count_and_length(limits):
    config = SchedulerConfig(max_stop_strings=4, max_stop_string_chars=10)
    assert intake(generate(stop=["x" * 10] * 4), limits, config).stop_strings == ["x" * 10] * 4
    with pytest.raises(InvalidRequestError, match=r"5 stop strings; the limit is 4 \(--max-stop-strings\)"):
        intake(generate(stop=["x"] * 5), limits, config)
    with pytest.raises(InvalidRequestError, match=r"stop\[1\] is 11 characters; the limit is 10"):
        intake(generate(stop=["x", "y" * 11]), limits, config)
    # The case: refused at the defaults, before anything is matched.
    with pytest.raises(InvalidRequestError, match="2000 stop strings"):
        intake(generate(stop=["z" * 1000] * 2000), limits, SchedulerConfig())


# ------------------------------------------------------- prompt sizes (item 4)


def test_prompt_bytes_and_chat_messages_are_capped_before_tokenizing(limits):
    config = SchedulerConfig(max_prompt_bytes=1000, max_chat_messages=3)
    with pytest.raises(InvalidRequestError, match=r"text is 1001 bytes; the limit is 1000 \(--max-prompt-bytes\)"):
        intake(generate(text="x" * 1001), limits, config)
    with pytest.raises(InvalidRequestError, match="text is 1002 bytes"):
        intake(generate(text="é" * 501), limits, config)  # bytes, not characters
    chat = lambda n, size: pb.GenerateRequest(  # noqa: E731
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="y" * size) for _ in range(n)])
    )
    with pytest.raises(InvalidRequestError, match=r"chat has 4 messages; the limit is 3 \(--max-chat-messages\)"):
        intake(chat(4, 1), limits, config)
    with pytest.raises(InvalidRequestError, match="chat.messages and chat.tools are 1012 bytes together"):
        intake(chat(2, 502), limits, config)
    # The cases, at the defaults: refused at once, nothing rendered or tokenized.
    with pytest.raises(InvalidRequestError, match="text is 4194304 bytes"):
        intake(generate(text="z" * (4 << 20)), limits, SchedulerConfig())
    with pytest.raises(InvalidRequestError, match="chat has 200000 messages"):
        intake(chat(200_000, 1), limits, SchedulerConfig())


def test_token_ids_beyond_the_context_are_refused_before_they_are_read(limits):
    with pytest.raises(InvalidRequestError, match="the prompt is 256 tokens; the model's context is 256"):
        intake(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 256)), limits, SchedulerConfig())


def test_message_size_must_exceed_the_prompt_limit():
    with pytest.raises(ValueError, match="max_message_bytes"):
        SchedulerConfig(max_prompt_bytes=4 << 20, max_message_bytes=4 << 20)


# ------------------------------------------------------------------------- structured output


def test_a_grammar_is_carried_to_the_request(limits):
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    accepted = intake(generate(structured_output=pb.StructuredOutput(json_schema=schema)), limits, SchedulerConfig())
    assert (accepted.request.structured_output.kind, accepted.request.structured_output.text) == ("json_schema", schema)
    assert accepted.request.structured_output.to_pb().json_schema == schema
    assert intake(generate(), limits, SchedulerConfig()).request.structured_output is None
    json_object = intake(generate(structured_output=pb.StructuredOutput(json_object=True)), limits, SchedulerConfig())
    assert json_object.request.structured_output.to_pb().json_object


@pytest.mark.parametrize(
    "structured_output,problem",
    [
        (pb.StructuredOutput(json_schema="{oops"), "structured_output.json_schema is not a valid JSON schema"),
        (pb.StructuredOutput(json_schema='"a string"'), "must be a JSON object"),
        (
            pb.StructuredOutput(json_schema='{"type": "integer", "minimum": "x"}'),
            "structured_output.json_schema is invalid",
        ),
        (pb.StructuredOutput(json_schema='{"$ref": "#/defs/missing"}'), "/defs/missing"),
        (pb.StructuredOutput(regex="a(b"), "unclosed group"),
        (pb.StructuredOutput(lark="start: foo"), 'unknown name: "foo"'),
        # Only the model's token table knows which special tokens exist.
        (pb.StructuredOutput(lark='start: "a" <|no_such_token|>'), "unknown special token"),
        (pb.StructuredOutput(json_object=False), "json_object must be true"),
    ],
)
def test_a_bad_grammar_is_invalid_argument_naming_the_problem(limits, structured_output, problem):
    with pytest.raises(InvalidRequestError, match=re.escape(problem)):
        intake(generate(structured_output=structured_output), limits, SchedulerConfig())


def test_a_grammar_beyond_the_size_limit_is_refused_before_it_is_compiled(limits):
    config = SchedulerConfig(max_grammar_bytes=64)
    with pytest.raises(
        InvalidRequestError, match=r"structured_output.regex is 65 bytes; the limit is 64 \(--max-grammar-bytes\)"
    ):
        intake(generate(structured_output=pb.StructuredOutput(regex="a" * 65)), limits, config)
    assert intake(
        generate(structured_output=pb.StructuredOutput(regex="a" * 64)), limits, config
    ).request.structured_output


# ------------------------------------------------------------- max_new_tokens clamped (agent clients)


def test_max_new_tokens_beyond_the_context_is_refused_unless_clamped(limits):
    config = SchedulerConfig()
    num_prompt = len(intake(generate(max_new_tokens=1), limits, config).request.prompt_token_ids)
    with pytest.raises(InvalidRequestError, match=r"^max_new_tokens=64000 is beyond the context"):
        intake(generate(max_new_tokens=64000), limits, config)
    # Clamped to what one request can hold: the context, or less where the KV cache is smaller.
    assert intake(generate(max_new_tokens=64000), limits, config, 10_000).request.max_new_tokens == 256 - num_prompt
    assert intake(generate(max_new_tokens=64000), limits, config, 100).request.max_new_tokens == 100 - num_prompt
    assert intake(generate(max_new_tokens=5), limits, config, 100).request.max_new_tokens == 5
    # A prompt that leaves no room is still refused, saying why.
    with pytest.raises(InvalidRequestError, match=r"one request can hold at most 1 tokens here.*no room to generate"):
        intake(generate(max_new_tokens=64000), limits, config, 1)
    with pytest.raises(InvalidRequestError, match="which leaves no room to generate"):
        intake(generate(text="hi " * 300, max_new_tokens=64000), limits, config, 10_000)
