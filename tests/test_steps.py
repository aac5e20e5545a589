"""Values adjusted for the steps a run reached (core/steps.py): the slope, and the judge comparing adjusted values
on a CPU-like session where val_bpb is a line in the steps the machine allowed."""

from __future__ import annotations

import pytest

from orchestrator.core import steps
from orchestrator.core.judge import Finished, decide
from orchestrator.core.noise import Gate
from orchestrator.core.state import Kind, replay
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


def candidate(n: int, bpb: float, made: int) -> Finished:
    return Finished(record(n, bpb, made, decision=""), Kind.CANDIDATE)


def test_fit_finds_the_slope_within_configurations_and_nothing_where_steps_explain_nothing():
    groups = [[(float(r.metrics["num_steps"]), r.bpb) for r in SESSION if (r.group or r.n) == g] for g in (1, 5)]
    fit = steps.fit(groups, 102.5)
    assert fit is not None and fit.slope == pytest.approx(SLOPE, rel=0.05) and fit.dof == 4
    assert 0.03 < fit.scatter < 0.07  # the machine's scatter of steps, a share of the mean
    assert steps.moved(fit, [110]) and not steps.moved(fit, [150])  # 150 steps: faster beyond the machine's noise
    assert steps.adjust(fit, 110, 1.9) == pytest.approx(1.9 - fit.slope * (110 - 102.5))
    assert steps.fit([[(100.0, 2.0), (100.0, 2.1), (100.0, 1.9)], [(100.0, 2.0), (100.0, 2.0)]], 100) is None
    noise = [[(95.0, 2.0), (100.0, 2.05), (105.0, 1.96), (110.0, 2.04)], [(98.0, 2.1), (102.0, 2.0), (106.0, 2.1)]]
    assert steps.fit(noise, 100) is None  # the slope is not clear of zero
    assert steps.fit(groups[:1], 102.5) is None  # 2 residual degrees of freedom: too few


def judged(mode: str, adjust: bool, run: Finished):
    state = replay(list(SESSION), "c0")
    state.adjust_steps = adjust
    return decide(state, [run], Gate(mode))[0]


@pytest.mark.parametrize("mode", ["noise", "value"])
def test_a_gain_measured_on_a_slow_run_is_kept_once_steps_are_accounted_for(mode):
    # truly 0.03 better at equal steps, on a run the machine slowed to 95 steps: as measured it is worse than
    # the best's mean (2.02 against 1.975); moved to the best's 102.5 steps it is 1.945, clearly better
    slow = candidate(8, line(2.0, 95) - 0.03, 95)
    kept = judged(mode, True, slow)
    assert str(kept.gate.decision) == "keep", kept.gate.why
    assert kept.gate.stats["steps_slope"] == pytest.approx(SLOPE, rel=0.05)
    assert kept.gate.mean == pytest.approx(1.945, abs=1e-3) and kept.gate.best_mean == pytest.approx(1.975, abs=1e-3)
    assert str(judged(mode, False, slow).gate.decision) == "discard"  # as measured, the machine's noise hides it


def test_a_run_lucky_in_steps_is_not_a_gain_and_a_faster_edit_keeps_its_credit():
    lucky = candidate(8, line(2.0, 112), 112)  # the best's own configuration's value at 112 steps: a no-op
    assert str(judged("noise", True, lucky).gate.decision) == "discard"
    # 150 steps is beyond the machine's scatter: the edit made training faster, and its value stands as measured
    faster = judged("noise", True, candidate(8, line(2.0, 150), 150))
    assert str(faster.gate.decision) == "keep" and "steps_slope" not in faster.gate.stats
    assert faster.gate.mean == pytest.approx(line(2.0, 150))


def test_upstream_rule_compares_values_as_measured():
    # the workspace sets adjust_steps only for the noise and value gates; strict compares with the kept run
    lucky = candidate(8, line(2.0, 112), 112)
    assert str(judged("strict", False, lucky).gate.decision) == "keep"
