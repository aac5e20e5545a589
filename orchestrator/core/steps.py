"""Values adjusted for the steps a run reached (issue #45, item 2): measured by benchmarks/noise_spread.py, not
used by the gates yet (docs/trust.md, "Values at the same step count": on a run or two an edit's own speed cannot
be told from the machine's).

Under a wall-clock budget the machine's speed decides how many optimizer steps a run makes, and its val_bpb
follows: on a shared CPU two runs of one configuration that reach the same step count score the same to the
last digit, and a run that reaches more steps scores better (benchmarks/README.md, "Run-to-run spread").

- The slope is fitted within configurations: every configuration with two or more runs, each about its own
  means (least squares, pooled), and given only when its residual degrees of freedom reach MIN_DOF and it is
  clear of zero by MIN_T standard errors.
- The machine's scatter of steps: the sd of a run's steps about its configuration's mean, relative, pooled.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

MIN_DOF = 4  # residual degrees of freedom of the pooled fit, at least
MIN_T = 3.0  # the slope's t, at least (a slope the runs cannot tell from zero moves nothing)


@dataclass(frozen=True)
class Fit:
    slope: float  # val_bpb per step (negative: more steps score lower)
    se: float  # its standard error
    dof: int  # residual degrees of freedom
    scatter: float  # the sd of a run's steps about its configuration's mean, as a share of that mean
    reference: float  # the step count values are moved to


def fit(groups: Iterable[list[tuple[float, float]]], reference: float | None) -> Fit | None:
    """The pooled within-configuration slope of val_bpb on steps from groups of (steps, val_bpb) runs of one
    configuration each; None when too few runs vary in steps, the slope is not clear of zero, or there is no
    reference step count."""
    sxx = sxy = syy = scatter_ss = 0.0
    scatter_dof = 0
    for runs in groups:
        if len(runs) < 2:
            continue
        ms, mv = statistics.fmean(s for s, _ in runs), statistics.fmean(v for _, v in runs)
        sxx += sum((s - ms) ** 2 for s, _ in runs)
        sxy += sum((s - ms) * (v - mv) for s, v in runs)
        syy += sum((v - mv) ** 2 for _, v in runs)
        scatter_ss += sum((s / ms - 1) ** 2 for s, _ in runs) if ms > 0 else 0.0
        scatter_dof += len(runs) - 1
    dof = scatter_dof - 1  # a mean per configuration, and one slope for them all
    if reference is None or reference <= 0 or sxx <= 0 or sxy == 0 or dof < MIN_DOF:
        return None
    slope = sxy / sxx
    residual = max(syy - slope * sxy, 0.0) / dof
    se = math.sqrt(residual / sxx)
    if abs(slope) < MIN_T * se:
        return None
    return Fit(slope, se, dof, math.sqrt(scatter_ss / scatter_dof), reference)


def adjust(f: Fit, steps: float, value: float) -> float:
    """val_bpb as the run would have scored at the reference step count, along the slope."""
    return value - f.slope * (steps - f.reference)
