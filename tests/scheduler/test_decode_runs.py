"""Decode runs: a plan of decodes only runs several times in one Step call (StepRequest.max_runs),
a token per request per run, to save the scheduler's round trip per token.

The contract: a request's tokens are exactly those of one run per call (greedy and seeded,
with drafts, chunked prefills, finishes at max_new_tokens, stops the scheduler decides,
KV pressure); a later run that does not fit in the KV is not an error, the answer just
says how many runs were made; only requests that sampled in the run before run again.
The planner asks for runs only for decodes with nobody waiting, and within its window.
"""

from __future__ import annotations

import pytest

from executor_svc.engine.engine import MAX_RUNS_PER_PLAN, ScheduledRequest, StepRequest
from executor_svc.engine.request_state import FinishReason, NewRequest
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.planner import Planner, RequestResult
from scheduler_svc.request import Request
from service_common.errors import InvalidRequestError
from service_common.sampling_params import SamplingParams
from tests.support.planner_driver import run, workload
from tests.support.tiny_gguf import TinyModelSpec, tiny_kv_bytes_per_block


@pytest.fixture(scope="module")
def engine(make_tiny_engine):
    return make_tiny_engine(TinyModelSpec(context_length=512), kv_cache_bytes=4 << 20, max_draft_tokens=8)


@pytest.fixture(scope="module")
def small_engine(make_tiny_engine):
    """A KV cache too small for the workload at once: plans preempt, and runs stop for lack of blocks."""
    return make_tiny_engine(
        TinyModelSpec(context_length=512), kv_cache_bytes=14 * tiny_kv_bytes_per_block(), max_draft_tokens=8
    )


# ------------------------------------------------------------- planner + engine


@pytest.mark.parametrize("spec", ["off", "fixed:4"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_decode_runs_give_the_tokens_of_one_run_per_call(engine, spec, temperature):
    once, _ = run(engine, workload(temperature=temperature), max_in_flight=1, spec=spec)
    runs, counters = run(engine, workload(temperature=temperature), max_in_flight=1, spec=spec, max_decode_runs=4)
    assert runs == once
    assert all(len(t) == 6 + 5 * i for i, t in enumerate(once.values()))
    assert counters["multi_run_plans"] > 0 and counters["runs"] > counters["steps"], counters
    if spec != "off":
        assert counters["drafted"] > 0


def test_chunked_prefills_run_once_then_decodes_run_again(engine):
    once, _ = run(engine, workload(), max_in_flight=1, budget=8)
    runs, counters = run(engine, workload(), max_in_flight=1, budget=8, max_decode_runs=3)
    assert runs == once
    assert counters["runs"] > counters["steps"]


def test_stops_decided_by_the_scheduler_discard_what_later_runs_made(engine):
    stops = {"r1": 3, "r4": 1, "r7": 10}
    once, _ = run(engine, workload(), max_in_flight=1, spec="fixed:4", stop_after=stops)
    runs, _ = run(engine, workload(), max_in_flight=1, spec="fixed:4", stop_after=stops, max_decode_runs=4)
    assert runs == once
    assert {rid: len(once[rid]) for rid in stops} == stops


def test_kv_pressure_preempts_and_cuts_runs_short_without_changing_tokens(small_engine):
    free = small_engine.kv.num_free_blocks
    once, once_counters = run(small_engine, workload(), max_in_flight=1)
    runs, counters = run(small_engine, workload(), max_in_flight=1, max_decode_runs=8)
    assert runs == once
    assert small_engine.kv.num_free_blocks == free
    assert once_counters["preempted"] > 0, once_counters
    assert counters["runs"] > counters["steps"], counters


# ------------------------------------------------------------------ the engine


def decoding(engine, prompts: dict[str, list[int]], max_new_tokens: dict[str, int] | None = None) -> None:
    """Insert and prefill the requests: each is left with one sampled token to decode."""
    max_new_tokens = max_new_tokens or {}
    new = [
        NewRequest(rid, p, max_new_tokens=max_new_tokens.get(rid, 50), ignore_eos=True) for rid, p in prompts.items()
    ]
    engine.step(
        StepRequest(scheduled=[ScheduledRequest(n.request_id, len(n.token_ids)) for n in new], new_requests=new)
    )


def release_all(engine) -> None:
    engine.step(StepRequest(released=list(engine.request_ids)))
    assert not engine.request_ids


def test_a_plan_run_four_times_answers_for_all_four(engine):
    decoding(engine, {"a": [5, 6, 7, 8], "b": [9, 10, 11]})
    answer = engine.step(StepRequest(scheduled=[ScheduledRequest("a", 1), ScheduledRequest("b", 1)], max_runs=4))
    assert answer.num_runs == 4
    assert [len(o.new_token_ids) for o in answer.outputs] == [4, 4]
    assert answer.num_computed_tokens == 8 and answer.num_requests == 8 and answer.num_logits_rows == 8
    assert [o.num_computed_tokens for o in answer.outputs] == [4 + 4, 3 + 4]
    release_all(engine)
    # The same tokens, one call per run.
    decoding(engine, {"a": [5, 6, 7, 8], "b": [9, 10, 11]})
    tokens = {"a": [], "b": []}
    for _ in range(4):
        one = engine.step(StepRequest(scheduled=[ScheduledRequest("a", 1), ScheduledRequest("b", 1)]))
        assert one.num_runs == 1
        for o in one.outputs:
            tokens[o.request_id] += o.new_token_ids
    assert tokens == {o.request_id: o.new_token_ids for o in answer.outputs}
    release_all(engine)


def test_a_call_counts_every_run_whose_draft_missed(engine):
    """Draft counts are sums over the runs, and each run whose draft was accepted short of its
    depth is one miss: the scheduler's acceptance estimate needs them all (accepted < depth over
    the sums says only that some run missed), as the same runs made one call each show."""
    # The tiny model repeats its last token; its index says a run of 7s ends in a 6: each run misses.
    prompts = {"a": [7] * 8 + [6, 9, 7], "b": [5, 6, 7, 8] * 4}
    plan = [ScheduledRequest("a", 1, draft_budget=4), ScheduledRequest("b", 1, draft_budget=4)]
    decoding(engine, prompts)
    answer = engine.step(StepRequest(scheduled=plan, max_runs=4))
    release_all(engine)
    decoding(engine, prompts)
    runs = {"a": [], "b": []}
    for _ in range(answer.num_runs):
        for o in engine.step(StepRequest(scheduled=plan)).outputs:
            runs[o.request_id].append(o)
    release_all(engine)
    assert answer.num_runs == 4
    for o in answer.outputs:
        one_a_call = runs[o.request_id]
        assert o.num_drafted_tokens == sum(r.num_drafted_tokens for r in one_a_call) > 0
        assert o.num_accepted_tokens == sum(r.num_accepted_tokens for r in one_a_call)
        assert o.num_draft_misses == sum(r.num_accepted_tokens < r.draft_depth for r in one_a_call)
        assert o.to_pb().num_draft_misses == o.num_draft_misses
    assert max(o.num_draft_misses for o in answer.outputs) > 1  # a call that missed more than once


def test_a_request_that_finishes_stops_running_while_the_others_go_on(engine):
    decoding(engine, {"short": [5, 6, 7], "long": [8, 9, 10]}, max_new_tokens={"short": 3})
    answer = engine.step(StepRequest(scheduled=[ScheduledRequest("short", 1), ScheduledRequest("long", 1)], max_runs=5))
    by_id = {o.request_id: o for o in answer.outputs}
    assert len(by_id["short"].new_token_ids) == 2 and by_id["short"].finish_reason == FinishReason.LENGTH
    assert len(by_id["long"].new_token_ids) == 5 and by_id["long"].finish_reason is None
    assert "short" not in engine.request_ids
    release_all(engine)


def test_runs_end_when_every_request_has_finished(engine):
    decoding(engine, {"a": [5, 6, 7]}, max_new_tokens={"a": 3})
    answer = engine.step(StepRequest(scheduled=[ScheduledRequest("a", 1)], max_runs=10))
    assert answer.num_runs == 2 and answer.outputs[0].finish_reason == FinishReason.LENGTH
    assert not engine.request_ids


def test_a_request_mid_prefill_runs_once(engine):
    decoding(engine, {"d": [5, 6, 7]})
    prompt = list(range(3, 40))
    new = NewRequest("p", prompt, max_new_tokens=5, ignore_eos=True)
    answer = engine.step(
        StepRequest(scheduled=[ScheduledRequest("d", 1), ScheduledRequest("p", 16)], new_requests=[new], max_runs=3)
    )
    by_id = {o.request_id: o for o in answer.outputs}
    assert answer.num_runs == 3
    assert by_id["p"].new_token_ids == [] and by_id["p"].num_computed_tokens == 16
    assert len(by_id["d"].new_token_ids) == 3
    release_all(engine)


def test_runs_that_do_not_fit_in_the_kv_are_not_made(make_tiny_engine):
    engine = make_tiny_engine(TinyModelSpec(context_length=512), kv_cache_bytes=64 << 10)
    blocks = engine.kv.num_free_blocks
    prompt_len = engine.kv.block_size * blocks - 2  # two free slots left after the prompt's first token is sampled
    decoding(engine, {"a": list(range(3, 3 + prompt_len))})
    answer = engine.step(StepRequest(scheduled=[ScheduledRequest("a", 1)], max_runs=6))
    assert answer.num_runs == 2 and len(answer.outputs[0].new_token_ids) == 2
    assert answer.outputs[0].finish_reason is None
    release_all(engine)


@pytest.mark.parametrize("max_runs", [MAX_RUNS_PER_PLAN + 1, 1000])
def test_too_many_runs_are_refused_before_anything_changes(engine, max_runs):
    decoding(engine, {"a": [5, 6, 7]})
    with pytest.raises(InvalidRequestError, match="max_runs"):
        engine.step(StepRequest(scheduled=[ScheduledRequest("a", 1)], max_runs=max_runs))
    assert engine.step(StepRequest(scheduled=[ScheduledRequest("a", 1)])).outputs[0].num_computed_tokens == 4
    release_all(engine)


# ---------------------------------------------------------------------- planner


def planner_with(num_running: int, **config) -> Planner:
    """A planner whose `num_running` requests all decode (their prefill answered)."""
    settings = dict(max_num_batched_tokens=64, kv_watermark=0.0, spec="off", decode_runs_window_s=1.0) | config
    planner = Planner(SchedulerConfig(**settings), block_size=16, num_kv_blocks=100, max_num_batched_tokens=8192)
    for i in range(num_running):
        planner.add(Request(f"r{i}", [1, 2, 3], SamplingParams(), max_new_tokens=100))
    plan = planner.schedule(now=0.0)
    planner.update_from_output(plan, [RequestResult(s.request_id, [7], None, 3) for s in plan.scheduled], 90, now=0.0)
    return planner


def test_the_planner_asks_decodes_for_runs_within_its_window():
    planner = planner_with(2, max_decode_runs=4)
    plan = planner.schedule(now=0.0)
    assert plan.decode_ids == {s.request_id for s in plan.scheduled} and plan.max_runs == 4
    assert plan.to_pb().max_runs == 4
    # The window allows fewer runs than the cap: the first, and as many more as the cost model predicts fit.
    planner = planner_with(2, max_decode_runs=8, decode_runs_window_s=0.05)
    plan = planner.schedule(now=0.0)
    assert 1 < plan.max_runs == 1 + int(0.05 / plan.predicted_step_s) < 8
    planner = planner_with(2, max_decode_runs=8, decode_runs_window_s=0.0)
    assert planner.schedule(now=0.0).max_runs == 1


def test_one_run_while_a_request_waits_or_prefills():
    planner = planner_with(2, max_decode_runs=4)
    planner.add(Request("new", list(range(1, 40)), SamplingParams(), max_new_tokens=10))
    plan = planner.schedule(now=0.0)  # admits it: its prefill is in the plan
    assert plan.new_requests and plan.max_runs == 1
    planner = planner_with(2, max_decode_runs=4, max_running_requests=2)
    planner.add(Request("waits", [1, 2], SamplingParams(), max_new_tokens=10))
    plan = planner.schedule(now=0.0)  # no room to admit it: it waits, so the plan runs once
    assert planner.num_waiting == 1 and not plan.new_requests and plan.max_runs == 1


@pytest.mark.parametrize("config", [dict(max_decode_runs=1), dict(max_decode_runs=4, async_scheduling=True)])
def test_one_run_when_runs_are_off_or_steps_overlap(config):
    assert planner_with(2, **config).schedule(now=0.0).max_runs == 1


@pytest.mark.parametrize("bad", [dict(max_decode_runs=0), dict(max_decode_runs=65), dict(decode_runs_window_s=-1.0)])
def test_bad_decode_run_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)


def test_each_request_says_how_many_runs_it_took_part_in(engine):
    decoding(engine, {"short": [5, 6, 7], "long": [8, 9, 10]}, max_new_tokens={"short": 3})
    answer = engine.step(
        StepRequest(scheduled=[ScheduledRequest("short", 1), ScheduledRequest("long", 1, 2)], max_runs=4)
    )
    by_id = {o.request_id: o for o in answer.outputs}
    assert (by_id["short"].num_runs, by_id["long"].num_runs, answer.num_runs) == (2, 4, 4)
    assert by_id["long"].num_drafted_tokens <= 2 * 4
    assert answer.to_pb(1).results[1].num_runs == 4
    release_all(engine)
