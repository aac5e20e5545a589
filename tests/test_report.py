"""`autoloop report` / `results` on a real CPU session (tests/fixtures/cpu_session: 12 experiments of the project's
train.py, cpu profile, 10 s budget, --gate strict, recorded with its run records)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import TESTS, make_repo, subprocess_env

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
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)


def test_report_numbers_and_json_round_trip(session_repo, tmp_path):
    proc = autoloop("report", "--repo", str(session_repo), "--json")
    assert proc.returncode == 0, proc.stderr
    f = json.loads(proc.stdout)
    assert json.loads(json.dumps(f)) == f  # plain JSON: round-trips unchanged
    assert (f["experiments"], f["keep"], f["discard"], f["crash"]) == (12, 6, 6, 0)
    assert f["keep_rate"] == 0.5
    assert f["baseline_bpb"] == 2.824433 and f["best_bpb"] == 2.792544 and f["best_commit"] == "53e59da"
    assert f["delta"] == pytest.approx(-0.031889, abs=1e-9)
    assert f["delta_percent"] == pytest.approx(-1.12904, abs=1e-4)
    top = f["top_improvements"]
    assert [i["n"] for i in top[:3]] == [9, 6, 3]  # ranked by how much each lowered the running best
    assert top[0]["delta"] == pytest.approx(-0.017983, abs=1e-9)
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


def test_results_tsv_reads_like_upstream_analysis():
    """analysis.ipynb reads results.tsv with pandas by column name."""
    import pandas as pd

    df = pd.read_csv(FIXTURE / "results.tsv", sep="\t")
    assert list(df.columns[:6]) == ["commit", "val_bpb", "memory_gb", "mfu_percent", "status", "description"]
    kept = df[df["status"] == "keep"]
    assert kept["val_bpb"].min() == 2.792544 and set(df["status"]) <= {"keep", "discard", "crash"}
