"""`autoloop report` / `results` on a real CPU session (tests/fixtures/cpu_session: 12 experiments of the project's
train.py, cpu profile, 10 s budget, --gate strict, recorded with its run records)."""

from __future__ import annotations

import json
import shutil

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
