"""A measurement taken N times: its median and min–max, ratios between two of them, and
whether one is below the other by more than their noise.

Repeats are interleaved (repeat r measures every configuration before repeat r + 1 starts),
so drift on the machine touches every configuration alike, and repeat r of one configuration
is paired with repeat r of another: a ratio is the median of the per-repeat ratios, with
their min–max.

"Below by more than noise" is rank-based, on the observed spread: A is below B when A's best
repeat is below B's worst (their min–max ranges do not overlap). If A and B were the same
distribution, all N of A's values would fall below all N of B's with probability
1 / C(2N, N): 1/6 at N = 2, 1/20 at N = 3, 1/70 at N = 4, 1/252 at N = 5 (a one-sided
Mann-Whitney test with U = 0). With one repeat there is no spread to judge by, and no verdict.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """Median and range of one quantity over its repeats."""

    median: float
    low: float
    high: float
    num_repeats: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, digits: int = 1, suffix: str = "") -> str:
        """`61.2 (58.0–63.1)`; the median alone for one repeat."""
        median = f"{self.median:.{digits}f}{suffix}"
        if self.num_repeats == 1:
            return median
        return f"{median} ({self.low:.{digits}f}–{self.high:.{digits}f}{suffix})"

    def to_json(self) -> dict:
        return {"median": self.median, "min": self.low, "max": self.high, "num_repeats": self.num_repeats}


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> Spread | None:
    """The per-repeat ratios numerators[r] / denominators[r], as a Spread; None where a
    denominator is zero or the two were not repeated alike."""
    if not numerators or len(numerators) != len(denominators) or not all(denominators):
        return None
    return Spread.of([a / b for a, b in zip(numerators, denominators)])


def is_below_beyond_noise(values: Sequence[float], reference: Sequence[float]) -> bool | None:
    """True when every one of `values` is below every one of `reference` (see the module
    docstring for the rule's false-alarm rate); None with fewer than two repeats of either."""
    if len(values) < 2 or len(reference) < 2:
        return None
    return max(values) < min(reference)


def verdict_text(verdict: bool | None) -> str:
    if verdict is None:
        return "unknown (one repeat: no spread to judge by)"
    return "YES" if verdict else "no"
