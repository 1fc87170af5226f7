"""The real planner driving the real engine in one process, as the step loop does, without sockets.

`run` emulates the step loop's pipeline exactly: with `max_in_flight=2`, plan N is
sent, plan N+1 is built ahead (from the state N is expected to leave) and sent,
then N runs and its result is applied, and so on. Tests compare what requests
get under different settings (overlapped scheduling, decode runs, drafts, KV
pressure, stops decided by the scheduler), and that the executor ends holding nothing.
"""

from __future__ import annotations

from collections import deque

from executor_svc.engine.engine import Engine, ScheduledRequest, StepRequest
from executor_svc.engine.request_state import NewRequest
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.planner import Plan, Planner, RequestResult
from scheduler_svc.request import Request
from service_common.sampling_params import SamplingParams


def to_engine_plan(plan: Plan) -> StepRequest:
    return StepRequest(
        scheduled=[ScheduledRequest(s.request_id, s.num_tokens, s.draft_budget) for s in plan.scheduled],
        new_requests=[
            NewRequest(
                r.executor_request_id,
                list(r.prompt_token_ids),
                r.sampling,
                r.max_new_tokens,
                r.stop_token_ids,
                r.ignore_eos,
            )
            for r in plan.new_requests
        ],
        released=list(plan.released),
        preempted=list(plan.preempted),
        planned_after_step_id=plan.planned_after_step_id,
        max_runs=plan.max_runs,
    )


def results_of(output) -> list[RequestResult]:
    return [
        RequestResult(
            request_id=o.request_id,
            new_token_ids=list(o.new_token_ids),
            finish_reason=o.finish_reason.value if o.finish_reason else None,
            num_computed_tokens=o.num_computed_tokens,
            num_drafted_tokens=o.num_drafted_tokens,
            num_accepted_tokens=o.num_accepted_tokens,
            num_cached_tokens=o.num_cached_tokens,
            num_draftable_tokens=o.num_draftable_tokens,
            num_exclusive_blocks=o.num_exclusive_blocks,
        )
        for o in output.outputs
    ]


def workload(seed_base: int = 0, temperature: float = 0.0) -> list[Request]:
    requests = []
    for i in range(10):
        pattern = [(7 * i + j) % 50 + 3 for j in range(5)]
        prompt = (pattern * (4 + i))[: 12 + 9 * i]  # repetitive: the drafter finds matches
        sampling = SamplingParams(temperature=temperature, seed=seed_base + i if temperature else None)
        requests.append(Request(f"r{i}", prompt, sampling, max_new_tokens=6 + 5 * i, ignore_eos=True))
    return requests


def run(
    engine: Engine,
    requests: list[Request],
    max_in_flight: int,
    spec: str = "off",
    budget: int = 32,
    num_kv_blocks: int | None = None,
    stop_after: dict[str, int] | None = None,
    max_decode_runs: int = 1,
):
    """Serve `requests` with `max_in_flight` plans in flight; returns (tokens by request, counters).

    `stop_after`: request id -> the output length at which the scheduler ends it (as a stop string would).
    `max_decode_runs`: a plan of decodes only runs up to this many times per call (no time window).
    """
    config = SchedulerConfig(
        max_running_requests=8,
        max_num_batched_tokens=budget,
        spec=spec,
        kv_watermark=0.0,
        async_scheduling=max_in_flight > 1,
        max_decode_runs=max_decode_runs,
        decode_runs_window_s=1e9,
    )
    num_blocks = num_kv_blocks or engine.kv.num_free_blocks
    planner = Planner(config, engine.kv.block_size, num_blocks, 8192, max_draft_tokens=engine.config.max_draft_tokens)
    planner.num_free_blocks = min(num_blocks, engine.kv.num_free_blocks)
    reserve = engine.kv.num_free_blocks - planner.num_free_blocks  # blocks the planner must not know about
    stop_after = stop_after or {}
    for r in requests:
        planner.add(r)
    tokens = {r.request_id: [] for r in requests}
    counters = {"ahead": 0, "not_ahead": 0, "preempted": 0, "drafted": 0, "steps": 0, "runs": 0, "multi_run_plans": 0}
    in_flight: deque[Plan] = deque()
    while planner.has_work or in_flight:
        while len(in_flight) < max_in_flight and planner.has_work:
            ahead = bool(in_flight)  # the plan is built ahead of those (schedule puts it in flight too)
            plan = planner.schedule(now=0.0)
            if plan is None:
                counters["not_ahead"] += 1
                break
            assert not plan.failures
            if plan.is_empty:
                break
            counters["ahead"] += ahead
            counters["preempted"] += len(plan.preempted)
            in_flight.append(plan)
        plan = in_flight.popleft()
        output = engine.step(to_engine_plan(plan))
        assert 1 <= output.num_runs <= plan.max_runs
        counters["steps"] += 1
        counters["runs"] += output.num_runs
        counters["multi_run_plans"] += plan.max_runs > 1
        free = output.num_free_blocks - reserve
        for update in planner.update_from_output(plan, results_of(output), free, now=0.0):
            request = update.request
            tokens[request.request_id].extend(update.new_token_ids)
            limit = stop_after.get(request.request_id)
            if limit is not None and len(tokens[request.request_id]) >= limit and update.finish_reason is None:
                del tokens[request.request_id][limit:]  # what a stop string cuts is never streamed
                planner.finish(request)
        counters["drafted"] += sum(o.num_drafted_tokens for o in output.outputs)
    # The last releases go out with one more (empty) step.
    engine.step(StepRequest(released=planner.schedule(now=0.0).released))
    assert not engine.request_ids, "the executor still holds requests"
    return tokens, counters
