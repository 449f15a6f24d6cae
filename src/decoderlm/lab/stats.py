"""Mean ± spread over seeds, and when a difference between two variants is worth a ranking.

The spread is the sample standard deviation over the K seeds (ddof = 1). Two variants are
distinguishable only when both have ≥ 2 seeds and their means differ by more than the larger of
the two spreads; otherwise the report says "not distinguishable at K seeds" rather than ranking
them. It is a deliberately plain rule (no test statistic at K = 2 would be trustworthy): it
keeps seed noise from being written up as an effect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    mean: float  # over the finite values (NaN if none)
    spread: float  # sample standard deviation (0 for one value, NaN if none)
    n: int  # finite values
    n_total: int  # values, finite or not (a diverged run has a NaN loss)

    def __str__(self) -> str:
        if not self.n:
            return "n/a"
        return f"{self.mean:.4f} ± {self.spread:.4f}"


def summarise(values: Sequence[float | None]) -> Summary:
    """Mean and spread of the finite values (None and NaN count only in n_total)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(finite)
    if not n:
        return Summary(math.nan, math.nan, 0, len(values))
    mean = sum(finite) / n
    spread = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1)) if n > 1 else 0.0
    return Summary(mean, spread, n, len(values))


def distinguishable(a: Summary, b: Summary) -> bool:
    """|mean_a − mean_b| > max(spread_a, spread_b), with ≥ 2 finite seeds on each side."""
    if a.n < 2 or b.n < 2:
        return False
    return abs(a.mean - b.mean) > max(a.spread, b.spread)


def verdict(name_a: str, a: Summary, name_b: str, b: Summary, lower_is_better: bool = True) -> str:
    """One phrase comparing a with b: which is better and by how much, or that they are not
    distinguishable at the seed count."""
    if not distinguishable(a, b):
        k = min(a.n, b.n)
        return f"{name_a} vs {name_b}: not distinguishable at {k} seed{'s' if k != 1 else ''}"
    better, worse = (name_a, name_b) if (a.mean < b.mean) == lower_is_better else (name_b, name_a)
    delta = abs(a.mean - b.mean)
    return (
        f"{better} better than {worse} by {delta:.4f} "
        f"(> spread {max(a.spread, b.spread):.4f}, {min(a.n, b.n)} seeds)"
    )
