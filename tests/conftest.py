from __future__ import annotations

import os
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import git
import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def make_repo(path: Path, files: dict[str, str]) -> git.Repo:
    """A real git repository with `files` committed on main."""
    path.mkdir(parents=True, exist_ok=True)
    repo = git.Repo.init(path, initial_branch="main")
    with repo.config_writer() as cw:
        cw.set_value("user", "name", "test")
        cw.set_value("user", "email", "test@example.com")
    for rel, content in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(content)
    repo.git.add("-A")
    repo.git.commit("-m", "init")
    return repo


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_reaches_what_we_start():
    """A suite started in the background (`pytest &` in a script: no job control) inherits SIGINT ignored, and so
    would every controller it starts: the Ctrl-C tests would fail for want of a Ctrl-C. As in a terminal, then."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


CONFINED = {"test_confine", "test_sandbox_attacks", "test_box_attacks"}  # the modules that test the sandbox itself


@pytest.fixture(autouse=True)
def unconfined(monkeypatch, request):
    """The suite's fake train.py variants write markers and pid files next to the test, which the sandbox
    (default: on where bubblewrap works) would refuse: runs are unconfined here, but in CONFINED, which test the
    sandbox itself (and the real train.py in it)."""
    if request.module.__name__ in CONFINED:
        return
    monkeypatch.setenv("AUTOLOOP_SANDBOX", "off")  # `autoloop` in a subprocess
    from orchestrator.trust import confine

    monkeypatch.setitem(confine._PROBE, "result", "the test suite runs unconfined")  # run_loop in this process


# A harness that takes its budget from the controller (upstream's fixes 300 s: see test_stop's budget test).
PREPARE = 'import os\nTIME_BUDGET = float(os.environ.get("AUTOLOOP_TIME_BUDGET", "300"))\n'


@pytest.fixture
def fake_repo(tmp_path):
    """Factory: a repo with a fake train.py (and a trivial prepare.py) committed."""

    def factory(train: str, extra: dict[str, str] | None = None) -> Path:
        files = {"train.py": train, "prepare.py": PREPARE, **(extra or {})}
        make_repo(tmp_path / "repo", files)
        return tmp_path / "repo"

    return factory


@pytest.fixture
def plan(tmp_path, monkeypatch):
    """Factory: write the fakes.Scripted proposer's plan and point AUTOLOOP_TEST_PLAN at it."""
    import fakes

    def write(steps):
        path = fakes.write_plan(tmp_path / "plan.json", steps)
        monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(path))
        return path

    return write


# TEST-ONLY clock slack (orchestrator/trust/evaluation.py: slack_for_tests): seconds of start-up jitter the clock
# audit allows on top of its own. The real train.py at budgets of 0.5-5 s on a loaded 2-core machine starts
# seconds slower than its baseline did (1-3 s; 7 s seen with other suites running), and honest runs read "budget
# exceeded". Only for tests whose clock attacks overrun by far more than this (test_trust's slowed clock: ~25 s
# at a 0.5 s budget; test_eval_attacks': 20 s at 5 s); never for the fakes' clock tests (test_confine: 1.3x of
# 8 s), and the cap on the start-up slack is checked exactly, on the controller's numbers.
CLOCK_SLACK = {"AUTOLOOP_TEST_CLOCK_SLACK_S": "8"}


@pytest.fixture
def clock_slack(monkeypatch) -> dict[str, str]:
    """The test-only clock slack for run_loop in this process; the returned variables for `autoloop` in a
    subprocess."""
    for key, value in CLOCK_SLACK.items():
        monkeypatch.setenv(key, value)
    return dict(CLOCK_SLACK)


@pytest.fixture(scope="session")
def tiny_env(tmp_path_factory):
    """Environment with a prepared tiny-profile cache (the real prepare.py on the offline default data)."""
    cache = tmp_path_factory.mktemp("cache")
    env = dict(os.environ, AUTOLOOP_CACHE=str(cache), AUTOLOOP_PROFILE="tiny", AUTOLOOP_DEVICE="cpu")
    env.pop("AUTOLOOP_DATASET", None)
    proc = subprocess.run([sys.executable, "prepare.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return env


@dataclass
class CliResult:
    """What `autoloop` did: like subprocess.CompletedProcess."""

    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, env: dict[str, str] | None = None) -> CliResult:
    """`autoloop ARGS` in this process (click's CliRunner), without the ~1 s start-up of a subprocess: for the
    commands that need no signal and no second process. An exception the command does not handle comes back
    as the traceback the real command would print on stderr."""
    from click.testing import CliRunner

    from orchestrator.cli import main

    result = CliRunner().invoke(main, list(args), env=env)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return CliResult(result.exit_code, result.stdout, stderr)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for running `autoloop` in a subprocess that can import the test fakes."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        AUTOLOOP_BASELINE_REPEATS="0",
    )  # fakes are deterministic: no noise to measure
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real one-node Slurm cluster on this machine (tests/slurm_cluster.py), for the session; stopped at its
    end, jobs and all. Skipped where Slurm cannot start, but on CI (CI set), where that fails instead: .ci/run
    installs it, and a CI without it must not pass without its tests."""
    from slurm_cluster import SlurmCluster, slurm_problem

    if problem := slurm_problem():
        if os.environ.get("CI"):
            pytest.fail(f"CI has no Slurm cluster: {problem}")
        pytest.skip(problem)
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=max(2, os.cpu_count() or 1)) as cluster:
        yield cluster
