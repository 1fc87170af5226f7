"""A minimal test-side scheduler that drives the engine with chosen chunking and arrivals.

Not the product's scheduler: just enough policy to put requests into batches of
different shapes, so tests can check that a request's tokens do not depend on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from executor_svc.engine.engine import Engine, ScheduledRequest, StepRequest
from executor_svc.engine.request_state import FinishReason, NewRequest


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)
    num_steps: int = 0
    max_batch_size: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    cached_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens reused from the prefix cache

    @property
    def num_cached(self) -> int:
        return sum(self.cached_tokens.values())


def drive(
    engine: Engine,
    requests: list[NewRequest],
    chunk_size: int | None = None,
    arrival_steps: dict[str, int] | None = None,
    draft_budget: int | Callable[[int, str], int] = 0,
    max_steps: int = 100_000,
) -> Run:
    """Run requests to completion.

    chunk_size caps each prefill chunk (None = whole prompt); draft_budget is the
    speculative budget of every decoding request, or a function (step, request id) → budget.
    """
    arrival_steps = arrival_steps or {}
    budget_of = draft_budget if callable(draft_budget) else (lambda step, request_id: draft_budget)
    waiting = sorted(requests, key=lambda r: arrival_steps.get(r.request_id, 0))
    run = Run()
    known: dict[str, int] = {}  # request id -> prompt + output tokens
    computed: dict[str, int] = {}  # request id -> tokens in KV
    step = 0
    while waiting or known:
        if step >= max_steps:
            raise RuntimeError(f"requests still running after {max_steps} steps")
        new = []
        while waiting and arrival_steps.get(waiting[0].request_id, 0) <= step:
            request = waiting.pop(0)
            new.append(request)
            known[request.request_id] = len(request.token_ids)  # prompt + any output it is resubmitted with
            computed[request.request_id] = 0
            run.tokens[request.request_id] = []
            run.logprobs[request.request_id] = []
        scheduled = []
        for request_id in known:
            pending = known[request_id] - computed[request_id]
            budget = budget_of(step, request_id) if pending == 1 else 0
            scheduled.append(ScheduledRequest(request_id, min(pending, chunk_size or pending), budget))
        run.max_batch_size = max(run.max_batch_size, len(scheduled))
        result = engine.step(StepRequest(scheduled=scheduled, new_requests=new))
        for out in result.outputs:
            rid = out.request_id
            run.tokens[rid].extend(out.new_token_ids)
            run.logprobs[rid].extend(out.logprobs)
            run.num_drafted += out.num_drafted_tokens
            run.num_accepted += out.num_accepted_tokens
            run.cached_tokens[rid] = max(run.cached_tokens.get(rid, 0), out.num_cached_tokens)
            known[rid] += len(out.new_token_ids)
            computed[rid] = out.num_computed_tokens
            if out.finish_reason is not None:
                run.finish_reasons[rid] = out.finish_reason
                del known[rid], computed[rid]
        step += 1
    run.num_steps = step
    return run


def num_held_requests(engine: Engine) -> int:
    """Requests the engine holds, read from a thread other than the engine's (which may be
    changing its table: then read again)."""
    while True:
        try:
            return len(engine.request_ids)
        except RuntimeError:
            continue


class ScriptedDrafter:
    """Proposes each request's known greedy continuation, spoiled as the mode says:
    `full` keeps it (every draft accepted), `partial` spoils one token in the middle of
    each draft, `none` spoils the first. Exercises exact accept counts without relying
    on a model that happens to repeat itself."""

    def __init__(self, continuations: dict[str, list[int]], mode: str, vocab_size: int) -> None:
        self.continuations, self.mode, self.vocab_size = continuations, mode, vocab_size
        self.tokens: dict[str, list[int]] = {}
        self.prompt_lens: dict[str, int] = {}

    def add_request(self, request_id, token_ids):
        self.tokens[request_id] = list(token_ids)
        self.prompt_lens[request_id] = len(token_ids)

    def append(self, request_id, token_ids):
        self.tokens[request_id].extend(token_ids)

    def release(self, request_id):
        del self.tokens[request_id]

    def num_draftable(self, request_id):
        return 4

    def propose(self, request_id, max_tokens):
        done = len(self.tokens[request_id]) - self.prompt_lens[request_id]
        draft = list(self.continuations[request_id][done : done + max_tokens])
        spoil = {"full": None, "partial": len(draft) // 2, "none": 0}[self.mode]
        if draft and spoil is not None and (spoil > 0 or self.mode == "none"):
            draft[spoil] = (draft[spoil] + 1) % self.vocab_size
        return draft
