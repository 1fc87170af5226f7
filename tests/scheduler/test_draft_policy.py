"""Draft budgets per policy, on cost models fitted to synthetic step times, and the acceptance
estimates that feed them: budgets stay inside S and d_i, shrink as the batch grows, follow
acceptance, and never draft where the index has nothing."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.acceptance import AcceptanceConfig, AcceptanceTracker
from scheduler_svc.cost_model import CostModel, StepTimeSample
from scheduler_svc.draft_policy import (
    DraftCandidate,
    DraftStep,
    EvenSplitPolicy,
    FixedPolicy,
    GoodputPolicy,
    OffPolicy,
    draft_attention_pairs,
    free_token_budget,
    parse_draft_policy,
)
from service_common.attention_pairs import attention_pairs

MS = 1e-3
CONTEXT = 1000  # the keys each request's decode row attends


def fitted(step_time) -> CostModel:
    tokens, pair_counts = (1, 2, 4, 8, 16, 32, 64), (512, 4096, 16384)
    return CostModel(calibration=[StepTimeSample(t, p, step_time(t, p)) for t in tokens for p in pair_counts])


# A wide slack: a 25.2 ms weight stream hides ~24 tokens of 1.04 ms arithmetic (S = 25 at 5%), as a 9B Q4_K_M
# model on an RX 9070 XT does.
WIDE_SLACK = fitted(lambda t, k: max(25.2 * MS, 1.04 * MS * t) + 1e-8 * k)
# A small slack: 8 tokens hide under an 8 ms stream; past that every token costs 1 ms.
SMALL_SLACK = fitted(lambda t, k: max(8 * MS, 1.0 * MS * t) + 1e-8 * k)
# No free region at all: every token costs 1 ms on a 20 ms step, so a draft must earn its price.
LINEAR = fitted(lambda t, k: 20 * MS + 1.0 * MS * t + 1e-8 * k)

ALL_POLICIES = [OffPolicy(), FixedPolicy(4), EvenSplitPolicy(), GoodputPolicy()]


def candidates(num_requests, draftable=32, acceptance=0.8, context=CONTEXT):
    return [DraftCandidate(f"r{i:02d}", draftable, acceptance, context) for i in range(num_requests)]


def decode_step(cands, num_prefill_tokens=0, **kwargs):
    """A step of len(cands) decodes (one committed token each) plus a prefill chunk (a prompt's first)."""
    num_pairs = sum(c.num_context_tokens for c in cands) + attention_pairs(0, num_prefill_tokens)
    return DraftStep(num_other_tokens=len(cands) + num_prefill_tokens, num_attention_pairs=num_pairs, **kwargs)


def allocate(policy, cands, cost_model, **step_kwargs):
    return policy.allocate(cands, decode_step(cands, **step_kwargs), cost_model)


# ------------------------------------------------------------------- every policy


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=lambda p: p.name)
def test_no_drafts_where_the_index_has_none(policy):
    cands = [
        DraftCandidate("a", 0, 0.95, CONTEXT),
        DraftCandidate("b", 6, 0.95, CONTEXT),
        DraftCandidate("c", 0, 0.5, 1),
    ]
    budgets = allocate(policy, cands, WIDE_SLACK).draft_budgets
    assert budgets["a"] == budgets["c"] == 0
    assert set(budgets) == {"a", "b", "c"}


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(ALL_POLICIES),
    cost_model=st.sampled_from([WIDE_SLACK, SMALL_SLACK, LINEAR]),
    shapes=st.lists(
        st.tuples(st.integers(0, 24), st.floats(0.0, 1.0), st.integers(0, 20_000)), min_size=1, max_size=16
    ),
    num_prefill_tokens=st.integers(0, 48),
    max_num_draft_tokens=st.one_of(st.none(), st.integers(0, 64)),
)
def test_budgets_stay_within_draftable_tokens_the_step_cap_and_S(
    policy, cost_model, shapes, num_prefill_tokens, max_num_draft_tokens
):
    cands = [DraftCandidate(f"r{i:02d}", d, alpha, ctx) for i, (d, alpha, ctx) in enumerate(shapes)]
    step = decode_step(cands, num_prefill_tokens, max_num_draft_tokens=max_num_draft_tokens)
    allocation = policy.allocate(cands, step, cost_model)
    for c in cands:
        assert 0 <= allocation.draft_budgets[c.request_id] <= c.num_draftable_tokens
    if max_num_draft_tokens is not None:
        assert allocation.num_draft_tokens <= max_num_draft_tokens
    if isinstance(policy, EvenSplitPolicy):
        S = free_token_budget(cost_model, step, cands)
        if S >= step.num_other_tokens:
            assert sum(1 + k for k in allocation.draft_budgets.values()) + num_prefill_tokens <= S
        else:
            assert allocation.num_draft_tokens == 0


def test_allocation_reports_S_expected_tokens_and_predicted_time():
    cands = [DraftCandidate("a", 4, 0.5, 100), DraftCandidate("b", 4, 0.9, 300)]
    step = DraftStep(num_other_tokens=2 + 16, num_attention_pairs=400 + 136, num_prefill_output_tokens=1)
    allocation = FixedPolicy(3).allocate(cands, step, LINEAR)
    assert allocation.draft_budgets == {"a": 3, "b": 3}
    assert allocation.num_free_tokens == LINEAR.free_token_budget(536, 0.05, num_pairs_per_token=200)
    assert allocation.num_expected_tokens == pytest.approx(2 + 1 + (0.5 + 0.25 + 0.125) + (0.9 + 0.81 + 0.729))
    # a's 3 drafts attend 101 + 102 + 103 keys, b's 301 + 302 + 303
    assert allocation.predicted_step_s == pytest.approx(LINEAR.predict(18 + 6, 536 + 306 + 906))


def test_an_empty_batch_gets_an_empty_allocation():
    for policy in ALL_POLICIES:
        allocation = policy.allocate([], DraftStep(num_other_tokens=32, num_attention_pairs=32), WIDE_SLACK)
        assert allocation.draft_budgets == {} and allocation.num_expected_tokens == 0


def test_inconsistent_steps_are_refused():
    cands = candidates(4)
    with pytest.raises(ValueError, match="one committed token"):
        EvenSplitPolicy().allocate(cands, DraftStep(num_other_tokens=3, num_attention_pairs=0), WIDE_SLACK)
    with pytest.raises(ValueError, match="duplicate"):
        EvenSplitPolicy().allocate(cands + cands[:1], decode_step(cands + cands[:1]), WIDE_SLACK)
    with pytest.raises(ValueError, match="acceptance"):
        DraftCandidate("x", 4, 1.5, 0)
    with pytest.raises(ValueError, match="num_draftable_tokens"):
        DraftCandidate("x", -1, 0.5, 0)
    with pytest.raises(ValueError, match="num_attention_pairs"):
        DraftStep(num_other_tokens=1, num_attention_pairs=-1)


# ------------------------------------------------------------------- off and fixed


def test_off_drafts_nothing():
    assert set(allocate(OffPolicy(), candidates(4), WIDE_SLACK).draft_budgets.values()) == {0}


def test_fixed_caps_at_what_the_index_can_propose():
    cands = [DraftCandidate("a", 2, 0.5, CONTEXT), DraftCandidate("b", 9, 0.5, CONTEXT)]
    assert allocate(FixedPolicy(4), cands, WIDE_SLACK).draft_budgets == {"a": 2, "b": 4}
    # It ignores the batch: 16 requests get 4 each, far past S (the baseline's flaw).
    assert allocate(FixedPolicy(4), candidates(16), WIDE_SLACK).num_draft_tokens == 64


# ------------------------------------------------------------------- even


def test_even_splits_what_S_leaves_evenly():
    S = WIDE_SLACK.free_token_budget(8 * CONTEXT)
    assert 22 <= S <= 27
    budgets = allocate(EvenSplitPolicy(), candidates(8), WIDE_SLACK).draft_budgets
    assert sum(budgets.values()) == S - 8
    assert max(budgets.values()) - min(budgets.values()) <= 1  # ~2 each at eight agents


def test_even_prefill_tokens_spend_the_budget_before_drafts():
    cands = candidates(2)
    S = WIDE_SLACK.free_token_budget(2 * CONTEXT + 10)
    assert allocate(EvenSplitPolicy(), cands, WIDE_SLACK, num_prefill_tokens=10).num_draft_tokens == S - 2 - 10
    assert allocate(EvenSplitPolicy(), cands, WIDE_SLACK, num_prefill_tokens=S).num_draft_tokens == 0


def test_even_gives_a_capped_request_s_unused_share_to_the_others():
    cands = [DraftCandidate("a", 1, 0.5, CONTEXT)] + [DraftCandidate(r, 20, 0.5, CONTEXT) for r in "bcd"]
    S = WIDE_SLACK.free_token_budget(4 * CONTEXT)
    budgets = allocate(EvenSplitPolicy(), cands, WIDE_SLACK).draft_budgets
    assert budgets["a"] == 1
    assert sum(budgets.values()) == S - 4
    assert max(budgets[r] for r in "bcd") - min(budgets[r] for r in "bcd") <= 1


def test_even_leftover_tokens_go_to_the_likeliest_accepted():
    cands = [DraftCandidate("a", 20, 0.3, CONTEXT), DraftCandidate("b", 20, 0.9, CONTEXT)]
    budgets = allocate(EvenSplitPolicy(), cands, WIDE_SLACK, max_num_draft_tokens=7).draft_budgets
    assert budgets == {"a": 3, "b": 4}


# ------------------------------------------------------------------- goodput


def test_goodput_gives_more_drafts_to_requests_more_likely_accepted():
    cands = [
        DraftCandidate("low", 16, 0.4, CONTEXT),
        DraftCandidate("mid", 16, 0.7, CONTEXT),
        DraftCandidate("high", 16, 0.9, CONTEXT),
    ]
    budgets = allocate(GoodputPolicy(), cands, LINEAR).draft_budgets
    assert budgets["high"] > budgets["mid"] > budgets["low"]


@pytest.mark.parametrize("cost_model", [WIDE_SLACK, SMALL_SLACK, LINEAR], ids=["wide-slack", "small-slack", "linear"])
def test_goodput_never_drafts_what_is_never_accepted(cost_model):
    cands = [DraftCandidate("a", 16, 0.0, CONTEXT), DraftCandidate("b", 16, 0.0, 10)]
    assert allocate(GoodputPolicy(min_gain=0.0), cands, cost_model).num_draft_tokens == 0


def expected_tokens_per_second(cands, budgets, step, cost_model):
    num_tokens = step.num_other_tokens + sum(budgets.values())
    num_pairs = step.num_attention_pairs + sum(
        draft_attention_pairs(c.num_context_tokens, budgets[c.request_id]) for c in cands
    )
    expected = len(cands) + sum(c.acceptance**j for c in cands for j in range(1, budgets[c.request_id] + 1))
    return expected / cost_model.predict(num_tokens, num_pairs)


@settings(max_examples=100, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 8), st.floats(0.0, 0.99)), min_size=1, max_size=6),
    fixed_ms=st.floats(1.0, 40.0),
    per_token_ms=st.floats(0.05, 3.0),
)
def test_goodput_stops_where_expected_tokens_per_second_peaks(shapes, fixed_ms, per_token_ms):
    """No single draft token more or less would raise E/t (exact for costs linear in T)."""
    cost_model = fitted(lambda t, k: fixed_ms * MS + per_token_ms * MS * t)
    cands = [DraftCandidate(f"r{i}", d, alpha, CONTEXT) for i, (d, alpha) in enumerate(shapes)]
    step = decode_step(cands)
    budgets = GoodputPolicy(min_gain=0.0).allocate(cands, step, cost_model).draft_budgets
    best = expected_tokens_per_second(cands, budgets, step, cost_model)
    for c in cands:
        for delta in (-1, 1):
            k = budgets[c.request_id] + delta
            if 0 <= k <= c.num_draftable_tokens:
                neighbour = {**budgets, c.request_id: k}
                assert expected_tokens_per_second(cands, neighbour, step, cost_model) <= best * (1 + 1e-9)


def test_goodput_is_deterministic_and_independent_of_candidate_order():
    cands = candidates(8, draftable=6, acceptance=0.7) + [DraftCandidate("z", 6, 0.95, 50)]
    expected = allocate(GoodputPolicy(), cands, WIDE_SLACK).draft_budgets
    rng = random.Random(0)
    for _ in range(5):
        shuffled = cands[:]
        rng.shuffle(shuffled)
        assert allocate(GoodputPolicy(), shuffled, WIDE_SLACK).draft_budgets == expected
    # Equal requests: a token that does not divide evenly goes to the smaller request id.
    ties = allocate(GoodputPolicy(), candidates(16, acceptance=0.8), WIDE_SLACK).draft_budgets
    assert list(ties.values()) == sorted(ties.values(), reverse=True)


def test_goodput_prices_a_draft_by_the_keys_it_attends():
    """A draft row of a request at 20k tokens of context attends 20k keys: where attention is
    priced (a CPU at long context), the long request's drafts must earn more to be proposed."""
    pairs_priced = fitted(lambda t, p: 20 * MS + 0.1 * MS * t + 1e-6 * p)
    cands = [DraftCandidate("short", 12, 0.8, 100), DraftCandidate("long", 12, 0.8, 20_000)]
    budgets = allocate(GoodputPolicy(), cands, pairs_priced).draft_budgets
    assert budgets["short"] > budgets["long"]
    unpriced = fitted(lambda t, p: 20 * MS + 0.1 * MS * t)  # attention free: context no longer matters
    budgets = allocate(GoodputPolicy(), cands, unpriced).draft_budgets
    assert budgets["short"] == budgets["long"]


def test_draft_attention_pairs():
    assert draft_attention_pairs(1000, 0) == 0
    assert draft_attention_pairs(1000, 3) == 1001 + 1002 + 1003  # each draft also attends the drafts before it


def test_goodput_never_grows_the_step_past_what_was_measured():
    flat = fitted(lambda t, k: 20 * MS)  # every measured size looks free; beyond 64 nobody knows
    allocation = allocate(GoodputPolicy(), candidates(4, draftable=40, acceptance=0.95), flat)
    assert 4 + allocation.num_draft_tokens <= flat.max_observed_tokens == 64


# ------------------------------------------------------------------- the budget shrinks as the batch grows


BATCH_SIZES = (1, 2, 4, 8, 16)


@pytest.mark.parametrize("policy", [EvenSplitPolicy(), GoodputPolicy()], ids=lambda p: p.name)
@pytest.mark.parametrize("cost_model", [WIDE_SLACK, SMALL_SLACK, LINEAR], ids=["wide-slack", "small-slack", "linear"])
def test_per_request_drafts_shrink_as_the_batch_grows(policy, cost_model):
    most, mean = [], []
    for num_requests in BATCH_SIZES:
        budgets = allocate(policy, candidates(num_requests), cost_model).draft_budgets
        most.append(max(budgets.values()))
        mean.append(sum(budgets.values()) / num_requests)
    assert most == sorted(most, reverse=True), most
    assert mean == sorted(mean, reverse=True), mean


def test_even_per_request_drafts_are_about_24_minus_B_over_B():
    per_request = [allocate(EvenSplitPolicy(), candidates(b), WIDE_SLACK).num_draft_tokens / b for b in BATCH_SIZES]
    S = WIDE_SLACK.free_token_budget(CONTEXT)
    assert per_request[0] == S - 1  # ~23 at one agent
    assert per_request[3] == pytest.approx((S - 8) / 8)  # ~2 each at eight agents
    assert per_request[4] < 1  # almost nothing at sixteen


def test_goodput_drafts_several_tokens_alone_and_none_once_the_batch_fills_the_slack():
    per_request = [
        allocate(GoodputPolicy(), candidates(b, acceptance=0.8), SMALL_SLACK).num_draft_tokens / b for b in BATCH_SIZES
    ]
    assert per_request[0] >= 5
    assert per_request[-1] == 0  # 16 decodes are past the 8-token slack: a 1 ms draft earns 0.8 token < E/t


# ------------------------------------------------------------------- parsing --spec


@pytest.mark.parametrize(
    "text, policy",
    [
        ("off", OffPolicy()),
        ("even", EvenSplitPolicy()),
        ("goodput", GoodputPolicy()),
        ("fixed:4", FixedPolicy(4)),
        (" Fixed:12 ", FixedPolicy(12)),
    ],
)
def test_parse_draft_policy(text, policy):
    parsed = parse_draft_policy(text)
    assert parsed == policy
    assert parse_draft_policy(parsed.name) == parsed


@pytest.mark.parametrize(
    "text, message",
    [
        ("fixed:0", "positive integer"),
        ("fixed:x", "positive integer"),
        ("fixed:-2", "positive integer"),
        ("fixed:", "positive integer"),
        ("fixed", "draft length"),
        ("bogus", "off|fixed:K|even|goodput"),
        ("", "off|fixed:K|even|goodput"),
    ],
)
def test_parse_draft_policy_errors_name_the_flag(text, message):
    with pytest.raises(ValueError, match="--spec") as info:
        parse_draft_policy(text)
    assert message in str(info.value)


# ------------------------------------------------------------------- acceptance estimates


def simulate_drafts(rng, acceptance, num_drafted):
    """Accepted length of a linear draft: each token accepted with probability α given the previous one was."""
    num_accepted = 0
    while num_accepted < num_drafted and rng.random() < acceptance:
        num_accepted += 1
    return num_accepted


@pytest.mark.parametrize("true_acceptance", [0.2, 0.5, 0.8, 0.95])
def test_acceptance_converges_to_the_true_rate(true_acceptance):
    rng = np.random.default_rng(0)
    tracker = AcceptanceTracker()
    slow = AcceptanceTracker(AcceptanceConfig(decay=0.995))
    estimates = []
    for step in range(3000):
        num_drafted = int(rng.integers(1, 9))
        num_accepted = simulate_drafts(rng, true_acceptance, num_drafted)
        tracker.observe("r", num_drafted, num_accepted)
        slow.observe("r", num_drafted, num_accepted)
        if step >= 1000:
            estimates.append(tracker.estimate("r"))
    assert np.mean(estimates) == pytest.approx(true_acceptance, abs=0.04)
    assert slow.estimate("r") == pytest.approx(true_acceptance, abs=0.04)


@pytest.mark.parametrize("true_acceptance", [0.3, 0.6])
def test_acceptance_counts_every_run_that_missed(true_acceptance):
    """A call that ran its decodes 4 times reports sums over the runs and how many runs missed:
    the estimate still converges to the true rate. Without the misses (one failure per call) it
    would not: at 0.3 it drifts to about 0.6."""
    rng = np.random.default_rng(4)
    tracker = AcceptanceTracker()
    one_miss_a_call = AcceptanceTracker()
    estimates, overstated = [], []
    for call in range(2000):
        runs = [simulate_drafts(rng, true_acceptance, 3) for _ in range(4)]
        num_accepted, num_misses = sum(runs), sum(a < 3 for a in runs)
        tracker.observe("r", 12, num_accepted, num_misses)
        one_miss_a_call.observe("r", 12, num_accepted)
        if call >= 500:
            estimates.append(tracker.estimate("r"))
            overstated.append(one_miss_a_call.estimate("r"))
    assert np.mean(estimates) == pytest.approx(true_acceptance, abs=0.04)
    assert np.mean(overstated) > true_acceptance + 0.2
    with pytest.raises(ValueError, match="num_misses"):
        tracker.observe("r", 4, 2, 3)  # three misses need three rejected tokens


def test_acceptance_follows_a_request_that_changes_phase():
    rng = np.random.default_rng(1)
    tracker = AcceptanceTracker()
    for _ in range(200):  # copying a file from its context
        tracker.observe("r", 8, simulate_drafts(rng, 0.95, 8))
    assert tracker.estimate("r") > 0.85
    for _ in range(60):  # now writing fresh prose
        tracker.observe("r", 4, simulate_drafts(rng, 0.2, 4))
    assert tracker.estimate("r") < 0.4


def test_new_requests_start_at_the_prior_then_at_the_swarm_rate():
    tracker = AcceptanceTracker(AcceptanceConfig(prior_acceptance=0.5))
    assert tracker.estimate("new") == 0.5
    rng = np.random.default_rng(2)
    for step in range(500):
        tracker.observe(f"agent{step % 8}", 6, simulate_drafts(rng, 0.85, 6))
    assert tracker.swarm_acceptance == pytest.approx(0.85, abs=0.05)
    assert tracker.estimate("another-new") == tracker.swarm_acceptance
    tracker.forget("agent3")
    assert tracker.estimate("agent3") == tracker.swarm_acceptance
    assert tracker.num_requests == 7


def test_acceptance_observation_semantics():
    tracker = AcceptanceTracker(AcceptanceConfig(prior_acceptance=0.5, prior_strength=2.0))
    tracker.observe("r", 0, 0)  # nothing drafted, nothing learned
    assert tracker.num_requests == 0
    tracker.observe("r", 4, 4)  # all accepted: 4 successes, no failure (the 5th was never tried)
    assert tracker.estimate("r") > 0.5
    tracker = AcceptanceTracker(AcceptanceConfig(prior_acceptance=0.5, prior_strength=2.0))
    tracker.observe("r", 4, 0)  # first token rejected: one failure, and the rest were never tested
    # Swarm: (0 + 1) / (0 + 1 + 2) = 1/3; request: (0 + 2·1/3) / (1 + 2) = 2/9.
    assert tracker.estimate("r") == pytest.approx(2 / 9)
    with pytest.raises(ValueError, match="num_accepted"):
        tracker.observe("r", 2, 3)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 16), st.integers(0, 16)), max_size=50))
def test_acceptance_estimate_is_a_probability_below_one(observations):
    tracker = AcceptanceTracker()
    for num_drafted, num_accepted in observations:
        tracker.observe("r", num_drafted, min(num_accepted, num_drafted))
        assert 0.0 <= tracker.estimate("r") <= tracker.config.max_acceptance < 1.0


def test_tracked_acceptance_steers_goodput():
    rng = np.random.default_rng(3)
    tracker = AcceptanceTracker()
    for _ in range(50):
        tracker.observe("copying", 8, simulate_drafts(rng, 0.95, 8))
        tracker.observe("reasoning", 4, simulate_drafts(rng, 0.3, 4))
    cands = [DraftCandidate(r, 16, tracker.estimate(r), CONTEXT) for r in ("copying", "reasoning", "newcomer")]
    budgets = allocate(GoodputPolicy(), cands, LINEAR).draft_budgets
    assert budgets["copying"] > budgets["newcomer"] > budgets["reasoning"]


def test_goodput_probes_a_request_that_has_gone_without_drafts_for_a_while():
    """α is learned only from drafts: a request whose estimate says drafting does not pay would
    never draft again, even once it starts copying. After `probe_every` decodes without a draft,
    one draft token (if the index has one and the step has room) tests it."""

    def cand(since, draftable=16, acceptance=0.01):  # below min_gain: goodput alone never drafts it
        return DraftCandidate("a", draftable, acceptance, CONTEXT, num_decodes_since_draft=since)

    assert allocate(GoodputPolicy(), [cand(7)], LINEAR).draft_budgets["a"] == 0
    assert allocate(GoodputPolicy(), [cand(8)], LINEAR).draft_budgets["a"] == 1
    assert allocate(GoodputPolicy(), [cand(50, draftable=0)], LINEAR).draft_budgets["a"] == 0
    assert allocate(GoodputPolicy(probe_every=0), [cand(50)], LINEAR).draft_budgets["a"] == 0
    assert allocate(GoodputPolicy(), [cand(50)], LINEAR, max_num_draft_tokens=0).draft_budgets["a"] == 0
    # A request goodput already drafts for is not probed on top.
    assert allocate(GoodputPolicy(), [cand(50, acceptance=0.9)], WIDE_SLACK).draft_budgets["a"] > 1
    with pytest.raises(ValueError, match="probe_every"):
        GoodputPolicy(probe_every=-1)


# ------------------------------------------------------------------- draft trees: the executor's curve


def todays_goodput_budgets(policy, cands, step, cost_model):
    """GoodputPolicy.budgets as it was before trees (α_i^(k+1) per next draft), kept verbatim as
    the reference a request without a curve must still get."""
    from scheduler_svc.draft_policy import _step_time

    budgets = {c.request_id: 0 for c in cands}
    room = max(0, cost_model.max_observed_tokens - step.num_other_tokens)
    if step.max_num_draft_tokens is not None:
        room = min(room, step.max_num_draft_tokens)
    heap = [(-c.acceptance, c.request_id, c) for c in cands if c.num_draftable_tokens > 0 and c.acceptance > 0]
    heapq.heapify(heap)
    num_tokens, num_pairs = step.num_other_tokens, step.num_attention_pairs
    expected = float(len(cands) + step.num_prefill_output_tokens)
    num_drafts = 0
    step_s = _step_time(cost_model, step, len(cands), num_tokens, num_pairs, num_drafts)
    while heap and room > 0:
        negative_gain, request_id, c = heapq.heappop(heap)
        gain = -negative_gain
        if gain < policy.min_gain:
            break
        k = budgets[request_id]
        pairs = draft_attention_pairs(c.num_context_tokens, k + 1) - draft_attention_pairs(c.num_context_tokens, k)
        next_step_s = _step_time(cost_model, step, len(cands), num_tokens + 1, num_pairs + pairs, num_drafts + 1)
        if not (expected + gain) * step_s > expected * next_step_s:
            continue
        budgets[request_id] = k + 1
        num_tokens, num_pairs, step_s = num_tokens + 1, num_pairs + pairs, next_step_s
        num_drafts += 1
        expected += gain
        room -= 1
        if k + 1 < c.num_draftable_tokens:
            heapq.heappush(heap, (-gain * c.acceptance, request_id, c))
    for c in cands:
        if room > 0 and policy._is_probe_due(c) and budgets[c.request_id] == 0:
            budgets[c.request_id] = 1
            room -= 1
    return budgets


@settings(max_examples=200, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 20), st.floats(0.0, 0.99), st.integers(1, 5000), st.integers(0, 12)),
        min_size=1,
        max_size=12,
    ),
    cost_model=st.sampled_from([WIDE_SLACK, SMALL_SLACK, LINEAR]),
    num_prefill_tokens=st.integers(0, 40),
    max_num_draft_tokens=st.one_of(st.none(), st.integers(0, 40)),
)
def test_goodput_without_a_curve_is_todays_policy_exactly(shapes, cost_model, num_prefill_tokens, max_num_draft_tokens):
    cands = [
        DraftCandidate(f"r{i}", d, alpha, context, num_decodes_since_draft=since)
        for i, (d, alpha, context, since) in enumerate(shapes)
    ]
    step = decode_step(cands, num_prefill_tokens, max_num_draft_tokens=max_num_draft_tokens)
    policy = GoodputPolicy()
    allocation = policy.allocate(cands, step, cost_model)
    assert allocation.draft_budgets == todays_goodput_budgets(policy, cands, step, cost_model)
    expected = float(len(cands))
    for c in cands:  # summed as allocate always has
        expected += sum(c.acceptance**j for j in range(1, allocation.draft_budgets[c.request_id] + 1))
    assert allocation.num_expected_tokens == expected


def chain_curve(alpha, num_nodes):
    """E(n) of a chain whose j-th token is accepted with probability α^j."""
    return tuple(sum(alpha**j for j in range(1, n + 1)) for n in range(1, num_nodes + 1))


def branching_curve(alpha, num_nodes):
    """E(n) of a tree that branches at every node: one child accepted with probability α given
    its parent, another with α/2 (α <= 2/3, so they sum to at most 1), grown likeliest node
    first, as the drafter grows its trees."""
    candidates, curve, total = [-alpha, -alpha / 2], [], 0.0
    for _ in range(num_nodes):
        probability = -heapq.heappop(candidates)
        total += probability
        curve.append(total)
        heapq.heappush(candidates, -probability * alpha)
        heapq.heappush(candidates, -probability * alpha / 2)
    return tuple(curve)


def tree_candidate(request_id, curve, acceptance=0.6, correction=1.0, draftable=None, **kwargs):
    draftable = len(curve) if draftable is None else draftable
    return DraftCandidate(
        request_id,
        draftable,
        acceptance,
        CONTEXT,
        expected_accepted_tokens_by_nodes=curve,
        tree_correction=correction,
        **kwargs,
    )


def test_a_branching_curve_buys_more_nodes_than_a_chain_at_the_same_acceptance():
    """Where drafts are not free (inside the slack both buy all that fits), a tree's second
    branch is worth more than the chain's next token."""
    cost_model = LINEAR
    chain = DraftCandidate("chain", 16, 0.6, CONTEXT)
    tree = tree_candidate("tree", branching_curve(0.6, 16))
    alone = {
        c.request_id: allocate(GoodputPolicy(), [c], cost_model).draft_budgets[c.request_id] for c in (chain, tree)
    }
    assert alone["tree"] > alone["chain"] > 0
    together = allocate(GoodputPolicy(), [chain, tree], cost_model).draft_budgets
    assert together["tree"] > together["chain"]


def test_a_chain_curve_buys_what_the_chain_model_buys():
    """α = 1/2: the curve's gains are α^j exactly, so pricing by the curve is pricing by α."""
    for cost_model in (WIDE_SLACK, SMALL_SLACK, LINEAR):
        chain = allocate(GoodputPolicy(), [DraftCandidate("a", 12, 0.5, CONTEXT)], cost_model)
        curve = allocate(GoodputPolicy(), [tree_candidate("a", chain_curve(0.5, 12), acceptance=0.9)], cost_model)
        assert curve.draft_budgets == chain.draft_budgets
        assert curve.num_expected_tokens == chain.num_expected_tokens


@pytest.mark.parametrize("cost_model", [WIDE_SLACK, SMALL_SLACK, LINEAR], ids=["wide-slack", "small-slack", "linear"])
def test_a_flat_curve_buys_nothing_whatever_the_acceptance(cost_model):
    """The curve, where there is one, is the price: α (which says 0.95 here) is not consulted."""
    flat = tree_candidate("a", (0.0,) * 8, acceptance=0.95)
    assert allocate(GoodputPolicy(min_gain=0.0), [flat], cost_model).num_draft_tokens == 0
    # Flat after its first node: the first node is worth a draft, the rest add nothing.
    first_only = tree_candidate("a", (0.9,) * 8, acceptance=0.95)
    assert allocate(GoodputPolicy(), [first_only], cost_model).draft_budgets["a"] == 1


def test_the_tree_correction_scales_the_curve():
    curve = branching_curve(0.6, 16)
    budgets = [
        allocate(GoodputPolicy(), [tree_candidate("a", curve, correction=c)], LINEAR).draft_budgets["a"]
        for c in (0.0, 0.5, 1.0, 1.5)
    ]
    assert budgets[0] == 0
    assert budgets == sorted(budgets) and budgets[1] < budgets[3]


def test_curve_gains_are_capped_at_one_never_rise_and_end_with_the_curve():
    assert tree_candidate("a", (0.5, 1.5, 1.6), correction=3.0).draft_gains() == pytest.approx([1.0, 1.0, 0.3])
    assert tree_candidate("a", (0.1, 0.9, 1.0)).draft_gains() == pytest.approx([0.1, 0.1, 0.1])
    assert tree_candidate("a", (0.5, 0.75, 0.8), draftable=2).draft_gains() == pytest.approx([0.5, 0.25])
    assert tree_candidate("a", (0.5, 0.75), draftable=5).draft_gains() == pytest.approx([0.5, 0.25])
    assert DraftCandidate("a", 3, 0.5, CONTEXT).draft_gains() == [0.5, 0.25, 0.125]
    with pytest.raises(ValueError, match="expected_accepted_tokens_by_nodes"):
        tree_candidate("a", (0.5, float("nan")))
    with pytest.raises(ValueError, match="tree_correction"):
        tree_candidate("a", (0.5,), correction=-1.0)


def test_trees_buy_nothing_once_the_batch_fills_the_slack():
    """Past the slack a draft costs what a committed token does: no node, however likely, pays."""
    curve = branching_curve(0.66, 16)
    per_request = [
        allocate(GoodputPolicy(), [tree_candidate(f"r{i:02d}", curve) for i in range(b)], SMALL_SLACK).num_draft_tokens
        / b
        for b in BATCH_SIZES
    ]
    assert per_request[0] >= 5
    assert per_request == sorted(per_request, reverse=True)
    assert per_request[-1] == 0


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=lambda p: p.name)
def test_expected_tokens_count_a_curve_where_there_is_one(policy):
    curve = (0.9, 1.7, 2.0, 2.1)
    allocation = allocate(policy, [tree_candidate("a", curve)], WIDE_SLACK)
    k = allocation.draft_budgets["a"]
    assert allocation.num_expected_tokens == pytest.approx(1 + (curve[k - 1] if k else 0.0))


def test_tree_correction_learns_accepted_over_expected():
    tracker = AcceptanceTracker(AcceptanceConfig(prior_strength=1.0))
    assert tracker.tree_correction("new") == 1.0  # the drafter is believed at first
    tracker.observe_trees("r", 0.0, 3)  # a chain (nothing expected): tells nothing
    assert tracker.tree_correction("r") == 1.0
    rng = np.random.default_rng(4)
    for _ in range(300):  # the drafter expects 3 tokens a step; verification accepts about 1.5
        tracker.observe_trees("r", 3.0, int(rng.integers(0, 4)))
    assert tracker.tree_correction("r") == pytest.approx(0.5, abs=0.15)
    assert tracker.swarm_tree_correction == pytest.approx(0.5, abs=0.15)
    assert tracker.tree_correction("another") == tracker.swarm_tree_correction
    tracker.forget("r")
    assert tracker.tree_correction("r") == tracker.swarm_tree_correction
    with pytest.raises(ValueError, match="num_expected"):
        tracker.observe_trees("r", float("inf"), 1)
