"""More than one slot: generations of runs at once, confirmation before the branch moves, freed slots reused."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import fakes
import git
import pytest
from conftest import subprocess_env

from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths


def timed(bpb: float, sleep: float = 1.5) -> str:
    """A fake train.py that prints when it started and ended, so overlap can be checked."""
    return (
        'import time\nprint(f"t_start {time.time()}", flush=True)\n'
        + fakes.ok(bpb, sleep)
        + 'print(f"t_end {time.time()}")\n'
    )


def span(run_dir) -> tuple[float, float]:
    text = (run_dir / "run.log").read_text()
    return (float(re.search(r"t_start (\S+)", text).group(1)), float(re.search(r"t_end (\S+)", text).group(1)))


def settings(repo, **kw) -> Settings:
    base = dict(
        repo=repo,
        tag="p",
        budget=10.0,
        timeout=30.0,
        proposer="fakes:Scripted",
        baseline_repeats=0,
        workers=2,
        executor_options={"gpus": []},
    )
    base.update(kw)
    return Settings(**base)


def test_two_slots_run_generations(fake_repo, plan):
    repo = fake_repo(timed(1.0))
    plan(
        [
            {"description": "better", "train": timed(0.8)},
            {"description": "worse", "train": timed(0.9)},
            {"description": "crashes", "train": fakes.crash()},
            {"description": "best", "train": timed(0.7)},
        ]
    )
    lines: list[str] = []
    state = run_loop(settings(repo, max_experiments=10), echo=lines.append)
    rows = read_rows(repo / "results.tsv")
    paths = Paths(repo, "p")
    got = [(r.description.split(" [")[0].split(" (1 run")[0], r.status) for r in rows]
    assert got == [
        ("baseline", "keep"),
        ("baseline (slot 2)", "discard"),  # generation 1: the baseline twice
        ("better", "discard"),
        ("worse", "discard"),  # generation 2: better is selected
        ("better (confirmation 1/1)", "keep"),
        ("baseline (repeat: confirmation)", "discard"),  # confirmed
        ("parent (repeat: a fresh run of the new best)", "discard"),  # generation 4: the new best measured afresh
        ("crashes", "crash"),  # beside it; its crash frees a slot, which re-runs the parent
        ("parent (repeat: slot freed early)", "discard"),
        ("best", "keep"),  # generation 5: one candidate left: judged directly (no pick, no bias)
    ], "\n".join(lines)
    assert "best of 2, by 0.2000: confirming" in rows[2].description and "confirmed by 1 run" in rows[4].description

    # two experiments in flight at once, on their own slot worktrees
    for a, b in ((1, 2), (3, 4), (5, 6), (7, 9)):
        (s1, e1), (s2, e2) = span(paths.run_dir(a)), span(paths.run_dir(b))
        assert max(s1, s2) < min(e1, e2), (a, b)
        assert {read_record(paths.run_dir(a)).slot, read_record(paths.run_dir(b)).slot} == {0, 1}
    assert all((paths.slot(i) / ".git").exists() for i in (0, 1))
    assert all(read_record(paths.run_dir(n)).device == "cpu" for n in (1, 2, 3))
    assert read_record(paths.run_dir(3)).gate.selection is True

    # the branch holds exactly the kept commits; the user's checkout is untouched
    user = git.Repo(repo)
    branch = user.heads["autoloop/p"].commit
    assert branch.hexsha.startswith(rows[9].commit) and state.best_bpb == pytest.approx(0.7)
    for r in rows:
        assert user.is_ancestor(user.commit(r.commit).hexsha, branch.hexsha) == (r.status == "keep"), r
    assert user.active_branch.name == "main" and not user.is_dirty(untracked_files=True)


def test_selection_that_does_not_confirm_is_discarded(fake_repo, plan, tmp_path):
    """A candidate that was lucky once (the counter file makes its second run worse) never reaches the branch."""
    counter = tmp_path / "runs-of-lucky"
    lucky = (
        f"import os\np = {str(counter)!r}\nk = int(open(p).read()) if os.path.exists(p) else 0\n"
        f'open(p, "w").write(str(k + 1))\n' + fakes.ok(1.0).replace("BPB = 1.0", "BPB = 0.5 if k == 0 else 1.1")
    )
    repo = fake_repo(fakes.ok(1.0))
    plan([{"description": "lucky", "train": lucky}, {"description": "same", "train": fakes.ok(1.0)}])
    run_loop(settings(repo, max_experiments=6), echo=lambda _: None)
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows] == ["keep", "discard", "discard", "discard", "discard", "discard"]
    assert "not confirmed" in rows[4].description
    assert git.Repo(repo).heads["autoloop/p"].commit.hexsha.startswith(rows[0].commit)


def test_resume_after_a_parallel_session(fake_repo, plan):
    repo = fake_repo(fakes.ok(1.0))
    plan([{"description": f"idea {i}", "train": fakes.ok(1.0 + i / 10)} for i in range(1, 6)])
    run_loop(settings(repo, max_experiments=4), echo=lambda _: None)
    run_loop(settings(repo, max_experiments=6), echo=lambda _: None)
    rows = read_rows(repo / "results.tsv")
    assert [r.description for r in rows] == ["baseline", "baseline (slot 2)", "idea 1", "idea 2", "idea 3", "idea 4"]


def test_status_shows_every_busy_slot(fake_repo, tmp_path):
    repo = fake_repo(fakes.ok(1.0, sleep=8.0))
    plan_path = fakes.write_plan(tmp_path / "plan.json", [])
    env = subprocess_env(AUTOLOOP_TEST_PLAN=str(plan_path))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--repo",
            str(repo),
            "--tag",
            "s",
            "--workers",
            "2",
            "--gpus",
            "",
            "--proposer",
            "fakes:Scripted",
            "--budget",
            "10",
            "--max-experiments",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline, shown = time.monotonic() + 60, ""
        while time.monotonic() < deadline and not ("slot 0: #" in shown and "slot 1: #" in shown):
            shown = subprocess.run(
                [sys.executable, "-m", "orchestrator.cli", "status", "--repo", str(repo)],
                env=env,
                capture_output=True,
                text=True,
            ).stdout
            time.sleep(0.3)
        assert "slot 0: #" in shown and "slot 1: #" in shown and "running" in shown, shown
    finally:
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


def test_pipelined_generations_make_the_next_ideas_while_one_trains(fake_repo, plan):
    repo = fake_repo(timed(1.0, sleep=5.0))
    plan([{"description": f"idea {i}", "train": timed(1.0 + i / 10, sleep=5.0), "sleep": 1.0} for i in range(1, 5)])
    run_loop(settings(repo, max_experiments=6, pipeline=True), echo=lambda _: None)
    paths = Paths(repo, "p")
    assert [r.description for r in read_rows(repo / "results.tsv")][2:] == ["idea 1", "idea 2", "idea 3", "idea 4"]
    generation_2_end = min(span(paths.run_dir(n))[1] for n in (3, 4))
    for n in (5, 6):  # generation 3's ideas were ready before generation 2 had finished training
        record = read_record(paths.run_dir(n))
        assert record.started - record.timings["idea_waited"] < generation_2_end, n
