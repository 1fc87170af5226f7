"""The timeline's two summary numbers on hand-made steps: prediction error and scheduler overhead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from clients.step_stats import prediction_error, scheduler_overhead


def step(step_id, start, duration, executor, predicted=0.0, requests=4):
    return SimpleNamespace(
        step_id=step_id, start_time_s=start, duration_s=duration, executor_prepare_s=0.0,
        executor_forward_s=executor, executor_sample_s=0.0, predicted_duration_s=predicted, num_requests=requests,
    )  # fmt: skip


def test_prediction_error_skips_the_first_steps_and_compares_with_the_executor_time():
    steps = [
        step(i, i * 0.02, 0.02, 0.010, predicted=0.010 * (2.0 if i <= 20 else 1.1 if i % 2 else 1.0))
        for i in range(1, 41)
    ]
    summary = prediction_error(steps)
    assert summary.num_steps == 20
    assert summary.median == pytest.approx(0.05)
    assert summary.p90 == pytest.approx(0.1)
    assert prediction_error(steps[:20]) is None


def test_scheduler_overhead_is_the_step_period_the_executor_does_not_use():
    # A result every 20 ms, 15 ms of it in the executor: 25% is the scheduler side and the RPC.
    steps = [step(i, i * 0.020, 0.018, 0.015) for i in range(1, 11)]
    summary = scheduler_overhead(steps)
    assert summary.num_steps == 9
    assert summary.mean_period_s == pytest.approx(0.020)
    assert summary.overhead_share == pytest.approx(0.25)
    # An idle gap (no work) is not overhead.
    gap = steps[:5] + [step(i, 10 + i * 0.020, 0.018, 0.015) for i in range(6, 11)]
    assert scheduler_overhead(gap).num_steps == 8
