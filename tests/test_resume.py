"""SIGKILL the controller at several points of an experiment; the restarted loop ends with exactly the rows."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import fakes
import git
import psutil
import pytest
from conftest import subprocess_env

from orchestrator.store.ledger import read_rows
from orchestrator.store.session import Paths


def start(repo, plan_path, *extra):
    cmd = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "run",
        "--repo",
        str(repo),
        "--tag",
        "k",
        "--budget",
        "6",
        "--timeout",
        "30",
        "--proposer",
        "fakes:Scripted",
        "--max-experiments",
        "6",
        "--baseline-repeats",
        "0",
        *extra,
    ]
    return subprocess.Popen(
        cmd,
        env=subprocess_env(AUTOLOOP_TEST_PLAN=str(plan_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def status(repo) -> dict:
    try:
        return json.loads(Paths(repo, "k").status.read_text())
    except (OSError, ValueError):
        return {}


PLAN = [
    {"description": "e2 slow proposal", "train": fakes.ok(0.9), "sleep": 1.5},
    {"description": "e3 slow training", "train": fakes.ok(0.95, sleep=6.0)},
    {"description": "e4 better", "train": fakes.ok(0.8)},
    {"description": "e5 worse", "train": fakes.ok(0.85)},
    {"description": "e6 best", "train": fakes.ok(0.7)},
]
EXPECTED = [
    ("baseline", "keep"),
    ("e2 slow proposal", "keep"),
    ("e3 slow training", "discard"),
    ("e4 better", "keep"),
    ("e5 worse", "discard"),
    ("e6 best", "keep"),
]


@pytest.mark.timeout(180)
def test_sigkill_at_several_points_then_resume(fake_repo, tmp_path):
    repo = fake_repo(fakes.ok(1.0))
    plan_path = fakes.write_plan(tmp_path / "plan.json", PLAN)
    ledger = repo / ".autoloop" / "k" / "results.tsv"

    # 1. killed while proposing experiment 2
    proc = start(repo, plan_path)
    wait_for(lambda: status(repo).get("phase") == "proposing" and status(repo).get("n") == 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(read_rows(ledger)) == 1

    # 2. killed while experiment 3 trains (its train.py keeps running: the restart must end it)
    proc = start(repo, plan_path)
    wait_for(
        lambda: status(repo).get("phase") == "training" and status(repo).get("n") == 3 and status(repo).get("train_pid")
    )
    orphan = status(repo)["train_pid"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(read_rows(ledger)) == 2

    # 3. the restart ends the orphaned training run at once; then it is killed right after a decision
    proc = start(repo, plan_path)
    wait_for(lambda: status(repo).get("train_pid") not in (None, orphan))
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    wait_for(lambda: len(read_rows(ledger)) >= 4, timeout=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    # 4. a clean run to the end
    proc = start(repo, plan_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    rows = read_rows(ledger)
    assert [(r.description, r.status) for r in rows] == EXPECTED
    user = git.Repo(repo)
    branch = user.heads["autoloop/k"].commit.hexsha
    assert branch.startswith(rows[-1].commit)
    for r in rows:
        assert user.is_ancestor(user.commit(r.commit).hexsha, branch) == (r.status == "keep")
    assert not git.Repo(Paths(repo, "k").worktree).is_dirty(untracked_files=True)
    assert (repo / "results.tsv").read_text() == ledger.read_text()


def test_second_run_on_same_tag_refuses_while_first_alive(fake_repo, tmp_path):
    repo = fake_repo(fakes.ok(1.0))
    plan_path = fakes.write_plan(tmp_path / "plan.json", [{"description": "slow", "train": fakes.ok(0.9, 5.0)}])
    first = start(repo, plan_path)
    try:
        wait_for(lambda: status(repo).get("phase") == "training" and status(repo).get("n") == 2)
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "run",
                "--repo",
                str(repo),
                "--tag",
                "k",
                "--proposer",
                "fakes:Scripted",
            ],
            env=subprocess_env(AUTOLOOP_TEST_PLAN=str(plan_path)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1
        assert "already running on tag 'k'" in second.stderr and "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGINT)
        out, _ = first.communicate(timeout=60)
    assert first.returncode == 130 and "interrupted" in out
    assert [r.description for r in read_rows(repo / "results.tsv")] == ["baseline"]  # the killed run left no row
    wt = git.Repo(Paths(repo, "k").worktree)
    assert not wt.is_dirty(untracked_files=True)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_slow_runs(repo, tmp_path, workers: int):
    """A loop on `workers` slots whose second generation's runs each train for a minute: (process, their pids)."""
    plan_path = fakes.write_plan(
        tmp_path / "plan.json",
        [{"description": f"slow {i}", "train": fakes.ok(0.95 + i / 100, sleep=60.0)} for i in range(workers)],
    )
    proc = start(repo, plan_path, "--workers", str(workers), "--gpus", "")
    wait_for(lambda: len(status(repo).get("train_pids") or {}) == workers and status(repo).get("generation") == 2)
    return proc, [pid for pid, _ in status(repo)["train_pids"].values()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2])
def test_sigkill_while_training_then_resume(fake_repo, tmp_path, workers):
    """Every slot's run is orphaned by a SIGKILLed controller: the restart ends them and redoes the generation."""
    repo = fake_repo(fakes.ok(1.0))
    first, orphans = start_slow_runs(repo, tmp_path, workers)
    first.kill()
    first.communicate(timeout=30)
    # each run ends with its controller (its reaper is told of the death), before any restart looks for it
    wait_for(lambda: not [pid for pid in orphans if running(pid)], timeout=15)
    fast = fakes.write_plan(
        tmp_path / "plan.json",
        [{"description": f"slow {i}", "train": fakes.ok(0.95 + i / 100)} for i in range(workers)],
    )
    second = start(repo, fast, "--workers", str(workers), "--gpus", "", "--max-experiments", str(2 * workers))
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out
    for pid in orphans:
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    rows = read_rows(repo / "results.tsv")
    baseline = ["baseline"] + [f"baseline (slot {i + 2})" for i in range(workers - 1)]
    assert [r.description.split(" [")[0].split(" (1 run")[0] for r in rows] == baseline + [
        f"slow {i}" for i in range(workers)
    ]
    assert (repo / ".autoloop" / "k" / "incomplete").is_dir()  # the killed runs' directories were kept aside
