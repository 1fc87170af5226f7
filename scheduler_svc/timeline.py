"""The step history as a GetTimelineResponse: the raw material of `swarmserve timeline`.

Step start times are kept as time.monotonic() readings; they leave as unix time,
converted with this process's current offset between the two clocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from scheduler_svc.step_record import StepRecord
from swarmserve.scheduler.v1 import scheduler_pb2 as pb


def timeline_to_pb(
    history: Sequence[StepRecord], max_steps: int, num_kv_blocks: int, max_steps_kept: int
) -> pb.GetTimelineResponse:
    """`history`: oldest first; the last `max_steps` of it (0: all). Every field of a record fits
    its proto field: the record's own check saw to that when the step made it (step_record.py)."""
    records = list(history)
    if max_steps:
        records = records[-max_steps:]
    unix_offset = time.time() - time.monotonic()
    return pb.GetTimelineResponse(
        steps=[
            pb.TimelineStep(
                step_id=r.step_id,
                start_time_s=r.start_s + unix_offset,
                duration_s=r.wall_s,
                num_requests=r.num_requests,
                num_prefill_tokens=r.num_prefill_tokens,
                num_decode_tokens=r.num_decode_tokens,
                num_new_requests=r.num_new_requests,
                num_preempted=r.num_preempted,
                num_free_kv_blocks=r.num_free_kv_blocks,
                num_draft_tokens=r.num_draft_tokens,
                num_drafted_tokens=r.num_drafted_tokens,
                num_accepted_tokens=r.num_accepted_tokens,
                num_free_tokens=r.num_free_tokens,
                predicted_duration_s=r.predicted_step_s,
                executor_prepare_s=r.executor_prepare_s,
                executor_forward_s=r.executor_forward_s,
                executor_sample_s=r.executor_sample_s,
                num_runs=r.num_runs,
                draft_depth=r.draft_depth,
                num_draft_leaves=r.num_draft_leaves,
                requests=[
                    pb.TimelineRequestSlice(
                        request_id=q.request_id,
                        num_scheduled_tokens=q.num_scheduled_tokens,
                        is_decode=q.is_decode,
                        num_draft_tokens=q.num_draft_tokens,
                        num_drafted_tokens=q.num_drafted_tokens,
                        num_accepted_tokens=q.num_accepted_tokens,
                        num_new_tokens=q.num_new_tokens,
                        finish_reason=q.finish_reason,
                        draft_depth=q.draft_depth,
                        num_draft_leaves=q.num_draft_leaves,
                    )
                    for q in r.requests
                ],
            )
            for r in records
        ],
        num_kv_blocks=num_kv_blocks,
        max_steps_kept=max_steps_kept,
    )
