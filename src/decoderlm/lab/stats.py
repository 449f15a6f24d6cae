"""Mean and 95% confidence interval over seeds, and the verdict rule every comparison follows.

A variant's metric over K seeds is summarised by its mean and the 95% Student t-interval
mean ± t₀.₉₇₅,K−1 · s/√K (s: the sample standard deviation, ddof = 1).

Two variants are compared by seed (`compare`): the same seed gives every variant the same batches,
so the per-seed differences d_k = a_k − b_k are paired and their t-interval
mean(d) ± t₀.₉₇₅,n−1 · sd(d)/√n is the test. Only seeds where both runs trained healthily count
(a run classified stuck, diverged or NaN by `decoderlm.lab.measure.classify` enters no interval):

- fewer than MIN_SEEDS seeds on either side: "too few seeds for a verdict";
- every run of both variants failed: "both fail"; every run of one and none of the other's: the
  failing one is worse ("fails where the other trains");
- fewer than MIN_SEEDS healthy pairs: "too few seeds for a verdict";
- the interval excludes 0: a is lower (or higher) than b;
- it contains 0: "not distinguishable".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIN_SEEDS = 3  # healthy paired seeds a verdict needs
# t₀.₉₇₅ for 1 … 30 degrees of freedom (two-sided 95%); beyond, the Cornish–Fisher expansion
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
T975 += (2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
T975 += (2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z975 = 1.959964
RULE = (
    "Verdict rule: per seed the difference d = a − b between two variants (the same seed gives "
    "both the same batches), over the seeds where both runs trained healthily; a differs from b "
    f'when the 95% t-interval mean(d) ± t·sd(d)/√n excludes 0 (n ≥ {MIN_SEEDS}), else "not '
    'distinguishable"; fewer healthy seeds: "too few seeds for a verdict". A variant whose '
    "runs all failed (stuck, diverged or NaN) while the other's all trained is worse. Intervals "
    "in brackets are 95% t-intervals."
)

# outcomes of `compare`
LOWER, HIGHER, SAME, TOO_FEW = "lower", "higher", "not distinguishable", "too few seeds"
A_FAILS, B_FAILS, BOTH_FAIL = "a fails", "b fails", "both fail"


def t_quantile(df: int) -> float:
    """t₀.₉₇₅ with `df` degrees of freedom (the table, then Cornish–Fisher to O(1/df³))."""
    if df < 1:
        return math.nan
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Summary:
    mean: float  # over the finite values (NaN if none)
    spread: float  # sample standard deviation (0 for one value, NaN if none)
    n: int  # finite values
    n_total: int  # values, finite or not (a failed run counts here only)

    @property
    def half_width(self) -> float:
        """t₀.₉₇₅,n−1 · s/√n: half the 95% interval of the mean (NaN below 2 values)."""
        return t_quantile(self.n - 1) * self.spread / math.sqrt(self.n) if self.n > 1 else math.nan

    @property
    def interval(self) -> tuple[float, float]:
        return self.mean - self.half_width, self.mean + self.half_width

    def format(self, digits: int = 4) -> str:
        """ "mean ± half-width" (95% t-interval), "mean" alone for one value, "n/a" for none."""
        if not self.n:
            return "n/a"
        if self.n == 1:
            return f"{self.mean:,.{digits}f}"
        return f"{self.mean:,.{digits}f} ± {self.half_width:,.{digits}f}"

    def __str__(self) -> str:
        return self.format()


def summarise(values: Sequence[float | None]) -> Summary:
    """Mean and spread of the finite values (None and NaN count only in n_total)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(finite)
    if not n:
        return Summary(math.nan, math.nan, 0, len(values))
    mean = sum(finite) / n
    spread = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1)) if n > 1 else 0.0
    return Summary(mean, spread, n, len(values))


@dataclass(frozen=True)
class Comparison:
    """a against b by seed: the outcome and the interval of the mean difference a − b."""

    outcome: str  # LOWER, HIGHER, SAME, TOO_FEW, A_FAILS, B_FAILS or BOTH_FAIL
    difference: Summary  # of d_k = a_k − b_k over the healthy paired seeds
    failed: tuple[int, int]  # failed runs of a, of b
    seeds: tuple[int, int]  # runs of a, of b

    def phrase(self, name_a: str, name_b: str, digits: int = 4) -> str:
        """One line: the outcome, Δ = mean [interval] and the seed counts."""
        d = self.difference
        low, high = d.interval
        delta = (
            f"Δ = {d.mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}], {d.n} seeds"
            if d.n > 1
            else f"{d.n} healthy paired seed{'s' if d.n != 1 else ''}"
        )
        failed = [
            f"{name} {k}/{n} failed"
            for name, k, n in (
                (name_a, self.failed[0], self.seeds[0]),
                (name_b, self.failed[1], self.seeds[1]),
            )
            if k
        ]
        extra = f"; {', '.join(failed)}" if failed else ""
        text = {
            LOWER: f"{name_a} lower than {name_b}",
            HIGHER: f"{name_a} higher than {name_b}",
            SAME: f"{name_a} vs {name_b}: not distinguishable",
            TOO_FEW: f"{name_a} vs {name_b}: too few seeds for a verdict",
            A_FAILS: f"{name_a} fails where {name_b} trains",
            B_FAILS: f"{name_b} fails where {name_a} trains",
            BOTH_FAIL: f"{name_a} and {name_b} both fail",
        }[self.outcome]
        return f"{text} ({delta}{extra})"


def compare(a: Mapping[int, float | None], b: Mapping[int, float | None]) -> Comparison:
    """a against b by seed; {seed: value}, None for a failed run (see the module's rule)."""
    failed = (sum(v is None for v in a.values()), sum(v is None for v in b.values()))
    seeds = (len(a), len(b))
    paired = [a[k] - b[k] for k in sorted(set(a) & set(b)) if a[k] is not None and b[k] is not None]
    difference = summarise(paired)
    all_a, all_b = failed[0] == seeds[0] > 0, failed[1] == seeds[1] > 0
    if min(seeds) < MIN_SEEDS:
        outcome = TOO_FEW
    elif all_a and all_b:
        outcome = BOTH_FAIL
    elif (all_a and not failed[1]) or (all_b and not failed[0]):
        outcome = A_FAILS if all_a else B_FAILS
    elif difference.n < MIN_SEEDS:
        outcome = TOO_FEW
    else:
        low, high = difference.interval
        outcome = LOWER if high < 0 else HIGHER if low > 0 else SAME
    return Comparison(outcome, difference, failed, seeds)
