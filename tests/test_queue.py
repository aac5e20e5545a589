"""The idea queue: CLI add/list/rm, `--proposer queue` end to end, and ideas queued into a running loop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from conftest import cli, make_repo, subprocess_env

from orchestrator.contract import FAKE_TRAIN
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths


def autoloop(*args, env=None):
    return cli(*args, env=env or subprocess_env())  # in this process (conftest.cli)


def test_queue_cli_and_queue_proposer_end_to_end(tmp_path):
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": FAKE_TRAIN})
    r = str(repo)
    assert autoloop("queue", "add", "lower lr", "--set", "LR=0.02", "--repo", r).stdout.startswith("queued #1")
    assert autoloop("queue", "add", "drop me", "--set", "DEPTH=3", "--repo", r).returncode == 0
    stale = tmp_path / "stale.patch"
    stale.write_text("--- a/train.py\n+++ b/train.py\n@@ -1,1 +1,1 @@\n-NOT IN THE FILE\n+X\n")
    assert autoloop("queue", "add", "stale patch", "--patch", str(stale), "--repo", r).returncode == 0
    assert autoloop("queue", "add", "mode c", "--set", "MODE=c", "--set", "WIDTH=64", "--repo", r).returncode == 0
    assert autoloop("queue", "rm", "2", "--repo", r).stdout.strip() == "removed #2"
    listing = autoloop("queue", "list", "--repo", r).stdout
    assert "#1  lower lr  [LR=0.02]" in listing and "#2" not in listing and "#4  mode c" in listing
    bad = autoloop("queue", "add", "nope", "--set", "NOPE=1", "--repo", r)
    assert bad.returncode == 1 and "no hyperparameter NOPE" in bad.stderr
    assert autoloop("queue", "add", "neither", "--repo", r).returncode == 2
    assert autoloop("queue", "rm", "99", "--repo", r).returncode == 1

    run = autoloop("run", "--repo", r, "--tag", "q", "--proposer", "queue", "--budget", "1")
    assert run.returncode == 0, run.stderr
    assert "the proposer has no more ideas" in run.stdout
    rows = read_rows(repo / "results.tsv")
    assert [r_.description.split(" [")[0] for r_ in rows] == ["baseline", "lower lr", "stale patch", "mode c"]
    assert [r_.status for r_ in rows] == ["keep", "keep", "crash", "discard"]
    assert "queued patch no longer applies" in rows[2].description
    assert read_record(Paths(repo, "q").run_dir(2)).info["queue_id"] == 1
    assert autoloop("queue", "list", "--repo", r).stdout.strip() == "the queue is empty"


def test_idea_queued_while_the_loop_runs_is_taken_next(tmp_path):
    repo = tmp_path / "repo"
    gate = tmp_path / "gate"  # run 2 trains until the test has queued its idea (30 s at most)
    gated = FAKE_TRAIN.replace(
        "import math",
        (
            "import math, os, time\nfrom pathlib import Path as _P\n_c = _P(os.environ['AUTOLOOP_TEST_COUNTER'])\n"
            "_run = int(_c.read_text()) + 1 if _c.exists() else 1\n_c.write_text(str(_run))\n_t0 = time.monotonic()\n"
            "while _run == 2 and not os.path.exists(os.environ['AUTOLOOP_TEST_GATE']) and time.monotonic() - _t0 < 30:\n"
            "    time.sleep(0.05)"
        ),
        1,
    )
    make_repo(repo, {"train.py": gated})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--repo",
            str(repo),
            "--tag",
            "live",
            "--budget",
            "30",
            "--max-experiments",
            "4",
        ],
        env=subprocess_env(AUTOLOOP_TEST_COUNTER=str(tmp_path / "runs"), AUTOLOOP_TEST_GATE=str(gate)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    status = Paths(repo, "live").status
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            s = json.loads(status.read_text())
            if s.get("phase") == "training" and s.get("n") == 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    added = autoloop("queue", "add", "wider, from the queue", "--set", "WIDTH=256", "--repo", str(repo))
    gate.touch()
    assert added.returncode == 0
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.send_signal(signal.SIGKILL)
    assert proc.returncode == 0, out
    rows = read_rows(repo / "results.tsv")
    assert len(rows) == 4
    assert rows[2].description == "wider, from the queue"  # taken before the search's next idea
    assert " -> " in rows[1].description and " -> " in rows[3].description  # the search (default) around it
