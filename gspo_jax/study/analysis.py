"""The study's pre-registered analysis, one rule for every sweep: a run's final accuracy, intervals over
seeds, paired differences to a control arm, and the collapse rule at three thresholds.

Written down before the sweeps that use it ran (docs/RESULTS.md, "How results are read"), so that a
verdict is what this rule gives, not a reading chosen after seeing the curves:
- **Final accuracy** of a run is the mean of its last `FINAL_EVALS` held-out evaluations after step 0
  (fewer if it has fewer), greedy (`eval_accuracy`) and sampled (`eval_accuracy_sampled`) alike; the
  gain is that minus the step-0 (warm-start) evaluation.
- **An arm** (the runs that differ only in seed) gives the mean ± sample sd over its seeds and a 95%
  t-interval for the mean (n − 1 degrees of freedom).
- **Paired difference**: a sweep may name a control arm; each other arm's difference to it is taken per
  seed (runs of one seed share the warm start and the data order), and its 95% t-interval over seeds.
- **Collapse**: a run collapsed if its final accuracy is more than `COLLAPSE_DROP` (10 points) below
  its step-0 accuracy, or a logged loss is non-finite. The accuracy is the sampled one where the run
  logged it (the policy RL optimises; the greedy mode can fall to it and recover), else the greedy one.
  Counts are also given at a looser (5 points) and a stricter (20 points) threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FINAL_EVALS = 3
COLLAPSE_DROP = 0.10
COLLAPSE_DROPS = (0.05, COLLAPSE_DROP, 0.20)  # looser, the rule, stricter
# Two-sided 95% quantiles of Student's t, t_{0.975}(df), for df = 1..30; beyond, the normal 1.96.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """The two-sided 95% critical value of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"t975: df must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass(frozen=True)
class Interval:
    """mean ± sd over n values and the 95% t-interval of the mean (lo = hi = mean for n = 1)."""

    n: int
    mean: float
    sd: float
    lo: float
    hi: float

    def text(self, scale: float = 100.0, digits: int = 1, signed: bool = True) -> str:
        """E.g. '+4.5 ± 9.4 (-13.3 to +22.3)' in points for scale 100; one value: the value alone."""
        f = lambda v: f"{v * scale:{'+' if signed else ''}.{digits}f}"  # noqa: E731
        if self.n == 1:
            return f(self.mean)
        return f"{f(self.mean)} ± {self.sd * scale:.{digits}f} ({f(self.lo)} to {f(self.hi)})"


def interval(values: Sequence[float]) -> Interval | None:
    """The mean, sample sd and 95% t-interval over the finite `values`; None when there are none."""
    vs = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if not len(vs):
        return None
    mean = float(vs.mean())
    if len(vs) == 1:
        return Interval(1, mean, math.nan, mean, mean)
    sd = float(vs.std(ddof=1))
    half = t975(len(vs) - 1) * sd / math.sqrt(len(vs))
    return Interval(len(vs), mean, sd, mean - half, mean + half)


def final_value(points: Sequence[tuple[int, float]], last: int = FINAL_EVALS) -> float:
    """The mean of the last `last` evaluations after step 0 of (step, value) points (the step-0 value
    alone if there is no other); NaN with no points."""
    after = [v for s, v in points if s > 0]
    if not after:
        return points[0][1] if points else math.nan
    return float(np.mean(after[-last:]))


def paired(arm: dict[int, float], control: dict[int, float]) -> tuple[dict[int, float], Interval | None]:
    """Per-seed differences arm − control over the seeds both have (finite), and their interval."""
    seeds = sorted(s for s in arm.keys() & control.keys() if math.isfinite(arm[s]) and math.isfinite(control[s]))
    diffs = {s: arm[s] - control[s] for s in seeds}
    return diffs, interval(list(diffs.values()))


def collapsed(start: float, final: float, non_finite_loss: bool, drop: float = COLLAPSE_DROP) -> bool:
    """The collapse rule: final more than `drop` below start (False for a NaN start), or a non-finite loss."""
    return non_finite_loss or (math.isfinite(start) and math.isfinite(final) and final < start - drop)
