"""The noise-aware keep gate: σ from repeats, margins, re-runs, simplicity, strict mode, and resume."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys

import fakes
import pytest
from conftest import subprocess_env

from orchestrator.core.noise import Gate, Spread, judge, parent_first, reference_spread, significant_lines
from orchestrator.core.state import group_of
from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import Evidence, read_record, read_rows
from orchestrator.store.session import Paths

BASE = [1.000, 1.010, 0.990]  # sd 0.01
TYPICAL = [[0.9, 0.91, 0.89], [0.8, 0.81], [0.85, 0.84, 0.86]]  # other configurations, sd about 0.01
VOLATILE = [[1.10, 0.96, 1.03]]  # one configuration far noisier than the rest (sd 0.07)
# the night, in val_bpb: the baseline, a volatile EMBEDDING_LR candidate, MATRIX_LR and WARMDOWN_RATIO
NIGHT = [[2.1645, 2.1582, 2.1454], [2.1218, 2.0651, 1.9881], [2.134, 2.137, 2.108], [2.051, 2.172, 2.148]]

# candidate runs, best runs, other configurations, gate, shorter -> decision, a word of the reason
TABLE = [
    ([0.90], BASE, TYPICAL, {}, False, "keep", "beats the best"),  # 10 σ better on one run
    ([0.99], BASE, TYPICAL, {}, False, "rerun", "promising"),  # 1 σ better: run again
    ([1.00], BASE, TYPICAL, {}, False, "discard", "hopeless"),  # exactly the best's mean: nothing to gain
    ([1.01], BASE, TYPICAL, {}, False, "discard", "hopeless"),  # worse: stops at its first run
    ([1.002, 0.998], BASE, TYPICAL, {}, False, "discard", "hopeless"),  # t < 0.5 at run 2: stops early
    ([0.99] * 2 + [0.985] * 8, BASE, TYPICAL, {}, False, "discard", "after 10 run(s)"),  # the cap: decided
    ([0.97, 0.975, 0.965, 0.97], BASE, TYPICAL, {}, False, "rerun", "promising"),  # 3 σ, on 4 runs: not yet
    ([0.97, 0.975, 0.965, 0.97, 0.97], BASE, TYPICAL, {}, False, "keep", "beats the best"),  # on 5 runs
    ([1.005], BASE, TYPICAL, {}, True, "keep", "simplification"),  # shorter and within the noise
    ([1.2], BASE, TYPICAL, {}, True, "discard", "hopeless"),  # shorter but far worse
    ([0.999], BASE, TYPICAL, {"mode": "strict"}, False, "keep", "strict"),
    ([0.90], BASE, TYPICAL, {"min_delta": 0.2}, False, "rerun", "promising"),  # the floor holds
    ([0.99], BASE, TYPICAL, {"max_repeats": 1}, False, "discard", "after 1 run"),
    # unequal variances: a volatile candidate's own spread counts for it...
    ([0.93, 1.00, 0.86], BASE, TYPICAL, {}, False, "rerun", "promising"),
    # ...and is not imposed on a stable candidate judged after it (test below): 3 σ better, clearly promising
    ([0.97, 0.972, 0.968], BASE, TYPICAL + VOLATILE, {}, False, "rerun", "promising"),
    ([0.97, 0.972, 0.968, 0.969, 0.971], BASE + [1.0, 1.005], TYPICAL + VOLATILE, {}, False, "keep", "beats"),
    # the night: EMBEDDING_LR's three volatile runs against the baseline's: promising, not kept yet
    ([2.1218, 2.0651, 1.9881], NIGHT[0], NIGHT[2:], {}, False, "rerun", "promising"),
    # early: no other configuration measured yet, the pooled spread of the two
    ([0.95, 0.951], BASE, [], {}, False, "rerun", "promising"),  # t 6.6, but on 3 degrees of freedom
    ([0.95, 0.951, 0.949, 0.95], BASE, [], {}, False, "keep", "beats the best"),
    # identical runs of the best (a deterministic run) say the spread is small, not zero: one different run of a
    # no-op is run again, and its second run, back at the best's value, is no keep
    ([2.786404], [2.815670] * 3, [], {}, False, "rerun", "identical"),
    ([2.786404, 2.815670], [2.815670] * 3, [], {}, False, "rerun", "promising"),
    ([2.786404, 2.815670, 2.815670], [2.815670] * 3, [], {}, False, "discard", "hopeless"),
    ([0.99], [1.0], [], {}, False, "keep", "spread unknown"),  # --baseline-repeats 0: upstream's rule
    ([1.01], [1.0], [], {}, False, "discard", "spread unknown"),
]


@pytest.mark.parametrize("candidate,best,others,gate,shorter,decision,why", TABLE)
def test_gate_decisions(candidate, best, others, gate, shorter, decision, why):
    verdict = judge(candidate, best, others, Gate(**gate), shorter)
    assert (verdict.decision, why in verdict.why) == (decision, True), verdict
    if verdict.evidence.get("test") == "welch-t":  # the evidence a record keeps
        e = verdict.evidence
        assert {"t", "threshold", "dof", "se", "look", "looks", "alpha", "sd", "best_sd", "best_runs"} <= set(e)
        assert e["look"] == len(candidate) and e["best_runs"] == len(best)
        assert verdict.margin == pytest.approx(max(Gate(**gate).min_delta, e["threshold"] * e["se"]))


def test_reference_spread_is_robust_to_one_volatile_configuration():
    calm = reference_spread(TYPICAL + [BASE])
    assert calm.sd == pytest.approx(0.01, rel=0.3) and calm.dof == 8  # alike configurations: worth 8 runs
    mixed = reference_spread(TYPICAL + [BASE] + VOLATILE)
    assert mixed.sd < 1.2 * calm.sd and mixed.dof < calm.dof  # pooled plainly, σ would be 2.7x; worth less
    assert reference_spread([[1.0], [2.0]]) == Spread(None, 0)
    # a stable candidate's margin is the same whether or not a volatile configuration ran before it
    stable = [0.97, 0.972, 0.968]
    with_volatile = judge(stable, BASE, TYPICAL + VOLATILE, Gate(), False)
    without = judge(stable, BASE, TYPICAL, Gate(), False)
    # (its standard error; the threshold also moves with the reference's worth in runs)
    assert with_volatile.evidence["se"] == pytest.approx(without.evidence["se"], rel=0.25)


def test_sequential_gate_keeps_few_no_ops_and_most_real_gains():
    """Simulated candidates with normal noise (σ = 1) against a best of 3 runs, five other configurations
    measured: a change that does nothing is kept at most at the false-keep rate, however many runs it gets;
    a real gain of 3 σ is nearly always kept, with few runs spent on worse candidates."""
    rng = random.Random(7)

    def trial(effect: float) -> tuple[bool, int]:
        best = [rng.gauss(0, 1) for _ in range(3)]
        others = [[rng.gauss(0, 1) for _ in range(rng.choice([2, 3]))] for _ in range(5)]
        candidate = [rng.gauss(-effect, 1)]
        gate = Gate()
        while True:
            verdict = judge(candidate, best, others, gate, False)
            if verdict.decision != "rerun":
                return verdict.decision == "keep", len(candidate) + len(best) - 3
            if parent_first(candidate, best, others, len(best) - 3):
                best.append(rng.gauss(0, 1))
            else:
                candidate.append(rng.gauss(-effect, 1))

    null = [trial(0.0) for _ in range(1500)]
    assert sum(k for k, _ in null) / len(null) <= Gate().alpha + 0.01
    gains = [trial(3.0) for _ in range(300)]
    assert sum(k for k, _ in gains) / len(gains) >= 0.85
    worse = [trial(-1.0) for _ in range(300)]
    assert sum(k for k, _ in worse) <= 3 and statistics.fmean(r for _, r in worse) < 1.5


def test_parent_first_balances_the_runs():
    assert parent_first([0.99, 0.98, 0.985], [1.0], TYPICAL)  # the best's one run is the weak side
    assert not parent_first([0.99], BASE + [1.0], TYPICAL)  # the candidate's is
    assert not parent_first([0.99], [1.0] * 12, TYPICAL)  # never beyond PARENT_RUNS
    # nor beyond COMPARISON_RUNS for one candidate, however much the best's runs scatter
    assert parent_first([0.99, 0.98, 0.985], [1.0, 1.05, 0.95], TYPICAL, asked=2)
    assert not parent_first([0.99, 0.98, 0.985], [1.0, 1.05, 0.95], TYPICAL, asked=3)
    assert significant_lines("a = 1\n\n# comment\n  # indented comment\nb = 2\n") == 2


VALUES = [
    1.000,
    1.010,
    0.990,  # baseline and two repeats: σ = 0.01
    0.995,
    0.990,
    0.985,  # A: better but inside the margin, three runs, then discarded
    0.700,  # B: far better, kept at once
    0.702,  # a fresh run of B before it is compared with (its keep's run is selected)
    0.705,  # C: within the margin but shorter: kept as a simplification
    0.704,  # a fresh run of C
    0.750,
]  # D: worse


def counted(values_path, counter_path, extra: str = "") -> str:
    """A fake train.py printing the next value of a list (a stand-in for noisy training)."""
    return (
        f"""import json, os
UNUSED = 1
{extra}
values = json.load(open({str(values_path)!r}))
counter = {str(counter_path)!r}
k = int(open(counter).read()) if os.path.exists(counter) else 0
open(counter, "w").write(str(k + 1))
BPB = values[k]
"""
        + fakes.SUMMARY
    )


@pytest.fixture
def gate_repo(fake_repo, tmp_path, monkeypatch):
    values, counter = tmp_path / "values.json", tmp_path / "counter"
    values.write_text(json.dumps(VALUES))
    repo = fake_repo(counted(values, counter))
    base = counted(values, counter)
    plan = [  # four programs (a comment alone would make one idea of them all: proposers/memory.py)
        {"description": "A", "train": counted(values, counter, "IDEA = 'A'")},
        {"description": "B", "train": counted(values, counter, "IDEA = 'B'")},
        {"description": "C", "train": counted(values, counter, "IDEA = 'B'").replace("UNUSED = 1\n", "")},
        {"description": "D", "train": counted(values, counter, "IDEA = 'D'")},
    ]
    assert significant_lines(plan[2]["train"]) < significant_lines(plan[1]["train"]) == significant_lines(base) + 1
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(fakes.write_plan(tmp_path / "plan.json", plan)))
    return repo


def run(repo, **kw):
    base = dict(repo=repo, tag="g", budget=1.0, timeout=20.0, proposer="fakes:Scripted", gate=Gate(max_repeats=3))
    return run_loop(Settings(**{**base, **kw}), echo=lambda line: None)


EXPECTED = [
    ("baseline", "keep"),
    ("baseline (repeat 2/3)", "discard"),
    ("baseline (repeat 3/3)", "discard"),
    ("A", "discard"),
    ("A (repeat 2/3)", "discard"),
    ("A (repeat 3/3)", "discard"),
    ("B", "keep"),
    ("parent (repeat: a fresh run of the new best)", "discard"),
    ("C", "keep"),
    ("parent (repeat: a fresh run of the new best)", "discard"),
    ("D", "discard"),
]


def test_noise_gate_end_to_end(gate_repo):
    state = run(gate_repo)
    rows = read_rows(gate_repo / "results.tsv")
    assert [
        (r.description.split(" [")[0].split(" (mean")[0].split(" (1 run")[0].split(" (simpl")[0], r.status)
        for r in rows
    ] == EXPECTED
    assert "inside the margin" in rows[3].description and "running again" in rows[3].description
    assert "(mean of 3 runs, margin " in rows[5].description and abs(rows[5].val_bpb - 0.99) < 1e-9
    assert "B (1 run, margin " in rows[6].description
    assert "C (simplification, 1 run, margin " in rows[8].description
    records = [read_record(Paths(gate_repo, "g").run_dir(n)) for n in range(1, 12)]
    assert [r.gate.decision for r in records[3:6]] == ["rerun", "rerun", "discard"]
    assert records[5].gate.runs == 3 and records[5].gate.margin > 0 and records[5].gate.stats["sd"] > 0
    assert {r.group for r in records[3:6]} == {4}
    # record.json keeps the gate's evidence as one flat object (the test's figures beside the decision), and it
    # reads back as the same typed evidence
    raw = json.loads((Paths(gate_repo, "g").run_dir(6) / "record.json").read_text())["gate"]
    assert raw["decision"] == "discard" and raw["runs"] == 3 and raw["test"] == "welch-t" and raw["sd"] > 0
    assert "stats" not in raw and "selection" not in raw and Evidence.from_dict(raw) == records[5].gate
    assert state.best_bpb == 0.704 and abs(state.baseline_bpb - 1.0) < 1e-9
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "status", "--repo", str(gate_repo)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
    ).stdout
    assert "noise: typical σ = 0.0" in out


def test_resume_in_the_middle_of_repeats(gate_repo):
    run(gate_repo, max_experiments=5)  # stops after A's second run, undecided
    run(gate_repo, max_experiments=11)
    rows = read_rows(gate_repo / "results.tsv")
    assert [r.status for r in rows] == [s for _, s in EXPECTED]
    assert rows[5].description.startswith("A (repeat 3/3) (mean of 3 runs")


def test_strict_gate_keeps_any_lower_value(gate_repo):
    run(gate_repo, gate=Gate(mode="strict"), baseline_repeats=0)
    rows = read_rows(gate_repo / "results.tsv")
    # strict: 1.000 then 1.010 (A: worse), 0.990 (B: kept), 0.995 (C), 0.990 (D: not lower)
    assert [r.status for r in rows] == ["keep", "discard", "keep", "discard", "discard"]


def drifting(counter, depth: int) -> str:
    """A fake train.py on a machine that slows down from its 5th run on (val_bpb +0.003 per run, as a time budget
    turns lost steps into loss), whose DEPTH 2 scored lucky on its first run: the night of issue #32."""
    return (
        f"""import os
DEPTH = {depth}  # [1, 8]
p = {str(counter)!r}
k = int(open(p).read()) if os.path.exists(p) else 0
open(p, "w").write(str(k + 1))
BPB = {{4: 1.530, 2: 1.490, 1: 1.450}}[DEPTH] + 0.003 * max(0, k - 3) + 0.0005 * (-1) ** k
if DEPTH == 2 and not os.path.exists(p + ".lucky"):
    open(p + ".lucky", "w").write("")
    BPB = 1.440
"""
        + fakes.SUMMARY
    )


def test_a_promising_candidate_after_a_one_run_keep_on_a_drifting_machine_is_decided_in_four_runs(
    fake_repo, plan, tmp_path
):
    """The night of issue #32: a change kept on one lucky run, then a promising candidate, on a machine slowing
    down. Then, the best (compared by the mean of the runs that kept it) was run 11 times in a row for one
    comparison, its drift counted as noise. Now the new best is measured afresh before it is compared with, its
    runs alternate with the candidate's (close in time: the drift hits both alike) and one comparison asks for
    at most 3 of them: the candidate is decided within 4 runs of its first."""
    counter = tmp_path / "runs"
    repo = fake_repo(drifting(counter, 4))
    plan(
        [{"description": "DEPTH 4 -> 2", "train": drifting(counter, 2)}]
        + [{"description": "DEPTH 2 -> 1", "train": drifting(counter, 1)}] * 3
    )
    run(repo, gate=Gate(), max_experiments=12)
    rows = read_rows(repo / "results.tsv")
    records = [read_record(Paths(repo, "g").run_dir(n)) for n in range(1, len(rows) + 1)]
    kept = [r for r in records if r.status == "keep"]
    assert kept[1].description == "DEPTH 4 -> 2" and kept[1].gate.runs == 1, rows  # kept on its one lucky run
    first = next(r for r in records if r.description == "DEPTH 2 -> 1")
    decided = next(r for r in records if group_of(r) == first.n and r.gate.decision in ("keep", "discard"))
    assert decided.status == "keep" and decided.n - first.n + 1 <= 4, [
        (r.n, r.description, r.gate.note) for r in records
    ]
    parents = [r for r in records if first.n < r.n < decided.n and group_of(r) == kept[1].n]
    assert 1 <= len(parents) <= 3
    between = [group_of(r) for r in records if first.n <= r.n <= decided.n]
    assert all(a != b for a, b in zip(between, between[1:]))  # the best's runs and the candidate's alternate
    fresh = records[kept[1].n]  # the run after the keep: the new best again, before any candidate
    assert group_of(fresh) == kept[1].n and fresh.info.get("repeat") == "a fresh run of the new best"


def by_config(tmp_path, name: str) -> str:
    """A fake train.py printing its configuration's next value (values.json: {name: [values]})."""
    return (
        f"""import json, os
NAME = {name!r}
values = json.load(open({str(tmp_path / "values.json")!r}))[NAME]
counter = {str(tmp_path / "counter-")!r} + NAME
k = int(open(counter).read()) if os.path.exists(counter) else 0
open(counter, "w").write(str(k + 1))
BPB = values[min(k, len(values) - 1)]
"""
        + fakes.SUMMARY
    )


def test_one_comparison_runs_the_best_at_most_three_times(fake_repo, plan, tmp_path):
    """A candidate that stays promising for many looks while the best's runs scatter (parent_first would ask
    for the best again and again): the best runs at most COMPARISON_RUNS = 3 times for it."""
    best = [1.000, 1.001, 0.999] + [1.03, 0.97] * 6
    candidate = [0.98, 0.975, 0.985] * 3 + [0.98]  # 2 units ahead of a best that scatters by 3 after its first runs
    (tmp_path / "values.json").write_text(json.dumps({"best": best, "A": candidate}))
    repo = fake_repo(by_config(tmp_path, "best"))
    plan([{"description": "A", "train": by_config(tmp_path, "A")}])
    run(repo, gate=Gate(), max_experiments=20)
    records = [read_record(Paths(repo, "g").run_dir(n)) for n in range(1, len(read_rows(repo / "results.tsv")) + 1)]
    trace = [(r.n, r.description, r.val_bpb, r.gate.decision) for r in records]
    decided = next((r for r in records if r.group == 4 and r.gate.decision in ("keep", "discard")), records[-1])
    parents = [r for r in records if 4 < r.n <= decided.n and group_of(r) == 1]
    assert len(parents) == 3, trace
    assert decided.gate.runs >= 5, trace  # the comparison went on past the best's third run: the cap decided
