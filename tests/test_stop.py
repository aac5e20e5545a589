"""Every way out is clean: Ctrl-C, SIGTERM, a LoopError in the middle of a generation, a stop while a pipelined
agent is making an idea. A few seconds after the controller exits, no process of a run or of the agent is
alive (psutil), the status file says stopped, and the same command resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import fakes
import psutil
import pytest
from conftest import ROOT, CliResult, cli, make_repo, subprocess_env

from orchestrator.store.ledger import read_rows
from orchestrator.store.session import Paths

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


STARTED: list[subprocess.Popen] = []  # the controllers a test started (ended after it: no_leftovers)


def start(repo: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "run",
        "--repo",
        str(repo),
        "--tag",
        "s",
        "--timeout",
        "120",
        "--baseline-repeats",
        "0",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, env=env or subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    STARTED.append(proc)
    return proc


def resume(repo: Path, *args: str, env: dict | None = None) -> CliResult:
    """The same command once the controller is gone: in this process (it is not signalled)."""
    base = ["run", "--repo", str(repo), "--tag", "s", "--timeout", "120", "--baseline-repeats", "0"]
    return cli(*base, *args, env=env or subprocess_env())


@pytest.fixture(autouse=True)
def no_leftovers():
    """A test that fails before its controller exits leaves no controller and no 60 s train.py behind."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            procs = tree([proc.pid])
            for p in procs:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(procs, timeout=10)
        proc.communicate()


def status(repo: Path) -> dict:
    try:
        return json.loads(Paths(repo, "s").status.read_text())
    except (OSError, ValueError):
        return {}


def wait_for(predicate, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the controller exited early: {proc.stdout.read()}")
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def tree(pids: list[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return procs


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def gone(procs: list[psutil.Process], within: float = 5.0) -> bool:
    """Every process of the run ended within a few seconds of its controller (polled: at once when they did;
    one that survived its controller is still here after `within`)."""
    deadline = time.monotonic() + within
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(procs) == []


def stop_and_check(proc: subprocess.Popen, sig: int, procs: list[psutil.Process], expect: str = "") -> str:
    assert procs and not proc.poll()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == EXIT.get(sig, 1), out
    assert "Traceback" not in out, out
    assert gone(procs), (out, alive(procs))
    assert expect in out, out
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_training_stops_the_real_train_py(tiny_env, tmp_path, sig):
    """The orphan that was: the real train.py kept training after Ctrl-C, and a resume did not know of it."""
    repo = tmp_path / "repo"
    make_repo(
        repo, {name: (ROOT / name).read_text() for name in ("train.py", "prepare.py", "evaluate.py", ".gitignore")}
    )
    env = subprocess_env(**{k: tiny_env[k] for k in ("AUTOLOOP_CACHE", "AUTOLOOP_PROFILE", "AUTOLOOP_DEVICE")})
    proc = start(repo, "--budget", "60", "--max-experiments", "1", env=env)
    wait_for(
        lambda: (
            status(repo).get("train_pids")
            and (Paths(repo, "s").run_dir(1) / "run.log").exists()
            and "step" in (Paths(repo, "s").run_dir(1) / "run.log").read_text()
        ),
        proc=proc,
    )
    time.sleep(3)  # well into training: the controller sits in its wait for the run (where the orphan was made)
    procs = tree([pid for pid, _ in status(repo)["train_pids"].values()])
    stop_and_check(proc, sig, procs, "interrupted; experiment 1 was not recorded")
    assert status(repo)["phase"] == "stopped" and not status(repo)["train_pids"]
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--repo",
            str(repo),
            "--tag",
            "s",
            "--budget",
            "2",
            "--baseline-repeats",
            "0",
            "--max-experiments",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert [(r.description, r.status) for r in read_rows(repo / "results.tsv")] == [("baseline", "keep")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_slot_then_the_session_resumes(fake_repo, tmp_path, workers, sig):
    repo = fake_repo(fakes.ok(1.0))
    slow = [{"description": f"slow {i}", "train": fakes.ok(0.9 + i / 100, sleep=60.0)} for i in range(workers)]
    plan = fakes.write_plan(tmp_path / "plan.json", slow)
    env = subprocess_env(AUTOLOOP_TEST_PLAN=str(plan))
    proc = start(
        repo, "--budget", "1", "--proposer", "fakes:Scripted", "--workers", str(workers), "--gpus", "", env=env
    )
    wait_for(
        lambda: len(status(repo).get("train_pids") or {}) == workers and status(repo).get("generation") == 2, proc=proc
    )
    procs = tree([pid for pid, _ in status(repo)["train_pids"].values()])
    lost = "the runs of the current generation were" if workers > 1 else "experiment 2 was"
    stop_and_check(proc, sig, procs, f"interrupted; {lost} not recorded")
    assert status(repo)["phase"] == "stopped"
    done = len(read_rows(repo / "results.tsv"))
    assert done == workers  # the baseline generation only: the stopped runs left no row
    fakes.write_plan(plan, [{"description": f"fast {i}", "train": fakes.ok(0.95)} for i in range(workers)])
    again = resume(
        repo,
        "--budget",
        "1",
        "--proposer",
        "fakes:Scripted",
        "--workers",
        str(workers),
        "--gpus",
        "",
        "--max-experiments",
        str(2 * workers),
        env=env,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert [r.description.split(" [")[0].split(" (")[0] for r in read_rows(repo / "results.tsv")][done:] == [
        f"fast {i}" for i in range(workers)
    ]


@pytest.mark.timeout(180)
def test_a_loop_error_in_the_middle_of_a_two_slot_generation(fake_repo, tmp_path):
    """Slot 2's run breaks the pinned harness (and the git index it would be restored with) and crashes while
    slot 1 trains: the harness cannot be restored, which stops the loop (LoopError) -- and slot 1's run with it."""
    repo = fake_repo(fakes.ok(1.0))
    breaker = (
        'from pathlib import Path\nPath("../../worktree/prepare.py").write_text("TIME_BUDGET = 1\\n")\n'
        'gitdir = Path("../../worktree/.git").read_text().split(":", 1)[1].strip()\n'
        'Path(gitdir, "index.lock").write_text("")\n'
        'raise SystemExit("broke the harness")\n'
    )
    plan = fakes.write_plan(
        tmp_path / "plan.json",
        [{"description": "slow", "train": fakes.ok(0.9, sleep=60.0)}, {"description": "breaks", "train": breaker}],
    )
    proc = start(
        repo,
        "--budget",
        "30",
        "--proposer",
        "fakes:Scripted",
        "--workers",
        "2",
        "--gpus",
        "",
        env=subprocess_env(AUTOLOOP_TEST_PLAN=str(plan)),
    )
    wait_for(lambda: status(repo).get("generation") == 2 and status(repo).get("train_pids"), proc=proc)
    procs = tree([pid for pid, _ in status(repo)["train_pids"].values()])
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 1 and "the pinned harness and it could not be restored" in out, out
    assert "Traceback" not in out, out
    assert gone(procs), (out, alive(procs))
    assert status(repo)["phase"] == "stopped" and not status(repo)["train_pids"]
    (repo / ".git" / "worktrees" / "worktree" / "index.lock").unlink()
    subprocess.run(["git", "checkout", "prepare.py"], cwd=Paths(repo, "s").worktree, check=True)
    fakes.write_plan(plan, [{"description": "fast", "train": fakes.ok(0.95)}])
    again = resume(
        repo,
        "--budget",
        "30",
        "--proposer",
        "fakes:Scripted",
        "--workers",
        "2",
        "--gpus",
        "",
        "--max-experiments",
        "4",
        env=subprocess_env(AUTOLOOP_TEST_PLAN=str(plan)),
    )
    assert again.returncode == 0, again.stdout + again.stderr


SLOW_AGENT = """import os, sys, time
open(os.environ["AUTOLOOP_TEST_AGENT_PIDFILE"], "a").write(f"{os.getpid()}\\n")
time.sleep(120)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_pipelined_agent_makes_an_idea(fake_repo, tmp_path, sig):
    repo = fake_repo(fakes.ok(1.0))
    agent, pidfile = tmp_path / "slow_agent.py", tmp_path / "agent.pids"
    agent.write_text(SLOW_AGENT)
    env = subprocess_env(AUTOLOOP_TEST_AGENT_PIDFILE=str(pidfile))
    proc = start(
        repo,
        "--budget",
        "1",
        "--proposer",
        "agent",
        "--agent-cmd",
        f"{sys.executable} {agent} {{prompt_file}}",
        "--pipeline",
        env=env,
    )
    # the baseline is recorded while the agent, started during its training, still works on the next idea
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip() and read_rows(repo / "results.tsv"), proc=proc)
    procs = tree([int(line) for line in pidfile.read_text().split()])
    stop_and_check(proc, sig, procs, "interrupted")
    assert status(repo)["phase"] == "stopped"
    rows = read_rows(repo / "results.tsv")
    assert [r.description for r in rows] == ["baseline"]
    fast = tmp_path / "fast_agent.py"  # resume with an agent that answers
    fast.write_text(
        "import re, sys\nfrom pathlib import Path\np = Path('train.py')\n"
        "p.write_text(p.read_text().replace('BPB = 1.0', 'BPB = 0.9'))\n"
        "Path(re.search(r'to this\\s+file: (\\S+)', Path(sys.argv[1]).read_text()).group(1))"
        ".write_text('lower BPB')\n"
    )
    again = resume(
        repo,
        "--budget",
        "1",
        "--proposer",
        "agent",
        "--agent-cmd",
        f"{sys.executable} {fast} {{prompt_file}}",
        "--max-experiments",
        "2",
        env=env,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert [r.description.split(" (")[0] for r in read_rows(repo / "results.tsv")] == ["baseline", "lower BPB"]
