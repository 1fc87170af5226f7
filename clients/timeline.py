"""`swarmserve timeline`: the scheduler's recent steps as a Chrome/Perfetto trace and a PNG.

For users without a tracing backend. GetTimeline returns the last steps the
scheduler ran; they become `PREFIX.json` (Chrome trace event format: open it in
ui.perfetto.dev or chrome://tracing) and `PREFIX.png` (step time, batch size, tokens
per step and drafts over time).

The trace's tracks:
- scheduler / steps: each step from plan sent to result back;
- executor / executor: prepare, forward and sample(+verify) inside each step, as the
  executor timed them (placed mid-step: the RPC's own time is split evenly around them);
- requests / one track per request: its prefill chunks and decodes, with drafts;
- counters: batch size, tokens per step, drafts, free KV blocks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

from clients.client import DEFAULT_SCHEDULER_ADDRESS
from clients.errors import SwarmServeError
from clients.step_stats import DEFAULT_SKIP_STEPS, prediction_error, scheduler_overhead
from swarmserve.scheduler.v1 import scheduler_pb2 as pb
from swarmserve.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

SCHEDULER_PID, EXECUTOR_PID, REQUESTS_PID = 1, 2, 3
STEPS_TID = EXECUTOR_TID = 1


def fetch_timeline(address: str, max_steps: int = 0, timeout: float | None = 10.0) -> pb.GetTimelineResponse:
    with grpc.insecure_channel(address) as channel:
        try:
            return pb_grpc.SchedulerServiceStub(channel).GetTimeline(
                pb.GetTimelineRequest(max_steps=max_steps), timeout=timeout
            )
        except grpc.RpcError as error:
            raise SwarmServeError.from_rpc_error(error) from error


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _process_metadata(pid: int, name: str) -> list[dict]:
    return [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
    ]


def _thread_metadata(pid: int, tid: int, name: str) -> list[dict]:
    return [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}},
        {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}},
    ]


def _request_slice_name(q: pb.TimelineRequestSlice) -> str:
    if not q.is_decode:
        return f"prefill {q.num_scheduled_tokens}"
    if not q.num_drafted_tokens:
        return "decode"
    name = f"decode +{q.num_new_tokens} ({q.num_accepted_tokens}/{q.num_drafted_tokens} drafts"
    if q.draft_depth < q.num_drafted_tokens:  # a tree: its nodes reach less deep than a chain of as many
        name += f" in a tree {q.draft_depth} deep, {q.num_draft_leaves} leaves"
    return name + ")"


def chrome_trace(timeline: pb.GetTimelineResponse) -> dict:
    """The timeline in Chrome's trace event format (times in microseconds from the first step)."""
    steps = list(timeline.steps)
    origin = steps[0].start_time_s if steps else 0.0
    events = _process_metadata(SCHEDULER_PID, "scheduler") + _thread_metadata(SCHEDULER_PID, STEPS_TID, "steps")
    events += _process_metadata(EXECUTOR_PID, "executor") + _thread_metadata(EXECUTOR_PID, EXECUTOR_TID, "executor")
    events += _process_metadata(REQUESTS_PID, "requests")
    request_tids: dict[str, int] = {}
    for step in steps:
        start = step.start_time_s - origin
        step_args = {
            "step_id": step.step_id,
            "batch_size": step.num_requests,
            "runs": max(1, step.num_runs),
            "prefill_tokens": step.num_prefill_tokens,
            "decode_tokens": step.num_decode_tokens,
            "draft_tokens_allocated": step.num_draft_tokens,
            "draft_tokens_drafted": step.num_drafted_tokens,
            "draft_tokens_accepted": step.num_accepted_tokens,
            "draft_depth": step.draft_depth,
            "draft_leaves": step.num_draft_leaves,
            "free_token_budget": step.num_free_tokens,
            "predicted_ms": round(step.predicted_duration_s * 1e3, 3),
            "actual_ms": round(step.duration_s * 1e3, 3),
            "executor_ms": round((step.executor_prepare_s + step.executor_forward_s + step.executor_sample_s) * 1e3, 3),
            "free_kv_blocks": step.num_free_kv_blocks,
            "new_requests": step.num_new_requests,
            "preempted": step.num_preempted,
        }
        events.append(
            {"name": f"step {step.step_id}", "cat": "step", "ph": "X", "ts": _us(start), "dur": _us(step.duration_s),
             "pid": SCHEDULER_PID, "tid": STEPS_TID, "args": step_args}
        )  # fmt: skip
        executor_s = step.executor_prepare_s + step.executor_forward_s + step.executor_sample_s
        phase_start = start + max(0.0, step.duration_s - executor_s) / 2
        for name, seconds in (
            ("prepare", step.executor_prepare_s),
            ("forward", step.executor_forward_s),
            ("sample", step.executor_sample_s),
        ):
            events.append(
                {"name": name, "cat": "executor", "ph": "X", "ts": _us(phase_start), "dur": _us(seconds),
                 "pid": EXECUTOR_PID, "tid": EXECUTOR_TID, "args": {"step_id": step.step_id}}
            )  # fmt: skip
            phase_start += seconds
        for q in step.requests:
            tid = request_tids.get(q.request_id)
            if tid is None:
                tid = request_tids[q.request_id] = len(request_tids) + 1
                events += _thread_metadata(REQUESTS_PID, tid, f"request {q.request_id}")
            args = {
                "step_id": step.step_id,
                "scheduled_tokens": q.num_scheduled_tokens,
                "draft_budget": q.num_draft_tokens,
                "drafted": q.num_drafted_tokens,
                "accepted": q.num_accepted_tokens,
                "draft_depth": q.draft_depth,
                "draft_leaves": q.num_draft_leaves,
                "new_tokens": q.num_new_tokens,
            }
            events.append(
                {"name": _request_slice_name(q), "cat": "decode" if q.is_decode else "prefill", "ph": "X",
                 "ts": _us(start), "dur": _us(step.duration_s), "pid": REQUESTS_PID, "tid": tid, "args": args}
            )  # fmt: skip
            if q.finish_reason:
                events.append(
                    {"name": f"finish: {q.finish_reason}", "ph": "i", "s": "t", "ts": _us(start + step.duration_s),
                     "pid": REQUESTS_PID, "tid": tid}
                )  # fmt: skip
        counters = {
            "batch size": {"requests": step.num_requests},
            "tokens per step": {
                "prefill": step.num_prefill_tokens,
                "decode": step.num_decode_tokens,
                "draft": step.num_drafted_tokens,
            },
            "drafts": {"allocated": step.num_draft_tokens, "accepted": step.num_accepted_tokens},
            "free KV blocks": {"blocks": step.num_free_kv_blocks},
        }
        for name, values in counters.items():
            events.append({"name": name, "ph": "C", "ts": _us(start), "pid": SCHEDULER_PID, "args": values})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "swarmserve GetTimeline",
            "first_step_unix_time_s": origin,
            "num_steps": len(steps),
            "num_requests": len(request_tids),
            "num_kv_blocks": timeline.num_kv_blocks,
        },
    }


def print_step_stats(steps) -> None:
    """The cost model's prediction error and the scheduler's share of each step (see clients/step_stats.py)."""
    error = prediction_error(steps)
    print(
        f"cost model |predicted - executor| / executor (steps after the first {DEFAULT_SKIP_STEPS}): "
        + (str(error) if error else "no steps yet")
    )
    overhead = scheduler_overhead(steps)
    if overhead:
        print(f"scheduler overhead: {overhead}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=DEFAULT_SCHEDULER_ADDRESS, help="scheduler address (default %(default)s)")
    parser.add_argument(
        "--out", required=True, metavar="PREFIX", help="write PREFIX.json (Chrome trace) and PREFIX.png"
    )
    parser.add_argument(
        "--max-steps", type=int, default=0, metavar="N", help="only the last N steps (default: all the scheduler keeps)"
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="deadline in seconds for the call (default %(default)g)"
    )


def run(args: argparse.Namespace) -> int:
    from clients.timeline_plot import plot_timeline

    timeline = fetch_timeline(args.server, max(0, args.max_steps), args.timeout)
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    trace = chrome_trace(timeline)
    json_path, png_path = Path(f"{prefix}.json"), Path(f"{prefix}.png")
    json_path.write_text(json.dumps(trace))
    info = trace["otherData"]
    print(f"{json_path}: {info['num_steps']} steps, {info['num_requests']} requests (open in ui.perfetto.dev)")
    print_step_stats(timeline.steps)
    try:
        plot_timeline(timeline, png_path)
    except RuntimeError as error:  # no matplotlib
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{png_path}: step time, batch size, tokens per step and drafts over time")
    return 0
