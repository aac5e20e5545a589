"""Noise-aware decisions: measure σ of val_bpb from repeated runs, and keep only what beats the noise.

Upstream keeps any lower val_bpb, so a change that does nothing is kept about half the time. Here the
baseline is run more than once to estimate σ (pooled over every configuration measured more than once, so it
keeps improving), a candidate is kept only if its mean beats the best's mean by a margin of about
`gate_sigmas` standard errors (t-corrected while σ rests on few runs, floored at `min_delta`), a promising
candidate inside the margin is re-run and judged on its mean, and, within the margin, a shorter train.py wins.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# two-sided 95% Student t quantiles by degrees of freedom; 1.96 beyond
_T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t_factor(dof: int) -> float:
    """How much wider than the normal 1.96 an interval must be when σ rests on `dof` degrees of freedom."""
    for k in sorted(_T975):
        if dof <= k:
            return _T975[k] / 1.96
    return 1.0


@dataclass
class Sigma:
    value: float | None  # pooled standard deviation of val_bpb between runs of the same configuration
    dof: int


def pooled_sigma(groups: list[list[float]]) -> Sigma:
    """σ pooled over groups of repeated measurements of one configuration each."""
    ss = sum(sum((x - statistics.fmean(g)) ** 2 for x in g) for g in groups if len(g) >= 2)
    dof = sum(len(g) - 1 for g in groups if len(g) >= 2)
    return Sigma(math.sqrt(ss / dof) if dof else None, dof)


@dataclass
class Gate:
    mode: str = "noise"  # noise | strict (upstream: keep if lower at all)
    sigmas: float = 2.0
    min_delta: float = 0.0
    max_repeats: int = 3  # runs of one candidate at most, the first included


@dataclass
class Verdict:
    decision: str  # keep | discard | rerun
    margin: float
    delta: float  # best mean - candidate mean (positive: the candidate is better)
    why: str


def significant_lines(source: str) -> int:
    """Lines of code that count for the simplicity criterion: not blank, not comments."""
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def judge(candidate: list[float], best: list[float], sigma: Sigma, gate: Gate, shorter: bool) -> Verdict:
    """Decide on the candidate's runs so far against the best's runs."""
    delta = statistics.fmean(best) - statistics.fmean(candidate)
    if gate.mode == "strict":
        return Verdict("keep" if delta > 0 else "discard", 0.0, delta, "strict: lower is kept")
    if sigma.value is None:
        margin = gate.min_delta
        return Verdict("keep" if delta > margin else "discard", margin, delta, "σ unknown: no repeats yet")
    se = sigma.value * math.sqrt(1 / len(candidate) + 1 / len(best))
    margin = max(gate.min_delta, gate.sigmas * t_factor(sigma.dof) * se)
    if delta > margin:
        return Verdict("keep", margin, delta, "beats the best by more than the margin")
    if abs(delta) <= margin and shorter:
        return Verdict("keep", margin, delta, "simplification: within the margin and shorter")
    if delta > 0 and len(candidate) < gate.max_repeats:
        return Verdict("rerun", margin, delta, "better but inside the margin: run again")
    return Verdict("discard", margin, delta, "not better by more than the margin")
