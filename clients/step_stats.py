"""Two numbers a step timeline answers: how well the cost model predicts a step, and how much
of each step the scheduler side (planning, protobufs, the RPC, applying results,
streaming) costs beyond the executor's own work.

Both read `TimelineStep`s (GetTimeline's answer) or anything with the same fields.

- **Prediction error**: |predicted − actual| / actual per step, where predicted is what the
  cost model said when it planned the step and actual is the executor's whole step
  (prepare + forward + sample), the quantity the model is fitted to. The first
  `skip_steps` steps of a scheduler's life are left out (the model is still learning).
- **Scheduler overhead**: the executor is busy `prepare + forward + sample` of each step;
  everything else between one step's result and the next's is the scheduler side and
  the RPC. With steps back to back, the step period is the time between consecutive
  results arriving (end of step i-1 to end of step i); overhead = period − executor
  time, and its share = Σ overhead / Σ period. With overlapped scheduling the next plan
  is queued at the executor before the current step ends, so the overhead that is left
  is what the executor really idles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.cost_model import PredictionError
from scheduler_svc.cost_model import prediction_error as summarize_errors

DEFAULT_SKIP_STEPS = 20


def executor_s(step) -> float:
    return step.executor_prepare_s + step.executor_forward_s + step.executor_sample_s


def prediction_error(steps: Sequence, skip_steps: int = DEFAULT_SKIP_STEPS) -> PredictionError | None:
    errors = [
        abs(s.predicted_duration_s - executor_s(s)) / executor_s(s)
        for s in steps
        if s.step_id > skip_steps and s.predicted_duration_s > 0 and executor_s(s) > 0
    ]
    return summarize_errors(errors)


@dataclass(frozen=True)
class OverheadSummary:
    num_steps: int
    mean_period_s: float  # result to result
    mean_executor_s: float
    overhead_share: float  # Σ (period − executor) / Σ period

    def __str__(self) -> str:
        return (
            f"step every {self.mean_period_s * 1e3:.1f} ms, executor busy {self.mean_executor_s * 1e3:.1f} ms: "
            f"scheduler + RPC {self.overhead_share:.0%} of the step over {self.num_steps} steps"
        )


def scheduler_overhead(steps: Sequence, max_gap_s: float = 1.0) -> OverheadSummary | None:
    """Over consecutive steps (a gap over `max_gap_s` means the server was idle, not slow: not counted)."""
    periods, busy = [], []
    for previous, step in zip(steps, steps[1:]):
        period = (step.start_time_s + step.duration_s) - (previous.start_time_s + previous.duration_s)
        if 0 < period <= max_gap_s:
            periods.append(period)
            busy.append(min(executor_s(step), period))
    if not periods:
        return None
    total = sum(periods)
    return OverheadSummary(len(periods), total / len(periods), sum(busy) / len(busy), (total - sum(busy)) / total)
