"""A night that cannot go wrong: each test reproduces one way an overnight run used to go wrong (P10) and shows
what happens now. Pinned sessions, the harness's own budget, git isolated from the user's config."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import git
import pytest

import fakes
from conftest import subprocess_env
from orchestrator.cli import default_tag
from orchestrator.ledger import read_record, read_rows
from orchestrator.session import Paths


def autoloop(repo, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--repo", str(repo), "--timeout", "60",
                           *args], capture_output=True, text=True, env=env or subprocess_env(), timeout=timeout)


def rows(repo, tag):
    return read_rows(Paths(repo, tag).ledger)


def test_resume_with_a_changed_budget_starts_a_new_session_under_the_default_tag(fake_repo, plan):
    """Old: `--budget 30` then `--budget 300` the same day continued the first session, judging new runs
    against a baseline measured at another budget. Now the default tag moves on to <tag>-2 and says so."""
    repo = fake_repo(fakes.ok(1.0))
    plan([{"description": "better", "train": fakes.ok(0.9)}])
    first = autoloop(repo, "--budget", "1", "--max-experiments", "1", "--proposer", "fakes:Scripted")
    assert first.returncode == 0, first.stdout + first.stderr
    tag = default_tag()
    second = autoloop(repo, "--budget", "2", "--max-experiments", "1", "--proposer", "fakes:Scripted")
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"session {tag} was started with other settings (budget 1s (now 2s)); this run is session {tag}-2" \
        in second.stdout
    assert len(rows(repo, tag)) == 1 and len(rows(repo, f"{tag}-2")) == 1  # each session has its own baseline
    assert read_record(Paths(repo, f"{tag}-2").run_dir(1)).description.startswith("baseline")
    again = autoloop(repo, "--budget", "2", "--max-experiments", "2", "--proposer", "fakes:Scripted")
    assert again.returncode == 0 and f"this run is session {tag}-2" in again.stdout  # resumes the matching one
    assert len(rows(repo, tag)) == 1 and len(rows(repo, f"{tag}-2")) == 2


def test_a_chosen_tag_refuses_a_changed_session_and_names_every_difference(fake_repo):
    repo = fake_repo(fakes.ok(1.0))
    first = autoloop(repo, "--tag", "t", "--budget", "1", "--max-experiments", "1")
    assert first.returncode == 0, first.stderr
    changed = autoloop(repo, "--tag", "t", "--budget", "2", "--seed", "7", "--gate", "strict",
                       "--max-experiments", "2")
    assert changed.returncode == 1 and "Traceback" not in changed.stderr
    for part in ("session 't' was started with other settings", "budget 1s (now 2s)", "seed 42 (now 7)",
                 "gate noise 2σ min 0 (now strict 2σ min 0)", "--tag t-2"):
        assert part in changed.stderr, changed.stderr
    assert len(rows(repo, "t")) == 1  # nothing ran
    same = autoloop(repo, "--tag", "t", "--budget", "1", "--max-experiments", "2")
    assert same.returncode == 0 and len(rows(repo, "t")) == 2


def test_a_newly_committed_train_py_is_not_ignored(fake_repo):
    """Old: a session resumed from its own branch and ignored a train.py committed since. Now it is a new
    session (default tag) or a refusal (chosen tag); a commit that leaves train.py alone resumes as before."""
    repo = fake_repo(fakes.ok(1.0))
    assert autoloop(repo, "--tag", "t", "--budget", "1", "--max-experiments", "1").returncode == 0
    user = git.Repo(repo)
    (repo / "NOTES.md").write_text("notes\n")
    user.git.add("-A")
    user.git.commit("-m", "notes only")
    resumed = autoloop(repo, "--tag", "t", "--budget", "1", "--max-experiments", "2")
    assert resumed.returncode == 0 and len(rows(repo, "t")) == 2
    (repo / "train.py").write_text(fakes.ok(0.5))
    user.git.commit("-am", "a new baseline")
    refused = autoloop(repo, "--tag", "t", "--budget", "1", "--max-experiments", "3")
    assert refused.returncode == 1 and "train.py changed since the session started" in refused.stderr


def test_a_harness_that_fixes_its_budget_sets_the_timeout_audit_and_pin(fake_repo):
    """Old: upstream's prepare.py fixes 300 s; `--budget 10` set the hard timeout from 10 (140 s), so every run
    was killed as a timeout, and the clock audit called a full 300 s run "budget exceeded". Now both follow the
    harness (scaled down here: a harness fixing 20 s, a run reporting 20 s of training, --budget 1)."""
    train = fakes.ok(1.0).replace('print("training_seconds: 0.1")', 'print("training_seconds: 20.0")')
    repo = fake_repo(train, {"prepare.py": "TIME_BUDGET = 20\n"})
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--repo", str(repo), "--tag", "h",
                           "--budget", "1", "--max-experiments", "1"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fixes its own budget (20s); --budget 1 does not reach it, so runs are timed, audited and pinned at 20s" \
        in proc.stdout
    assert "budget 20s | timeout 160s" in proc.stdout
    assert rows(repo, "h")[0].status == "keep"  # not "budget exceeded"
    pinned = json.loads(Paths(repo, "h").session.read_text())["pin"]
    assert pinned["budget"] == 20.0
    again = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--repo", str(repo), "--tag", "h",
                            "--budget", "5", "--max-experiments", "2"], capture_output=True, text=True,
                           env=subprocess_env(), timeout=120)
    assert again.returncode == 0, again.stderr  # --budget never reached this harness: the session is the same


def test_a_hanging_signer_cannot_stop_the_loop(fake_repo, plan, tmp_path):
    """Old: with commit.gpgsign on, a signer waiting for a passphrase at 2 a.m. blocked the loop forever (a
    failing signer and failing hooks: test_loop). Now signing is off for the loop's commits."""
    repo = fake_repo(fakes.ok(1.0))
    plan([{"description": "better", "train": fakes.ok(0.9)}])
    signer = tmp_path / "signer.sh"
    signer.write_text("#!/bin/sh\nsleep 3600\n")
    signer.chmod(0o755)
    with git.Repo(repo).config_writer() as cw:
        cw.set_value("commit", "gpgsign", "true")
        cw.set_value("gpg", "program", str(signer))
    proc = autoloop(repo, "--tag", "g", "--budget", "1", "--max-experiments", "2", "--proposer", "fakes:Scripted")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r.status for r in rows(repo, "g")] == ["keep", "keep"]
    assert next(git.Repo(repo).iter_commits("autoloop/g")).author.email == "test@example.com"  # the user's name


def test_every_git_command_of_the_loop_has_a_deadline(fake_repo, monkeypatch):
    from orchestrator import gitops

    monkeypatch.setattr(gitops, "GIT_TIMEOUT_S", 1.0)
    repo = gitops.open_repo(fake_repo(fakes.ok(1.0)))
    started = time.monotonic()
    with pytest.raises(git.GitCommandError):
        repo.git.execute(["git", "-c", "alias.stuck=!sleep 30", "stuck"])
    assert time.monotonic() - started < 10
