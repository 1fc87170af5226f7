"""Each request's part in a step, as recorded in the step history (one timeline track each).

Built from the plan (what was scheduled, and which entries were decodes, decided
before the results changed the requests) and the executor's per-request results.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRequestRecord:
    request_id: str  # the client's id
    num_scheduled_tokens: int  # a prefill chunk, or 1 to decode
    is_decode: bool
    num_draft_tokens: int = 0  # draft budget allocated (over the runs it took part in)
    num_drafted_tokens: int = 0  # drafts proposed and verified
    num_accepted_tokens: int = 0
    num_new_tokens: int = 0  # accepted drafts + the bonus token; 0 mid-prefill
    finish_reason: str = ""  # empty while the request goes on


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
            )
        )
    return tuple(records)
