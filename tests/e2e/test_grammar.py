"""Structured output through the real services on loopback (tiny random model): JSON that
validates on 20 seeds, regex and Lark grammars, greedy tokens the same with speculation on
and off, a bad grammar refused with INVALID_ARGUMENT, and requests without a grammar unaffected."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import pytest

from clients import AsyncSwarmClient, SwarmServeError
from tests.support.stack import Stack
from tests.support.tiny_gguf import TinyModelSpec, write_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"enum": ["the", "in", "on", "an"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["word", "count"],
    "additionalProperties": False,
    # Compact: at temperature 1 this random model fills every gap the default JSON whitespace allows.
    "x-guidance": {"whitespace_flexible": False},
}
PROMPT = "the a"


def executor_args(tiny_model) -> list[str]:
    # One thread and no calibration: a model this small gains nothing from either, and on a busy
    # box a thread pool stalls and calibrating alone took minutes.
    return ["--model", str(tiny_model), "--kv-cache-gb", "0.01", "--threads", "1", "--no-calibration"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf", TinyModelSpec(context_length=256))


@pytest.fixture(scope="module")
def executor(tiny_model, tmp_path_factory):
    stack = Stack(executor_args(tiny_model), log_dir=tmp_path_factory.mktemp("logs"))
    try:  # a start that times out must not leave the process behind
        stack.start_executor()
        yield stack
    finally:
        stack.stop()


def with_scheduler(stack: Stack, *args: str):
    stack.scheduler_args = ["--max-running-requests", "20", *args]
    stack.start_scheduler()
    return stack


@pytest.fixture(scope="module")
def stack(executor):
    with_scheduler(executor)
    yield executor
    executor.kill_scheduler()


def complete_all(stack: Stack, requests: list[dict]):
    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            return await asyncio.gather(*(client.complete(PROMPT, **r) for r in requests))

    return asyncio.run(main())


def test_sampled_json_validates_against_its_schema_on_20_seeds(stack):
    completions = complete_all(
        stack,
        [
            {"structured_output": {"json_schema": SCHEMA}, "temperature": 1.0, "seed": seed, "max_new_tokens": 200}
            for seed in range(20)
        ],
    )
    for completion in completions:
        assert completion.finish_reason == "eos", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_regex_and_lark_grammars(stack):
    lark = 'start: ("yes" | "no") ", " %json{"type": "integer", "minimum": 10, "maximum": 20}'
    regex = r"(red|green|blue)-[0-9]{2,4}"
    completions = complete_all(
        stack,
        [{"structured_output": {"regex": regex}, "temperature": 1.0, "seed": seed} for seed in range(4)]
        + [{"structured_output": {"lark": lark}, "temperature": 1.0, "seed": seed} for seed in range(4)],
    )
    for completion in completions[:4]:
        assert re.fullmatch(regex, completion.text) and completion.finish_reason == "eos", completion.text
    for completion in completions[4:]:
        answer, number = completion.text.split(", ")
        assert answer in ("yes", "no") and 10 <= json.loads(number) <= 20, completion.text


def test_requests_without_a_grammar_are_unaffected(stack):
    free = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    (alone,) = complete_all(stack, [free])
    mixed = complete_all(stack, [free, {"structured_output": {"json_schema": SCHEMA}, "temperature": 1.0, "seed": 1}])
    assert mixed[0].token_ids == alone.token_ids
    json.loads(mixed[1].text)


@pytest.mark.parametrize(
    "structured_output,problem",
    [
        ({"json_schema": "{not json"}, "structured_output.json_schema is not a valid JSON schema"),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
        ({"regex": "(unclosed"}, "unclosed group"),
        ({"lark": "start: missing_rule"}, 'unknown name: "missing_rule"'),
    ],
)
def test_a_bad_grammar_is_invalid_argument_and_the_server_goes_on(stack, structured_output, problem):
    async def main():
        async with AsyncSwarmClient(stack.scheduler_address) as client:
            with pytest.raises(SwarmServeError) as error:
                await client.complete(PROMPT, structured_output=structured_output)
            return error.value, await client.complete(PROMPT, max_new_tokens=3, ignore_eos=True)

    error, still_fine = asyncio.run(main())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and problem in error.message, error.message
    assert len(still_fine.token_ids) == 3


def test_greedy_under_a_grammar_is_the_same_with_speculation_on_and_off(tiny_model, tmp_path_factory):
    executor = Stack(executor_args(tiny_model), log_dir=tmp_path_factory.mktemp("logs"))
    regex = r"[a-z ]{20,60}\."  # free text: the drafter finds repeats to propose
    requests = [
        {"structured_output": {"json_schema": SCHEMA}, "temperature": 0.0, "max_new_tokens": 120},
        {
            "structured_output": {"json_schema": {k: v for k, v in SCHEMA.items() if k != "x-guidance"}},
            "temperature": 0.0,
            "max_new_tokens": 120,
        },
        {"structured_output": {"regex": regex}, "temperature": 0.0, "max_new_tokens": 120},
    ]
    by_policy = {}
    try:
        executor.start_executor()
        for policy in ("off", "fixed:4"):
            with_scheduler(executor, "--spec", policy)
            try:
                by_policy[policy] = complete_all(executor, requests)
            finally:
                executor.kill_scheduler()
    finally:
        executor.stop()
    assert [c.token_ids for c in by_policy["fixed:4"]] == [c.token_ids for c in by_policy["off"]]
    assert sum(c.usage.accepted_tokens for c in by_policy["fixed:4"]) > 0, "no draft accepted: the test proves nothing"
