"""A minimal test-side scheduler that drives the engine with chosen chunking and arrivals.

Not the product's scheduler: just enough policy to put requests into batches of
different shapes, so tests can check that a request's tokens do not depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from executor_svc.engine import Engine, ScheduledRequest, StepPlan
from executor_svc.request_state import FinishReason, NewRequest


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)
    num_steps: int = 0
    max_batch_size: int = 0


def drive(
    engine: Engine,
    requests: list[NewRequest],
    chunk_size: int | None = None,
    arrival_steps: dict[str, int] | None = None,
    max_steps: int = 100_000,
) -> Run:
    """Run requests to completion; `chunk_size` caps each prefill chunk (None = whole prompt)."""
    arrival_steps = arrival_steps or {}
    waiting = sorted(requests, key=lambda r: arrival_steps.get(r.request_id, 0))
    run = Run()
    running: dict[str, int] = {}  # request id -> tokens not yet in KV
    step = 0
    while waiting or running:
        if step >= max_steps:
            raise RuntimeError(f"requests still running after {max_steps} steps")
        new = []
        while waiting and arrival_steps.get(waiting[0].request_id, 0) <= step:
            request = waiting.pop(0)
            new.append(request)
            running[request.request_id] = len(request.prompt_token_ids)
            run.tokens[request.request_id] = []
            run.logprobs[request.request_id] = []
        scheduled = [
            ScheduledRequest(request_id, min(pending, chunk_size or pending)) for request_id, pending in running.items()
        ]
        run.max_batch_size = max(run.max_batch_size, len(scheduled))
        result = engine.step(StepPlan(scheduled=scheduled, new_requests=new))
        for out in result.outputs:
            running[out.request_id] -= next(s.num_tokens for s in scheduled if s.request_id == out.request_id)
            run.tokens[out.request_id].extend(out.new_token_ids)
            run.logprobs[out.request_id].extend(out.logprobs)
            running[out.request_id] += len(out.new_token_ids)
            if out.finish_reason is not None:
                run.finish_reasons[out.request_id] = out.finish_reason
                del running[out.request_id]
        step += 1
    run.num_steps = step
    return run
