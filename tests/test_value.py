"""The value rule (`--gate value`, orchestrator/core/value.py) as a decision table, and its behaviour over many
simulated candidates: a clear gain kept on its first run, a clear loser and a no-op dropped at once, a
marginal candidate run again only while another run can change the decision and is worth a new idea's run,
and identical runs never taken for a spread of zero."""

from __future__ import annotations

import random
import statistics

import pytest

from orchestrator.core import value
from orchestrator.core.noise import Gate, judge, parent_first

BASE = [1.000, 1.010, 0.990]  # the best's runs: sd 0.01
OTHERS = [[0.9, 0.91, 0.89], [0.8, 0.81], [0.85, 0.84, 0.86]]  # other configurations, sd about 0.01
SE = 0.0115  # a new idea's standard error on one run against BASE
# a late night: most ideas did nothing or hurt, none was large (the prior learned from them)
LATE = [(d, SE) for d in (-0.03, -0.02, -0.015, -0.01, -0.005, 0.0, 0.0, 0.002, -0.04, 0.004, -0.02, 0.003)]
# an early night: a third of its ideas were large gains, so a run of a new idea is worth a lot
EARLY = [(d, SE) for d in (0.08, 0.06, 0.1, -0.03, -0.02, -0.05, 0.07, -0.01, 0.09)]
SAME = [2.815670] * 3  # three identical runs of the best (a deterministic CPU run at --budget 3)

# a night with some real gains among its ideas
MIXED = [(d, SE) for d in (-0.03, -0.02, 0.0, 0.001, -0.001, 0.02, 0.015, -0.05, 0.0, 0.025, -0.01, 0.0)]

# candidate runs, best runs, others, ideas, gate -> decision, a word of the reason
TABLE = [
    ([0.90], BASE, OTHERS, LATE, {}, "keep", "beats the best"),  # 10 sd better on one run: kept at once
    ([0.90], BASE, OTHERS, [], {}, "keep", "beats the best"),  # ... with no idea judged yet too
    ([0.96], BASE, OTHERS, EARLY, {}, "keep", "beats the best"),  # 4 sd, early (gains that size are common)
    ([1.03], BASE, OTHERS, LATE, {}, "discard", "hopeless"),  # a clear loser: stops at its first run
    ([1.00], BASE, OTHERS, LATE, {}, "discard", "hopeless"),  # no better on its run: stops at once
    ([0.96], BASE, OTHERS, LATE, {}, "rerun", "promising"),  # 4 sd, late (no idea was that good): run again
    ([0.97], BASE, OTHERS, MIXED, {}, "rerun", "promising"),  # 3 sd, some gains among the ideas: run again
    ([0.97], BASE, OTHERS, EARLY, {}, "discard", "worth less than a new idea"),  # early, a new idea is worth more
    ([0.96], BASE, OTHERS, LATE, {"max_repeats": 1}, "discard", "last look"),  # no look left
    ([0.97, 0.975, 0.965, 0.97], BASE, OTHERS, MIXED, {}, "keep", "beats the best"),  # 3 sd on 4 runs
    ([0.999], BASE, OTHERS, LATE, {"mode": "strict"}, "keep", "strict"),
    # identical runs of the best say the spread is small, not zero: one different run is not a keep...
    ([2.786404], SAME, [], [], {}, "rerun", "identical"),
    # ... and its second run, back at the best's value, shows the first was the run's luck
    ([2.786404, 2.815670], SAME, [], [], {}, "discard", "P(no better)"),
]


@pytest.mark.parametrize("candidate,best,others,ideas,gate,decision,why", TABLE)
def test_value_rule_decisions(candidate, best, others, ideas, gate, decision, why):
    verdict = judge(candidate, best, others, Gate(**{"mode": "value", **gate}), False, ideas)
    assert (verdict.decision, why in verdict.why) == (decision, True), verdict
    if "p_worse" in verdict.evidence:  # the evidence a record keeps
        assert {"p_worse", "gain", "run_value", "rerun_value", "se", "look", "ideas"} <= set(verdict.evidence)


def test_a_marginal_candidate_runs_again_only_while_a_run_can_change_the_decision():
    """Once no outcome of the runs left can make it a keep, it stops; while one can, and it is worth a run,
    it goes on."""
    prior = value.fit_prior(LATE, 0.01)
    assert value.gain_after(prior, 0.02, SE, SE / 2)[0] > value.run_value(prior, SE)  # 2 sd: worth another run
    assert value.gain_after(prior, -0.03, SE, SE / 2)[1] < value.HOPELESS  # 3 sd worse: hardly ever a keep
    assert value.gain_after(prior, 0.02, SE, SE) == (0, 0)  # a run that teaches nothing is worth nothing


def test_the_prior_learns_the_session_s_ideas():
    """A session whose ideas were no-ops learns that: a 2 sd result is then more likely luck than in a session
    with real gains among its ideas."""
    noops = [(random.Random(i).gauss(0, SE), SE) for i in range(40)]
    gains = [(d, SE) for d in (0.03, 0.025, 0.04, 0.0, -0.01, 0.035, 0.02, 0.0, 0.03, 0.05)]
    dull = value.belief(value.fit_prior(noops, 0.01), 0.023, SE)
    lively = value.belief(value.fit_prior(gains, 0.01), 0.023, SE)
    assert dull.worse > 2 * lively.worse and lively.mean > dull.mean


def night(effect: float, n: int, seed: int) -> tuple[float, float]:
    """n candidates of one true effect (sd 1) judged one after another as the loop does, the prior learned from
    the session's own earlier candidates: (share kept, runs per candidate)."""
    rng = random.Random(seed)
    ideas: list[tuple[float, float]] = []
    kept, runs = 0, 0
    others = [[rng.gauss(0, 1) for _ in range(3)] for _ in range(5)]
    gate = Gate(mode="value")
    for _ in range(n):
        best = [rng.gauss(0, 1) for _ in range(3)]
        candidate = [rng.gauss(-effect, 1)]
        while True:
            verdict = judge(candidate, best, others, gate, False, ideas)
            if verdict.decision != "rerun":
                break
            if parent_first(candidate, best, others, len(best) - 3):
                best.append(rng.gauss(0, 1))
            else:
                candidate.append(rng.gauss(-effect, 1))
        ideas.append((verdict.delta, verdict.evidence["se"]))
        kept += verdict.decision == "keep"
        runs += len(candidate) + len(best) - 3
    return kept / n, runs / n


def test_no_ops_are_dropped_within_two_runs_and_rarely_kept():
    kept, runs = night(0.0, 120, 1)
    assert kept <= 0.03 and runs <= 2.0, (kept, runs)


def test_clear_gains_are_kept_on_their_first_run():
    rng = random.Random(3)
    best = [rng.gauss(0, 1) for _ in range(3)]
    others = [[rng.gauss(0, 1) for _ in range(3)] for _ in range(5)]
    first = [judge([rng.gauss(-6, 1)], best, others, Gate(mode="value"), False).decision for _ in range(50)]
    assert statistics.mean(d == "keep" for d in first) >= 0.9


def test_under_the_value_rule_the_best_runs_again_as_ideas_are_judged_against_it():
    """The best's mean serves every later comparison: it runs again until it has two fresh runs plus one per
    two ideas judged against it (plan.grows); the noise gate keeps its own rule."""
    from orchestrator.core import plan
    from orchestrator.core.state import replay
    from orchestrator.store.ledger import Evidence, Record

    def rec(n, bpb, decision, group=0, status="discard"):
        return Record(n, status, "", commit=f"c{n}", val_bpb=bpb, group=group, gate=Evidence(decision), device="cpu")

    records = [rec(1, 1.0, "keep", status="keep"), rec(2, 1.01, "repeat", 1), rec(3, 0.99, "repeat", 1)]
    records += [rec(4, 0.9, "keep", status="keep"), rec(5, 0.91, "repeat", 4), rec(6, 0.9, "repeat", 4)]
    value_gate, noise_gate = Gate(mode="value"), Gate(mode="noise")
    assert not plan.grows(replay(records, "c0"), value_gate, "cpu")  # two fresh runs, no idea judged yet
    records.append(rec(7, 0.95, "discard"))
    assert plan.grows(replay(records, "c0"), value_gate, "cpu")  # one idea: 2.5 runs wanted
    assert not plan.grows(replay(records, "c0"), noise_gate, "cpu")
    records.append(rec(8, 0.9, "repeat", 4))
    assert not plan.grows(replay(records, "c0"), value_gate, "cpu")  # three runs
    records += [rec(9, 0.95, "rerun"), rec(10, 0.95, "discard", 9)]  # one idea, whatever its runs
    assert not plan.grows(replay(records, "c0"), value_gate, "cpu")
    records += [rec(n, 0.95, "discard") for n in range(11, 40)]
    records += [rec(n, 0.9, "repeat", 4) for n in range(40, 49)]  # 12 fresh runs: the cap
    assert not plan.grows(replay(records, "c0"), value_gate, "cpu")


def test_a_best_whose_runs_crash_is_not_asked_again_and_again():
    from orchestrator.core import plan
    from orchestrator.core.state import replay
    from orchestrator.store.ledger import Evidence, Record

    def rec(n, bpb, decision, group=0, status="discard"):
        return Record(n, status, "", commit=f"c{n}", val_bpb=bpb, group=group, gate=Evidence(decision), device="cpu")

    records = [rec(1, 1.0, "keep", status="keep"), rec(2, 1.01, "repeat", 1), rec(3, 0.9, "keep", 0, "keep")]
    records += [rec(4, None, "", 3, "crash"), rec(5, None, "", 3, "crash"), rec(6, 0.95, "discard")]
    assert plan.grows(replay(records, "c0"), Gate(mode="value"), "cpu")  # 2 tried, 2.5 wanted: once more
    records.append(rec(7, None, "", 3, "crash"))
    assert not plan.grows(replay(records, "c0"), Gate(mode="value"), "cpu")  # 3 tried: the next idea
