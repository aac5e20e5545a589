"""Values adjusted for the steps a run reached (core/steps.py, measured by benchmarks/noise_spread.py; not used by
the gate: docs/trust.md, "Values at the same step count")."""

from __future__ import annotations

import pytest

from orchestrator.core import steps
from orchestrator.store.ledger import Evidence, Record

SLOPE = -0.01  # val_bpb per step


def record(n: int, bpb: float, made: int, group: int = 0, decision: str = "repeat") -> Record:
    return Record(
        n=n,
        status="keep" if decision == "keep" else "discard",
        description=f"run {n}",
        commit=f"c{group or n}",
        val_bpb=bpb,
        gate=Evidence(decision, runs=1),
        device="cpu",
        group=group,
        metrics={"num_steps": made, "total_tokens_M": float(made), "training_seconds": 10.0, "num_params_M": 1.0},
    )


def line(level: float, made: int, wobble: float = 0.0) -> float:
    return level + SLOPE * (made - 100) + wobble


# the baseline, run 4 times on a machine whose speed varies; another configuration run 3 times
SESSION = [
    record(1, line(2.0, 95), 95, decision="keep"),
    record(2, line(2.0, 100, 0.0004), 100, group=1),
    record(3, line(2.0, 105, -0.0003), 105, group=1),
    record(4, line(2.0, 110), 110, group=1),
    record(5, line(2.1, 98), 98, decision="discard"),
    record(6, line(2.1, 102, 0.0002), 102, group=5),
    record(7, line(2.1, 106, -0.0004), 106, group=5),
]


def test_fit_finds_the_slope_within_configurations_and_nothing_where_steps_explain_nothing():
    groups = [[(float(r.metrics["num_steps"]), r.bpb) for r in SESSION if (r.group or r.n) == g] for g in (1, 5)]
    fit = steps.fit(groups, 102.5)
    assert fit is not None and fit.slope == pytest.approx(SLOPE, rel=0.05) and fit.dof == 4
    assert 0.03 < fit.scatter < 0.07  # the machine's scatter of steps, a share of the mean
    assert steps.adjust(fit, 110, 1.9) == pytest.approx(1.9 - fit.slope * (110 - 102.5))
    assert steps.fit([[(100.0, 2.0), (100.0, 2.1), (100.0, 1.9)], [(100.0, 2.0), (100.0, 2.0)]], 100) is None
    noise = [[(95.0, 2.0), (100.0, 2.05), (105.0, 1.96), (110.0, 2.04)], [(98.0, 2.1), (102.0, 2.0), (106.0, 2.1)]]
    assert steps.fit(noise, 100) is None  # the slope is not clear of zero
    assert steps.fit(groups[:1], 102.5) is None  # 2 residual degrees of freedom: too few
