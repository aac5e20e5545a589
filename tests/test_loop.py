"""The controller loop over small fake train.py variants: each outcome recorded right, nothing left alive."""

from __future__ import annotations

import os
import time

import fakes
import git
import psutil
import pytest

from orchestrator import LoopError
from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths


def settings(repo, **kw) -> Settings:
    base = dict(repo=repo, tag="t1", budget=1.0, timeout=20.0, proposer="fakes:Scripted", baseline_repeats=0)
    base.update(kw)
    return Settings(**base)


def quiet(_line: str) -> None:
    pass


def test_outcomes_are_recorded_and_branch_holds_only_keeps(fake_repo, plan, tmp_path):
    repo_path = fake_repo(fakes.ok(1.0))
    plan(
        [
            {"description": "better", "train": fakes.ok(0.8)},
            {"description": "worse", "train": fakes.ok(0.9)},
            {"description": "crashes", "train": fakes.crash()},
            {"description": "nan", "train": fakes.nan()},
            {"description": "forgets summary", "train": fakes.no_summary()},
            {"description": "fake block", "train": fakes.fake_then_real(0.85)},
            {"description": "touches prepare", "train": fakes.ok(0.1), "files": {"prepare.py": "X = 1\n"}},
            {"description": "syntax error", "train": "def broken(:\n"},
            {"description": "tampers at run time", "train": fakes.modifies_prepare()},
            {"description": "best", "train": fakes.ok(0.7)},
        ]
    )
    user = git.Repo(repo_path)
    before = (user.head.commit.hexsha, user.git.status("--porcelain"), user.active_branch.name)
    state = run_loop(settings(repo_path), echo=quiet)

    rows = read_rows(repo_path / "results.tsv")
    assert [r.status for r in rows] == [
        "keep",
        "keep",
        "discard",
        "crash",
        "crash",
        "crash",
        "discard",
        "crash",
        "crash",
        "crash",
        "keep",
    ]
    assert [r.val_bpb for r in rows][:3] == [1.0, 0.8, 0.9] and rows[-1].val_bpb == 0.7
    assert "RuntimeError: CUDA out of memory (fake)" in rows[3].description
    assert "not finite" in rows[4].description and "no val_bpb" in rows[5].description
    assert rows[6].val_bpb == 0.85  # the early fake block was ignored
    assert "edited files other than train.py: prepare.py" in rows[7].description
    tried = user.commit(rows[7].commit)  # the failed idea is kept as its train.py alone
    assert tried.tree["prepare.py"].data_stream.read() == user.head.commit.tree["prepare.py"].data_stream.read()
    assert "BPB = 0.1" in tried.tree["train.py"].data_stream.read().decode()
    assert "does not compile" in rows[8].description
    assert "the run modified prepare.py" in rows[9].description
    assert all(r.val_bpb == 0.0 and r.memory_gb == 0.0 for r in rows if r.status == "crash")
    assert rows[1].memory_gb == 2.0 and rows[1].mfu_percent == 1.5

    # the user's checkout is untouched; the loop branch holds exactly the kept commits
    assert (user.head.commit.hexsha, user.git.status("--porcelain"), user.active_branch.name) == before
    branch = user.heads["autoloop/t1"].commit.hexsha
    records = [read_record(Paths(repo_path, "t1").run_dir(n)) for n in range(1, len(rows) + 1)]
    for rec in records:
        assert rec.commit.startswith(rows[rec.n - 1].commit)
        assert user.git.rev_parse(f"refs/autoloop/t1/tried/{rec.n}") == rec.commit  # every idea reachable
        ancestor = user.is_ancestor(rec.commit, branch)
        assert ancestor == (rec.status == "keep"), rec
    assert state.best_bpb == 0.7 and state.best_commit == branch
    assert records[3].reason.startswith("exit code 1") and records[3].exit_code == 1
    assert set(records[1].timings) >= {"propose", "check", "git", "train", "record"}
    # crashes caught by the checks never ran: no training time spent
    assert "train" not in records[7].timings and "train" not in records[8].timings
    # the worktree is back at the best commit with a clean tree
    wt = git.Repo(Paths(repo_path, "t1").worktree)
    assert wt.head.commit.hexsha == branch and not wt.is_dirty(untracked_files=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("reaper", [True, False], ids=["reaper", "no-reaper"])
def test_hang_and_grandchildren_are_killed(fake_repo, plan, tmp_path, monkeypatch, reaper):
    """The grandchildren left the process group. Under the reaper (Linux) they are ended even when they ignore
    SIGTERM (SIGKILL after the grace) and when their parent exited. Without it (every other system) kill_tree
    alone must find them, by parentage: a grandchild whose parent exited is beyond that (test_leftovers)."""
    from orchestrator.executors import runner

    monkeypatch.setattr(runner, "REAPER", reaper)
    repo_path = fake_repo(fakes.ok(1.0))
    pid_a, pid_b = tmp_path / "a.pid", tmp_path / "b.pid"
    if reaper:
        steps = [
            {"description": "hangs", "train": fakes.hang()},
            {"description": "grandchild then hang", "train": fakes.grandchild(pid_a, then="hang")},
            {"description": "grandchild then exit", "train": fakes.grandchild(pid_b, then="exit")},
        ]
        expected, pidfiles = ["keep", "crash", "crash", "discard"], (pid_a, pid_b)
    else:
        steps = [{"description": "grandchild then hang", "train": fakes.grandchild(pid_a, "hang", ignore_term=False)}]
        expected, pidfiles = ["keep", "crash"], (pid_a,)
    plan(steps)
    t0 = time.monotonic()
    try:
        run_loop(settings(repo_path, timeout=3.0), echo=quiet)
        rows = read_rows(repo_path / "results.tsv")
        assert [r.status for r in rows] == expected
        assert all("timeout after 3s" in r.description for r in rows if r.status == "crash")
        assert rows[-1].val_bpb == 1.5 if reaper else True
        for pidfile in pidfiles:
            pid = int(pidfile.read_text())
            deadline = time.monotonic() + 5
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(pid), f"grandchild {pid} survived"
    finally:  # a failure leaves no grandchild behind (they sleep an hour)
        for pidfile in (pid_a, pid_b):
            if pidfile.exists() and _alive(int(pidfile.read_text())):
                psutil.Process(int(pidfile.read_text())).kill()
    assert time.monotonic() - t0 < 60


def test_proposer_error_is_a_crash_row_and_dry_proposer_ends_loop(fake_repo, plan):
    repo_path = fake_repo(fakes.ok(1.0))
    plan([{"description": "x", "raise": "no idea"}, {"description": "fine", "train": fakes.ok(0.9)}])
    state = run_loop(settings(repo_path), echo=quiet)
    rows = read_rows(repo_path / "results.tsv")
    assert [r.status for r in rows] == ["keep", "crash", "keep"]
    assert "proposer error: ValueError: no idea" in rows[1].description
    assert state.done == 3


def test_max_experiments_and_resume_continue_the_count(fake_repo, plan):
    repo_path = fake_repo(fakes.ok(1.0))
    plan([{"description": f"step {i}", "train": fakes.ok(1.0 - 0.01 * i)} for i in range(1, 6)])
    run_loop(settings(repo_path, max_experiments=2), echo=quiet)
    assert len(read_rows(repo_path / "results.tsv")) == 2
    run_loop(settings(repo_path, max_experiments=4), echo=quiet)
    rows = read_rows(repo_path / "results.tsv")
    assert [r.description for r in rows] == ["baseline", "step 1", "step 2", "step 3"]


def test_refuses_dirty_train_py_and_unknown_proposer(fake_repo, plan):
    repo_path = fake_repo(fakes.ok(1.0))
    plan([])
    (repo_path / "train.py").write_text(fakes.ok(0.5))
    with pytest.raises(LoopError, match="uncommitted changes to train.py.*git commit"):
        run_loop(settings(repo_path), echo=quiet)
    git.Repo(repo_path).git.checkout("--", "train.py")
    with pytest.raises(LoopError, match="unknown proposer 'nope'; available: .*perturb"):
        run_loop(settings(repo_path, proposer="nope"), echo=quiet)


def test_baseline_crash_stops_with_a_clear_error(fake_repo, plan):
    repo_path = fake_repo(fakes.crash())
    plan([])
    with pytest.raises(LoopError, match="baseline crashed .*run.log"):
        run_loop(settings(repo_path), echo=quiet)
    assert [r.status for r in read_rows(repo_path / "results.tsv")] == ["crash"]


def test_existing_results_file_is_kept_aside(fake_repo, plan):
    repo_path = fake_repo(fakes.ok(1.0))
    (repo_path / "results.tsv").write_text("commit\tval_bpb\nabc\t1.0\n")
    plan([])
    run_loop(settings(repo_path), echo=quiet)
    kept = list((repo_path / ".autoloop").glob("results.*.tsv"))
    assert len(kept) == 1 and kept[0].read_text() == "commit\tval_bpb\nabc\t1.0\n"
    assert os.path.islink(repo_path / "results.tsv") and len(read_rows(repo_path / "results.tsv")) == 1


def test_max_hours_stops_starting_new_experiments(fake_repo, plan):
    repo_path = fake_repo(fakes.ok(1.0, sleep=0.5))
    plan([{"description": f"s{i}", "train": fakes.ok(0.9, sleep=0.5)} for i in range(20)])
    lines = []
    state = run_loop(settings(repo_path, max_hours=1.0 / 3600), echo=lines.append)  # one second
    assert 1 <= state.done <= 3
    assert "reached --max-hours" in lines[-1]


def test_five_ideas_in_a_row_failing_before_training_stop_the_loop(fake_repo, plan):
    repo = fake_repo(fakes.ok(1.0))
    plan([{"description": f"bad {i}", "raise": "no idea"} for i in range(6)])
    with pytest.raises(LoopError, match="the last 5 ideas all failed before training .*proposer error"):
        run_loop(settings(repo), echo=lambda _: None)
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows] == ["keep"] + ["crash"] * 5  # the sixth idea was never asked for
    records = [read_record(Paths(repo, "t1").run_dir(n)) for n in range(2, 7)]
    assert {r.phase for r in records} == {"propose"}  # each crash says where it happened


def test_a_crashed_baseline_run_again_on_resume_is_the_baseline(fake_repo, plan, tmp_path):
    """#1 crashes (the loop stops); the resumed session's baseline is #2: status, report and σ repeats use it."""
    import json
    import subprocess
    import sys

    from conftest import subprocess_env

    flaky = (
        f"import os\np = {str(tmp_path / 'count')!r}\nk = int(open(p).read()) if os.path.exists(p) else 0\n"
        'open(p, "w").write(str(k + 1))\nif k == 0:\n    raise SystemExit("the first run crashes")\n'
        + fakes.ok(1.0).replace("BPB = 1.0", "BPB = [1.0, 1.0, 1.02, 0.98][min(k, 3)]")
    )
    repo = fake_repo(flaky)
    plan([{"description": "better", "train": fakes.ok(0.5)}])
    with pytest.raises(LoopError, match="baseline crashed"):
        run_loop(settings(repo, baseline_repeats=2), echo=lambda _: None)
    state = run_loop(settings(repo, baseline_repeats=2), echo=lambda _: None)
    rows = read_rows(repo / "results.tsv")
    assert [r.description.split(" (1 run")[0].split(" (simplification")[0] for r in rows] == [
        "baseline [crash: exit code 1: the first run crashes]",
        "baseline (retry)",
        "baseline (repeat 2/3)",
        "baseline (repeat 3/3)",
        "better",
        "parent (repeat: a fresh run of the new best)",  # its keep's run is a selected sample
    ]
    assert state.baseline_run == 2 and state.baseline_bpb == pytest.approx(1.0) and state.best_run == 5
    for command in (["status", "--json"], ["report", "--json"]):
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *command, "--repo", str(repo)],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=120,
        )
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert json.loads(proc.stdout)["baseline_bpb"] == pytest.approx(1.0)


def test_one_slot_resumed_on_another_device_recovers(fake_repo, plan, tmp_path, monkeypatch):
    """Runs are compared only on one device type: after a move to another GPU model the first idea cannot be
    judged (its row says why), then the best runs there once, and later ideas are judged again."""
    repo = fake_repo(fakes.ok(1.0))
    plan(
        [
            {"description": "better", "train": fakes.ok(0.5)},
            {"description": "lost", "train": fakes.ok(0.45)},
            {"description": "best", "train": fakes.ok(0.4)},
        ]
    )
    run_loop(settings(repo, max_experiments=2), echo=lambda _: None)  # on the CPU
    smi = tmp_path / "bin" / "nvidia-smi"  # now a (fake) GPU machine, on which the runs are labelled
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\ncase "$*" in *query-gpu*) echo "FakeGPU 80GB";; *) exit 9;; esac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    run_loop(settings(repo, max_experiments=5), echo=lambda _: None)
    rows = read_rows(repo / "results.tsv")
    assert [read_record(Paths(repo, "t1").run_dir(n)).device for n in (3, 4, 5)] == ["FakeGPU 80GB"] * 3
    assert rows[2].description == "lost [no run of the best on FakeGPU 80GB to compare with]"
    assert rows[3].description.startswith("parent (repeat: no run of the best on FakeGPU 80GB yet)")
    assert rows[4].description.startswith("best") and rows[4].status == "keep"  # judged against #4


def test_the_users_git_config_neither_breaks_nor_hangs_the_loop(fake_repo, plan, tmp_path):
    """Signing with a signer that fails, hooks that fail (commit, checkout), a fsmonitor: none of it reaches the
    loop's own git commands; the user's identity is used for the commits."""
    repo = fake_repo(fakes.ok(1.0))
    hooks, signer = tmp_path / "hooks", tmp_path / "signer.sh"
    hooks.mkdir()
    for name in ("pre-commit", "prepare-commit-msg", "commit-msg", "post-commit", "post-checkout"):
        (hooks / name).write_text(f"#!/bin/sh\ntouch {tmp_path}/ran-{name}\nexit 1\n")
        (hooks / name).chmod(0o755)
    signer.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran-signer\nexit 1\n")
    signer.chmod(0o755)
    with git.Repo(repo).config_writer() as cw:
        cw.set_value("commit", "gpgsign", "true")
        cw.set_value("gpg", "program", str(signer))
        cw.set_value("core", "hooksPath", str(hooks))
        cw.set_value("core", "fsmonitor", str(signer))
        cw.set_value("user", "name", "Ada Lovelace")
        cw.set_value("user", "email", "ada@example.com")
    plan([{"description": "better", "train": fakes.ok(0.9)}, {"description": "worse", "train": fakes.ok(1.1)}])
    run_loop(settings(repo), echo=lambda _: None)
    assert [r.status for r in read_rows(repo / "results.tsv")] == ["keep", "keep", "discard"]
    assert not list(tmp_path.glob("ran-*"))  # no hook, no signer, no fsmonitor ran
    head = git.Repo(repo).heads["autoloop/t1"].commit
    assert head.author.name == "Ada Lovelace" and head.message.startswith("autoloop t1 #2")
