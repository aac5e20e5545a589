"""No silent unconfined night (issue 44): `autoloop doctor` checks the sandbox and names the fix; the gpu profile's
night stops without a sandbox unless --sandbox off says so; the cpu profile's runs unconfined with a note of what
that means; and, confined or not, a startup hook (.pth, sitecustomize) a run plants in the Python's site
directories is caught by the protected-state check, reported as the run's crash and removed.

"Without bubblewrap" is real: the command runs in a subprocess whose PATH holds git and Python only."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import fakes
import pytest
from conftest import subprocess_env

from orchestrator.core.protection import restore_hooks, startup_hooks
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths

FIX = "apt-get install bubblewrap"
MEANS = "a run can read the validation data"  # the start of what unconfined means, as the console and doctor say


@pytest.fixture
def no_bwrap(tmp_path) -> dict[str, str]:
    """The environment of a machine without bubblewrap: PATH holds git and this Python, nothing else; the
    sandbox left to --sandbox (the suite's AUTOLOOP_SANDBOX=off removed), the CPU chosen on purpose."""
    bin_dir = tmp_path / "bin-without-bwrap"
    bin_dir.mkdir()
    git = subprocess.run(["which", "git"], capture_output=True, text=True).stdout.strip()
    (bin_dir / "git").symlink_to(git)
    env = subprocess_env(PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}", AUTOLOOP_DEVICE="cpu")
    for key in ("AUTOLOOP_SANDBOX", "AUTOLOOP_PROFILE", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    probe = [sys.executable, "-c", "import shutil; assert not shutil.which('bwrap')"]
    assert subprocess.run(probe, env=env).returncode == 0
    return env


def autoloop(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def sandbox_line(out: str) -> str:
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line[6:].startswith("sandbox"))
    return "\n".join(lines[i : i + 2])


def test_doctor_without_bubblewrap_names_the_fix_and_what_unconfined_means(fake_repo, no_bwrap, monkeypatch):
    repo = fake_repo(fakes.ok(1.0))
    proc = autoloop("doctor", "--repo", str(repo), "--profile", "gpu", env=no_bwrap)
    line = sandbox_line(proc.stdout)
    assert proc.returncode == 1 and line.startswith("FAIL") and "stops before experiment 1" in line, proc.stdout
    assert "bubblewrap is not installed" in line and f"fix: {FIX}" in line and "--sandbox off" in line
    assert MEANS in line and "rewrite the packages the evaluator imports" in line

    # a cpu night runs unconfined: a warning, not a stop (the same probe, in this process, on the same PATH)
    from orchestrator.core.settings import Settings
    from orchestrator.doctor import WARN, check_sandbox
    from orchestrator.trust import confine

    monkeypatch.setenv("PATH", no_bwrap["PATH"])
    monkeypatch.setattr(confine, "_PROBE", {})  # probed afresh (the suite's fixture said "unconfined")
    finding = check_sandbox(Settings(repo=repo, tag="t"), "cpu")
    assert finding.status == WARN and "runs would be unconfined" in finding.detail and MEANS in finding.detail
    assert finding.fix.startswith(FIX)


def test_gpu_profile_without_a_sandbox_stops_before_experiment_1_unless_sandbox_off(fake_repo, no_bwrap):
    repo = fake_repo(fakes.ok(1.0))
    run = ("run", "--repo", str(repo), "--profile", "gpu", "--budget", "1", "--max-experiments", "1")
    proc = autoloop(*run, "--tag", "g", env=no_bwrap)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "install bubblewrap" in proc.stderr.lower() and FIX in proc.stderr and "--sandbox off" in proc.stderr
    assert MEANS in proc.stderr
    assert not Paths(repo, "g").ledger.exists() or not read_rows(Paths(repo, "g").ledger)

    proc = autoloop(*run, "--tag", "off", "--sandbox", "off", env=no_bwrap)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"runs are unconfined (--sandbox off): {MEANS}" in proc.stdout
    assert [r.status for r in read_rows(Paths(repo, "off").ledger)] == ["keep"]


def test_cpu_profile_without_a_sandbox_runs_unconfined_and_says_what_that_means(fake_repo, no_bwrap):
    repo = fake_repo(fakes.ok(1.0))
    proc = autoloop("run", "--repo", str(repo), "--tag", "c", "--budget", "1", "--max-experiments", "1", env=no_bwrap)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    note = next(line for line in proc.stdout.splitlines() if "runs are unconfined" in line)
    assert "bubblewrap is not installed" in note and MEANS in note and "re-encode any secret" in note
    assert [r.status for r in read_rows(Paths(repo, "c").ledger)] == ["keep"]


# --- the Python's startup hooks ------------------------------------------------------------------------------


def planting(name: str, body: str) -> str:
    """A fake train.py that plants a startup hook in the user site directory of its Python (PYTHONUSERBASE: a
    throwaway one of the test's), then reports as an honest run."""
    return (
        "import os, site\n"
        "d = site.getusersitepackages()\n"
        "os.makedirs(d, exist_ok=True)\n"
        f"open(os.path.join(d, {name!r}), 'w').write({body!r})\n" + fakes.ok(0.5)
    )


@pytest.fixture
def user_site(tmp_path, monkeypatch) -> Path:
    """A throwaway user site directory for the controller and its runs (PYTHONUSERBASE), never the real one."""
    monkeypatch.setenv("PYTHONUSERBASE", str(tmp_path / "userbase"))
    monkeypatch.setattr(site, "USER_BASE", None)  # computed again from PYTHONUSERBASE
    monkeypatch.setattr(site, "USER_SITE", None)
    where = Path(site.getusersitepackages())
    assert where.is_relative_to(tmp_path)
    return where


def test_a_pth_planted_by_a_run_is_its_crash_and_removed(fake_repo, plan, user_site):
    from orchestrator.loop import Settings, run_loop

    repo = fake_repo(fakes.ok(1.0))
    plan([{"description": "plant a .pth", "train": planting("evil.pth", "import os; os.environ['X'] = '1'\n")}])
    lines: list[str] = []
    settings = Settings(
        repo=repo, tag="p", budget=1.0, timeout=20.0, max_experiments=2, proposer="fakes:Scripted", baseline_repeats=0
    )
    run_loop(settings, lines.append)
    records = [read_record(Paths(repo, "p").run_dir(n)) for n in (1, 2)]
    assert records[0].status == "keep" and records[1].status == "crash", lines
    assert "the run touched what it may not (restored)" in records[1].reason
    assert str(user_site / "evil.pth") in records[1].reason
    assert not (user_site / "evil.pth").exists()  # put back: gone before any later process of this Python


def test_a_changed_or_planted_startup_hook_is_put_back(tmp_path):
    """The check alone, on a directory of its own: an existing .pth rewritten (its stat kept: same size, mtime
    set back) is restored; a planted sitecustomize.py and a planted package named usercustomize are removed."""
    d = tmp_path / "site-packages"
    d.mkdir()
    (d / "editable.pth").write_text("/home/me/project\n")
    (d / "plain.txt").write_text("not a hook")
    before = startup_hooks([d])
    assert list(before) == [d / "editable.pth"]
    stat = (d / "editable.pth").stat()
    (d / "editable.pth").write_text("import evil; x  \n"[: stat.st_size])
    os.utime(d / "editable.pth", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (d / "sitecustomize.py").write_text("import evil\n")
    (d / "usercustomize").mkdir()
    (d / "plain.txt").write_text("changed, but no hook")
    changed = restore_hooks(before, [d])
    assert sorted(changed) == sorted(str(d / n) for n in ("editable.pth", "sitecustomize.py", "usercustomize"))
    assert (d / "editable.pth").read_text() == "/home/me/project\n"
    assert not (d / "sitecustomize.py").exists() and not (d / "usercustomize").exists()
    assert restore_hooks(startup_hooks([d]), [d]) == []  # nothing else to put back


def test_sandboxed_runs_leave_the_users_own_pip_install_alone(tmp_path):
    """Sandboxed, the Python's directories are read-only to runs: a .pth rewritten while a run trains is the user's
    (`pip install -e .` of another checkout, in another terminal; a real night met it), neither blamed on the run
    nor put back. Unconfined it is both."""
    from conftest import make_repo

    from orchestrator.core.protection import Protection
    from orchestrator.core.state import replay

    repo = make_repo(tmp_path / "repo", {"train.py": "x = 1\n"})
    d = tmp_path / "site-packages"
    d.mkdir()
    (d / "__editable__.project.pth").write_text("/home/me/project\n")
    protection = Protection(repo, Paths(tmp_path / "repo", "t"), tmp_path / "repo", "t", print, hook_dirs=[d])
    state = replay([], repo.head.commit.hexsha)
    for sandboxed, blamed in ((True, []), (False, [str(d / "__editable__.project.pth")])):
        (d / "__editable__.project.pth").write_text("/home/me/project\n")
        before = protection.snapshot(state, hooks=not sandboxed)
        (d / "__editable__.project.pth").write_text("/home/me/other-checkout\n")
        assert protection.touched(before) == blamed
        kept = "/home/me/other-checkout\n" if sandboxed else "/home/me/project\n"
        assert (d / "__editable__.project.pth").read_text() == kept
