"""The box holds, again (#44): what a run sees is only what it needs, its directory keeps only what the controller
expects, and its memory is bounded. Each test is an attack a train.py made, planted as an idea through the loop
(or, where the loop cannot set the stage, run through run_steps / run_command as the loop runs them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from pathlib import Path

import fakes
import pytest
from conftest import PREPARE, make_repo

from orchestrator.executors import base
from orchestrator.executors.base import Job, run_steps
from orchestrator.executors.runner import run_command
from orchestrator.trust import confine

needs_bwrap = pytest.mark.skipif(
    confine.sandbox_problem() != "", reason=f"bubblewrap cannot run here ({confine.sandbox_problem()})"
)


@pytest.fixture(autouse=True)
def confined(unconfined, monkeypatch):
    """These test the sandbox itself: undo conftest's `unconfined` (as for its CONFINED modules)."""
    monkeypatch.delenv("AUTOLOOP_SANDBOX", raising=False)
    monkeypatch.setattr(confine, "_PROBE", {})


def project_dir(fallback: Path) -> Path:
    """A fresh directory for the repository outside /tmp (which the sandbox always emptied: there the old
    sandbox hid the run directories by chance), in HOME where it can be, as a real checkout is."""
    home = Path.home()
    if not os.access(home, os.W_OK) or any(str(home).startswith(m) for m in confine.MASKED):
        return fallback
    return Path(tempfile.mkdtemp(prefix=".autoloop-box-test-", dir=home))


def run_ideas(repo: Path, tmp_path: Path, monkeypatch, ideas: list[dict], sandbox: str = "on", tag: str = "b"):
    """The loop (fake harness) with the baseline and then `ideas` queued by the scripted proposer; the rows."""
    from orchestrator.loop import Settings, run_loop
    from orchestrator.store.ledger import read_rows
    from orchestrator.store.session import Paths

    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(fakes.write_plan(tmp_path / "plan.json", ideas)))
    settings = Settings(
        repo=repo,
        tag=tag,
        budget=1.0,
        timeout=60.0,
        proposer="fakes:Scripted",
        baseline_repeats=0,
        max_experiments=1 + len(ideas),
        sandbox=sandbox,
    )
    run_loop(settings, echo=lambda _: None)
    return read_rows(Paths(repo, tag).ledger), Paths(repo, tag)


def seen(log: str) -> dict:
    lines = [line for line in log.splitlines() if line.startswith("SEEN ")]
    assert lines, log[-3000:]
    return json.loads(lines[-1][len("SEEN ") :])


# A sacrificial run leaves a checkpoint in its own directory (and crashes, as a run trained past its budget does)
SAVES = """
import os
run_dir = os.path.dirname(os.environ["TMPDIR"])  # its TMPDIR is <run dir>/tmp
open(os.path.join(run_dir, "ckpt.pt"), "wb").write(b"weights trained 20x past the budget")
os.makedirs(os.path.join(run_dir, "cache"), exist_ok=True)
open(os.path.join(run_dir, "cache", "more.pt"), "wb").write(b"x")
os.symlink("/etc/hostname", os.path.join(run_dir, "link.pt"))
raise SystemExit("trained past the budget")
"""

# The next run looks for it, and for anything of any other run, session or verify run, from every place it knows
LOOKS = """
import glob, json, os
run_dir = os.path.dirname(os.environ["TMPDIR"])
state = os.path.dirname(os.path.dirname(run_dir))  # .autoloop/<tag>
anchors = [os.path.dirname(state), {repo!r}, os.path.join(os.getcwd(), "..", "..", "..")]
found = set()
for anchor in anchors:
    for path in glob.glob(os.path.join(anchor, "**"), recursive=True) + glob.glob(os.path.join(anchor, ".*", "**"), recursive=True):
        real = os.path.realpath(path)
        if os.path.isfile(real) and not real.startswith((run_dir + "/", os.path.realpath(os.getcwd()) + "/")):
            found.add(real)
print("SEEN " + json.dumps(sorted(found)), flush=True)
"""


@needs_bwrap
@pytest.mark.timeout(300)
def test_a_checkpoint_left_in_a_run_directory_reaches_no_later_run(tmp_path, monkeypatch):
    """#44 attack 3: a run trained past its budget left a checkpoint in its run directory (a crash row, never
    cleaned), and the next edit, reading the run directories of the session through the read-only /, loaded it
    and was kept 22% better. Now the run's directory keeps only what the controller expects (the checkpoint, a
    directory and a link it left are removed once it ends), and the next run sees nothing of the repository but its
    own worktree and run directory: no other run, no other session's best model.pt, no verify run, no .git."""
    project = project_dir(tmp_path)
    try:
        repo = project / "repo"
        make_repo(repo, {"train.py": fakes.ok(1.0), "prepare.py": PREPARE})
        other = repo / ".autoloop" / "old" / "runs" / "7"  # another session's best
        other.mkdir(parents=True)
        (other / "model.pt").write_bytes(b"the best model of another session")
        ideas = [
            {"description": "saves a checkpoint", "train": SAVES + fakes.ok(0.9)},
            {"description": "looks for it", "train": LOOKS.format(repo=str(repo)) + fakes.ok(0.8)},
        ]
        rows, paths = run_ideas(repo, tmp_path, monkeypatch, ideas)
        assert [r.status for r in rows][:2] == ["keep", "crash"], rows
        left = sorted(p.name for p in paths.run_dir(2).iterdir())
        assert not {"ckpt.pt", "cache", "link.pt", "tmp", "home"} & set(left), left
        found = seen((paths.run_dir(3) / "run.log").read_text())
        assert found == [], found
        assert rows[2].status == "keep", rows  # the run itself went on: only the others' files were out of sight
    finally:
        if project != tmp_path:
            shutil.rmtree(project, ignore_errors=True)


# What the run reads where another Python keeps its test suites (the scored text), and this Python's own
READS_PYTHONS = """
import json, os
def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        return type(e).__name__
print("SEEN " + json.dumps({{path: listing(path) for path in {paths!r}}}), flush=True)
"""


@pytest.fixture
def other_pythons(tmp_path, monkeypatch):
    """Test suites of other Pythons where a machine keeps them: a pyenv-like Python outside every bound place
    (/opt, where it can be made), and a distribution's beside what the step reads (as /usr/lib/python2.7 lies
    beside /usr/lib/python3.11; here in a tree on the controller's PYTHONPATH, not to touch /usr)."""
    made, suites = [], []
    if os.access("/opt", os.W_OK):
        top = Path(tempfile.mkdtemp(prefix="autoloop-test-", dir="/opt"))
        made.append(top)
        suites.append(top / "lib" / "python2.7" / "test")
    usr = tmp_path / "usr"
    suites.append(usr / "lib" / "python2.7" / "test")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*os.environ.get("PYTHONPATH", "").split(os.pathsep), str(usr)]))
    for suite in suites:
        suite.mkdir(parents=True)
        (suite / "test_scored.py").write_text("# a validation document, byte for byte\n")
    for top in made:
        for path in (top, *top.rglob("*")):
            path.chmod(0o755)
    yield [str(suite) for suite in suites]
    for top in made:
        shutil.rmtree(top, ignore_errors=True)


@needs_bwrap
@pytest.mark.timeout(300)
def test_no_other_pythons_test_suites_nor_our_own_are_readable(tmp_path, monkeypatch, other_pythons):
    """#44 attack 4: a pyenv Python 2.7 left 649 test files readable in the sandbox (the manifest hid python3*
    only), holding validation documents byte for byte. Now the sandbox binds the step's own Python only: another
    Python outside it is not there, one beside the system's (/usr/lib/pythonX) is hidden, and the test suites of
    the step's own standard library read empty whatever the harness's manifest says (this fake harness has none)."""
    ours = os.path.join(sysconfig.get_paths()["stdlib"], "test")
    assert os.path.isdir(ours) and os.listdir(ours)
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": fakes.ok(1.0), "prepare.py": PREPARE})
    paths = [*other_pythons, ours]
    ideas = [{"description": "reads test suites", "train": READS_PYTHONS.format(paths=paths) + fakes.ok(0.9)}]
    rows, state = run_ideas(repo, tmp_path, monkeypatch, ideas)
    assert [r.status for r in rows] == ["keep", "keep"], rows
    found = seen((state.run_dir(2) / "run.log").read_text())
    assert all(listing in ([], "FileNotFoundError") for listing in found.values()), found


ALLOCATES = """
import os
held = bytearray(1 << 30)  # 1 GiB, touched
for i in range(0, len(held), 4096):
    held[i] = 1
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sandbox", ["on", "off"])
def test_a_run_that_allocates_past_its_memory_limit_is_a_crash_that_says_so(tmp_path, monkeypatch, sandbox):
    """#44 attack 6 (memory): no step had a memory limit. Now each has one (a share of the machine's memory;
    here 256 MiB): a train.py that allocates 1 GiB is a crash whose reason names the limit, confined or not."""
    if sandbox == "on" and confine.sandbox_problem():
        pytest.skip(confine.sandbox_problem())
    monkeypatch.setattr(base, "default_memory_limit", lambda: 256 << 20)
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": fakes.ok(1.0), "prepare.py": PREPARE})
    rows, _ = run_ideas(
        repo, tmp_path, monkeypatch, [{"description": "allocates", "train": ALLOCATES + fakes.ok(0.5)}], sandbox
    )
    assert [r.status for r in rows] == ["keep", "crash"], rows
    assert "memory limit of 512 MiB" in rows[1].description, rows[1]


GROWS = """
import time
held = []
for _ in range(40):  # 25 MiB at a time, touched, to 1 GiB
    block = bytearray(25 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    held.append(block)
    time.sleep(0.02)
print("HELD 1 GiB", flush=True)
time.sleep(60)
"""


def test_a_step_whose_processes_hold_more_than_its_limit_is_killed(tmp_path):
    """Where no address space limit can be set (a GPU step: CUDA reserves terabytes of it), the runner measures
    what the step's processes hold and kills them past the limit, within a second, with the reason in its log."""
    run = run_command(
        [sys.executable, "-c", GROWS], tmp_path, dict(os.environ), tmp_path / "log", 30.0, memory_limit=300 << 20
    )
    log = (tmp_path / "log").read_text()
    assert run.killed.startswith("autoloop: out of memory: the step reached its memory limit of 300 MiB"), run
    assert run.wall_s < 15 and not run.timed_out and run.exit_code != 0 and "HELD" not in log, (run, log)
    assert log.strip().splitlines()[-1] == run.killed


@pytest.mark.parametrize("sandbox", [None, {"net": False, "required": True}])
def test_an_evaluator_that_allocates_256_gib_ends_at_once_saying_why(tmp_path, sandbox):
    """#44 attack 6: an archive whose weight declares [2**36] elements kept the evaluator busy until the hard
    timeout. Without a GPU an allocation of its size (256 GiB) fails at once under the address space limit, and
    the step's result says it reached its memory limit (the crash reason the controller gives it)."""
    if sandbox and confine.sandbox_problem():
        pytest.skip(confine.sandbox_problem())
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    job = Job(
        steps=[[sys.executable, "-c", "print('trained')"], [sys.executable, "-c", "x = bytearray(1 << 38)"]],
        logs=["run.log", "eval.log"],
        env=confine.allowed_env(),
        timeout_s=120,
        workdir=work,
        out_dir=out,
        sandbox=sandbox,
        memory_limit=1 << 30,
    )
    result = run_steps(job, work, out, {"CUDA_VISIBLE_DEVICES": ""})
    step = result.steps[1]
    assert step.exit_code != 0 and not step.timed_out and step.wall_s < 30, result
    assert step.killed == "autoloop: out of memory: the step reached its memory limit of 2.0 GiB of address space"
    assert (out / "eval.log").read_text().strip().splitlines()[-1] == step.killed


def test_a_run_directory_keeps_only_what_the_controller_expects(tmp_path):
    """After each step, what it left in the run's directory beyond its logs, its declared outputs ({out}/NAME:
    the model, the result) and what the controller put there is removed: a file, a directory, a link in a
    kept name's place; a job that gives its steps the directory itself ({out}) keeps what they write."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (out / "proposer.log").write_text("the controller's")
    leaves = (
        "import os\nout = os.path.dirname(os.environ['ARTIFACT'])\n"
        "open(os.path.join(out, 'model.pt'), 'w').write('model')\n"
        "open(os.path.join(out, 'ckpt.pt'), 'w').write('checkpoint')\n"
        "os.makedirs(os.path.join(out, 'runs', 'x'), exist_ok=True)\n"
        "os.path.lexists(os.path.join(out, 'eval.json')) or os.symlink('/etc/passwd', os.path.join(out, 'eval.json'))\n"
    )
    lists = "import os; print(sorted(os.listdir(os.path.dirname(os.environ['ARTIFACT']))))"
    job = Job(
        steps=[[sys.executable, "-c", leaves], [sys.executable, "-c", lists]],
        logs=["run.log", "eval.log"],
        env={**confine.allowed_env(), "TMPDIR": "{out}/tmp", "ARTIFACT": "{out}/model.pt", "RESULT": "{out}/eval.json"},
        timeout_s=60,
        workdir=work,
        out_dir=out,
    )
    result = run_steps(job, work, out, {})
    assert [s.exit_code for s in result.steps] == [0, 0], [s.log.read_text() for s in result.steps]
    assert "'ckpt.pt'" not in (out / "eval.log").read_text()  # gone before the next step started
    assert sorted(p.name for p in out.iterdir()) == ["eval.log", "model.pt", "proposer.log", "run.log"]
    job.env["AUTOLOOP_OUT"] = "{out}"
    run_steps(job, work, out, {})
    assert {"ckpt.pt", "runs", "eval.json"} <= {p.name for p in out.iterdir()}


@needs_bwrap
def test_the_sandbox_binds_nothing_of_the_repository_nor_home_even_where_what_it_reads_holds_them(tmp_path):
    """A PYTHONPATH entry (or the directory the controller was started from) that holds the repository or HOME
    would have brought them into the sandbox whole: they are emptied there, and what is read within them (the
    entry itself, the worktree, the run directory) is bound back."""
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": "pass\n", "lib/helper_mod.py": "VALUE = 'imported'\n"})
    state = repo / ".autoloop" / "t"
    (state / "runs" / "1").mkdir(parents=True)
    (state / "runs" / "1" / "model.pt").write_text("another run's")
    work, out = state / "slots" / "0", state / "runs" / "2"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "--detach", str(work)], check=True)
    mine = Path.home() / f".autoloop-box-test-{uuid.uuid4().hex}"  # a file of the user's, in HOME
    mine.write_text("the user's")
    code = (
        "import os, helper_mod\n"
        f"print('SEEN', helper_mod.VALUE, os.path.exists({str(state / 'runs' / '1' / 'model.pt')!r}),"
        f" os.path.exists({str(repo / 'train.py')!r}), os.path.exists({str(mine)!r}), sorted(os.listdir('.')))\n"
    )
    job = Job(
        steps=[[sys.executable, "-c", code]],
        logs=["run.log"],
        env={**confine.allowed_env(), "PYTHONPATH": f"{repo}{os.pathsep}{repo / 'lib'}{os.pathsep}/"},
        timeout_s=60,
        workdir=work,
        out_dir=out,
        sandbox={"net": False, "required": True},
        readable=(str(tmp_path),),
    )
    try:
        result = run_steps(job, work, out, {"CUDA_VISIBLE_DEVICES": ""})
    finally:
        mine.unlink()
    log = (out / "run.log").read_text()
    assert result.ok, log
    assert "SEEN imported False False False ['.git', 'lib', 'train.py']" in log, log
