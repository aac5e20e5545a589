"""`autoloop verify`: leave-one-out ablation of a real session's kept stack (a fake train.py with additive effects:
two changes that matter, one that does nothing), the minimal stack and its branch, the transfer to a longer
budget, an entangled revert, Ctrl-C and resume, and the result where users look (report, status, trackers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fakes
import git
import psutil
import pytest
from conftest import cli, subprocess_env

from orchestrator import LoopError
from orchestrator.core.noise import Gate
from orchestrator.core.verify import compare, transfer_verdict
from orchestrator.loop import Settings, pinned_fields, run_loop, verify_session
from orchestrator.store.ledger import read_record
from orchestrator.store.session import Paths
from orchestrator.trackers.base import Backend, session_totals


def quiet(_line: str) -> None:
    pass


def settings(repo: Path, **kw) -> Settings:
    base = dict(
        repo=repo, tag="v", tag_given=True, budget=1.0, timeout=30.0, proposer="fakes:Scripted", baseline_repeats=0
    )
    base.update(kw)
    return Settings(**base)


def session(fake_repo, plan, tmp_path, steps) -> Path:
    """A strict-gate session (upstream's rule: every lower run kept) of `steps`, each a dict of A, B, C."""
    counter = tmp_path / "counter"
    repo = fake_repo(fakes.additive(counter))
    plan([{"description": d, "train": fakes.additive(counter, **values)} for d, values in steps])
    state = run_loop(settings(repo, gate=Gate(mode="strict")), echo=quiet)
    assert state.done == len(steps) + 1
    return repo


STACK = [("A off", {"a": 0}), ("B off (does nothing)", {"a": 0, "b": 0}), ("C off", {"a": 0, "b": 0, "c": 0})]


def test_ablation_flags_the_no_op_keeps_what_matters_and_finds_the_transfer_reverses(
    fake_repo, plan, tmp_path, monkeypatch
):
    repo = session(fake_repo, plan, tmp_path, STACK)
    paths = Paths(repo, "v")
    assert [r.split("\t")[4] for r in paths.ledger.read_text().splitlines()[1:]] == ["keep"] * 4  # B kept by luck
    monkeypatch.setattr(Recorder, "totals", {})
    lines: list[str] = []
    result = verify_session(settings(repo, trackers=(f"{__name__}:Recorder",)), echo=lines.append)

    verdicts = {c["description"]: c["verdict"] for c in result["changes"]}
    assert verdicts == {"A off": "matters", "B off (does nothing)": "no measurable contribution", "C off": "matters"}
    by = {c["description"]: c for c in result["changes"]}
    assert by["A off"]["contribution"] == pytest.approx(0.3, abs=0.02)
    assert by["C off"]["contribution"] == pytest.approx(0.2, abs=0.02)
    assert abs(by["B off (does nothing)"]["contribution"]) < 3 * by["B off (does nothing)"]["se"]
    assert by["B off (does nothing)"]["runs"] >= 3  # flagged only after MIN_LOOKS runs

    # the minimal stack drops B only: the branch holds the best's train.py with B back as it was
    b = by["B off (does nothing)"]["n"]
    assert result["minimal"]["dropped"] == [b] and result["minimal"]["branch"] == "autoloop/v-minimal"
    user = git.Repo(repo)
    minimal = user.git.show("autoloop/v-minimal:train.py")
    assert "A = 0\nB = 1\nC = 0\n" in minimal
    assert user.git.show("autoloop/v:train.py").replace("B = 0", "B = 1") == minimal

    # transfer at 3x: at 1 s the stack gains 0.5; at 3 s it loses 0.5
    transfer = result["transfer"]
    assert transfer["metric"] == "val_bpb" and [row["budget"] for row in transfer["rows"]] == [1.0, 3.0]
    assert transfer["rows"][0]["best"]["improvement"] == pytest.approx(0.5, abs=0.02)
    assert transfer["rows"][1]["best"]["improvement"] == pytest.approx(-0.5, abs=0.02)
    assert transfer["verdicts"] == {"best": "reverses", "minimal": "reverses"}
    budgets = {read_record(d).info["budget"] for d in (paths.verify / "runs").iterdir()}
    assert budgets == {1.0, 3.0}

    # where users look: verify.json, results.tsv untouched, report, status, trackers, results --verify
    assert json.loads(paths.verify_json.read_text()) == json.loads(json.dumps(result))
    assert len(paths.ledger.read_text().splitlines()) == 5  # verify's runs are not rows
    assert any("verify: minimal stack: not worse" in line for line in lines), lines
    status = json.loads(cli("status", "--repo", str(repo), "--json").stdout)["verify"]
    assert status["complete"] and status["minimal_branch"] == "autoloop/v-minimal"
    assert status["changes"][f"#{b}"] == "no measurable contribution"
    assert status["transfer"] == {"best": "reverses", "minimal": "reverses"}
    assert "verify: complete" in cli("status", "--repo", str(repo)).stdout
    out = cli("report", "--repo", str(repo), "--out", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "r" / "report.md").read_text()
    assert "## Verification" in report and "| 3s |" in report and "no measurable contribution" in report
    assert "Verdict: the best reverses" in report
    listed = cli("results", "--repo", str(repo), "--verify").stdout
    assert "verify: the best at 3s" in listed and "verify: without #" in listed
    assert Recorder.totals["verify_no_contribution"] == f"#{b}"
    assert Recorder.totals["verify_minimal_branch"] == "autoloop/v-minimal"
    assert Recorder.totals["verify_transfer_best"] == "reverses"


class Recorder(Backend):
    """A tracker that keeps the parent run's totals it was closed with."""

    totals: dict = {}

    def close(self, state, stop, files) -> None:
        type(self).totals = {**session_totals(self.ws, state), "stop": stop}


def test_an_entangled_revert_is_ablated_with_the_change_it_conflicts_with(fake_repo, plan, tmp_path):
    counter = tmp_path / "counter"
    repo = fake_repo(fakes.additive(counter, a=2))  # A's line is edited twice: 2 -> 1 -> 0
    plan(
        [
            {"description": "A 2 -> 1", "train": fakes.additive(counter, a=1)},
            {"description": "A 1 -> 0", "train": fakes.additive(counter, a=0)},
        ]
    )
    run_loop(settings(repo, gate=Gate(mode="strict")), echo=quiet)
    lines: list[str] = []
    result = verify_session(settings(repo, transfer=0.0), echo=lines.append)
    first, second = result["changes"]
    assert first["note"] == f"entangled with #{second['n']}: ablated together", result
    assert first["removed_with"] == [second["n"]] and first["verdict"] == "matters"  # A back to 2: +0.6
    assert first["contribution"] == pytest.approx(0.6, abs=0.02)
    assert any(f"#{first['n']}: entangled with #{second['n']}" in line for line in lines), lines
    assert result["transfer"] is None and result["minimal"]["verdict"] == "nothing to drop"


@pytest.mark.slow
def test_ctrl_c_during_verify_then_the_same_command_resumes_without_repeating_runs(fake_repo, plan, tmp_path):
    counter = tmp_path / "counter"
    repo = fake_repo(fakes.additive(counter, sleep=0.4))
    plan([{"description": d, "train": fakes.additive(counter, sleep=0.4, **v)} for d, v in STACK])
    run_loop(settings(repo, gate=Gate(mode="strict")), echo=quiet)
    paths = Paths(repo, "v")
    command = [sys.executable, "-m", "orchestrator.cli", "verify", "--repo", str(repo), "--timeout", "30"]
    env = subprocess_env()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = paths.verify / "runs"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(runs.glob("*/record.json"))) < 3:
        time.sleep(0.05)
    time.sleep(0.2)  # inside the next run
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "verify interrupted; its finished runs are kept: the same command resumes it" in out
    assert "Traceback" not in out
    alive = [p for p in psutil.process_iter(["cmdline"]) if "train.py" in " ".join(p.info["cmdline"] or [])]
    assert not [p for p in alive if p.cwd().startswith(str(repo))], alive
    before = {int(d.name): read_record(d) for d in runs.iterdir() if read_record(d) is not None}
    assert len(before) >= 3

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{len(before)} run(s) done" in again.stdout
    after = {int(d.name): read_record(d) for d in runs.iterdir()}
    assert all(after[n].ended == r.ended and after[n].val_bpb == r.val_bpb for n, r in before.items())
    assert sorted(after) == list(range(1, len(after) + 1))  # the cut-short run's number is used again
    first_new = min(n for n in after if n not in before)
    assert f"verify {first_new:>3}" in again.stdout and f"verify {first_new - 1:>3}" not in again.stdout
    assert json.loads(paths.verify_json.read_text())["complete"]


def test_nothing_to_verify_and_no_session_are_clear_errors(fake_repo, plan, tmp_path):
    counter = tmp_path / "counter"
    repo = fake_repo(fakes.additive(counter))
    out = cli("verify", "--repo", str(repo))
    assert out.returncode == 1 and "no autoloop session in" in out.stderr and "Traceback" not in out.stderr
    plan([{"description": "worse", "train": fakes.additive(counter, a=2)}])
    run_loop(settings(repo, gate=Gate(mode="strict")), echo=quiet)
    with pytest.raises(LoopError, match="kept nothing beyond its baseline: there is nothing to verify"):
        verify_session(settings(repo), echo=quiet)
    out = cli("verify", "--repo", str(repo), "--transfer", "0.5x")
    assert out.returncode == 2 and "longer than the session's" in out.stderr
    out = cli("verify", "--repo", str(repo), "--transfer", "abc")
    assert out.returncode == 2 and "is not a multiple of the budget" in out.stderr


def test_compare_decides_on_the_gate_test_and_flags_only_after_min_looks():
    gate = Gate()
    others = [[1.0, 1.01, 0.99], [2.0, 2.01, 1.99]]  # sd 0.01
    best = [1.0, 1.01, 0.99]
    assert compare([1.1], best, others, gate).decision == "undecided"  # 10 sd worse, but one run: its own spread?
    assert compare([1.1, 1.11], best, others, gate).decision == "matters"
    assert compare([1.1, 1.11], best[:1], others, gate).decision == "undecided"  # the best's own spread too
    assert compare([0.995], best, others, gate).decision == "undecided"  # look 1: never flagged yet
    assert compare([0.995, 1.005], best, others, gate).decision == "undecided"
    assert compare([0.995, 1.005, 1.0], best, others, gate).decision == "none"
    assert compare([1.01] * 10, best, others, gate).decision in ("none", "matters")  # the last look decides
    assert compare([], best, others, gate).decision == "undecided"


def test_transfer_verdicts():
    assert transfer_verdict(0.5, 0.01, 0.5, 0.01) == "holds"
    assert transfer_verdict(0.5, 0.01, 0.7, 0.01) == "holds"
    assert transfer_verdict(0.5, 0.01, 0.3, 0.01) == "shrinks"
    assert transfer_verdict(0.5, 0.01, 0.01, 0.01) == "shrinks"  # not clear of noise any more
    assert transfer_verdict(0.5, 0.01, -0.1, 0.01) == "reverses"


def test_verify_takes_the_session_s_pinned_settings():
    pin = {"budget": 5.0, "seed": 7, "profile": "tiny", "gate": "noise alpha 0.02 looks 6 min 0.001 early-stop on"}
    fields = pinned_fields({"pin": pin})
    assert fields["budget"] == 5.0 and fields["seed"] == 7 and fields["profile"] == "tiny"
    assert fields["gate"] == Gate("noise", 0.02, 0.001, 6, "on")
    assert pinned_fields({"pin": {"gate": "strict alpha 0.035 looks 10 min 0"}})["gate"].early_stop == "off"
    assert os.environ.get("AUTOLOOP_SANDBOX") == "off"  # (the suite's runs are unconfined: conftest)


def test_a_verify_run_that_rewrites_an_earlier_verify_record_is_a_crash_and_the_record_is_put_back(
    fake_repo, plan, tmp_path
):
    """Unconfined (the sandbox keeps runs out of .autoloop/ altogether), a run that forges the verification's
    earlier records is caught after it and the record restored, as the session's own records are."""
    counter = tmp_path / "counter"
    forge = (
        "\nfrom pathlib import Path as _P\n_r = _P({r!r})\n"
        "if _r.exists():\n    _r.write_text(_r.read_text().replace('\"val_bpb\": 2', '\"val_bpb\": 0'))\n"
    )
    repo = fake_repo("")
    record = repo / ".autoloop" / "v" / "verify" / "runs" / "1" / "record.json"

    def train(**values) -> str:
        return fakes.additive(counter, **values) + forge.format(r=str(record))

    (repo / "train.py").write_text(train())
    git.Repo(repo).git.commit("-qam", "forging train.py")
    plan([{"description": "A off", "train": train(a=0)}])
    run_loop(settings(repo, gate=Gate(mode="strict")), echo=quiet)
    with pytest.raises(LoopError, match="verification runs crashed"):
        verify_session(settings(repo, max_crashes=3), echo=quiet)
    first = json.loads(record.read_text())
    assert first["val_bpb"] > 1.5  # put back as the controller wrote it
    second = read_record(record.parent.parent / "2")
    assert second.status == "crash" and "touched what it may not (restored)" in second.reason, second.reason


def test_run_verify_verifies_at_the_end_of_the_session(fake_repo, plan, tmp_path):
    counter = tmp_path / "counter"
    repo = fake_repo(fakes.additive(counter))
    plan([{"description": "A off", "train": fakes.additive(counter, a=0)}])
    lines: list[str] = []
    run_loop(settings(repo, gate=Gate(mode="strict"), verify=True, transfer=0.0), echo=lines.append)
    result = json.loads(Paths(repo, "v").verify_json.read_text())
    assert result["complete"] and [c["verdict"] for c in result["changes"]] == ["matters"]
    assert lines.index(next(x for x in lines if x.startswith("autoloop: stopped"))) < lines.index(
        next(x for x in lines if x.startswith("autoloop: verify v:"))
    )


def test_a_decision_is_the_first_look_s_with_that_look_s_figures_and_later_runs_only_add_theirs():
    from orchestrator.core.verify import Verdict, first_decision
    from orchestrator.store.ledger import Record

    def run(n: int, key: str, value: float) -> Record:
        return Record(n=n, status="verify", description="", val_bpb=value, info={"verify": key})

    records = [run(1, "best", 1.0), run(2, "without-2", 1.2), run(3, "best", 1.0), run(4, "without-2", 1.1)]
    records += [run(5, "best", 1.3), run(6, "other", 9.0)]  # the best's later runs, for another comparison

    def verdict_of(recs):  # decided by the look after run 3; undecided again with everything
        decision = "matters" if len(recs) in (3, 4) else "undecided"
        return Verdict(decision, delta=float(len(recs)), se=1.0, runs=len(recs), best_runs=len(recs))

    v = first_decision(records, {"without-2", "best"}, verdict_of)
    assert v.decision == "matters" and v.delta == 3.0  # the decision and the figures of the look that made it
    assert v.latest is not None and v.latest.delta == 6.0  # all six runs' figures beside them
    assert first_decision(records[:3], {"without-2", "best"}, verdict_of).latest is None  # nothing since
    assert first_decision(records, {"without-2", "best"}, lambda recs: Verdict("undecided")).decision == "undecided"
    assert first_decision(records[:2], {"without-2", "best"}, verdict_of).decision == "undecided"


def test_a_verdict_reads_with_its_own_figures_and_names_the_later_ones():
    from orchestrator.core.verify import text
    from orchestrator.views.report import verify_lines

    change = {"n": 2, "description": "x", "contribution": 0.19, "se": 0.05, "runs": 2, "verdict": "matters"}
    change |= {"note": "", "latest": {"contribution": 0.19, "se": 0.365, "runs": 2, "best_runs": 6}}
    result = {"changes": [change], "runs": 8, "budget": 1.0, "best_commit": "abc1234", "complete": True}
    later = "with all 6 runs of the best: +0.190000 ± 0.365000"
    assert "+0.190000 ± 0.050000 (2 runs): matters; decided on those runs; " + later in text(result)[0]
    assert later in "\n".join(verify_lines(result))
