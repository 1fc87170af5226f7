"""The scheduler's pure core, driven step by step with fake executor results (vLLM-style):
admission order, the token budget, decodes first, preemption and resume, static vs continuous."""

from __future__ import annotations

import math

import pytest

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.cost_model import CostModel, CostModelConfig, StepCost
from scheduler_svc.draft_policy import FixedPolicy
from scheduler_svc.planner import DEFAULT_STEP_TOKENS, Plan, Planner, RequestResult
from scheduler_svc.request import Request
from service_common.attention_pairs import attention_pairs
from service_common.sampling_params import SamplingParams

BLOCK = 4


def make_planner(num_blocks=100, budget=16, max_running=4, batching="continuous", watermark=0.0):
    config = SchedulerConfig(
        max_running_requests=max_running, max_num_batched_tokens=budget, batching=batching, kv_watermark=watermark
    )
    return Planner(config, block_size=BLOCK, num_kv_blocks=num_blocks, max_num_batched_tokens=8192)


def req(request_id, prompt_len, max_new_tokens=100):
    return Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(), max_new_tokens)


class FakeExecutor:
    """Executes plans the way the real engine accounts for them: tokens, KV blocks, finishes."""

    def __init__(self, planner: Planner, lengths: dict[str, int] | None = None):
        self.planner = planner
        self.free = planner.num_kv_blocks
        self.blocks: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.known: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.lengths = lengths or {}  # request id -> output length at which it finishes
        self.plans: list[Plan] = []

    def step(self, plan: Plan) -> list[RequestResult]:
        self.plans.append(plan)
        for rid in plan.released:
            self._free(rid)
            self.known.pop(rid, None)
        for rid in plan.preempted:
            self._free(rid)
            self.computed[rid] = 0
        for r in plan.new_requests:  # the executor knows requests by their executor id
            self.known[r.executor_request_id] = r.num_prompt_tokens
            self.computed[r.executor_request_id] = 0
            self.outputs[r.executor_request_id] = 0
        results = []
        for s in plan.scheduled:
            rid = s.request_id
            assert self.computed[rid] + s.num_tokens <= self.known[rid], f"{rid} computes past its known tokens"
            need = math.ceil((self.computed[rid] + s.num_tokens) / BLOCK) - self.blocks.get(rid, 0)
            assert need <= self.free, f"plan over-allocates KV for {rid}: needs {need}, {self.free} free"
            self.free -= need
            self.blocks[rid] = self.blocks.get(rid, 0) + need
            self.computed[rid] += s.num_tokens
            new, finish = [], None
            if self.computed[rid] == self.known[rid]:
                new = [7]
                self.known[rid] += 1
                self.outputs[rid] += 1
                if self.outputs[rid] >= self.lengths.get(rid, 10**9):
                    finish = "length"
            results.append(RequestResult(rid, new, finish, self.computed[rid], num_exclusive_blocks=self.blocks[rid]))
            if finish:
                self._free(rid)
                self.known.pop(rid)
        self.planner.update_from_output(plan, results, self.free, now=0.0)
        return results

    def _free(self, rid):
        self.free += self.blocks.pop(rid, 0)

    def run_step(self):
        return self.step(self.planner.schedule(now=0.0))


def scheduled(plan):
    return {s.request_id: s.num_tokens for s in plan.scheduled}


def test_the_step_budget_is_the_flag_else_the_executors_preference_within_its_cap():
    def budget(flag, preferred, executor_cap=8192):
        config = SchedulerConfig(max_num_batched_tokens=flag)
        planner = Planner(config, BLOCK, 100, executor_cap, preferred_step_tokens=preferred)
        return planner.token_budget

    assert budget(None, 1024) == 1024  # --matmul bf16's executor
    assert budget(None, 256) == 256
    assert budget(None, 0) == DEFAULT_STEP_TOKENS == 256  # an executor that names none
    assert budget(64, 1024) == 64  # the flag wins
    assert budget(None, 1024, executor_cap=512) == 512  # never past the executor's guard
    with pytest.raises(ValueError, match="max_num_batched_tokens must be positive"):
        SchedulerConfig(max_num_batched_tokens=0)


def test_fifo_admission_and_chunked_prefill_under_the_budget():
    p = make_planner(budget=16, max_running=4)
    for rid, n in [("a", 10), ("b", 10), ("c", 30)]:
        p.add(req(rid, n))
    ex = FakeExecutor(p)
    plan = p.schedule(now=0.0)
    # a whole, b cut to the 6 tokens left; c waits.
    assert scheduled(plan) == {"a": 10, "b": 6}
    assert [r.request_id for r in plan.new_requests] == ["a", "b"]
    ex.step(plan)
    plan = p.schedule(now=0.0)
    # Decodes first (a), then b's remainder, then c's first chunk.
    assert list(scheduled(plan).items()) == [("a", 1), ("b", 4), ("c", 11)]
    ex.step(plan)
    plan = p.schedule(now=0.0)
    assert scheduled(plan) == {"a": 1, "b": 1, "c": 14}
    assert plan.num_scheduled_tokens <= 16


def distinct_req(request_id, prompt_len, first_token):
    """A request whose prompt shares no prefix with another's (req's prompts all count from 1)."""
    return Request(request_id, list(range(first_token, first_token + prompt_len)), SamplingParams(), 100)


def preferred_budget_planner(preferred=16, executor_cap=8192):
    """A planner whose step budget is the executor's preference (no --max-num-batched-tokens)."""
    config = SchedulerConfig(max_running_requests=4, kv_watermark=0.0)
    return Planner(config, BLOCK, 100, executor_cap, preferred_step_tokens=preferred)


def test_a_prompt_that_ends_within_a_quarter_past_the_executors_budget_takes_one_step():
    p = preferred_budget_planner(preferred=16)  # a stretch of 4 tokens
    assert p.step_stretch == 4
    p.add(distinct_req("a", 20, 1))
    assert scheduled(p.schedule(now=0.0)) == {"a": 20}
    p = preferred_budget_planner(preferred=16)
    p.add(distinct_req("b", 21, 1))
    ex = FakeExecutor(p)
    plan = p.schedule(now=0.0)
    assert scheduled(plan) == {"b": 16}
    ex.step(plan)
    assert scheduled(p.schedule(now=0.0)) == {"b": 5}
    # Never past the executor's guard, nor past a budget the user set.
    assert preferred_budget_planner(preferred=16, executor_cap=18).step_stretch == 2
    assert make_planner(budget=16).step_stretch == 0


def test_a_newcomer_that_fits_one_step_waits_for_the_next_rather_than_split():
    for p in (make_planner(budget=16), preferred_budget_planner(preferred=16)):
        ex = FakeExecutor(p)
        p.add(distinct_req("a", 10, 1))
        p.add(distinct_req("b", 12, 100))  # 12 > the 6 (+ the stretch) a leaves, <= a step
        p.add(distinct_req("c", 3, 200))  # FIFO: nor does anyone behind it go first
        plan = p.schedule(now=0.0)
        assert scheduled(plan) == {"a": 10}
        ex.step(plan)
        plan = p.schedule(now=0.0)
        assert scheduled(plan)["b"] == 12  # whole, its first token one step after it started
        ex.step(plan)
    p = make_planner(budget=16)
    p.add(distinct_req("a", 10, 1))
    p.add(distinct_req("long", 40, 100))  # longer than any step: it starts in a's leftover at once
    assert scheduled(p.schedule(now=0.0)) == {"a": 10, "long": 6}


def test_a_newcomer_is_sized_by_the_prompt_its_expected_prefix_hit_leaves():
    p = preferred_budget_planner(preferred=16)
    ex = FakeExecutor(p)
    p.add(distinct_req("first", 12, 1))
    ex.run_step()
    # The next turn extends the first request's tokens: 12 expected cached (3 whole blocks of 4),
    # 18 new, more than the 15 the decode leaves, within the stretch: it is sent to end in this step.
    p.add(Request("turn2", list(range(1, 13)) + list(range(500, 518)), SamplingParams(), 100))
    plan = p.schedule(now=0.0)
    # The guess plus a block (22), capped at the 15 left plus the stretch of 4.
    assert scheduled(plan)["turn2"] == 19
    assert plan.new_requests[0].expected_prefix_hit == 12
    # Without a prefix to hit, the same 30 tokens take the 15 left and continue next step.
    p = preferred_budget_planner(preferred=16)
    ex = FakeExecutor(p)
    p.add(distinct_req("first", 12, 1))
    ex.run_step()
    p.add(distinct_req("fresh", 30, 500))
    assert scheduled(p.schedule(now=0.0))["fresh"] == 15


def test_decodes_are_never_starved_by_prefill():
    p = make_planner(budget=8, max_running=8)
    for i in range(6):
        p.add(req(f"d{i}", 2))
    ex = FakeExecutor(p)
    ex.run_step()  # six prefills of 2 tokens (budget 8: four admitted whole... )
    p.add(req("long", 500))
    for _ in range(5):
        plan = p.schedule(now=0.0)
        decodes = [rid for rid, n in scheduled(plan).items() if rid.startswith("d") and n == 1]
        running_decoders = [r for r in p.running if r.request_id.startswith("d") and r.num_pending_tokens == 1]
        assert len(decodes) == min(8, len(running_decoders))
        ex.step(plan)


def latency_planner(target_s, budget=256, min_chunk=16):
    """A planner whose cost model is a known line: a step costs 10 ms + 1 ms per token (no KV term)."""
    config = SchedulerConfig(
        max_running_requests=32,
        max_num_batched_tokens=budget,
        kv_watermark=0.0,
        decode_latency_target_s=target_s,
        min_prefill_chunk=min_chunk,
    )
    line = StepCost(fixed_s=0.010, per_token_s=0.001, per_attention_pair_s=0.0)
    cost_model = CostModel(CostModelConfig(prior=line))
    return Planner(config, block_size=BLOCK, num_kv_blocks=100_000, max_num_batched_tokens=8192, cost_model=cost_model)


def decoding(p, ex, num_agents):
    """`num_agents` requests admitted and prefilled: each decodes one token a step from now on."""
    for i in range(num_agents):
        p.add(req(f"agent{i}", 4))
    ex.run_step()
    assert all(p.requests[r].num_pending_tokens == 1 for r in scheduled(ex.plans[-1]))


def test_a_newcomers_prompt_takes_the_whole_budget_when_no_one_decodes():
    p = latency_planner(target_s=0.020)
    p.add(req("newcomer", 1000))
    plan = p.schedule(now=0.0)
    assert scheduled(plan) == {"newcomer": 256}  # the 20 ms target does not apply: no one waits for a token


def test_while_agents_decode_a_newcomers_chunks_keep_each_step_within_the_target():
    p = latency_planner(target_s=0.050)
    ex = FakeExecutor(p)
    decoding(p, ex, 4)
    p.add(req("newcomer", 1000))
    for _ in range(5):
        plan = p.schedule(now=0.0)
        tokens = scheduled(plan)
        assert all(tokens[f"agent{i}"] == 1 for i in range(4))  # decodes first, every step
        # 10 ms + (4 decodes + chunk) x 1 ms <= 50 ms: a chunk of 36.
        assert tokens["newcomer"] == 36
        assert plan.predicted_step_s <= 0.050 + 1e-9
        ex.step(plan)


def test_many_decoders_still_leave_a_newcomer_half_of_each_step():
    p = latency_planner(target_s=0.020)
    ex = FakeExecutor(p)
    decoding(p, ex, 30)  # the decodes alone take 40 ms, past the 20 ms target
    p.add(req("newcomer", 1000))
    plan = p.schedule(now=0.0)
    # Within twice the decodes' 40 ms: 10 ms + (30 + chunk) x 1 ms <= 80 ms, a chunk of 40.
    assert scheduled(plan)["newcomer"] == 40
    assert plan.predicted_step_s == pytest.approx(0.080)


def test_no_latency_target_gives_prefill_the_rest_of_the_budget():
    for off in (None, 0.0):
        p = latency_planner(target_s=off)
        ex = FakeExecutor(p)
        decoding(p, ex, 4)
        p.add(req("newcomer", 1000))
        assert scheduled(p.schedule(now=0.0))["newcomer"] == 252


def test_max_running_requests_caps_the_batch_and_finished_slots_refill_next_step():
    p = make_planner(budget=64, max_running=2)
    for rid in "abc":
        p.add(req(rid, 3))
    ex = FakeExecutor(p, lengths={"a": 2, "b": 5, "c": 5})
    plan = p.schedule(now=0.0)
    assert set(scheduled(plan)) == {"a", "b"}
    ex.step(plan)  # a: 1 output
    ex.run_step()  # a: 2 outputs → finished
    assert p.requests.get("a") is None
    plan = p.schedule(now=0.0)
    assert "c" in scheduled(plan) and [r.request_id for r in plan.new_requests] == ["c"]


def test_the_queue_counts_only_requests_beyond_the_batchs_free_places():
    """What --max-queued-requests caps: the same count whether or not a step was planned between
    a burst's requests (the one about to enter the batch is not queued)."""
    p = make_planner(budget=64, max_running=1)
    for rid in "abc":
        p.add(req(rid, 3))
    assert (p.num_waiting, p.num_queued) == (3, 2)  # a takes the free place at the next step
    FakeExecutor(p).step(p.schedule(now=0.0))
    assert (len(p.running), p.num_waiting, p.num_queued) == (1, 2, 2)


def test_kv_aware_admission_waits_for_room_for_the_whole_prompt():
    p = make_planner(num_blocks=10, budget=64, max_running=4)
    p.add(req("a", 20))  # 6 blocks incl. one token of headroom
    p.add(req("b", 20))  # would need 6 more
    ex = FakeExecutor(p, lengths={"a": 1})
    plan = p.schedule(now=0.0)
    assert scheduled(plan) == {"a": 20}
    ex.step(plan)  # a finishes immediately and frees its blocks
    plan = p.schedule(now=0.0)
    assert scheduled(plan) == {"b": 20}


def test_preemption_newest_first_when_decodes_run_out_of_kv_and_everyone_finishes():
    # 7 blocks of 4 tokens: three 7-token prompts take 2 blocks each, then decodes need more.
    p = make_planner(num_blocks=7, budget=64, max_running=4)
    for rid in "abc":
        p.add(req(rid, 7, max_new_tokens=20))
    ex = FakeExecutor(p, lengths={rid: 6 for rid in "abc"})
    plan = p.schedule(now=0.0)
    assert scheduled(plan) == {"a": 7, "b": 7, "c": 7}
    ex.step(plan)
    preempted_seen, failures = [], []
    for _ in range(200):
        if not p.has_work:
            break
        plan = p.schedule(now=0.0)
        preempted_seen += plan.preempted
        failures += plan.failures
        ex.step(plan)
    assert preempted_seen[0] == "c", preempted_seen
    assert not failures, "a running request must never fail for lack of KV"
    assert all(ex.outputs[rid] == 6 for rid in "abc")
    assert ex.free == p.num_kv_blocks


def test_preempted_request_keeps_its_tokens_and_goes_back_to_the_front():
    p = make_planner(num_blocks=5, budget=64, max_running=4)
    p.add(req("old", 7, max_new_tokens=50))
    p.add(req("new", 7, max_new_tokens=50))
    ex = FakeExecutor(p)
    ex.run_step()
    outputs_before = None
    for _ in range(10):
        plan = p.schedule(now=0.0)
        if plan.preempted:
            assert plan.preempted == ["new"]
            victim = next(r for r in p.waiting if r.request_id == "new")
            outputs_before = list(victim.output_token_ids)
            assert victim.num_computed_tokens == 0 and p.waiting[0] is victim
            ex.step(plan)
            break
        ex.step(plan)
    assert outputs_before is not None
    # When it resumes, it recomputes prompt + output in one chunk, without a new_requests entry.
    for _ in range(100):
        plan = p.schedule(now=0.0)
        if "new" in scheduled(plan):
            assert scheduled(plan)["new"] == 7 + len(outputs_before)
            assert all(r.request_id != "new" for r in plan.new_requests)
            break
        ex.step(plan)
    else:
        raise AssertionError("the preempted request never resumed")


def test_a_request_that_cannot_fit_even_alone_fails_instead_of_hanging():
    p = make_planner(num_blocks=4, budget=64, max_running=2)
    p.add(req("huge", 20))
    plan = p.schedule(now=0.0)
    assert not plan.scheduled
    assert [f.request.request_id for f in plan.failures] == ["huge"]
    assert "KV blocks" in plan.failures[0].message


def test_static_batching_admits_no_one_until_the_whole_batch_finishes():
    p = make_planner(budget=64, max_running=2, batching="static")
    for rid in "abc":
        p.add(req(rid, 3))
    ex = FakeExecutor(p, lengths={"a": 1, "b": 4, "c": 1})
    plan = p.schedule(now=0.0)
    assert set(scheduled(plan)) == {"a", "b"}
    ex.step(plan)  # a finishes after its first token
    for _ in range(3):
        plan = p.schedule(now=0.0)
        assert set(scheduled(plan)) == {"b"}, "static batching must not refill a's slot"
        ex.step(plan)
    plan = p.schedule(now=0.0)
    assert set(scheduled(plan)) == {"c"}


def test_continuous_batching_refills_the_slot_on_the_next_step():
    p = make_planner(budget=64, max_running=2, batching="continuous")
    for rid in "abc":
        p.add(req(rid, 3))
    ex = FakeExecutor(p, lengths={"a": 1, "b": 4, "c": 1})
    ex.run_step()  # a finishes
    plan = p.schedule(now=0.0)
    assert set(scheduled(plan)) == {"b", "c"}


def test_abort_releases_at_the_next_step_and_frees_the_slot():
    p = make_planner(budget=64, max_running=2)
    p.add(req("a", 5))
    p.add(req("b", 5))
    p.add(req("c", 5))
    ex = FakeExecutor(p)
    ex.run_step()
    p.abort("a")
    p.abort("c")  # still waiting: removed without involving the executor
    plan = p.schedule(now=0.0)
    assert plan.released == ["a"]
    assert "a" not in scheduled(plan) and "c" not in scheduled(plan)
    ex.step(plan)
    assert ex.free == p.num_kv_blocks - math.ceil(7 / BLOCK)  # only b's blocks remain held


def test_a_client_id_reused_mid_step_never_receives_the_old_submissions_results():
    """Issue 12, item 1: plans and results carry per-submission executor ids."""
    p = make_planner(budget=64)
    old = Request("X", list(range(1, 11)), SamplingParams(), 100, executor_request_id="x-1")
    p.add(old)
    ex = FakeExecutor(p)
    ex.run_step()  # old X prefilled
    in_flight = p.schedule(now=0.0)  # old X decodes ...
    p.abort("x-1")  # ... and is aborted while that step runs
    assert p.is_releasing("X")
    new = Request("X", [1, 2], SamplingParams(), 100, executor_request_id="x-2")
    p.add(new)
    ex.step(in_flight)  # the old X's token comes back
    assert new.output_token_ids == [] and new.num_computed_tokens == 0
    plan = p.schedule(now=0.0)
    assert plan.released == ["x-1"] and scheduled(plan) == {"x-2": 2}
    ex.step(plan)  # its answer confirms the release
    assert not p.is_releasing("X")
    assert new.output_token_ids == [7] and new.num_computed_tokens == 2


class SpyPolicy(FixedPolicy):
    """Fixed budgets, keeping the candidates the planner built."""

    def allocate(self, candidates, step, cost_model):
        self.seen = list(candidates)
        return super().allocate(candidates, step, cost_model)


def test_a_tree_result_feeds_the_next_candidate_its_curve_and_the_acceptance_its_depth():
    p = make_planner()
    p.draft_policy = SpyPolicy(4)
    p.max_draft_tokens = 8
    ex = FakeExecutor(p)
    p.add(req("a", 4))
    ex.run_step()  # the prompt: now decoding
    curve = (0.9, 1.6, 2.0)
    p.update_from_output(
        Plan(step_id=99),
        [
            RequestResult(
                "a",
                [7],
                None,
                5,
                num_drafted_tokens=6,
                num_accepted_tokens=2,
                num_draftable_tokens=3,
                draft_depth=2,
                num_draft_leaves=3,
                expected_num_accepted_tokens=1.0,
                expected_accepted_tokens_by_nodes=curve,
            )
        ],
        ex.free,
        now=0.0,
    )
    ex.known["a"] += 1
    # Its kept path reached the tree's depth: successes, no miss (not 2 of 6 with a miss).
    assert p.acceptance.estimate("a") > p.acceptance.config.prior_acceptance
    # 2 accepted of 1.0 expected, with one pseudo-observation of the swarm's ratio (itself (2 + 1) / (1 + 1)).
    assert p.acceptance.tree_correction("a") == pytest.approx((2 + 1.5) / (1.0 + 1))
    p.schedule(now=0.0)
    (candidate,) = p.draft_policy.seen
    assert candidate.expected_accepted_tokens_by_nodes == curve
    assert candidate.tree_correction == p.acceptance.tree_correction("a")
    assert candidate.num_draftable_tokens == 3


def test_an_agents_next_turn_is_priced_at_the_context_its_prefix_hit_leaves():
    """The executor finds an agent's last turn in its prefix cache, so the next turn's first chunk
    attends thousands of keys per row. The planner guesses that hit (the longest common prefix with
    an ended or running request, whole blocks) to price the step; a fresh prompt starts at 0."""
    pairs_only = StepCost(fixed_s=0.010, per_token_s=0.0, per_attention_pair_s=1e-6)
    config = SchedulerConfig(max_running_requests=4, max_num_batched_tokens=64, kv_watermark=0.0)
    p = Planner(
        config, block_size=BLOCK, num_kv_blocks=10_000, max_num_batched_tokens=8192,
        cost_model=CostModel(CostModelConfig(prior=pairs_only)),
    )  # fmt: skip
    ex = FakeExecutor(p, lengths={"turn1": 3})
    first = req("turn1", 1000, max_new_tokens=3)
    p.add(first)
    while not first.is_finished:
        ex.run_step()
    history = first.prompt_token_ids + first.output_token_ids  # 1,003 tokens
    p.add(Request("turn2", history + list(range(5000, 5100)), SamplingParams(), 10))
    plan = p.schedule(now=0.0)
    assert p.requests["turn2"].expected_prefix_hit == 1000  # whole blocks of the 1,003
    assert scheduled(plan) == {"turn2": 64}
    assert plan.predicted_step_s == pytest.approx(0.010 + 1e-6 * attention_pairs(1000, 64))
    ex.step(plan)  # the fake executor has no prefix cache: from now on its report counts, not the guess
    assert p.requests["turn2"].num_computed_tokens == 64
    assert p.schedule(now=0.0).predicted_step_s == pytest.approx(0.010 + 1e-6 * attention_pairs(64, 64))
