"""`autoloop report` / `results` on a real CPU session (tests/fixtures/cpu_session: 12 experiments of the project's
train.py, cpu profile, 10 s budget, --gate strict, recorded with its run records)."""

from __future__ import annotations

import json
import shutil
import statistics

import fakes
import pytest
from conftest import TESTS, cli, make_repo, subprocess_env

FIXTURE = TESTS / "fixtures" / "cpu_session"


@pytest.fixture
def session_repo(tmp_path):
    repo = tmp_path / "repo"
    make_repo(repo, {"README.md": "a repo that ran a session\n"})
    state = repo / ".autoloop" / "cpu"
    shutil.copytree(FIXTURE, state)
    (state / "status.json").write_text(json.dumps({"phase": "finished", "tag": "cpu"}))
    return repo


def autoloop(*args):
    return cli(*args, env=subprocess_env())  # in this process (conftest.cli)


def test_report_numbers_and_json_round_trip(session_repo, tmp_path):
    proc = autoloop("report", "--repo", str(session_repo), "--json")
    assert proc.returncode == 0, proc.stderr
    f = json.loads(proc.stdout)
    assert json.loads(json.dumps(f)) == f  # plain JSON: round-trips unchanged
    assert (f["experiments"], f["keep"], f["discard"], f["crash"]) == (12, 6, 6, 0)
    assert f["keep_rate"] == 0.5
    assert f["baseline_bpb"] == pytest.approx(2.824433, abs=1e-6) and f["best_commit"] == "53e59da"
    assert f["best_bpb"] == pytest.approx(2.792544, abs=1e-6)
    assert f["delta"] == pytest.approx(-0.031889, abs=2e-6)
    assert f["delta_percent"] == pytest.approx(-1.12904, abs=1e-4)
    top = f["top_improvements"]
    assert [i["n"] for i in top[:3]] == [9, 6, 3]  # ranked by how much each lowered the running best
    assert top[0]["delta"] == pytest.approx(-0.017983, abs=2e-6)
    assert top[0]["description"] == "ADAM_BETAS[0] 0.449 -> 0.0"
    assert f["holdout"]["best"]["commit"].startswith("53e59da")
    assert f["training_hours"] > 0 and f["hours"] >= f["training_hours"]


def test_report_writes_plot_and_markdown(session_repo, tmp_path):
    out = tmp_path / "out"
    proc = autoloop("report", "--repo", str(session_repo), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    png = (out / "progress.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    md = (out / "report.md").read_text()
    assert "**val_bpb 2.824433 -> 2.792544** (-0.031889, -1.13%) at `53e59da`" in md
    assert "12 (6 keep, 6 discard, 0 crash); keep rate 50.0%" in md
    assert md.index("| 9 | `53e59da`") < md.index("| 6 | `275206d`") < md.index("| 3 | `89a8dc9`")
    assert "held-out split: baseline" in md


def test_results_table_filters(session_repo):
    keeps = autoloop("results", "--repo", str(session_repo), "--status", "keep").stdout.splitlines()
    assert len(keeps) == 1 + 6 and "53e59da" in keeps[-1]
    last = autoloop("results", "--repo", str(session_repo), "--limit", "2").stdout.splitlines()
    assert len(last) == 3 and "MATRIX_LR 0.04 -> 0.0578" in last[-1]
    missing = autoloop("report", "--repo", str(session_repo), "--tag", "nope")
    assert missing.returncode == 1 and "no autoloop session 'nope'" in missing.stderr


def test_results_tsv_reads_like_upstream_analysis(fake_repo, plan):
    """analysis.ipynb reads results.tsv with pandas by column name: a ledger this code writes, crash included."""
    import fakes
    import pandas as pd

    from orchestrator.loop import Settings, run_loop

    repo = fake_repo(fakes.ok(1.0))
    plan(
        [{"description": "better\twith a tab", "train": fakes.ok(0.9)}, {"description": "boom", "train": fakes.crash()}]
    )
    run_loop(
        Settings(repo=repo, tag="u", budget=1.0, timeout=20.0, proposer="fakes:Scripted", baseline_repeats=0),
        echo=lambda _: None,
    )
    df = pd.read_csv(repo / "results.tsv", sep="\t")
    assert list(df.columns) == ["commit", "val_bpb", "memory_gb", "mfu_percent", "status", "description"]
    assert list(df["status"]) == ["keep", "keep", "crash"] and df["commit"].str.len().eq(7).all()
    assert list(df["val_bpb"]) == [1.0, 0.9, 0.0] and list(df["memory_gb"]) == [2.0, 2.0, 0.0]
    assert df["description"][1] == "better with a tab" and df["description"][2].startswith("boom [crash: ")
    assert (repo / "results.tsv").read_text().splitlines()[1].split("\t")[1] == "1.000000"  # 6 decimals


GATE_FIXTURE = TESTS / "fixtures" / "gate_session.tar.gz"  # made by tests/fixtures/make_gate_session.py


def test_report_status_and_console_agree_with_the_branch_tip(tmp_path):
    """A session recorded with the default noise gate: σ from baseline repeats, a candidate run again inside
    the margin and then kept, a simplification kept within the margin (so the best is not the lowest row)."""
    import re
    import tarfile

    import git

    with tarfile.open(GATE_FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    repo = tmp_path / "repo"
    report = json.loads(autoloop("report", "--repo", str(repo), "--json").stdout)
    status = json.loads(autoloop("status", "--repo", str(repo), "--json").stdout)
    console = (repo / ".autoloop" / "gate" / "console.txt").read_text()
    summary = re.search(r"val_bpb (\S+) -> (\S+) \(.*\) at (\w+) on autoloop/gate", console)
    rows = (repo / ".autoloop" / "gate" / "results.tsv").read_text().splitlines()[1:]
    assert any("repeat 2/3" in row and "\tkeep\t" in row for row in rows)  # a re-run that was then kept
    assert any("simplification" in row for row in rows)
    lowest_kept = min(float(r.split("\t")[1]) for r in rows if "\tkeep\t" in r)
    tip = git.Repo(repo).heads["autoloop/gate"].commit.hexsha[:7]
    assert report["best_commit"] == status["best_commit"] == summary.group(3) == tip
    assert report["best_bpb"] == pytest.approx(status["best_bpb"]) == pytest.approx(float(summary.group(2)))
    assert report["baseline_bpb"] == pytest.approx(status["baseline_bpb"]) == pytest.approx(float(summary.group(1)))
    assert report["best_bpb"] > lowest_kept  # the best is the branch tip, not the lowest kept row


# --- progress.png: the gate's view ------------------------------------------------------------------------------


def scripted(counter, values: list[float]) -> str:
    """A fake train.py whose k-th run reports values[k] (its counter outside the repo)."""
    return (
        f"import os\np = {str(counter)!r}\nk = int(open(p).read()) if os.path.exists(p) else 0\n"
        'open(p, "w").write(str(k + 1))\n'
        + fakes.ok(1.0).replace("BPB = 1.0", f"BPB = {values!r}[min(k, {len(values) - 1})]")
    )


def artists(fig) -> dict:
    """The plot's scatters, lines and bands by their legend label."""
    ax = fig.axes[0]
    return {a.get_label(): a for a in [*ax.collections, *ax.lines]}


def test_progress_draws_repeats_of_the_best_as_repeats_and_the_best_as_its_mean(fake_repo, plan, tmp_path):
    """A night's pattern: the best's first run was lucky (0.98), its repeats say 1.01. The repeats are drawn as
    runs of the best, not as discarded ideas, and the running best is the best's mean (what the gate compared
    ideas with), ± its standard error, not the lucky run."""
    import matplotlib.pyplot as plt

    from orchestrator.core.state import load_state
    from orchestrator.loop import Settings, run_loop
    from orchestrator.store.session import Paths
    from orchestrator.views.report import AGAIN, DISCARDED, KEPT, figure, running_best

    values = [0.98, 1.02, 1.01, 1.03]
    repo = fake_repo(scripted(tmp_path / "count", values))
    plan([{"description": "worse", "train": fakes.ok(1.2)}])
    settings = Settings(repo=repo, tag="r", budget=1.0, timeout=20.0, proposer="fakes:Scripted", baseline_repeats=3)
    run_loop(settings, echo=lambda _: None)
    paths = Paths(repo, "r")
    state = load_state(paths)
    assert [r.gate.decision for r in state.records] == ["keep", "repeat", "repeat", "repeat", "discard"]
    fig = figure(paths)
    drawn = artists(fig)
    assert [x for x, _ in drawn[AGAIN].get_offsets()] == [2, 3, 4]  # the best's repeats
    assert [x for x, _ in drawn[DISCARDED].get_offsets()] == [5] and [x for x, _ in drawn[KEPT].get_offsets()] == [1]
    mean = sum(values) / 4
    line = drawn["best: mean of its runs"]
    assert list(line.get_ydata()) == pytest.approx([0.98, 1.0, 3.01 / 3, mean, mean, mean])
    assert state.best_bpb == pytest.approx(mean) and line.get_ydata()[-1] == pytest.approx(state.best_bpb)
    se = statistics.stdev(values) / 2
    assert running_best(state.records, state.start_commit)[-1] == (5, pytest.approx(mean), pytest.approx(se))
    band = drawn["± standard error"].get_paths()[0].vertices
    last = band[band[:, 0] >= 5][:, 1]
    assert (last.min(), last.max()) == (pytest.approx(mean - se), pytest.approx(mean + se))
    plt.close(fig)


def test_progress_labels_are_short_and_inside_the_axes(fake_repo, plan, tmp_path):
    """Kept ideas with long descriptions: five close together (their labels would cover each other), the last
    kept by the last run at the lowest value (the corner where a label runs off the figure). Each label is cut
    short, lies inside the axes of the saved figure, and covers no other."""
    import matplotlib.pyplot as plt

    from orchestrator.core.noise import Gate
    from orchestrator.loop import Settings, run_loop
    from orchestrator.store.session import Paths
    from orchestrator.views.report import LABEL_CHARS, figure

    long = "lower the learning rate of the matrices and warm it up for longer, with a cosine schedule after it"
    repo = fake_repo(fakes.ok(1.0))
    values = [0.999, 0.998, 0.997, 0.996, 0.995, 0.6]
    plan([{"description": f"{i}: {long}", "train": fakes.ok(v)} for i, v in enumerate(values, start=1)])
    settings = Settings(
        repo=repo, tag="l", budget=1.0, timeout=20.0, proposer="fakes:Scripted", baseline_repeats=0, gate=Gate("strict")
    )
    run_loop(settings, echo=lambda _: None)
    fig = figure(Paths(repo, "l"))
    fig.savefig(tmp_path / "progress.png")
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    inside = ax.get_window_extent(renderer)
    labels = ax.texts
    assert [t.get_text()[:2] for t in labels] == ["1:", "2:", "3:", "4:", "5:", "6:"]
    for label in labels:
        box = label.get_window_extent(renderer)
        assert len(label.get_text()) == LABEL_CHARS and label.get_text().endswith("…")
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, label
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    plt.close(fig)


# --- the night's value against its compute ----------------------------------------------------------------------


def hand_made_session(repo) -> None:
    """Nine runs, each training half an hour in a 40-minute run (one crash: a quarter of an hour of training): the baseline
    and its repeat; idea A discarded; idea B inside the margin, then kept on its second run, then repeated; idea C
    crashed; idea D slowed from outside (not judged); idea E inside the margin, still pending. Held-out: 1.10 -> 1.04."""
    from orchestrator.core.judge import row_of
    from orchestrator.store.ledger import Evidence, Record, append_row, write_record
    from orchestrator.store.session import Paths

    paths = Paths(repo, "h")
    runs = [  # (description, group, status, val_bpb, decision, disturbed)
        ("baseline", 1, "keep", 1.00, "keep", ""),
        ("baseline (repeat 2/2)", 1, "discard", 1.02, "repeat", ""),
        ("A", 3, "discard", 1.05, "discard", ""),
        ("B", 4, "discard", 0.95, "rerun", ""),
        ("B (repeat 2/3)", 4, "keep", 0.93, "keep", ""),
        ("C", 6, "crash", None, "", ""),
        ("D", 7, "discard", 0.99, "discard", "disturbed: steps per second 50% of its twins' median"),
        ("parent (repeat: confirmation)", 4, "discard", 0.94, "repeat", ""),
        ("E", 9, "discard", 0.92, "rerun", ""),
    ]
    for n, (description, group, status, bpb, decision, disturbed) in enumerate(runs, start=1):
        started = 2400.0 * (n - 1)
        record = Record(
            n=n,
            status=status,
            description=description,
            commit=f"{n:07d}" + "a" * 33,
            val_bpb=bpb,
            started=started,
            ended=started + 2400.0,
            timings={"propose": 60.0, "train": 900.0 if status == "crash" else 1800.0},
            group=group,
            gate=Evidence(decision, disturbed=disturbed),
            device="cpu",
        )
        paths.run_dir(n).mkdir(parents=True)
        write_record(paths.run_dir(n), record)
        append_row(paths.ledger, row_of(record))
    baseline = {"n": 1, "commit": "1" * 40, "holdout_bpb": 1.10, "val_bpb": 1.01}
    best = {"n": 5, "commit": "5" * 40, "holdout_bpb": 1.04, "val_bpb": 0.94}
    (paths.state / "holdout.json").write_text(json.dumps({"baseline": baseline, "best": best}))
    (paths.state / "status.json").write_text(json.dumps({"phase": "finished", "tag": "h"}))


def test_report_improvement_per_training_hour_and_ideas_judged_per_hour(tmp_path):
    """On a session made by hand: 4.25 training hours in 6 hours of runs (9 × 40 minutes); the baseline's mean
    1.01 -> the best's 0.94 (0.07) on validation, 1.10 -> 1.04 (0.06) held out; ideas judged: A and B (C crashed,
    D was not judged, E is pending)."""
    from orchestrator.core.settings import Settings
    from orchestrator.core.state import load_state
    from orchestrator.core.workspace import Workspace
    from orchestrator.store.session import Paths
    from orchestrator.trackers.base import session_totals

    repo = tmp_path / "repo"
    make_repo(repo, {"README.md": "a session made by hand\n"})
    hand_made_session(repo)
    f = json.loads(autoloop("report", "--repo", str(repo), "--json").stdout)
    assert (f["baseline_bpb"], f["best_bpb"]) == (pytest.approx(1.01), pytest.approx(0.94))
    assert (f["hours"], f["training_hours"]) == (pytest.approx(6.0), pytest.approx(4.25))
    assert f["val_improvement_per_training_hour"] == pytest.approx(0.07 / 4.25)
    assert f["holdout_improvement"] == pytest.approx(0.06)
    assert f["holdout_improvement_per_training_hour"] == pytest.approx(0.06 / 4.25)
    assert f["ideas_judged"] == 2 and f["ideas_judged_per_hour"] == pytest.approx(2 / 6.0)
    assert f["training_on_gpu"] is False
    assert f["holdout_disagrees"] == ""  # 0.07 on validation, 0.06 held out: they agree

    out = tmp_path / "out"
    assert autoloop("report", "--repo", str(repo), "--out", str(out)).returncode == 0
    md = (out / "report.md").read_text()
    assert "- time: 6.00 h, of which training 4.25 h" in md
    assert (
        "- improvement per training hour (CPU): 0.014118 bpb on the held-out split, 0.016471 on validation "
        "(baseline minus best)" in md
    )
    assert "- ideas judged: 2 (0.3 per hour)" in md
    # the report leads with the held-out improvement, its noise (one model each: σ√2) and its rate
    assert f["holdout_verdict"] == "beyond the noise" and 0.01 < f["holdout_improvement_se"] < 0.03
    lead = md.splitlines()[2]
    assert lead.startswith("**Held-out improvement +0.060000 bpb ± 0.0"), lead
    assert lead.endswith(
        "(beyond the noise), 0.014118 per training hour (CPU)** (baseline minus best, on the held-out split)"
    )

    ws, state = Workspace(Settings(repo=repo, tag="h"), lambda _: None), load_state(Paths(repo, "h"))
    totals = session_totals(ws, state)
    assert totals["training_hours"] == pytest.approx(4.25) and totals["ideas_judged"] == 2
    assert "contradicted_keeps" not in totals and totals["holdout_verdict"] == "beyond the noise"
    later = next(r for r in state.records if r.n == 8)  # B's run after its keep (#5), as if it had contradicted it
    later.gate.stats["contradicts"], later.gate.note = 5, "contradicts keep #5"
    assert session_totals(ws, state)["contradicted_keeps"] == "#5"
    assert totals["holdout_improvement_per_training_hour"] == pytest.approx(0.06 / 4.25)
    assert totals["ideas_judged_per_hour"] == pytest.approx(2 / 6.0)


# --- a held-out check that disagrees with validation --------------------------------------------------------------


def test_a_held_out_check_that_disagrees_with_validation_is_flagged_everywhere(fake_repo, plan, tmp_path):
    """A real loop whose best gains 0.5 on validation and 0.01 held out (as an edit that read the validation split
    does): the exit line, `status`, `report` (JSON and markdown) and the trackers' session totals say so. (The
    fake harness makes no check of its own: the check's result is written beforehand for the run that is kept.)"""
    from orchestrator.core.settings import Settings
    from orchestrator.core.state import load_state
    from orchestrator.core.workspace import Workspace
    from orchestrator.loop import run_loop
    from orchestrator.store.session import Paths
    from orchestrator.trackers.base import session_totals

    repo = fake_repo(fakes.ok(1.0))
    plan([{"description": "read the validation split", "train": fakes.ok(0.5)}])
    paths = Paths(repo, "v")
    paths.state.mkdir(parents=True)
    check = {
        "baseline": {"n": 1, "holdout_bpb": 1.10, "val_bpb": 1.0},
        "best": {"n": 2, "holdout_bpb": 1.09, "val_bpb": 0.5},
    }
    (paths.state / "holdout.json").write_text(json.dumps(check))
    lines: list[str] = []
    settings = Settings(
        repo=repo, tag="v", budget=1.0, timeout=20.0, max_experiments=2, proposer="fakes:Scripted", baseline_repeats=0
    )
    state = run_loop(settings, lines.append)
    assert state.best_run == 2, lines
    assert lines[-1].startswith("autoloop: WARNING: the held-out check disagrees with validation"), lines
    assert "gains 0.500000 bpb on validation but +0.010000 held out" in lines[-1]

    status = json.loads(autoloop("status", "--repo", str(repo), "--json").stdout)
    assert "disagrees with validation" in status["holdout"]["disagrees"]
    text = autoloop("status", "--repo", str(repo)).stdout
    assert "held-out check: baseline 1.100000 -> best 1.090000" in text and "WARNING: the held-out check" in text
    report = json.loads(autoloop("report", "--repo", str(repo), "--json").stdout)
    assert report["holdout_disagrees"] == status["holdout"]["disagrees"]
    out = tmp_path / "out"
    assert autoloop("report", "--repo", str(repo), "--out", str(out)).returncode == 0
    assert f"> **Warning:** {report['holdout_disagrees']}" in (out / "report.md").read_text()
    totals = session_totals(Workspace(Settings(repo=repo, tag="v"), lambda _: None), load_state(paths))
    assert totals["holdout_disagrees"] == report["holdout_disagrees"]

    # held out as much as on validation (within the noise): no flag anywhere
    check["best"]["holdout_bpb"] = 0.62
    (paths.state / "holdout.json").write_text(json.dumps(check))
    assert json.loads(autoloop("status", "--repo", str(repo), "--json").stdout)["holdout"]["disagrees"] == ""
    assert "WARNING" not in autoloop("status", "--repo", str(repo)).stdout
    assert json.loads(autoloop("report", "--repo", str(repo), "--json").stdout)["holdout_disagrees"] == ""
    assert "holdout_disagrees" not in session_totals(Workspace(Settings(repo=repo, tag="v"), lambda _: None), state)


def test_the_disagreement_rule_weighs_the_session_noise():
    """G_val - G_held > max(3σ√2, G_val / 2): the same gap flagged with a small σ, not with a large one."""
    from orchestrator.core.holdout import disagreement

    check = {"baseline": {"val_bpb": 1.0, "holdout_bpb": 1.0}, "best": {"val_bpb": 0.9, "holdout_bpb": 0.96}}
    assert disagreement(check, sigma=0.001)  # 0.06 apart > max(0.0042, 0.05)
    assert not disagreement(check, sigma=0.02)  # 0.06 < 3 * 0.02 * √2 = 0.085: within the noise
    assert disagreement({**check, "sigma": 0.001})  # σ as stored with the check
    assert not disagreement({"error": "best (#2): the saved model is gone"}, sigma=0.001)
    worse = {"baseline": {"val_bpb": 1.0, "holdout_bpb": 1.0}, "best": {"val_bpb": 1.01, "holdout_bpb": 0.9}}
    assert not disagreement(worse, sigma=None)  # no validation gain: nothing to disagree with


def test_the_report_checks_held_out_with_the_evaluation_the_session_had(tmp_path):
    """`autoloop report` makes a missing held-out check itself: with `python -I -S evaluate.py` for a session
    that had it (a real night's report asked prepare.py --evaluate, which no longer exists), with the older
    harness's own command for a session from before."""
    from orchestrator.core.holdout import session_harness
    from orchestrator.trust.evaluation import evaluator_args

    (tmp_path / "evaluate.py").write_text("")
    for session in ({"evaluator": "evaluate.py"}, {}):  # recorded, or a session from before the key
        args = evaluator_args(session_harness(session, tmp_path), "m.pt", "holdout", "r.json")
        assert args == ["-I", "-S", "evaluate.py", "m.pt", "--split", "holdout", "--result", "r.json"]
    older = session_harness({"evaluator": ""}, tmp_path)
    assert evaluator_args(older, "m.pt", "holdout", "r.json")[:2] == ["prepare.py", "--evaluate"]


def test_the_held_out_change_says_whether_it_is_beyond_the_noise():
    from orchestrator.trust.evaluation import holdout_noise, holdout_text

    def check(gain, sigma=None):
        result = {"baseline": {"holdout_bpb": 1.1, "val_bpb": 1.0}, "best": {"holdout_bpb": 1.1 - gain, "val_bpb": 0.9}}
        return holdout_noise({**result, **({"sigma": sigma} if sigma else {})}), holdout_text(result, sigma)

    (se, verdict), text = check(0.02, sigma=0.01)  # 0.02 against 2 x 0.0141: one model each cannot tell
    assert se == pytest.approx(0.01 * 2**0.5) and verdict == "within the noise of one model each"
    assert "(-0.020000 ± 0.014142, within the noise of one model each; on validation -0.100000)" in text
    assert check(0.05, sigma=0.01)[0][1] == "beyond the noise"
    assert check(-0.05, sigma=0.01)[0][1] == "worse, beyond the noise"
    (se, verdict), text = check(0.05)  # no σ: no verdict, the figures as they are
    assert se is None and verdict == "" and "±" not in text
