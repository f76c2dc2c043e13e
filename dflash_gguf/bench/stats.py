"""Medians and spread of repeated measurements, and the rows of a result table."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


@dataclass
class Spread:
    """Median, extremes and quartiles of one quantity over the repetitions."""

    median: float
    low: float
    high: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Optional["Spread"]:
        xs = sorted(v for v in values if v is not None)
        if not xs:
            return None
        if len(xs) == 1:
            q1 = q3 = xs[0]
        else:
            q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return cls(statistics.median(xs), xs[0], xs[-1], q1, q3, len(xs))

    def text(self, fmt: str = ".1f") -> str:
        """'median [low-high]' (the median alone when every value is the same)."""
        if self.low == self.high:
            return format(self.median, fmt)
        return f"{self.median:{fmt}} [{self.low:{fmt}}-{self.high:{fmt}}]"

    def to_json(self) -> dict:
        return {"median": self.median, "min": self.low, "max": self.high, "q1": self.q1, "q3": self.q3, "n": self.n}


def ratio(a: Optional[Spread], b: Optional[Spread]) -> Optional[float]:
    """a's median over b's."""
    return a.median / b.median if a is not None and b is not None and b.median > 0 else None


# a ratio this close to 1 is within what a handful of repetitions on a shared machine
# moves; it takes at least this many repetitions to be called either way
NEAR_ONE = (0.9, 1.1)
MIN_REPS_NEAR_ONE = 5


def verdict(ratio_of_medians: Optional[float], per_rep: Sequence[float]) -> Optional[str]:
    """What a comparison says from its per-repetition ratios: "faster" or "slower" (all of
    them on one side of 1), "no difference measured" (their range holds 1), or, for a
    ratio of medians within NEAR_ONE, "too few repetitions for a verdict" under
    MIN_REPS_NEAR_ONE of them. None without ratios."""
    if ratio_of_medians is None or not per_rep:
        return None
    if NEAR_ONE[0] <= ratio_of_medians <= NEAR_ONE[1] and len(per_rep) < MIN_REPS_NEAR_ONE:
        return "too few repetitions for a verdict"
    if min(per_rep) <= 1.0 <= max(per_rep):
        return "no difference measured"
    return "faster" if min(per_rep) > 1.0 else "slower"
