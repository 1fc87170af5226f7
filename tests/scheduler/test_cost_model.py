"""The step-time model, on synthetic measurements with known answers: recovery of a, b, c,
the roofline knee, S, outliers, degenerate data, recency, and the prefill chunk size."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.cost_model import CostModel, CostModelConfig, StepCost, StepTimeSample
from service_common.attention_pairs import attention_pairs

MS = 1e-3
CALIBRATION_TOKENS = (1, 2, 4, 8, 16, 32, 64)
CALIBRATION_KV = (512, 4096, 16384)


def samples(step_time, noise=0.0, seed=0, tokens=CALIBRATION_TOKENS, kv=CALIBRATION_KV, repeats=1):
    rng = np.random.default_rng(seed)
    return [
        StepTimeSample(t, k, step_time(t, k) * (1.0 + noise * rng.standard_normal()))
        for _ in range(repeats)
        for t in tokens
        for k in kv
    ]


def linear(a, b, c):
    return lambda t, k: a + b * t + c * k


def roofline(floor_s, per_token_s, c=0.0):
    """A memory-bound step: flat until the arithmetic outgrows the weight stream."""
    return lambda t, k: max(floor_s, per_token_s * t) + c * k


# ------------------------------------------------------------------- recovery


def test_recovers_known_coefficients_from_noisy_samples():
    a, b, c = 25 * MS, 1.04 * MS, 2e-7
    model = CostModel(calibration=samples(linear(a, b, c), noise=0.01, repeats=2))
    rng = np.random.default_rng(1)
    for _ in range(200):
        t, k = int(rng.integers(1, 65)), int(rng.integers(0, 20000))
        model.observe(t, k, linear(a, b, c)(t, k) * (1 + 0.01 * rng.standard_normal()))
    model.refit()
    fit = model.coefficients
    assert fit.fixed_s == pytest.approx(a, rel=0.05)
    assert fit.per_token_s + fit.per_token_past_knee_s == pytest.approx(b, rel=0.05)
    assert fit.per_attention_pair_s == pytest.approx(c, rel=0.1)
    for t in CALIBRATION_TOKENS:
        assert model.predict(t, 4096) == pytest.approx(linear(a, b, c)(t, 4096), rel=0.02)


def test_exact_linear_data_is_fitted_exactly_with_no_knee():
    a, b, c = 25 * MS, 1.04 * MS, 1e-7
    fit = CostModel(calibration=samples(linear(a, b, c))).coefficients
    assert (fit.fixed_s, fit.per_token_s, fit.per_attention_pair_s) == pytest.approx((a, b, c), rel=1e-4)
    assert fit.per_token_past_knee_s == 0.0


def test_coefficients_are_never_negative():
    # Step time that falls with KV (noise, caching effects): c is clamped at 0, the others refit around it.
    model = CostModel(calibration=samples(lambda t, k: 20 * MS + 0.5 * MS * t - 1e-8 * k))
    fit = model.coefficients
    assert min(fit.fixed_s, fit.per_token_s, fit.per_attention_pair_s, fit.per_token_past_knee_s) >= 0
    assert fit.per_attention_pair_s == 0.0
    assert model.predict(8, 4096) == pytest.approx(24 * MS, rel=0.02)


# ------------------------------------------------------------------- S


def free_tokens_by_definition(model: CostModel, kv: int, tolerance: float) -> int:
    limit = (1 + tolerance) * model.predict(1, kv)
    return max(n for n in range(1, model.max_observed_tokens + 1) if model.predict(n, kv) <= limit * (1 + 1e-12))


def test_free_token_budget_of_a_linear_model():
    # S = floor(1 + tol·(a + b + c·K) / b): 1 + 0.05 · 26.04 / 1.04 = 2.25 → 2. A line leaves almost nothing free.
    a, b = 25 * MS, 1.04 * MS
    model = CostModel(calibration=samples(linear(a, b, 0.0)))
    assert model.free_token_budget(0) == math.floor(1 + 0.05 * (a + b) / b) == 2
    # A cheaper token: 1 + 0.05 · 25.05 / 0.05 = 26.05 → 26.
    model = CostModel(calibration=samples(linear(a, 0.05 * MS, 0.0)))
    assert model.free_token_budget(0) == 26
    # KV makes the one-token step slower, so 5% of it buys more tokens: 1 + 0.05 · (25.05 + 10) / 0.05 = 36.05.
    model = CostModel(calibration=samples(linear(a, 0.05 * MS, 1e-6)))
    assert model.free_token_budget(10_000) == 36
    assert model.free_token_budget(10_000, tolerance=0.0) == 1


def test_free_token_budget_of_a_roofline_is_two_dozen():
    # A 9B Q4_K_M model on an RX 9070 XT: 25.2 ms floor, 1.04 ms per token of arithmetic → ~24 tokens
    # hide under the stream.
    model = CostModel(calibration=samples(roofline(25.2 * MS, 1.04 * MS), noise=0.01, repeats=2))
    assert 22 <= model.free_token_budget(4096) <= 27
    assert model.coefficients.knee_tokens == pytest.approx(24.2, abs=3)
    for t in CALIBRATION_TOKENS:
        assert model.predict(t, 4096) == pytest.approx(roofline(25.2 * MS, 1.04 * MS)(t, 4096), rel=0.05)
    # A plain line through the same points would claim almost nothing is free: why the model has a knee.
    tokens = np.array(CALIBRATION_TOKENS, dtype=float)
    slope, intercept = np.polyfit(tokens, [roofline(25.2 * MS, 1.04 * MS)(t, 0) for t in tokens], 1)
    assert 1 + 0.05 * (intercept + slope) / slope < 3


def test_free_token_budget_never_claims_past_the_largest_measured_step():
    flat = CostModel(calibration=samples(linear(25 * MS, 0.0, 0.0), tokens=(1, 2, 4, 8)))
    assert flat.free_token_budget(0) == 8


def test_free_token_budget_is_a_whole_number_after_mean_runs_are_observed():
    """A decode-runs step is observed as its mean run (13 tokens over 4 runs: 3.25): S stays an int,
    within the largest whole step measured, and so does the goodput policy's room that shares the cap."""
    flat = CostModel(calibration=samples(linear(25 * MS, 0.0, 0.0), tokens=(1, 2)))
    flat.observe(13 / 4, 400 / 4, 25 * MS, 13 / 4, 3.25)
    assert flat.max_observed_tokens == 3 and type(flat.max_observed_tokens) is int
    budget = flat.free_token_budget(100)
    assert budget == 3 and type(budget) is int
    flat.observe(8 / 1, 100 / 1, 25 * MS, 1.0, 1.0)  # one run: still a division
    assert type(flat.max_observed_tokens) is int and type(flat.free_token_budget(100)) is int


@settings(max_examples=60, deadline=None)
@given(
    a=st.floats(1 * MS, 50 * MS),
    b=st.floats(0.0, 2 * MS),
    c=st.floats(0.0, 1e-6),
    kv=st.integers(0, 100_000),
    tolerance=st.floats(0.0, 0.5),
)
def test_free_token_budget_matches_its_definition(a, b, c, kv, tolerance):
    model = CostModel(calibration=samples(linear(a, b, c)))
    assert model.free_token_budget(kv, tolerance) == free_tokens_by_definition(model, kv, tolerance)


# ------------------------------------------------------------------- robustness


def test_a_few_outliers_do_not_drag_the_fit():
    a, b, c = 25 * MS, 1.04 * MS, 2e-7
    data = samples(linear(a, b, c), noise=0.005, repeats=2)  # 42 samples
    for i in (3, 17, 30):  # a GC pause, a recompile, a noisy neighbour: 10× slower
        data[i] = StepTimeSample(data[i].num_tokens, data[i].num_attention_pairs, 10 * data[i].step_s)
    fit = CostModel(calibration=data).coefficients
    assert fit.fixed_s == pytest.approx(a, rel=0.05)
    assert fit.per_token_s + fit.per_token_past_knee_s == pytest.approx(b, rel=0.05)
    assert fit.per_attention_pair_s == pytest.approx(c, rel=0.1)


def test_recent_steps_outweigh_old_ones():
    model = CostModel(calibration=samples(linear(20 * MS, 0.5 * MS, 0.0)))
    rng = np.random.default_rng(2)
    for _ in range(model.config.max_online_samples):  # the card got slower (thermal throttling, another process)
        t = int(rng.integers(1, 65))
        model.observe(t, 1000, linear(40 * MS, 1.0 * MS, 0.0)(t, 1000))
    assert model.predict(8, 1000) == pytest.approx(48 * MS, rel=0.05)
    assert model.predict(64, 1000) == pytest.approx(104 * MS, rel=0.05)


def test_the_online_window_is_bounded_and_refits_happen_every_n_samples():
    config = CostModelConfig(refit_every=16, max_online_samples=10, refit_error=0.0)
    model = CostModel(config, calibration=samples(linear(20 * MS, 0.5 * MS, 0.0)))
    refitted_after = []
    for i in range(1, 41):
        before = model.num_refits
        model.observe(4, 100, 0.5 + 0.01 * i)
        if model.num_refits != before:
            refitted_after.append(i)
    # Early refits while the first real steps correct the calibration, then every `refit_every`.
    assert refitted_after == [1, 2, 4, 8, 24, 40]
    for _ in range(50):
        model.observe(4, 100, 0.5)
    assert model.num_samples == len(CALIBRATION_TOKENS) * len(CALIBRATION_KV) + 10


def test_a_model_that_predicts_well_refits_rarely_and_one_that_drifts_refits_again():
    """A refit stalls the scheduler for ~10 ms: once the recent predictions are within
    `refit_error`, only the level follows the steps (and a refit comes every `max_refit_every`);
    when the steps change shape, the errors rise and refits resume every `refit_every`."""
    config = CostModelConfig(refit_every=16, refit_error=0.05, max_refit_every=64)
    model = CostModel(config, calibration=samples(linear(20 * MS, 0.5 * MS, 0.0)))
    refitted_after = []
    for i in range(1, 201):
        before = model.num_refits
        model.observe(4, 100, 22 * MS)  # the same step again and again: predicted well after the first refits
        if model.num_refits != before:
            refitted_after.append(i)
    assert refitted_after == [1, 2, 4, 8, 72, 136, 200]
    assert model.predict(4, 100) == pytest.approx(22 * MS, rel=0.01)
    refitted_after.clear()
    for i in range(201, 241):
        before = model.num_refits
        # Bigger steps now cost far more per token than the fit says: the errors rise, refits come back.
        num_tokens = 4 + 16 * (i % 4)
        model.observe(num_tokens, 100, 20 * MS + num_tokens * 3 * MS)
        if model.num_refits != before:
            refitted_after.append(i)
    assert refitted_after == [216]  # the first check after the change; the refit fits the new steps
    assert float(np.median(list(model.errors)[-16:])) <= 0.05  # what keeps the next refits away


def test_observe_is_cheap_enough_to_call_every_step():
    model = CostModel(calibration=samples(roofline(25 * MS, 1.04 * MS), noise=0.01))
    rng = np.random.default_rng(3)
    steps = [(int(rng.integers(1, 65)), int(rng.integers(0, 20000))) for _ in range(512)]
    for t, k in steps[:256]:  # fill the window
        model.observe(t, k, 0.03)
    start = time.perf_counter()
    for t, k in steps[256:]:
        model.observe(t, k, 0.03)
        model.predict(t, k)
    per_step = (time.perf_counter() - start) / 256
    assert per_step < 1e-3, f"{per_step * 1e3:.3f} ms per step"


# ------------------------------------------------------------------- degenerate data


def test_no_samples_gives_the_prior():
    model = CostModel()
    assert model.coefficients == model.config.prior
    assert model.free_token_budget(1000) == 1  # nothing measured, nothing claimed free
    assert model.predict(1, 0) > 0


@pytest.mark.parametrize("num_samples", [1, 2])
def test_fewer_than_three_samples_keep_the_prior_slopes(num_samples):
    prior = StepCost(fixed_s=0.02, per_token_s=0.001, per_attention_pair_s=1e-7)
    model = CostModel(CostModelConfig(prior=prior))
    for _ in range(num_samples):
        model.observe(4, 1000, 0.05)
    model.refit()
    fit = model.coefficients
    assert (fit.per_token_s, fit.per_attention_pair_s) == (prior.per_token_s, prior.per_attention_pair_s)
    assert model.predict(4, 1000) == pytest.approx(0.05)


def test_all_samples_at_one_token_count_hold_b_at_the_prior():
    model = CostModel(calibration=samples(linear(25 * MS, 1 * MS, 1e-7), tokens=(1,)))
    fit = model.coefficients
    assert fit.per_token_s == model.config.prior.per_token_s
    assert fit.per_token_past_knee_s == 0.0
    assert fit.per_attention_pair_s == pytest.approx(1e-7, rel=1e-3)
    assert model.free_token_budget(1000) == 1


def test_all_samples_at_one_kv_size_hold_c_at_the_prior():
    model = CostModel(calibration=samples(linear(25 * MS, 1 * MS, 0.0), kv=(777,)))
    fit = model.coefficients
    assert fit.per_attention_pair_s == model.config.prior.per_attention_pair_s
    assert fit.per_token_s == pytest.approx(1 * MS, rel=1e-4)


def test_identical_samples_do_not_crash():
    model = CostModel(calibration=[StepTimeSample(1, 0, 0.01)] * 5)
    assert model.predict(1, 0) == pytest.approx(0.01)
    assert model.free_token_budget(0) == 1
    assert model.max_chunk_tokens(1, 0, 0.02, min_chunk=8, num_cached_tokens=0) >= 8


@pytest.mark.parametrize(
    "sample",
    [
        dict(num_tokens=0, num_attention_pairs=0, step_s=0.01),
        dict(num_tokens=1, num_attention_pairs=-1, step_s=0.01),
        dict(num_tokens=1, num_attention_pairs=0, step_s=0.0),
        dict(num_tokens=1, num_attention_pairs=0, step_s=math.nan),
    ],
)
def test_invalid_samples_are_refused(sample):
    with pytest.raises(ValueError):
        StepTimeSample(**sample)


def test_invalid_config_is_refused():
    with pytest.raises(ValueError, match="refit_every"):
        CostModelConfig(refit_every=0)
    with pytest.raises(ValueError, match="fixed_s"):
        StepCost(fixed_s=-1.0, per_token_s=0.0, per_attention_pair_s=0.0)


# ------------------------------------------------------------------- prefill chunk size


def test_max_chunk_tokens_is_the_largest_chunk_within_the_target():
    model = CostModel(calibration=samples(linear(20 * MS, 0.5 * MS, 1e-7)))
    other, pairs, target = 8, 8 * 2000, 40 * MS  # 8 decodes at 2,000 tokens of context
    chunk = model.max_chunk_tokens(other, pairs, target, min_chunk=16, num_cached_tokens=2000)
    assert model.predict(other + chunk, pairs + attention_pairs(2000, chunk)) <= target
    assert model.predict(other + chunk + 1, pairs + attention_pairs(2000, chunk + 1)) > target
    # 14.4 ms left after the intercept, the decodes and their pairs: 0.5 ms + 2,000 pairs (0.2 ms) a chunk token
    assert chunk == 20
    # The same chunk starting a prompt attends a few pairs, not 2,000 per row: 0.5 ms a token
    assert model.max_chunk_tokens(other, pairs, target, min_chunk=16, num_cached_tokens=0) == 28


def test_max_chunk_tokens_never_goes_below_the_floor():
    model = CostModel(calibration=samples(linear(20 * MS, 0.5 * MS, 0.0)))
    assert (
        model.max_chunk_tokens(16, 0, target_step_s=5 * MS, min_chunk=32, num_cached_tokens=0) == 32
    )  # decodes alone miss it
    assert model.max_chunk_tokens(16, 0, target_step_s=29 * MS, min_chunk=1, num_cached_tokens=0) == 2
    with pytest.raises(ValueError, match="min_chunk"):
        model.max_chunk_tokens(16, 0, target_step_s=29 * MS, min_chunk=0, num_cached_tokens=0)


def test_max_chunk_tokens_is_bounded_when_tokens_look_free():
    model = CostModel(CostModelConfig(max_num_tokens=512), calibration=samples(linear(20 * MS, 0.0, 0.0)))
    assert model.max_chunk_tokens(16, 0, target_step_s=30 * MS, min_chunk=8, num_cached_tokens=0) == 512 - 16


# ------------------------------------------------------------------- logits rows and requests


def batched(a, b, c, e, f):
    """A step priced per token, per KV token, per logits row and per request."""
    return lambda t, k, rows, requests: a + b * t + c * k + e * rows + f * requests


def random_step(rng):
    """A step as the planner makes them: B decodes with drafts, sometimes a prefill chunk."""
    num_decodes = int(rng.integers(1, 17))
    drafts = int(rng.integers(0, 3 * num_decodes + 1)) if rng.random() < 0.5 else 0
    chunk = int(rng.integers(16, 129)) if rng.random() < 0.3 else 0
    t = num_decodes + drafts + chunk
    rows = num_decodes + drafts + (1 if chunk and rng.random() < 0.5 else 0)
    requests = num_decodes + (1 if chunk else 0)
    k = sum(int(rng.integers(20, 600)) for _ in range(requests)) + t
    return t, k, rows, requests


def test_recovers_known_per_row_and_per_request_coefficients():
    truth = batched(8 * MS, 0.05 * MS, 4e-7, 0.4 * MS, 0.6 * MS)
    rng = np.random.default_rng(4)
    model = CostModel()
    for _ in range(256):
        t, k, rows, requests = random_step(rng)
        model.observe(t, k, truth(t, k, rows, requests) * (1 + 0.01 * rng.standard_normal()), rows, requests)
    model.refit()
    fit = model.coefficients
    assert fit.fixed_s == pytest.approx(8 * MS, rel=0.05)
    assert fit.per_token_s + fit.per_token_past_knee_s == pytest.approx(0.05 * MS, rel=0.15)
    assert fit.per_attention_pair_s == pytest.approx(4e-7, rel=0.15)
    assert fit.per_logits_row_s == pytest.approx(0.4 * MS, rel=0.05)
    assert fit.per_request_s == pytest.approx(0.6 * MS, rel=0.05)


def test_calibrated_on_one_request_the_error_on_batched_decode_converges_within_20_steps():
    """A failure seen live: calibration sees one request; batched decode steps cost
    per row and per request too, so the old model was 30-40% under and stayed there."""
    truth = batched(8 * MS, 0.05 * MS, 4e-7, 0.4 * MS, 0.6 * MS)
    calibration = [
        StepTimeSample(t, k + t, truth(t, k + t, 1, 1) * 0.98) for t in (1, 4, 8, 16, 32, 64) for k in (0, 512)
    ]
    model = CostModel(calibration=calibration)
    rng = np.random.default_rng(5)
    first_errors = []
    for step in range(120):
        t, k, rows, requests = random_step(rng)
        actual = truth(t, k, rows, requests) * (1 + 0.03 * rng.standard_normal())
        if step < 5:
            first_errors.append(abs(model.predict(t, k, rows, requests) - actual) / actual)
        model.observe(t, k, actual, rows, requests)
    assert max(first_errors) > 0.2  # calibration alone is far off on batched steps
    summary = model.error_summary(skip=20)
    assert summary.num_steps == 100
    assert summary.median <= 0.10, summary
    assert summary.p90 <= 0.15, summary


def test_old_three_term_shape_is_still_fitted_exactly():
    # Samples without logits rows or requests (one each) fit as before: the new columns are held at the prior (0).
    a, b, c = 25 * MS, 1.04 * MS, 1e-7
    fit = CostModel(calibration=samples(linear(a, b, c))).coefficients
    assert (fit.per_logits_row_s, fit.per_request_s) == (0.0, 0.0)
    assert (fit.fixed_s, fit.per_token_s, fit.per_attention_pair_s) == pytest.approx((a, b, c), rel=1e-4)


def test_a_calibration_taken_under_another_load_is_caught_up_within_a_few_steps():
    """Seen live: calibration at start-up on a busy shared CPU was ~2x slow, with a per-token slope
    the one-request decode steps that followed could not correct (their T never varies)."""
    calibration = [
        StepTimeSample(t, k + t, 2 * (10 * MS + 2 * MS * t + 1e-6 * k)) for t in (1, 4, 8, 16, 32, 64) for k in (0, 512)
    ]
    model = CostModel(calibration=calibration)
    rng = np.random.default_rng(6)
    for step in range(60):
        k = 30 + step
        model.observe(1, k, (10 * MS + 2 * MS + 1e-6 * k) * (1 + 0.03 * rng.standard_normal()))
    assert model.error_summary(skip=20).median <= 0.05
    assert model.predict(1, 100) == pytest.approx(12.1 * MS, rel=0.05)


def test_prediction_error_summary():
    model = CostModel(calibration=samples(linear(20 * MS, 0.5 * MS, 0.0)))
    assert model.error_summary() is None
    for t in (1, 2, 4, 8):
        model.observe(t, 100, linear(20 * MS, 0.5 * MS, 0.0)(t, 100) * 1.1)
    summary = model.error_summary()
    assert summary.num_steps == 4
    assert summary.median == pytest.approx(1 / 11, rel=0.3)
    with pytest.raises(ValueError, match="num_logits_rows"):
        StepTimeSample(2, 0, 0.01, num_logits_rows=3)
