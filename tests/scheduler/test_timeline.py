"""StepRecord -> GetTimelineResponse, over any values: every field of every record reaches the
proto (as it was, exactly), or the record is refused where it is made, naming the field."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.step_record import MAX_UINT32, MAX_UINT64, StepRecord, StepRequestRecord
from scheduler_svc.timeline import timeline_to_pb

# Record field -> its TimelineStep / TimelineRequestSlice field.
STEP_FIELDS = {
    "step_id": "step_id",
    "start_s": "start_time_s",  # monotonic -> unix: checked apart
    "wall_s": "duration_s",
    "num_requests": "num_requests",
    "num_prefill_tokens": "num_prefill_tokens",
    "num_decode_tokens": "num_decode_tokens",
    "num_new_requests": "num_new_requests",
    "num_preempted": "num_preempted",
    "num_free_kv_blocks": "num_free_kv_blocks",
    "executor_forward_s": "executor_forward_s",
    "num_draft_tokens": "num_draft_tokens",
    "num_drafted_tokens": "num_drafted_tokens",
    "num_accepted_tokens": "num_accepted_tokens",
    "num_free_tokens": "num_free_tokens",
    "predicted_step_s": "predicted_duration_s",
    "executor_prepare_s": "executor_prepare_s",
    "executor_sample_s": "executor_sample_s",
    "requests": "requests",
    "num_runs": "num_runs",
    "draft_depth": "draft_depth",
    "num_draft_leaves": "num_draft_leaves",
}
# Not sent as such: each is carried by fields that are.
DERIVED_STEP_FIELDS = {
    "executor_total_s",  # prepare + forward + sample
    "request_ids",  # the requests' slices name them
}
REQUEST_FIELDS = {f.name: f.name for f in dataclasses.fields(StepRequestRecord)}


def good_value(name: str, annotation: str) -> st.SearchStrategy:
    if annotation == "int":
        return st.integers(0, MAX_UINT64 if name == "step_id" else MAX_UINT32)
    if annotation == "float":
        return st.floats(allow_nan=False, allow_infinity=False)
    if annotation == "str":
        return st.text(st.characters(codec="utf-8"))
    if annotation == "bool":
        return st.booleans()
    raise AssertionError(f"no strategy for {name}: {annotation}")


def bad_value(name: str, annotation: str) -> st.SearchStrategy:
    """Values of the wrong kind for a field, the float count first among them."""
    limit = MAX_UINT64 if name == "step_id" else MAX_UINT32
    wrong = {
        "int": st.one_of(
            st.floats(allow_nan=True),  # 3.25 tokens: a mean over runs
            st.integers(max_value=-1),
            st.integers(min_value=limit + 1),
            st.booleans(),
            st.text(),
            st.none(),
        ),
        "float": st.one_of(st.sampled_from([float("nan"), float("inf"), -float("inf")]), st.text(), st.none()),
        "str": st.one_of(st.integers(), st.binary(), st.none(), st.just("agent-\ud800")),  # a lone surrogate
        "bool": st.one_of(st.integers(), st.text(), st.none()),
    }
    return wrong[annotation]


def field_values(cls, exclude=()) -> dict[str, st.SearchStrategy]:
    return {f.name: good_value(f.name, f.type) for f in dataclasses.fields(cls) if f.name not in exclude}


request_records = st.builds(StepRequestRecord, **field_values(StepRequestRecord))


@st.composite
def step_records(draw) -> StepRecord:
    values = draw(st.fixed_dictionaries(field_values(StepRecord, exclude=("request_ids", "requests"))))
    requests = tuple(draw(st.lists(request_records, max_size=4)))
    return StepRecord(**values, request_ids=tuple(q.request_id for q in requests), requests=requests)


def test_every_record_field_has_a_place_in_the_proto():
    """A field added to a record must be sent, or said to be derived from what is."""
    assert {f.name for f in dataclasses.fields(StepRecord)} == set(STEP_FIELDS) | DERIVED_STEP_FIELDS
    assert set(STEP_FIELDS).isdisjoint(DERIVED_STEP_FIELDS)
    from swarmserve.scheduler.v1 import scheduler_pb2 as pb

    assert set(STEP_FIELDS.values()) == set(pb.TimelineStep.DESCRIPTOR.fields_by_name)
    assert set(REQUEST_FIELDS.values()) == set(pb.TimelineRequestSlice.DESCRIPTOR.fields_by_name)


@settings(max_examples=200, deadline=None)
@given(records=st.lists(step_records(), max_size=5), max_steps=st.integers(0, 6))
def test_every_field_of_every_record_reaches_the_proto(records, max_steps):
    before = time.time() - time.monotonic()
    response = timeline_to_pb(records, max_steps, num_kv_blocks=100, max_steps_kept=4096)
    after = time.time() - time.monotonic()
    sent = records[-max_steps:] if max_steps else records
    assert len(response.steps) == len(sent)
    for record, step in zip(sent, response.steps):
        for name, pb_name in STEP_FIELDS.items():
            if name == "start_s":  # plus the clock offset, read between the two readings above
                assert record.start_s + before - 1e-3 <= step.start_time_s <= record.start_s + after + 1e-3
            elif name == "requests":
                assert len(step.requests) == len(record.requests)
                for q, q_pb in zip(record.requests, step.requests):
                    for q_name, q_pb_name in REQUEST_FIELDS.items():
                        assert getattr(q_pb, q_pb_name) == getattr(q, q_name), q_name
            else:
                assert getattr(step, pb_name) == getattr(record, name), name


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_value_of_the_wrong_kind_is_refused_naming_its_field(data):
    cls = data.draw(st.sampled_from([StepRecord, StepRequestRecord]))
    fields = [f for f in dataclasses.fields(cls) if f.type in ("int", "float", "str", "bool")]
    bad = data.draw(st.sampled_from(fields))
    values = data.draw(st.fixed_dictionaries(field_values(cls, exclude=("request_ids", "requests"))))
    if cls is StepRecord:
        values["request_ids"] = ()
    values[bad.name] = data.draw(bad_value(bad.name, bad.type))
    with pytest.raises((TypeError, ValueError), match=rf"{cls.__name__}\.{bad.name} must be"):
        cls(**values)


def test_a_float_count_from_a_mean_run_is_refused_where_the_record_is_made():
    """The history's first line of defence: the bug GetTimeline once met (UNKNOWN TypeError) stops here."""
    with pytest.raises(TypeError, match=r"StepRecord\.num_free_tokens must be an integer, got float 3\.25"):
        StepRecord(1, 0.0, 0.01, 1, 0, 1, 0, 0, 10, 0.01, 0.01, ("a",), num_free_tokens=3.25)
    with pytest.raises(TypeError, match=r"StepRecord\.requests\[0\] must be a StepRequestRecord"):
        StepRecord(1, 0.0, 0.01, 1, 0, 1, 0, 0, 10, 0.01, 0.01, ("a",), requests=({"request_id": "a"},))
    with pytest.raises(TypeError, match=r"StepRecord\.request_ids\[1\] must be a str"):
        StepRecord(1, 0.0, 0.01, 2, 0, 2, 0, 0, 10, 0.01, 0.01, ("a", 2))
