"""The step-time model: how long a step takes, from what it computes.

Batching, prefill chunking and speculation all spend one resource, the
arithmetic that hides under a step's weight stream. The scheduler prices every
choice it makes (chunk size, draft budgets) with this model, fitted to what the
executor measured: calibration steps at start-up, then every real step.

The model is

    t = a + b·T + c·P + e·L + f·R + d·max(0, T − knee)

with T = tokens computed, P = attention pairs (Σ over the step's query rows of
the keys each attends: a decode row its context, a chunk of n tokens after c
cached ones n·c + n(n + 1)/2; see service_common/attention_pairs.py), L = logits rows (the LM head and the
sampler run once per row that needs logits: one per sampling request plus its
drafts), R = requests in the step (per-request work: slicing, block tables,
drafting, verification), and every coefficient ≥ 0. t is the executor's whole
step (prepare + forward + sample): what a step occupies the executor for, and
so what the scheduler must predict. Without the L and R terms a batched decode
step looks like a one-request step of B tokens, which calibration (one request)
prices far too cheap: the fit was 30–40% under on batched decode, measured.

The hinge is there because a decode step is a roofline: flat (memory-bound)
until the arithmetic catches up with the weight stream, then linear in T. A
straight line through such data puts a slope where the card is flat and says
almost nothing is free (a 9B Q4_K_M model on an RX 9070 XT: a 25 ms weight
stream and 1.04 ms of arithmetic per token give S ≈ 2 from a line, ≈ 25 from
the hinge; ~24 is what hides under the stream). The knee is
chosen from a grid by least squares, and the hinge is kept only if it halves
the line's residual, so noise never invents a knee.

**The level follows the machine.** The fit gives the step's shape (what a token,
a KV token, a row, a request cost relative to each other); the overall level
moves with what else the machine runs (other processes on shared cores, clocks,
thermal limits), and a calibration taken at start-up under a different load can
sit 2× off. Coefficients fixed by calibration alone (every real step had one
request, say) cannot move, and non-negativity stops the intercept from making
up for them, so the fit alone never catches up. Every prediction is therefore
scaled by the median of actual/fitted over the last `level_window` steps,
updated at every step: the error on the steps the scheduler plans converges
within a few steps, and the fit still decides how steps of other shapes compare.

The fit is weighted non-negative least squares (exact: with 6 coefficients
every active set can be tried), over the calibration samples plus a bounded
window of recent steps weighted by recency, refitted with Huber weights so a
few outliers (a GC pause, a first-call compile) cannot drag it. Columns that
always move together in the data (a decode-only workload has T = L = R) cannot
be told apart, and need not be: the fit splits their sum, and predicts every
step shaped like the data correctly.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from service_common.attention_pairs import attention_pairs

MIN_SAMPLES_TO_FIT = 3
NUM_ROBUST_PASSES = 3
HUBER_K = 1.345  # residuals beyond k robust standard deviations are down-weighted (95% efficiency)
HINGE_MAX_LOSS_RATIO = 0.5  # the hinge must halve the line's weighted squared residual to be used
MAX_NUM_KNEES = 32  # knee candidates per fit: ~10% steps over the calibrated range of T
_NUM_COLUMNS = 6  # [1, T, P, L, R, max(0, T − knee)] → a, b, c, e, f, d
_HINGE = _NUM_COLUMNS - 1
# Refit after this many online samples while the window fills, then every `refit_every`:
# the first real steps (batched, unlike calibration) correct the model within a few steps.
_EARLY_REFITS = frozenset({1, 2, 4, 8})
# [63, 6]: every non-empty set of free coefficients (the rest held at 0), as 0/1 rows.
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
    """One measured step: tokens computed, attention pairs, seconds, logits rows, requests."""

    # Counts are floats: a step whose plan ran several times is observed as its mean run.
    num_tokens: float
    num_attention_pairs: float
    step_s: float
    num_logits_rows: float = 1
    num_requests: float = 1

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be at least 1, got {self.num_tokens}")
        if self.num_attention_pairs < 0:
            raise ValueError(f"num_attention_pairs must be non-negative, got {self.num_attention_pairs}")
        if not 0 <= self.num_logits_rows <= self.num_tokens:
            raise ValueError(
                f"num_logits_rows must be in [0, num_tokens={self.num_tokens}], got {self.num_logits_rows}"
            )
        if not 1 <= self.num_requests <= self.num_tokens:
            raise ValueError(f"num_requests must be in [1, num_tokens={self.num_tokens}], got {self.num_requests}")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"step_s must be positive and finite, got {self.step_s}")


@dataclass(frozen=True)
class StepCost:
    """Fitted coefficients of t = a + b·T + c·P + e·L + f·R + d·max(0, T − knee), in seconds."""

    fixed_s: float  # a: weight stream + launch overhead, paid by every step
    per_token_s: float  # b
    per_attention_pair_s: float  # c
    per_token_past_knee_s: float = 0.0  # d: the extra slope once arithmetic outgrows the weight stream
    knee_tokens: float = 0.0
    per_logits_row_s: float = 0.0  # e: LM head + sampling/verification per row that needs logits
    per_request_s: float = 0.0  # f: per-request work (slices, block tables, drafting, results)

    def __post_init__(self) -> None:
        for name in (
            "fixed_s", "per_token_s", "per_attention_pair_s", "per_token_past_knee_s", "knee_tokens", "per_logits_row_s",
            "per_request_s",
        ):  # fmt: skip
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be non-negative and finite, got {value}")

    def predict(
        self, num_tokens: float, num_attention_pairs: float, num_logits_rows: float = 1, num_requests: float = 1
    ) -> float:
        past_knee = num_tokens - self.knee_tokens
        return (
            self.fixed_s
            + self.per_token_s * num_tokens
            + self.per_attention_pair_s * num_attention_pairs
            + self.per_logits_row_s * num_logits_rows
            + self.per_request_s * num_requests
            + (self.per_token_past_knee_s * past_knee if past_knee > 0 else 0.0)
        )


@dataclass(frozen=True)
class CostModelConfig:
    max_online_samples: int = 256  # the window of recent steps kept for the fit
    half_life_samples: float = 64.0  # an online sample's weight halves every this many newer steps
    # Each start-up sample weighs this forever (the newest online step weighs 1): enough to anchor step sizes the
    # workload never visits, little enough that a full window of real steps outvotes a stale calibration.
    calibration_weight: float = 0.25
    refit_every: int = 16  # online samples between refits while predictions are off by more than refit_error
    refit_error: float = 0.05  # median relative error of the last level_window steps that calls for a refit
    max_refit_every: int = 256  # online samples between refits however good the predictions are
    level_window: int = 16  # recent steps whose median actual/fitted ratio scales every prediction
    min_level_samples: int = 3  # ... once there are this many
    max_num_tokens: int = 8192  # the largest step any query is answered for (bounds the searches)
    # Used before there is data, and for a coefficient the data cannot determine (all samples at one T,
    # or one P). Pessimistic on purpose: with no evidence, extra tokens are not assumed free.
    prior: StepCost = field(default_factory=lambda: StepCost(fixed_s=0.02, per_token_s=0.001, per_attention_pair_s=0.0))

    def __post_init__(self) -> None:
        for name in (
            "max_online_samples",
            "refit_every",
            "max_refit_every",
            "max_num_tokens",
            "level_window",
            "min_level_samples",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("half_life_samples", "calibration_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        if not (math.isfinite(self.refit_error) and self.refit_error >= 0):
            raise ValueError(f"refit_error must be non-negative and finite, got {self.refit_error}")


class CostModel:
    """Step-time predictions from calibration plus recent steps; refits itself every few steps.

    `observe` is called once per step: it appends to a bounded window, updates
    the level, and refits after the 1st, 2nd, 4th and 8th online sample, then
    every `refit_every` samples while the recent predictions are off by more than
    `refit_error` (median), else every `max_refit_every`: a refit over a full
    window takes ~10 ms on one CPU core, a stall of a whole decode step, and the
    level alone keeps a good fit calibrated. `predict` and the budget queries only
    read the current coefficients. Every `observe` also scores the prediction the current
    coefficients make for the step before it is folded in: `errors` holds
    |predicted − actual| / actual, the model's own report card.
    """

    def __init__(self, config: CostModelConfig | None = None, calibration: Iterable[StepTimeSample] = ()) -> None:
        self.config = config or CostModelConfig()
        self._calibration: list[StepTimeSample] = list(calibration)
        self._online: deque[StepTimeSample] = deque(maxlen=self.config.max_online_samples)
        self._num_unfitted = 0
        self._num_observed = 0
        self.errors: deque[float] = deque(maxlen=self.config.max_online_samples)  # relative, oldest first
        self.fitted: StepCost = self.config.prior  # the least-squares fit
        self.level = 1.0  # median actual/fitted over recent steps
        self.coefficients: StepCost = self.config.prior  # the fit scaled by the level: what predictions use
        self.num_refits = 0
        self.max_observed_tokens = 0  # the largest T among the fitted samples: S never claims beyond it
        self.refit()

    @property
    def num_samples(self) -> int:
        return len(self._calibration) + len(self._online)

    def calibrate(self, samples: Iterable[StepTimeSample]) -> None:
        """Replace the start-up samples (an executor reconnect re-measures) and refit."""
        self._calibration = list(samples)
        self.refit()

    def observe(
        self,
        num_tokens: float,
        num_attention_pairs: float,
        step_s: float,
        num_logits_rows: float = 1,
        num_requests: float = 1,
    ) -> None:
        """Add one step's measurement; refits on the early schedule, then as the class docstring says."""
        sample = StepTimeSample(num_tokens, num_attention_pairs, step_s, num_logits_rows, num_requests)
        predicted = self.predict(num_tokens, num_attention_pairs, num_logits_rows, num_requests)
        self.errors.append(abs(predicted - step_s) / step_s)
        self._online.append(sample)
        self._num_unfitted += 1
        self._num_observed += 1
        if self._num_observed in _EARLY_REFITS or self._is_refit_due():
            self.refit()
        else:
            self._update_level()

    def _is_refit_due(self) -> bool:
        c = self.config
        if self._num_unfitted >= c.max_refit_every:
            return True
        if self._num_unfitted < c.refit_every:
            return False
        return float(np.median(_newest(self.errors, c.level_window))) > c.refit_error

    def _update_level(self) -> None:
        """Scale the fit to the median actual/fitted ratio of the last `level_window` steps."""
        recent = _newest(self._online, self.config.level_window)
        if len(recent) >= self.config.min_level_samples:
            ratios = [
                s.step_s
                / max(
                    self.fitted.predict(s.num_tokens, s.num_attention_pairs, s.num_logits_rows, s.num_requests), 1e-12
                )
                for s in recent
            ]
            self.level = float(np.median(ratios))
        else:
            self.level = 1.0
        f = self.fitted
        self.coefficients = replace(
            f,
            fixed_s=f.fixed_s * self.level,
            per_token_s=f.per_token_s * self.level,
            per_attention_pair_s=f.per_attention_pair_s * self.level,
            per_token_past_knee_s=f.per_token_past_knee_s * self.level,
            per_logits_row_s=f.per_logits_row_s * self.level,
            per_request_s=f.per_request_s * self.level,
        )

    def refit(self) -> StepCost:
        samples = self._calibration + list(self._online)
        self._num_unfitted = 0
        self.num_refits += 1
        # A whole number of tokens: steps are observed as their mean run (13 tokens over 4 runs is 3.25,
        # and 8 over 1 run is 8.0), which counts as its floor, so S, a token count, stays an int wherever
        # it goes (plans, traces, the step history, GetTimeline).
        self.max_observed_tokens = math.floor(max((s.num_tokens for s in samples), default=0))
        if not samples:
            self.fitted = self.config.prior
            self._update_level()
            return self.coefficients
        columns = np.array(
            [(s.num_tokens, s.num_attention_pairs, s.num_logits_rows, s.num_requests) for s in samples],
            dtype=np.float64,
        )  # [num_samples, 4]: T, P, L, R
        step_s = np.array([s.step_s for s in samples], dtype=np.float64)
        # Newest online sample weighs 1; calibration keeps a constant weight.
        ages = np.arange(len(self._online) - 1, -1, -1, dtype=np.float64)
        weights = np.concatenate(
            [
                np.full(len(self._calibration), self.config.calibration_weight),
                np.exp2(-ages / self.config.half_life_samples),
            ]
        )
        self.fitted = fit_step_cost(
            columns[:, 0], columns[:, 1], step_s, weights, self.config.prior, columns[:, 2], columns[:, 3]
        )
        self._update_level()
        return self.coefficients

    # ----------------------------------------------------------------- queries

    def predict(
        self, num_tokens: float, num_attention_pairs: float, num_logits_rows: float = 1, num_requests: float = 1
    ) -> float:
        """Predicted seconds for a step computing `num_tokens` tokens whose query rows attend
        `num_attention_pairs` (query, key) pairs, with `num_logits_rows` rows of logits, for
        `num_requests` requests."""
        return self.coefficients.predict(num_tokens, num_attention_pairs, num_logits_rows, num_requests)

    def free_token_budget(
        self, num_attention_pairs: int, tolerance: float = 0.05, num_pairs_per_token: float = 0.0
    ) -> int:
        """S: the most tokens a step can compute within (1 + tolerance) of a one-token step.

        This is the compute slack batching and speculation share. Each extra
        token is priced as a token that needs logits (a decode or a draft row)
        and attends `num_pairs_per_token` keys (its request's context), which is
        what the slack is spent on. It is never claimed beyond the largest step
        actually measured (the fit says nothing about what lies past it), and is
        at least 1.
        """
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be non-negative, got {tolerance}")
        limit = (1.0 + tolerance) * self.predict(1, num_attention_pairs)
        limit *= 1.0 + 1e-12  # a flat model must not lose tokens to rounding
        cap = min(max(1, self.max_observed_tokens), self.config.max_num_tokens)

        def fits(n: int) -> bool:
            return self.predict(n, num_attention_pairs + (n - 1) * num_pairs_per_token, n) <= limit

        return _largest_within(fits, 1, cap)

    def max_chunk_tokens(
        self,
        num_other_tokens: int,
        num_attention_pairs: int,
        target_step_s: float,
        min_chunk: int,
        num_logits_rows: int | None = None,
        num_requests: int | None = None,
        *,
        num_cached_tokens: int,
    ) -> int:
        """The largest prefill chunk keeping the predicted step within `target_step_s`, at least `min_chunk`.

        `num_other_tokens`, `num_attention_pairs`, `num_logits_rows` and
        `num_requests` describe the rest of the step (None: one per other
        token, the decodes); the chunk adds its tokens to T, the pairs its rows
        attend after its request's `num_cached_tokens` to P, one request, and
        one logits row (it may end its prompt). The floor means a prefill
        always progresses, even when the decodes alone already miss the target.
        """
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be at least 1, got {min_chunk}")
        if not target_step_s > 0:
            raise ValueError(f"target_step_s must be positive, got {target_step_s}")
        cap = max(0, self.config.max_num_tokens - num_other_tokens)
        rows = (num_other_tokens if num_logits_rows is None else num_logits_rows) + 1
        requests = (num_other_tokens if num_requests is None else num_requests) + 1

        def fits(n: int) -> bool:
            return (
                self.predict(
                    num_other_tokens + n,
                    num_attention_pairs + attention_pairs(num_cached_tokens, n),
                    min(rows, num_other_tokens + n),
                    requests,
                )
                <= target_step_s
            )

        if cap == 0 or not fits(1):
            return min_chunk
        return max(min_chunk, _largest_within(fits, 1, cap))

    def error_summary(self, skip: int = 0) -> "PredictionError | None":
        """Median and p90 of the relative prediction error over the online steps after the first `skip`."""
        return prediction_error(list(self.errors)[skip:])


@dataclass(frozen=True)
class PredictionError:
    """|predicted − actual| / actual over some steps."""

    num_steps: int
    median: float
    p90: float

    def __str__(self) -> str:
        return f"median {self.median:.1%}, p90 {self.p90:.1%} over {self.num_steps} steps"


def prediction_error(relative_errors: Sequence[float]) -> PredictionError | None:
    """Summarize relative errors (None when there are none)."""
    if not len(relative_errors):
        return None
    errors = np.asarray(relative_errors, dtype=np.float64)
    return PredictionError(len(errors), float(np.median(errors)), float(np.quantile(errors, 0.9)))


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
    num_tokens: np.ndarray,
    num_attention_pairs: np.ndarray,
    step_s: np.ndarray,
    weights: np.ndarray,
    prior: StepCost,
    num_logits_rows: np.ndarray | None = None,
    num_requests: np.ndarray | None = None,
) -> StepCost:
    """Robust weighted NNLS fit of the hinge model; degenerate data falls back on `prior` per coefficient.

    Arrays are [num_samples]; logits rows and requests default to one per
    sample. Fewer than MIN_SAMPLES_TO_FIT samples give the prior's slopes with
    the intercept matched to the data. A column with a single distinct value
    (all samples at one T, one P, ...) cannot be told apart from the intercept:
    its coefficient is held at the prior's.
    """
    ones = np.ones_like(step_s)
    num_logits_rows = ones if num_logits_rows is None else num_logits_rows
    num_requests = ones if num_requests is None else num_requests
    # [num_samples, 4]: the slope columns T, P, L, R, and the prior's slope for each.
    features = np.stack([num_tokens, num_attention_pairs, num_logits_rows, num_requests], axis=1)
    prior_slopes = np.array(
        [prior.per_token_s, prior.per_attention_pair_s, prior.per_logits_row_s, prior.per_request_s]
    )
    distinct_tokens = np.unique(num_tokens)
    has_spread = np.array([len(np.unique(features[:, j])) >= 2 for j in range(features.shape[1])])
    enough = len(step_s) >= MIN_SAMPLES_TO_FIT
    held_columns = ~has_spread if enough else np.ones_like(has_spread)
    held = features[:, held_columns] @ prior_slopes[held_columns]  # the part of t explained by held coefficients
    if not enough:
        fixed = float(np.average(step_s - held, weights=weights))
        return replace(prior, fixed_s=max(0.0, fixed), per_token_past_knee_s=0.0, knee_tokens=0.0)

    target = step_s - held
    knees = _knee_candidates(distinct_tokens)
    active = [True, *has_spread, len(knees) > 0]
    robust = np.ones_like(step_s)
    for robust_pass in range(NUM_ROBUST_PASSES):
        coefficients, knee = _weighted_nnls(features, num_tokens, target, weights * robust, knees, active)
        if robust_pass == NUM_ROBUST_PASSES - 1:
            break
        residuals = target - _evaluate(coefficients, knee, features, num_tokens)
        # Robust scale (MAD); the floor keeps an exact fit from turning every tiny residual into an outlier.
        scale = 1.4826 * float(np.median(np.abs(residuals)))
        scale = max(scale, 1e-6 * float(np.median(np.abs(step_s))), 1e-12)
        robust = np.minimum(1.0, HUBER_K * scale / np.maximum(np.abs(residuals), 1e-300))
    a, b, c, e, f, d = (float(x) for x in coefficients)
    b, c, e, f = (float(prior_slopes[j]) if held_columns[j] else value for j, value in enumerate((b, c, e, f)))
    return StepCost(a, b, c, d, knee if d > 0 else 0.0, e, f)


def _newest(window: deque, n: int) -> list:
    """The newest n items of a window, oldest first, without copying the whole window (once per step)."""
    return list(itertools.islice(reversed(window), n))[::-1]


def _knee_candidates(distinct_tokens: np.ndarray) -> np.ndarray:
    """A geometric grid of knees with two distinct measured T on each side, so neither segment is one point."""
    if len(distinct_tokens) < 4:
        return np.empty(0)
    low, high = float(distinct_tokens[1]), float(distinct_tokens[-2])
    return np.geomspace(low, high, MAX_NUM_KNEES + 1)[:-1]


def _evaluate(coefficients: np.ndarray, knee: float, features: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
    return (
        coefficients[0] + features @ coefficients[1:_HINGE] + coefficients[_HINGE] * np.maximum(0.0, num_tokens - knee)
    )


def _weighted_nnls(
    features: np.ndarray,
    num_tokens: np.ndarray,
    target: np.ndarray,
    weights: np.ndarray,
    knees: np.ndarray,
    active: list[bool],
) -> tuple[np.ndarray, float]:
    """Best (coefficients [a, b, c, e, f, d], knee) over every knee and every active set with all coefficients ≥ 0.

    `features` is [num_samples, 4] (T, P, L, R). With 6 coefficients the exact
    NNLS optimum is the best feasible unconstrained solution over the 63
    active sets; all knees are solved at once as a batch of small
    normal-equation systems.
    """
    num_base = _NUM_COLUMNS - 1
    num_knees = max(1, len(knees))
    knee_values = knees if len(knees) else np.zeros(1)
    # Columns scaled to [0, 1] (and the target to ~1) so the normal equations are well conditioned.
    feature_scales = np.maximum(features.max(axis=0), 1.0)  # [4]
    target_scale = max(float(np.abs(target).max()), 1e-300)
    hinge = np.maximum(0.0, num_tokens[None, :] - knee_values[:, None])  # [num_knees, num_samples]
    hinge_scale = np.maximum(hinge.max(axis=1), 1e-300)
    hinge /= hinge_scale[:, None]
    base = np.concatenate([np.ones_like(target)[:, None], features / feature_scales], axis=1)  # [n, 5]
    y = target / target_scale
    weighted_base = base * weights[:, None]
    # The knee-independent columns are shared; only the hinge's rows of the Gram differ per knee.
    gram = np.empty((num_knees, _NUM_COLUMNS, _NUM_COLUMNS))  # [num_knees, 6, 6]
    gram[:, :num_base, :num_base] = base.T @ weighted_base
    gram[:, _HINGE, :num_base] = gram[:, :num_base, _HINGE] = hinge @ weighted_base
    gram[:, _HINGE, _HINGE] = (hinge * hinge) @ weights
    moment = np.empty((num_knees, _NUM_COLUMNS))  # [num_knees, 6]
    moment[:, :num_base] = weighted_base.T @ y
    moment[:, _HINGE] = hinge @ (weights * y)
    total = float(np.sum(weights * y * y))
    ridge = 1e-10 * float(np.sum(weights))

    # Every (active set, knee) system at once: columns outside the set become identity rows with a zero
    # right-hand side, so their coefficient solves to exactly 0.
    masks = _ACTIVE_SETS[np.all(_ACTIVE_SETS <= np.array(active, dtype=np.float64), axis=1)]  # [num_sets, 6]
    if not active[-1]:
        gram, moment = gram[:1], moment[:1]  # no hinge: every knee is the same system
    pair_masks = masks[:, :, None] * masks[:, None, :]  # [num_sets, 6, 6]
    systems = gram[None] * pair_masks[:, None] + ridge * pair_masks[:, None] * np.eye(_NUM_COLUMNS)
    systems += np.eye(_NUM_COLUMNS) * (1.0 - masks)[:, None, None, :]  # [num_sets, num_knees, 6, 6]
    rhs = moment[None] * masks[:, None, :]  # [num_sets, num_knees, 6]
    solutions = np.linalg.solve(systems, rhs[..., None])[..., 0]  # [num_sets, num_knees, 6]
    losses = total - np.sum(rhs * solutions, axis=2)  # [num_sets, num_knees]
    losses[~np.all(solutions >= 0, axis=2)] = np.inf
    # The hinge costs two parameters (d and the knee, the best of many): keep it only when it explains the
    # data far better than a line, so noise on a straight line never invents a knee.
    has_hinge_column = masks[:, _HINGE] > 0
    line_losses = np.where(has_hinge_column[:, None], np.inf, losses)
    hinge_losses = np.where(has_hinge_column[:, None], losses, np.inf)
    best_line_loss, best_hinge_loss = float(line_losses.min()), float(hinge_losses.min())
    use_hinge = best_hinge_loss < HINGE_MAX_LOSS_RATIO * best_line_loss and best_line_loss > 1e-9 * total
    chosen = hinge_losses if use_hinge else line_losses
    set_index, knee_index = np.unravel_index(int(np.argmin(chosen)), chosen.shape)
    if not chosen[set_index, knee_index] < total:  # nothing beats t = 0 (cannot happen for positive times)
        return np.zeros(_NUM_COLUMNS), 0.0
    best = solutions[set_index, knee_index]
    has_hinge = best[_HINGE] > 0
    scales = np.concatenate([[1.0], feature_scales, [hinge_scale[knee_index] if has_hinge else 1.0]]) / target_scale
    best_coefficients, best_knee = best / scales, float(knee_values[knee_index]) if has_hinge else 0.0
    return best_coefficients, best_knee
