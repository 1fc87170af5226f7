"""The step-time model: how long a step of T tokens over K cached tokens takes.

Batching, prefill chunking and speculation all spend one resource, the
arithmetic that hides under a step's weight stream. The scheduler prices every
choice it makes (chunk size, draft budgets) with this model, fitted to what the
executor measured: calibration steps at start-up, then every real step.

The model is

    t(T, K) = a + b·T + c·K + d·max(0, T − knee)

with T = tokens computed, K = KV tokens read (the executor reports the sum of
the scheduled requests' context lengths), and a, b, c, d ≥ 0. With d = 0 it is
the plain `a + b·T + c·K`. The hinge is there because a decode step is a
roofline: flat (memory-bound) until the arithmetic catches up with the weight
stream, then linear in T. A straight line through such data puts a slope where
the card is flat and says almost nothing is free (the seeds' card: a = 25 ms,
1.04 ms/token gives S ≈ 2 from a line, ≈ 25 from the hinge, and the seeds
measured ~24). The knee is chosen from a grid by least squares, and the hinge
is kept only if it halves the line's residual, so noise never invents a knee.

The fit is weighted non-negative least squares (exact: with 4 coefficients
every active set can be tried), over the calibration samples plus a bounded
window of recent steps weighted by recency, refitted with Huber weights so a
few outliers (a GC pause, a first-call compile) cannot drag it.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

MIN_SAMPLES_TO_FIT = 3
NUM_ROBUST_PASSES = 3
HUBER_K = 1.345  # residuals beyond k robust standard deviations are down-weighted (95% efficiency)
HINGE_MAX_LOSS_RATIO = 0.5  # the hinge must halve the line's weighted squared residual to be used
MAX_NUM_KNEES = 32  # knee candidates per fit: ~10% steps over the calibrated range of T
_NUM_COLUMNS = 4  # [1, T, K, max(0, T − knee)] → a, b, c, d
# [15, 4]: every non-empty set of free coefficients (the rest held at 0), as 0/1 rows.
_ACTIVE_SETS = np.array(
    [
        [i in free for i in range(_NUM_COLUMNS)]
        for size in range(1, _NUM_COLUMNS + 1)
        for free in itertools.combinations(range(_NUM_COLUMNS), size)
    ],
    dtype=np.float64,
)


@dataclass(frozen=True)
class StepTimeSample:
    """One measured step: tokens computed, KV tokens read, seconds."""

    num_tokens: int
    num_kv_tokens: int
    step_s: float

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be at least 1, got {self.num_tokens}")
        if self.num_kv_tokens < 0:
            raise ValueError(f"num_kv_tokens must be non-negative, got {self.num_kv_tokens}")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"step_s must be positive and finite, got {self.step_s}")


@dataclass(frozen=True)
class StepCost:
    """Fitted coefficients of t(T, K) = a + b·T + c·K + d·max(0, T − knee), in seconds."""

    fixed_s: float  # a: weight stream + launch overhead, paid by every step
    per_token_s: float  # b
    per_kv_token_s: float  # c
    per_token_past_knee_s: float = 0.0  # d: the extra slope once arithmetic outgrows the weight stream
    knee_tokens: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_token_s", "per_kv_token_s", "per_token_past_knee_s", "knee_tokens"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be non-negative and finite, got {value}")

    def predict(self, num_tokens: float, num_kv_tokens: float) -> float:
        past_knee = num_tokens - self.knee_tokens
        return (
            self.fixed_s
            + self.per_token_s * num_tokens
            + self.per_kv_token_s * num_kv_tokens
            + (self.per_token_past_knee_s * past_knee if past_knee > 0 else 0.0)
        )


@dataclass(frozen=True)
class CostModelConfig:
    max_online_samples: int = 256  # the window of recent steps kept for the fit
    half_life_samples: float = 64.0  # an online sample's weight halves every this many newer steps
    # Each start-up sample weighs this forever (the newest online step weighs 1): enough to anchor step sizes the
    # workload never visits, little enough that a full window of real steps outvotes a stale calibration.
    calibration_weight: float = 0.25
    refit_every: int = 16  # online samples between refits
    max_num_tokens: int = 8192  # the largest step any query is answered for (bounds the searches)
    # Used before there is data, and for a coefficient the data cannot determine (all samples at one T,
    # or one K). Pessimistic on purpose: with no evidence, extra tokens are not assumed free.
    prior: StepCost = field(default_factory=lambda: StepCost(fixed_s=0.02, per_token_s=0.001, per_kv_token_s=0.0))

    def __post_init__(self) -> None:
        for name in ("max_online_samples", "refit_every", "max_num_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("half_life_samples", "calibration_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite, got {value}")


class CostModel:
    """Step-time predictions from calibration plus recent steps; refits itself every few steps.

    `observe` is called once per step: it appends to a bounded window and refits
    every `refit_every` samples (about 1 ms over a full window on one CPU core),
    so the amortized cost is under 0.1 ms per step. `predict` and the budget
    queries only read the current coefficients.
    """

    def __init__(self, config: CostModelConfig | None = None, calibration: Iterable[StepTimeSample] = ()) -> None:
        self.config = config or CostModelConfig()
        self._calibration: list[StepTimeSample] = list(calibration)
        self._online: deque[StepTimeSample] = deque(maxlen=self.config.max_online_samples)
        self._num_unfitted = 0
        self.coefficients: StepCost = self.config.prior
        self.max_observed_tokens = 0  # the largest T among the fitted samples: S never claims beyond it
        self.refit()

    @property
    def num_samples(self) -> int:
        return len(self._calibration) + len(self._online)

    def calibrate(self, samples: Iterable[StepTimeSample]) -> None:
        """Replace the start-up samples (an executor reconnect re-measures) and refit."""
        self._calibration = list(samples)
        self.refit()

    def observe(self, num_tokens: int, num_kv_tokens: int, step_s: float) -> None:
        """Add one step's measurement; refits every `refit_every` calls."""
        self._online.append(StepTimeSample(num_tokens, num_kv_tokens, step_s))
        self._num_unfitted += 1
        if self._num_unfitted >= self.config.refit_every:
            self.refit()

    def refit(self) -> StepCost:
        samples = self._calibration + list(self._online)
        self._num_unfitted = 0
        self.max_observed_tokens = max((s.num_tokens for s in samples), default=0)
        if not samples:
            self.coefficients = self.config.prior
            return self.coefficients
        num_tokens = np.array([s.num_tokens for s in samples], dtype=np.float64)
        num_kv_tokens = np.array([s.num_kv_tokens for s in samples], dtype=np.float64)
        step_s = np.array([s.step_s for s in samples], dtype=np.float64)
        # Newest online sample weighs 1; calibration keeps a constant weight.
        ages = np.arange(len(self._online) - 1, -1, -1, dtype=np.float64)
        weights = np.concatenate(
            [
                np.full(len(self._calibration), self.config.calibration_weight),
                np.exp2(-ages / self.config.half_life_samples),
            ]
        )
        self.coefficients = fit_step_cost(num_tokens, num_kv_tokens, step_s, weights, self.config.prior)
        return self.coefficients

    # ----------------------------------------------------------------- queries

    def predict(self, num_tokens: float, num_kv_tokens: float) -> float:
        """Predicted seconds for a step computing `num_tokens` over `num_kv_tokens` cached tokens."""
        return self.coefficients.predict(num_tokens, num_kv_tokens)

    def free_token_budget(self, num_kv_tokens: int, tolerance: float = 0.05) -> int:
        """S: the most tokens a step can compute within (1 + tolerance) of a one-token step.

        This is the compute slack batching and speculation share. It is never
        claimed beyond the largest step actually measured (the fit says nothing
        about what lies past it), and is at least 1.
        """
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be non-negative, got {tolerance}")
        limit = (1.0 + tolerance) * self.predict(1, num_kv_tokens)
        limit *= 1.0 + 1e-12  # a flat model must not lose tokens to rounding
        cap = min(max(1, self.max_observed_tokens), self.config.max_num_tokens)
        return _largest_within(lambda n: self.predict(n, num_kv_tokens) <= limit, 1, cap)

    def max_chunk_tokens(self, num_other_tokens: int, num_kv_tokens: int, target_step_s: float, min_chunk: int) -> int:
        """The largest prefill chunk keeping the predicted step within `target_step_s`, at least `min_chunk`.

        `num_other_tokens` and `num_kv_tokens` describe the rest of the step,
        including the chunk's own request's already-cached context; the chunk
        adds its tokens to both T and K. The floor means a prefill always
        progresses, even when the decodes alone already miss the target.
        """
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be at least 1, got {min_chunk}")
        if not target_step_s > 0:
            raise ValueError(f"target_step_s must be positive, got {target_step_s}")
        cap = max(0, self.config.max_num_tokens - num_other_tokens)

        def fits(n: int) -> bool:
            return self.predict(num_other_tokens + n, num_kv_tokens + n) <= target_step_s

        if cap == 0 or not fits(1):
            return min_chunk
        return max(min_chunk, _largest_within(fits, 1, cap))


def _largest_within(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), given fits(low) or not; fits must be monotone."""
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


# --------------------------------------------------------------------- fitting


def fit_step_cost(
    num_tokens: np.ndarray, num_kv_tokens: np.ndarray, step_s: np.ndarray, weights: np.ndarray, prior: StepCost
) -> StepCost:
    """Robust weighted NNLS fit of the hinge model; degenerate data falls back on `prior` per coefficient.

    Arrays are [num_samples]. Fewer than MIN_SAMPLES_TO_FIT samples give the
    prior's slopes with the intercept matched to the data. A column with a
    single distinct value (all samples at one T, or one K) cannot be told apart
    from the intercept: its coefficient is held at the prior's.
    """
    distinct_tokens = np.unique(num_tokens)
    has_token_spread = len(distinct_tokens) >= 2
    has_kv_spread = len(np.unique(num_kv_tokens)) >= 2
    held = np.zeros_like(step_s)  # the part of t explained by coefficients held at the prior
    if len(step_s) < MIN_SAMPLES_TO_FIT or not has_token_spread:
        held += prior.per_token_s * num_tokens
    if len(step_s) < MIN_SAMPLES_TO_FIT or not has_kv_spread:
        held += prior.per_kv_token_s * num_kv_tokens
    if len(step_s) < MIN_SAMPLES_TO_FIT:
        fixed = float(np.average(step_s - held, weights=weights))
        return StepCost(max(0.0, fixed), prior.per_token_s, prior.per_kv_token_s)

    target = step_s - held
    knees = _knee_candidates(distinct_tokens)
    active = [True, has_token_spread, has_kv_spread, len(knees) > 0]
    robust = np.ones_like(step_s)
    for robust_pass in range(NUM_ROBUST_PASSES):
        coefficients, knee = _weighted_nnls(num_tokens, num_kv_tokens, target, weights * robust, knees, active)
        if robust_pass == NUM_ROBUST_PASSES - 1:
            break
        residuals = target - _evaluate(coefficients, knee, num_tokens, num_kv_tokens)
        # Robust scale (MAD); the floor keeps an exact fit from turning every tiny residual into an outlier.
        scale = 1.4826 * float(np.median(np.abs(residuals)))
        scale = max(scale, 1e-6 * float(np.median(np.abs(step_s))), 1e-12)
        robust = np.minimum(1.0, HUBER_K * scale / np.maximum(np.abs(residuals), 1e-300))
    a, b, c, d = (float(x) for x in coefficients)
    if not active[1]:
        b = prior.per_token_s
    if not active[2]:
        c = prior.per_kv_token_s
    return StepCost(a, b, c, d, knee if d > 0 else 0.0)


def _knee_candidates(distinct_tokens: np.ndarray) -> np.ndarray:
    """A geometric grid of knees with two distinct measured T on each side, so neither segment is one point."""
    if len(distinct_tokens) < 4:
        return np.empty(0)
    low, high = float(distinct_tokens[1]), float(distinct_tokens[-2])
    return np.geomspace(low, high, MAX_NUM_KNEES + 1)[:-1]


def _evaluate(coefficients: np.ndarray, knee: float, num_tokens: np.ndarray, num_kv_tokens: np.ndarray) -> np.ndarray:
    a, b, c, d = coefficients
    return a + b * num_tokens + c * num_kv_tokens + d * np.maximum(0.0, num_tokens - knee)


def _weighted_nnls(
    num_tokens: np.ndarray,
    num_kv_tokens: np.ndarray,
    target: np.ndarray,
    weights: np.ndarray,
    knees: np.ndarray,
    active: list[bool],
) -> tuple[np.ndarray, float]:
    """Best (coefficients [a, b, c, d], knee) over every knee and every active set with all coefficients ≥ 0.

    With 4 coefficients the exact NNLS optimum is the best feasible
    unconstrained solution over the 15 active sets; all knees are solved at
    once as a batch of small normal-equation systems.
    """
    num_knees = max(1, len(knees))
    knee_values = knees if len(knees) else np.zeros(1)
    # Columns scaled to [0, 1] (and the target to ~1) so the normal equations are well conditioned.
    token_scale = max(float(num_tokens.max()), 1.0)
    kv_scale = max(float(num_kv_tokens.max()), 1.0)
    target_scale = max(float(np.abs(target).max()), 1e-300)
    hinge = np.maximum(0.0, num_tokens[None, :] - knee_values[:, None])  # [num_knees, num_samples]
    hinge_scale = np.maximum(hinge.max(axis=1), 1e-300)
    hinge /= hinge_scale[:, None]
    base = np.stack([np.ones_like(target), num_tokens / token_scale, num_kv_tokens / kv_scale], axis=1)  # [n, 3]
    y = target / target_scale
    weighted_base = base * weights[:, None]
    # The three knee-independent columns are shared; only the hinge's rows of the Gram differ per knee.
    gram = np.empty((num_knees, _NUM_COLUMNS, _NUM_COLUMNS))  # [num_knees, 4, 4]
    gram[:, :3, :3] = base.T @ weighted_base
    gram[:, 3, :3] = gram[:, :3, 3] = hinge @ weighted_base
    gram[:, 3, 3] = (hinge * hinge) @ weights
    moment = np.empty((num_knees, _NUM_COLUMNS))  # [num_knees, 4]
    moment[:, :3] = weighted_base.T @ y
    moment[:, 3] = hinge @ (weights * y)
    total = float(np.sum(weights * y * y))
    ridge = 1e-10 * float(np.sum(weights))

    # Every (active set, knee) system at once: columns outside the set become identity rows with a zero
    # right-hand side, so their coefficient solves to exactly 0.
    masks = _ACTIVE_SETS[np.all(_ACTIVE_SETS <= np.array(active), axis=1)]  # [num_sets, 4]
    pair_masks = masks[:, :, None] * masks[:, None, :]  # [num_sets, 4, 4]
    systems = gram[None] * pair_masks[:, None] + ridge * pair_masks[:, None] * np.eye(_NUM_COLUMNS)
    systems += np.eye(_NUM_COLUMNS) * (1.0 - masks)[:, None, None, :]  # [num_sets, num_knees, 4, 4]
    rhs = moment[None] * masks[:, None, :]  # [num_sets, num_knees, 4]
    solutions = np.linalg.solve(systems, rhs[..., None])[..., 0]  # [num_sets, num_knees, 4]
    losses = total - np.sum(rhs * solutions, axis=2)  # [num_sets, num_knees]
    losses[~np.all(solutions >= 0, axis=2)] = np.inf
    # The hinge costs two parameters (d and the knee, the best of many): keep it only when it explains the
    # data far better than a line, so noise on a straight line never invents a knee.
    has_hinge_column = masks[:, 3] > 0
    line_losses = np.where(has_hinge_column[:, None], np.inf, losses)
    hinge_losses = np.where(has_hinge_column[:, None], losses, np.inf)
    best_line_loss, best_hinge_loss = float(line_losses.min()), float(hinge_losses.min())
    use_hinge = best_hinge_loss < HINGE_MAX_LOSS_RATIO * best_line_loss and best_line_loss > 1e-9 * total
    chosen = hinge_losses if use_hinge else line_losses
    set_index, knee_index = np.unravel_index(int(np.argmin(chosen)), chosen.shape)
    if not chosen[set_index, knee_index] < total:  # nothing beats t = 0 (cannot happen for positive times)
        return np.zeros(_NUM_COLUMNS), 0.0
    best = solutions[set_index, knee_index]
    has_hinge = best[3] > 0
    scales = np.array([1.0, token_scale, kv_scale, hinge_scale[knee_index] if has_hinge else 1.0]) / target_scale
    best_coefficients, best_knee = best / scales, float(knee_values[knee_index]) if has_hinge else 0.0
    return best_coefficients, best_knee
