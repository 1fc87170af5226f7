"""Per-request acceptance estimates: how likely a request's next draft token is accepted.

The goodput draft policy prices a request's j-th draft token at α^j (a linear
draft is accepted up to its first miss), so it needs α per request, and it
needs it from the first step: agents differ a lot (one copies a file from its
context, another reasons in fresh prose), and a request's copying phases come
and go, so the estimate decays.

Model: each draft token is accepted with probability α given the previous one
was. A step that drafted k tokens and accepted a of them observed a successes
and, if a < k, one failure (the first rejected token; the ones after it were
never tested). A call that ran a plan of decodes several times (--max-decode-runs)
reports its sums over the runs and how many runs missed (RequestResult.num_draft_misses):
one failure each. Counting one failure per call there overstated α: measured on the
copy workload at B = 8 (4 runs a call), α ≈ 0.95 against 44% of drafts accepted, and
goodput drafted until it ran 0.77x of no speculation. The estimate is successes / (successes + failures), both counts
decayed by `decay` per observation, with `prior_strength` pseudo-observations
at the swarm-wide rate, itself a slower EWMA over every request's
observations that starts at `prior_acceptance`. A new request therefore starts
at what the swarm currently achieves, and its own history takes over within a
few steps.

A draft tree is observed by its kept path: a step that verified trees of total
depth D and accepted a tokens saw a successes and, if a < D, one failure (a kept
path that ends at a shallower leaf did not miss: counting it errs low). Trees also have their own price: the
executor's drafter says how many tokens each tree of n nodes should get accepted,
and the policy trusts that curve only as far as it has held for this request. The
*tree correction* c_i is accepted tokens over what the drafter expected of the
trees verified, with the same decay and prior strength, its prior the swarm-wide
ratio, which starts at 1 (the drafter is believed until verification says
otherwise). A drafter that expects twice what gets accepted has its curve halved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AcceptanceConfig:
    prior_acceptance: float = 0.5  # the swarm-wide rate before anyone has drafted
    prior_strength: float = 1.0  # pseudo-observations of the swarm rate in every request's estimate
    decay: float = 0.9  # per observation, a request's own counts (memory of ~10 drafting steps)
    swarm_decay: float = 0.98  # per observation, the swarm-wide counts (memory of ~50 steps)
    # A request that never missed still may: capping keeps goodput from treating long drafts as certain.
    max_acceptance: float = 0.98

    def __post_init__(self) -> None:
        for name in ("prior_acceptance", "max_acceptance"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        for name in ("decay", "swarm_decay"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {value}")
        if not (math.isfinite(self.prior_strength) and self.prior_strength > 0):
            raise ValueError(f"prior_strength must be positive, got {self.prior_strength}")


@dataclass
class _Counts:
    """Decayed successes and failures."""

    num_successes: float = 0.0
    num_failures: float = 0.0

    def add(self, num_successes: int, num_failures: int, decay: float) -> None:
        self.num_successes = decay * self.num_successes + num_successes
        self.num_failures = decay * self.num_failures + num_failures


@dataclass
class _Ratio:
    """Decayed accepted tokens and the tokens the drafter expected accepted."""

    num_accepted: float = 0.0
    num_expected: float = 0.0

    def add(self, num_accepted: int, num_expected: float, decay: float) -> None:
        self.num_accepted = decay * self.num_accepted + num_accepted
        self.num_expected = decay * self.num_expected + num_expected

    def rate(self, prior: float, prior_strength: float) -> float:
        return (self.num_accepted + prior_strength * prior) / (self.num_expected + prior_strength)


class AcceptanceTracker:
    """α_i and the tree correction c_i per request id, each with the swarm-wide value as the prior."""

    def __init__(self, config: AcceptanceConfig | None = None) -> None:
        self.config = config or AcceptanceConfig()
        self._requests: dict[str, _Counts] = {}
        self._swarm = _Counts()
        self._tree_requests: dict[str, _Ratio] = {}
        self._swarm_trees = _Ratio()

    def observe(self, request_id: str, num_drafted: int, num_accepted: int, num_misses: int = 0) -> None:
        """Fold in one call's verification of a request's drafts, summed over its runs: num_accepted
        successes and num_misses failures (runs whose draft was accepted short of its length; at
        least one when any token was rejected, so 0 from an executor that does not count them
        reads as one). A call without drafts tells nothing."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(
                f"request {request_id!r}: need 0 <= num_accepted <= num_drafted, got {num_accepted} of {num_drafted}"
            )
        if not 0 <= num_misses <= num_drafted - num_accepted:
            raise ValueError(
                f"request {request_id!r}: need 0 <= num_misses <= the {num_drafted - num_accepted} rejected, "
                f"got {num_misses}"
            )
        if num_drafted == 0:
            return
        num_failures = max(num_misses, 1 if num_accepted < num_drafted else 0)
        self._requests.setdefault(request_id, _Counts()).add(num_accepted, num_failures, self.config.decay)
        self._swarm.add(num_accepted, num_failures, self.config.swarm_decay)

    @property
    def swarm_acceptance(self) -> float:
        """The swarm-wide rate: the prior of every request with little history of its own."""
        c = self.config
        return _rate(self._swarm, c.prior_acceptance, c.prior_strength, c.max_acceptance)

    def estimate(self, request_id: str) -> float:
        """α for this request, in [0, max_acceptance]."""
        c = self.config
        prior = self.swarm_acceptance
        counts = self._requests.get(request_id)
        if counts is None:
            return prior
        return _rate(counts, prior, c.prior_strength, c.max_acceptance)

    def observe_trees(self, request_id: str, num_expected: float, num_accepted: int) -> None:
        """Fold in one step's verified trees: the drafter expected `num_expected` of their tokens
        accepted (RequestResult.expected_num_accepted_tokens), verification accepted `num_accepted`."""
        if not (math.isfinite(num_expected) and num_expected >= 0) or num_accepted < 0:
            raise ValueError(
                f"request {request_id!r}: need finite num_expected >= 0 and num_accepted >= 0, "
                f"got {num_expected} and {num_accepted}"
            )
        if num_expected == 0:
            return  # nothing was expected of it: a chain, or no draft
        self._tree_requests.setdefault(request_id, _Ratio()).add(num_accepted, num_expected, self.config.decay)
        self._swarm_trees.add(num_accepted, num_expected, self.config.swarm_decay)

    @property
    def swarm_tree_correction(self) -> float:
        return self._swarm_trees.rate(1.0, self.config.prior_strength)

    def tree_correction(self, request_id: str) -> float:
        """c_i: accepted tokens per token the drafter expected of this request's trees (>= 0)."""
        prior = self.swarm_tree_correction
        counts = self._tree_requests.get(request_id)
        return prior if counts is None else counts.rate(prior, self.config.prior_strength)

    def forget(self, request_id: str) -> None:
        """The request is finished: drop its history (the swarm rate keeps what it taught)."""
        self._requests.pop(request_id, None)
        self._tree_requests.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)


def _rate(counts: _Counts, prior: float, prior_strength: float, max_acceptance: float) -> float:
    rate = (counts.num_successes + prior_strength * prior) / (
        counts.num_successes + counts.num_failures + prior_strength
    )
    return min(rate, max_acceptance)
