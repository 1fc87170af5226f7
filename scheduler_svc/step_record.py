"""One step as the scheduler saw it, and each request's part in it: the step history.

Each request's part is built from the plan (what was scheduled, and which entries were
decodes, decided before the results changed the requests) and the executor's
per-request results.

The history feeds the timeline (GetTimeline, `swarmserve timeline`), the step's trace
span and the metrics. Each field's type is decided here, once, by its annotation, and
checked when a record is made: a count is a non-negative integer that fits its proto
field (32 bits; step ids 64), a time is a finite number, text is text. A value of the
wrong kind (a float count: a mean over a step's runs, a prediction, a division) is
refused at the step that made it, naming the field, instead of surfacing later as a
TypeError inside an RPC that reads the history.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1
WIDE_FIELDS = frozenset({"step_id"})  # uint64 in the proto; every other count is uint32


def check_field_types(record) -> None:
    """Refuse a record (a dataclass) whose field values do not match their annotations
    (`int`, `float`, `str`, `bool`, `tuple[X, ...]`); TypeError or ValueError naming the field."""
    kind = type(record).__name__
    for name, annotation in _field_annotations(type(record)):
        value = getattr(record, name)
        if annotation.startswith("tuple["):
            item = annotation.removeprefix("tuple[").removesuffix(", ...]")
            if not isinstance(value, tuple):
                raise TypeError(f"{kind}.{name} must be a tuple, got {type(value).__name__}")
            for i, v in enumerate(value):
                _check_value(f"{kind}.{name}[{i}]", item, v)
        else:
            _check_value(f"{kind}.{name}", annotation, value)


@functools.cache
def _field_annotations(cls) -> tuple[tuple[str, str], ...]:
    """(name, annotation) per field, read once per class (annotations are strings here)."""
    return tuple((f.name, str(f.type)) for f in dataclasses.fields(cls))


def _check_value(where: str, annotation: str, value) -> None:
    if annotation == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{where} must be an integer, got {type(value).__name__} {value!r}")
        limit = MAX_UINT64 if where.rpartition(".")[2] in WIDE_FIELDS else MAX_UINT32
        if not 0 <= operator.index(value) <= limit:
            raise ValueError(f"{where} must be in [0, {limit}], got {value}")
    elif annotation == "float":
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"{where} must be a finite number, got {type(value).__name__} {value!r}")
    elif annotation == "str":
        if not isinstance(value, str):
            raise TypeError(f"{where} must be a str, got {type(value).__name__}")
        if not value.isascii():  # ids are ASCII; anything else must at least encode (a lone surrogate does not)
            try:
                value.encode()
            except UnicodeEncodeError as exc:
                raise ValueError(f"{where} must be a str of valid UTF-8 text, got {value!r} ({exc.reason})") from None
    elif annotation == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be a bool, got {type(value).__name__}")
    elif annotation == "StepRequestRecord":
        if not isinstance(value, StepRequestRecord):
            raise TypeError(f"{where} must be a StepRequestRecord, got {type(value).__name__}")
    else:
        raise TypeError(f"{where}: no check for a field of type {annotation}")  # a new field's type: add it above


@dataclass(frozen=True)
class StepRequestRecord:
    """A request's part in a step: one slice of its timeline track."""

    request_id: str  # the client's id
    num_scheduled_tokens: int  # a prefill chunk, or 1 to decode
    is_decode: bool
    num_draft_tokens: int = 0  # draft budget allocated (over the runs it took part in)
    num_drafted_tokens: int = 0  # drafts proposed and verified
    num_accepted_tokens: int = 0
    num_new_tokens: int = 0  # accepted drafts + the bonus token; 0 mid-prefill
    finish_reason: str = ""  # empty while the request goes on
    # The verified drafts' shape (num_drafted_tokens counts their nodes), summed over the runs:
    # a chain of k has depth k and one leaf; a tree branches where leaves exceed its drafting runs.
    draft_depth: int = 0  # the deepest node's depth: the most the drafts could have accepted
    num_draft_leaves: int = 0

    def __post_init__(self) -> None:
        check_field_types(self)


@dataclass(frozen=True)
class StepRecord:
    """One step as the scheduler saw it: the raw material for timelines and the cost model."""

    step_id: int
    start_s: float  # time.monotonic() when the plan was sent
    wall_s: float  # plan sent → result back (with overlapped scheduling: including the wait behind the step before)
    num_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_new_requests: int
    num_preempted: int
    num_free_kv_blocks: int
    executor_forward_s: float
    executor_total_s: float  # prepare + forward + sample, as the executor timed it
    request_ids: tuple[str, ...]
    num_draft_tokens: int = 0  # draft budget allocated (a request's budget holds in each run it takes part in)
    num_drafted_tokens: int = 0  # drafts the executor proposed and verified
    num_accepted_tokens: int = 0
    num_free_tokens: int = 0  # the free-token budget S the policy saw (0 without speculation)
    predicted_step_s: float = 0.0  # the cost model's prediction of executor_total_s for the step as planned
    executor_prepare_s: float = 0.0
    executor_sample_s: float = 0.0  # sampling and draft verification
    requests: tuple[StepRequestRecord, ...] = ()  # each request's part: one timeline track per request
    num_runs: int = 1  # runs of the plan in the call (decodes only run more than once): the times cover them all
    draft_depth: int = 0  # Σ of the requests' draft_depth: the most drafts the step could have accepted
    num_draft_leaves: int = 0  # Σ of the requests' num_draft_leaves

    def __post_init__(self) -> None:
        check_field_types(self)


def step_request_records(
    scheduled: Iterable, decode_ids: set[str], results: Iterable, client_ids: Mapping[str, str]
) -> tuple[StepRequestRecord, ...]:
    """`scheduled`: the plan's ScheduledRequest; `results`: the step's StepResultViews (both by
    executor id); `client_ids`: executor id -> the client's id, which names each record."""
    by_id = {r.request_id: r for r in results}
    records = []
    for s in scheduled:
        result = by_id.get(s.request_id)
        records.append(
            StepRequestRecord(
                request_id=client_ids[s.request_id],
                num_scheduled_tokens=s.num_tokens,
                is_decode=s.request_id in decode_ids,
                num_draft_tokens=s.draft_budget * (result.num_runs if result else 1),  # the budget holds in each run
                num_drafted_tokens=result.num_drafted_tokens if result else 0,
                num_accepted_tokens=result.num_accepted_tokens if result else 0,
                num_new_tokens=len(result.new_token_ids) if result else 0,
                finish_reason=(result.finish_reason or "") if result else "",
                draft_depth=result.draft_depth if result else 0,
                num_draft_leaves=result.num_draft_leaves if result else 0,
            )
        )
    return tuple(records)
