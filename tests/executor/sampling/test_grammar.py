"""Structured output in the engine: grammar masks, speculation under a grammar, resubmission.

The tiny random model (module fixture `engine`) runs the steps; its logits are very
peaked, so a high temperature is what makes sampling wander over every token the
grammar allows (and, without the mask, over the ones it does not).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from executor_svc.engine.engine import ScheduledRequest, StepRequest
from executor_svc.engine.request_state import FinishReason, NewRequest
from executor_svc.sampling.grammar import GrammarCompiler, _apply_masks_numpy, _apply_masks_torch, fill_masks
from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.tokenizer import load_tokenizer
from service_common.errors import InvalidRequestError
from service_common.sampling_params import SamplingParams
from service_common.structured_output import StructuredOutput
from tests.support.engine_driver import drive

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"enum": ["the", "in", "on", "an"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["word", "count", "ok"],
    "additionalProperties": False,
}
# Compact JSON (the schema's own x-guidance override): the tiny model loves whitespace.
COMPACT_SCHEMA = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
JSON_SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))
COMPACT_SPEC = StructuredOutput("json_schema", json.dumps(COMPACT_SCHEMA))


def request(engine, request_id, spec, *, prompt="the a", max_new_tokens=200, **sampling) -> NewRequest:
    return NewRequest(
        request_id,
        engine.tokenizer.tokenizer.encode(prompt).ids,
        SamplingParams(**sampling),
        max_new_tokens=max_new_tokens,
        structured_output=spec,
    )


def text_of(engine, token_ids) -> str:
    return engine.tokenizer.tokenizer.decode([t for t in token_ids if t not in engine.eos_token_ids])


def follows_grammar(engine, spec, token_ids) -> bool:
    """Every token, one at a time, is one a fresh matcher allows."""
    matcher = engine.grammars.matcher(spec).matcher
    return all(matcher.consume_token(t) for t in token_ids)


# ------------------------------------------------------------------ token table


@pytest.mark.slow
def test_token_table_spells_every_token_as_the_tokenizer_does(default_model_path):
    info = load_tokenizer(open_gguf(default_model_path))
    table = GrammarCompiler(info, 49152).ll_tokenizer
    tokenizer = info.tokenizer
    assert table.vocab_size == 49152 and list(table.eos_tokens) == list(info.eos_token_ids)
    special = {
        t
        for t in range(tokenizer.get_vocab_size())
        if tokenizer.id_to_token(t) in {a.content for a in tokenizer.get_added_tokens_decoder().values() if a.special}
    }
    assert special and all(table.is_special_token(t) for t in special)
    checked = 0
    for t in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([t], skip_special_tokens=False)
        if t in special or "\ufffd" in text:
            continue
        assert table.decode_bytes([t]) == text.encode(), t
        checked += 1
    assert checked > 40000


# ------------------------------------------------------------------ masks


def test_batched_masks_equal_masks_computed_one_position_at_a_time(engine):
    tokens = engine.tokenizer.tokenizer.encode('{"word":"in","count":42,"ok":true}').ids
    a, b = engine.grammars.matcher(COMPACT_SPEC), engine.grammars.matcher(COMPACT_SPEC)
    for t in tokens[:2]:
        b.consume(t)
    drafts = tokens[:5]
    bitmask = fill_masks([(a, drafts), (b, [])], 1 + len(drafts) + 1, engine.model_config.vocab_size)
    expected = []
    one = a.matcher.deep_copy()
    for t in [*drafts, None]:
        expected.append(one.compute_bitmask())
        if t is not None:
            assert one.consume_token(t)
    expected.append(b.matcher.compute_bitmask())
    assert [bytes(row.numpy().tobytes()) for row in bitmask] == expected
    # The matchers end where they started.
    assert a.num_valid(tokens) == len(tokens) and b.num_valid(tokens[2:]) == len(tokens) - 2


@pytest.mark.parametrize("apply", [_apply_masks_numpy, _apply_masks_torch], ids=["cpu", "device"])
def test_masks_set_exactly_the_forbidden_logits_of_the_grammar_rows(apply):
    vocab_size, generator = 70, torch.Generator().manual_seed(0)  # 70: the last word of each mask is partly unused
    logits = torch.randn(6, vocab_size, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 3), dtype=torch.int32, generator=generator)
    expected = logits.clone()
    for mask_row, row in enumerate([0, 3, 4, 5]):  # spans (0, 1) and (3, 3): rows 1 and 2 have no grammar
        for t in range(vocab_size):
            if not (int(bitmask[mask_row, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply(logits, [(0, 1), (3, 3)], bitmask)
    assert torch.equal(logits, expected)


# ------------------------------------------------------------------ sampling under a grammar


def test_seeded_sampling_at_temperature_1_gives_json_that_validates(engine):
    # Compact: at temperature 1 this model fills every gap the default JSON whitespace allows.
    run = drive(engine, [request(engine, f"s{seed}", COMPACT_SPEC, temperature=1.0, seed=seed) for seed in range(20)])
    for seed in range(20):
        tokens = run.tokens[f"s{seed}"]
        assert run.finish_reasons[f"s{seed}"] == FinishReason.EOS, text_of(engine, tokens)
        jsonschema.validate(json.loads(text_of(engine, tokens)), SCHEMA)


@pytest.mark.parametrize("draft_budget", [0, 3])
def test_masked_tokens_are_never_sampled_even_at_a_high_temperature(engine, draft_budget):
    specs = {"json": COMPACT_SPEC, "regex": StructuredOutput("regex", r"(yes|no|maybe)[.!] [a-z ]{0,6}")}
    requests = [
        request(engine, f"{k}{seed}", spec, temperature=30.0, seed=seed)
        for k, spec in specs.items()
        for seed in range(8)
    ]
    run = drive(engine, requests, draft_budget=draft_budget)
    for r in requests:
        tokens = run.tokens[r.request_id]
        assert follows_grammar(engine, r.structured_output, tokens), text_of(engine, tokens)
        assert run.finish_reasons[r.request_id] == FinishReason.EOS
        text = text_of(engine, tokens)
        if r.structured_output is COMPACT_SPEC:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(r"(yes|no|maybe)[.!] [a-z ]{0,6}", text), text
    # The control: the same sampling without a grammar leaves it at once.
    free = drive(engine, [request(engine, "free", None, temperature=30.0, seed=0, max_new_tokens=8)])
    assert not follows_grammar(engine, COMPACT_SPEC, free.tokens["free"])


def test_a_lark_grammar_with_embedded_json(engine):
    lark = 'start: "answer: " ("yes" | "no") " " %json{"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 3}'
    spec = StructuredOutput("lark", lark)
    run = drive(engine, [request(engine, f"l{seed}", spec, temperature=30.0, seed=seed) for seed in range(6)])
    for seed in range(6):
        text = text_of(engine, run.tokens[f"l{seed}"])
        head, _, tail = text.partition(" ")
        assert head == "answer:" and tail.split(" ", 1)[0] in ("yes", "no"), text
        values = json.loads(tail.split(" ", 1)[1])
        assert isinstance(values, list) and len(values) <= 3 and all(isinstance(v, int) and v <= 9 for v in values)


def test_logprobs_stay_the_models_own(engine):
    constrained = drive(engine, [request(engine, "g", JSON_SPEC, num_logprobs=3, max_new_tokens=1)])
    free = drive(engine, [request(engine, "f", None, num_logprobs=3, max_new_tokens=1)])
    assert constrained.tokens["g"] == [engine.tokenizer.tokenizer.token_to_id("{")] != free.tokens["f"]
    assert constrained.logprobs["g"][0].top_logprobs == free.logprobs["f"][0].top_logprobs


def test_requests_without_a_grammar_are_unaffected(engine):
    alone = drive(engine, [request(engine, "free", None, max_new_tokens=24)])
    mixed = drive(
        engine,
        [request(engine, "free", None, max_new_tokens=24), request(engine, "json", JSON_SPEC, temperature=1.0, seed=3)],
        draft_budget=2,
    )
    assert mixed.tokens["free"] == alone.tokens["free"]


# ------------------------------------------------------------------ the end of a grammar


def test_a_completed_grammar_ends_the_request_even_with_ignore_eos(engine):
    spec = StructuredOutput("regex", "yes|no")
    new = request(engine, "y", spec, max_new_tokens=50)
    run = drive(engine, [NewRequest(**{**new.__dict__, "ignore_eos": True})])
    assert text_of(engine, run.tokens["y"]) in ("yes", "no")
    assert run.finish_reasons["y"] == FinishReason.EOS


def test_max_new_tokens_still_cuts_a_grammar_short(engine):
    run = drive(engine, [request(engine, "short", JSON_SPEC, max_new_tokens=3)])
    assert len(run.tokens["short"]) == 3 and run.finish_reasons["short"] == FinishReason.LENGTH


# ------------------------------------------------------------------ speculation


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.5, "seed": 11}], ids=["greedy", "seeded"])
def test_speculation_under_a_grammar_gives_the_tokens_of_plain_decoding(engine, sampling):
    specs = [JSON_SPEC, COMPACT_SPEC, StructuredOutput("regex", r"[a-z]{3,40}\.")]
    requests = [request(engine, f"r{i}", spec, max_new_tokens=80, **sampling) for i, spec in enumerate(specs)]
    plain = drive(engine, requests)
    num_accepted = 0
    for budget in (6, lambda step, rid: step % 4):
        speculated = drive(engine, requests, draft_budget=budget)
        assert speculated.tokens == plain.tokens
        assert speculated.finish_reasons == plain.finish_reasons
        num_accepted += speculated.num_accepted
    assert num_accepted > 0, "no draft was accepted: the test proves nothing"


def test_drafts_are_cut_at_the_first_token_the_grammar_forbids(engine, monkeypatch):
    encode = engine.tokenizer.tokenizer.encode
    new = request(engine, "d", COMPACT_SPEC)
    first = engine.step(StepRequest(scheduled=[ScheduledRequest("d", len(new.token_ids))], new_requests=[new])).outputs[
        0
    ]
    assert text_of(engine, first.new_token_ids) == "{"
    allowed = encode('"word":"in",').ids
    monkeypatch.setattr(engine.drafter, "propose", lambda request_id, room: allowed + encode("x }").ids)
    try:
        out = engine.step(StepRequest(scheduled=[ScheduledRequest("d", 1, 16)])).outputs[0]
        assert out.num_drafted_tokens == len(allowed)
    finally:
        engine.release("d")


# ------------------------------------------------------------------ preemption and resubmission


def test_a_resubmitted_request_replays_its_output_through_a_fresh_matcher(engine):
    full = drive(engine, [request(engine, "a", JSON_SPEC, temperature=1.0, seed=5)]).tokens["a"]
    assert len(full) > 6
    for cut in (1, len(full) // 2, len(full) - 1):
        new = request(engine, "a", JSON_SPEC, temperature=1.0, seed=5)
        resumed = drive(engine, [NewRequest(**{**new.__dict__, "output_token_ids": tuple(full[:cut])})])
        assert full[:cut] + resumed.tokens["a"] == full


def test_a_preempted_request_keeps_its_place_in_the_grammar(engine):
    expected = drive(engine, [request(engine, "p", JSON_SPEC, temperature=1.0, seed=9)]).tokens["p"]
    new = request(engine, "p", JSON_SPEC, temperature=1.0, seed=9)
    out = engine.step(StepRequest(scheduled=[ScheduledRequest("p", len(new.token_ids))], new_requests=[new])).outputs[0]
    tokens = list(out.new_token_ids)
    for _ in range(4):
        tokens += engine.step(StepRequest(scheduled=[ScheduledRequest("p", 1)])).outputs[0].new_token_ids
    engine.step(StepRequest(preempted=["p"]))
    while True:
        state = engine.get_request("p")
        out = engine.step(StepRequest(scheduled=[ScheduledRequest("p", state.num_pending_tokens)])).outputs[0]
        tokens += out.new_token_ids
        if out.finish_reason is not None:
            break
    assert tokens == expected


def test_a_resubmission_that_breaks_the_grammar_is_refused(engine):
    bad = request(engine, "bad", JSON_SPEC)
    with pytest.raises(InvalidRequestError, match="output_token_ids do not follow"):
        engine.add_request(
            NewRequest(**{**bad.__dict__, "output_token_ids": tuple(engine.tokenizer.tokenizer.encode("x").ids)})
        )
    assert not engine.has_request("bad")


# ------------------------------------------------------------------ bad grammars


@pytest.mark.parametrize(
    "spec,problem",
    [
        (StructuredOutput("json_schema", "{not json"), "not a valid JSON schema"),
        (StructuredOutput("json_schema", "[1, 2]"), "must be a JSON object"),
        (StructuredOutput("json_schema", '{"type": "nope"}'), "nope"),
        (StructuredOutput("regex", "a(b"), "unclosed group"),
        (StructuredOutput("lark", "start: foo"), 'unknown name: "foo"'),
        (StructuredOutput("lark", 'start: "a" <|no_such_token|>'), "unknown special token"),
    ],
)
def test_a_bad_grammar_is_refused_naming_the_problem(engine, spec, problem):
    with pytest.raises(InvalidRequestError, match=re.escape(problem)) as error:
        engine.add_request(request(engine, "bad", spec))
    assert "structured_output" in str(error.value) and "'bad'" in str(error.value)
    assert not engine.has_request("bad")


def test_an_unknown_grammar_kind_is_refused():
    with pytest.raises(InvalidRequestError, match="kind must be one of"):
        StructuredOutput("yaml", "a: b")


def test_compiled_grammars_are_reused(engine):
    first = engine.grammars.matcher(JSON_SPEC).matcher
    again = engine.grammars.matcher(StructuredOutput("json_schema", json.dumps(SCHEMA))).matcher
    assert first is not again  # each request gets its own copy ...
    assert engine.grammars._compile(JSON_SPEC) is engine.grammars._compile(
        StructuredOutput("json_schema", json.dumps(SCHEMA))
    )


# ------------------------------------------------------------------ the embedded model

EMBEDDED_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "reason": {"type": "string", "maxLength": 30},
    },
    "required": ["answer", "confidence", "reason"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_the_embedded_model_samples_json_that_validates_on_20_seeds(engine_fp32):
    spec = StructuredOutput("json_schema", json.dumps(EMBEDDED_SCHEMA))  # the default whitespace, as a client sends it
    prompt = "Is the sky blue? Answer in JSON with the keys answer, confidence and reason.\n"
    requests = [
        request(engine_fp32, f"e{seed}", spec, prompt=prompt, temperature=1.0, seed=seed, max_new_tokens=160)
        for seed in range(20)
    ]
    run = drive(engine_fp32, requests)
    texts = [text_of(engine_fp32, run.tokens[r.request_id]) for r in requests]
    for r, text in zip(requests, texts):
        assert run.finish_reasons[r.request_id] == FinishReason.EOS, text
        jsonschema.validate(json.loads(text), EMBEDDED_SCHEMA)
    assert len(set(texts)) > 1, "every seed gave the same output: sampling did not explore"
