"""Tool calls for the HTTP API: the parsers read the model's syntax back (whole and streamed in
any split), the template picks the parser, and the forced-call grammars compile and accept
exactly calls to the allowed functions (checked with llguidance on a real tokenizer)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.http_api.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    Parsed,
    make_parser,
    parser_name_for_template,
)
from scheduler_svc.http_api.tool_grammar import forced_call_grammar

HERMES_OUTPUT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
LLAMA3_OUTPUT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
)


def _run(parser, pieces: list[str]) -> Parsed:
    total = Parsed()
    for piece in [*pieces, None]:
        parsed = parser.flush() if piece is None else parser.feed(piece)
        total.text += parsed.text
        total.calls += parsed.calls
    return total


def _splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def _calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 400), max_size=12))
def test_hermes_calls_are_found_however_the_text_is_split(cuts):
    parsed = _run(HermesParser(), _splits(HERMES_OUTPUT, cuts))
    assert parsed.text == "Let me check.\n"
    assert _calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in parsed.calls}) == 2


def test_hermes_streams_text_and_holds_back_only_a_possible_tag():
    parser = HermesParser()
    assert parser.feed("Hello <tool").text == "Hello "
    assert parser.feed("bar> and").text == "<toolbar> and"  # not a tag after all
    assert parser.feed(" more").text == " more"


def test_a_malformed_hermes_call_comes_back_as_text():
    text = "x <tool_call>{not json}</tool_call> y"
    parsed = _run(HermesParser(), [text])
    assert parsed.calls == [] and parsed.text == text
    unterminated = _run(HermesParser(), ['<tool_call>\n{"name": "f", "arguments": {"a": 1}}'])
    assert _calls(unterminated) == [("f", {"a": 1})], "a call cut off before its closing tag still parses"


def test_an_opened_tag_that_cannot_be_a_call_does_not_hold_the_stream():
    # A random model opens <tool_call> and rambles: the text streams on, chunk by chunk.
    parser = HermesParser()
    assert parser.feed("Sure <tool_call>").text == "Sure "
    assert parser.feed("\n").text == ""  # still could be a call
    assert parser.feed("I think").text == "<tool_call>\nI think"
    assert parser.feed(" so").text == " so"
    # A body that starts as JSON but holds what JSON cannot, or goes on after its object closes.
    for junk in ['{"name": "f", "arguments": {}} and more', '{"name": "f", @', "{ramble"]:
        parser = HermesParser()
        parsed = Parsed()
        for piece in ["<tool_call>\n", *junk]:  # a character at a time
            step = parser.feed(piece)
            parsed.text += step.text
            parsed.calls += step.calls
        assert parsed.calls == [] and parsed.text == "<tool_call>\n" + junk
    # ... while a real call split anywhere is still held to its end, strings and all.
    call = '<tool_call>\n{"name": "f", "arguments": {"s": "}{@ x\\" ]"}}\n</tool_call>'
    parsed = _run(HermesParser(), list(call))
    assert parsed.text == "" and _calls(parsed) == [("f", {"s": '}{@ x" ]'})]


def test_a_long_ramble_after_the_tag_is_text_long_before_the_end():
    parser = HermesParser()
    held = sum(len(parser.feed(piece).text) == 0 for piece in ["<tool_call>", " ", "x"] + ["word "] * 1000)
    assert held == 2  # the tag and the space: at "x" it cannot be a call


def test_a_forced_output_cut_by_the_length_limit_shows_no_syntax():
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu'
    parsed = _run(HermesParser(forced=True), _splits(cut, [7, 30, 70]))
    assert parsed.text == "" and _calls(parsed) == [("f", {"a": 1})]
    assert _run(HermesParser(forced=True), ["<tool_call>\n{"]).text == ""
    parsed = _run(Llama3JsonParser(forced=True), ['{"name": "f", "parameters": {}}; {"name": "g", "par'])
    assert parsed.text == "" and _calls(parsed) == [("f", {})]
    # Unforced, the same cut text stays text (nothing the model wrote is lost).
    assert _run(HermesParser(), ["<tool_call>\n{"]).text == "<tool_call>\n{"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 400), max_size=12))
def test_llama3_json_calls_are_found_however_the_text_is_split(cuts):
    parsed = _run(Llama3JsonParser(), _splits(LLAMA3_OUTPUT, cuts))
    assert parsed.text == ""
    assert _calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_llama3_plain_text_streams_at_once_and_bad_json_stays_text():
    parser = Llama3JsonParser()
    assert parser.feed("  ").text == ""
    assert parser.feed("The answer").text == "  The answer"
    assert parser.feed(" is 4").text == " is 4"
    assert _run(Llama3JsonParser(), ['{"not": "a call"}']).text == '{"not": "a call"}'


def test_the_parser_is_picked_from_the_chat_template():
    assert parser_name_for_template("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}") == "hermes"
    assert parser_name_for_template("{{- '<|python_tag|>' }}") == "llama3"
    assert parser_name_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") == "none"
    assert make_parser("none") is None
    with pytest.raises(ValueError):
        make_parser("mistral")


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string"}},
    "required": ["zone"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ll_tokenizer(tmp_path_factory):
    """llguidance over the tiny models' byte-level BPE tokenizer."""
    llguidance = pytest.importorskip("llguidance")
    from executor_svc.weights.tokenizer import build_tokenizer
    from tests.support.tiny_gguf import SPECIAL_TOKENS, tiny_vocab

    tokens, types, merges = tiny_vocab()
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(build_tokenizer(metadata).to_str())
    assert SPECIAL_TOKENS[2] == tokens[2]
    return llguidance, llguidance.LLTokenizer(str(path), eos_token=2)


def _accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    llguidance, tokenizer = ll_tokenizer
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_the_hermes_grammar_forces_calls_to_the_allowed_functions(ll_tokenizer):
    grammar = forced_call_grammar("hermes", [("get_weather", WEATHER), ("get_time", TIME)], allow_several=True)
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    assert _accepts(ll_tokenizer, grammar, one)
    assert _accepts(ll_tokenizer, grammar, two)
    assert not _accepts(ll_tokenizer, grammar, one.replace("get_weather", "get_news"))
    assert not _accepts(ll_tokenizer, grammar, one.replace('"city"', '"town"'))
    assert not _accepts(ll_tokenizer, grammar, "Sure! " + one)
    single = forced_call_grammar("hermes", [("get_weather", WEATHER)], allow_several=False)
    assert _accepts(ll_tokenizer, single, one)
    assert not _accepts(ll_tokenizer, single, one + "\n" + one)
    # What the grammar forces, the parser reads back.
    assert _calls(_run(HermesParser(), [two])) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def test_the_llama3_grammar_forces_a_json_call(ll_tokenizer):
    grammar = forced_call_grammar("llama3", [("get_weather", WEATHER)], allow_several=False)
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert _accepts(ll_tokenizer, grammar, call)
    assert not _accepts(ll_tokenizer, grammar, '{"name": "get_weather", "parameters": {}}')
    assert _calls(_run(Llama3JsonParser(), [call])) == [("get_weather", {"city": "Paris"})]
    with pytest.raises(ValueError):
        forced_call_grammar("none", [("f", None)], allow_several=False)
