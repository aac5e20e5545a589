"""The noise-aware keep gate: σ from repeats, margins, re-runs, simplicity, strict mode, and resume."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import fakes
from conftest import subprocess_env
from orchestrator.ledger import read_record, read_rows
from orchestrator.loop import Settings, run_loop
from orchestrator.noise import Gate, Sigma, judge, pooled_sigma, significant_lines, t_factor
from orchestrator.session import Paths


def test_pooled_sigma_and_t_factor():
    s = pooled_sigma([[1.0, 1.02, 0.98], [0.5], [0.7, 0.72]])
    assert s.dof == 3 and abs(s.value - ((0.0008 + 0.0002) / 3) ** 0.5) < 1e-12
    assert pooled_sigma([[1.0], [2.0]]) == Sigma(None, 0)
    assert t_factor(2) > t_factor(10) > t_factor(100) == 1.0


def test_judge_rules():
    sigma, gate = Sigma(0.01, 30), Gate()
    assert judge([0.90], [1.0, 1.0, 1.0], sigma, gate, False).decision == "keep"
    assert judge([0.995], [1.0, 1.0, 1.0], sigma, gate, False).decision == "rerun"
    assert judge([0.995, 0.995, 0.995], [1.0, 1.0, 1.0], sigma, gate, False).decision == "discard"
    assert judge([1.01], [1.0, 1.0, 1.0], sigma, gate, False).decision == "discard"
    assert judge([1.005], [1.0, 1.0, 1.0], sigma, gate, shorter=True).decision == "keep"  # simplification
    assert judge([1.2], [1.0], sigma, gate, shorter=True).decision == "discard"  # too much worse
    assert judge([0.999], [1.0], sigma, Gate(mode="strict"), False).decision == "keep"
    assert judge([0.98], [1.0], sigma, Gate(min_delta=0.05), False).decision == "rerun"  # the floor holds
    assert significant_lines("a = 1\n\n# comment\n  # indented comment\nb = 2\n") == 2


VALUES = [1.000, 1.010, 0.990,   # baseline and two repeats: σ = 0.01
          0.995, 0.990, 0.985,   # A: better but inside the margin, three runs, then discarded
          0.700,                 # B: far better, kept at once
          0.705,                 # C: within the margin but shorter: kept as a simplification
          0.750]                 # D: worse


def counted(values_path, counter_path, extra: str = "") -> str:
    """A fake train.py printing the next value of a list (a stand-in for noisy training)."""
    return f'''import json, os
UNUSED = 1
{extra}
values = json.load(open({str(values_path)!r}))
counter = {str(counter_path)!r}
k = int(open(counter).read()) if os.path.exists(counter) else 0
open(counter, "w").write(str(k + 1))
BPB = values[k]
''' + fakes.SUMMARY


@pytest.fixture
def gate_repo(fake_repo, tmp_path, monkeypatch):
    values, counter = tmp_path / "values.json", tmp_path / "counter"
    values.write_text(json.dumps(VALUES))
    repo = fake_repo(counted(values, counter))
    base = counted(values, counter)
    plan = [{"description": "A", "train": counted(values, counter, "# A")},
            {"description": "B", "train": counted(values, counter, "# B")},
            {"description": "C", "train": counted(values, counter, "# B").replace("UNUSED = 1\n", "")},
            {"description": "D", "train": counted(values, counter, "# D")}]
    assert significant_lines(plan[2]["train"]) < significant_lines(base)
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(fakes.write_plan(tmp_path / "plan.json", plan)))
    return repo


def run(repo, **kw):
    base = dict(repo=repo, tag="g", budget=1.0, timeout=20.0, proposer="fakes:Scripted")
    return run_loop(Settings(**{**base, **kw}), echo=lambda line: None)


EXPECTED = [("baseline", "keep"), ("baseline (repeat 2/3)", "discard"), ("baseline (repeat 3/3)", "discard"),
            ("A", "discard"), ("A (repeat 2/3)", "discard"), ("A (repeat 3/3)", "discard"), ("B", "keep"),
            ("C", "keep"), ("D", "discard")]


def test_noise_gate_end_to_end(gate_repo):
    state = run(gate_repo)
    rows = read_rows(gate_repo / "results.tsv")
    assert [(r.description.split(" [")[0].split(" (mean")[0].split(" (1 run")[0].split(" (simpl")[0], r.status)
            for r in rows] == EXPECTED
    assert "inside the margin" in rows[3].description and "running again" in rows[3].description
    assert "(mean of 3 runs, margin " in rows[5].description and abs(rows[5].val_bpb - 0.99) < 1e-9
    assert "B (1 run, margin " in rows[6].description
    assert "C (simplification, 1 run, margin " in rows[7].description
    records = [read_record(Paths(gate_repo, "g").run_dir(n)) for n in range(1, 10)]
    assert [r.gate["decision"] for r in records[3:6]] == ["rerun", "rerun", "discard"]
    assert records[5].gate["runs"] == 3 and records[5].gate["margin"] > 0 and records[5].gate["sigma"] > 0
    assert {r.group for r in records[3:6]} == {4}
    assert state.best_bpb == 0.705 and abs(state.baseline_bpb - 1.0) < 1e-9
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "--repo", str(gate_repo)],
                         capture_output=True, text=True, env=subprocess_env()).stdout
    assert "noise: σ = 0.0" in out


def test_resume_in_the_middle_of_repeats(gate_repo):
    run(gate_repo, max_experiments=5)  # stops after A's second run, undecided
    run(gate_repo, max_experiments=9)
    rows = read_rows(gate_repo / "results.tsv")
    assert [r.status for r in rows] == [s for _, s in EXPECTED]
    assert rows[5].description.startswith("A (repeat 3/3) (mean of 3 runs")


def test_strict_gate_keeps_any_lower_value(gate_repo):
    run(gate_repo, gate=Gate(mode="strict"), baseline_repeats=0)
    rows = read_rows(gate_repo / "results.tsv")
    # strict: 1.000 then 1.010 (A: worse), 0.990 (B: kept), 0.995 (C), 0.990 (D: not lower)
    assert [r.status for r in rows] == ["keep", "discard", "keep", "discard", "discard"]


def test_the_margin_is_pinned():
    """2 standard errors of the difference, widened by the Student-t factor while σ rests on few runs."""
    import math

    from orchestrator.noise import Gate, Sigma, judge

    best = [1.000, 1.010, 0.990]
    few = judge([0.95], best, Sigma(0.01, 2), Gate(), shorter=False)
    assert few.margin == pytest.approx(2 * (4.303 / 1.96) * 0.01 * math.sqrt(1 + 1 / 3))  # 0.0507
    assert few.decision == "rerun" and few.delta == pytest.approx(0.05)
    many = judge([0.95], best, Sigma(0.01, 40), Gate(), shorter=False)
    assert many.margin == pytest.approx(2 * 0.01 * math.sqrt(1 + 1 / 3)) and many.decision == "keep"
    floor = judge([0.95], best, Sigma(0.0001, 40), Gate(min_delta=0.06), shorter=False)
    assert floor.margin == 0.06 and floor.decision == "rerun"
    assert judge([0.95, 0.95, 0.95], best, Sigma(0.01, 2), Gate(), shorter=False).decision == "keep"
    assert judge([1.005], best, Sigma(0.01, 2), Gate(), shorter=True).why.startswith("simplification")
