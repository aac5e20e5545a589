"""`autoloop init` (a workspace from the package's files, or what an existing repo lacks) and `autoloop doctor`
(each failing condition it checks), through the real command line in subprocesses, with real git repositories;
the only fakes are executables put first on PATH (nvidia-smi, an agent CLI, a signer)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import fakes
import git
import pytest
from conftest import ROOT, make_repo, subprocess_env
from test_agent_presets import fake_bin
from test_gpu_check import env_with, fake_nvidia_smi

from orchestrator.store.ledger import read_rows
from orchestrator.store.session import Paths


def autoloop(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env or subprocess_env(),
        timeout=timeout,
    )


def lines_of(check: str, out: str) -> str:
    """A check's line (and its fix line) from doctor's output."""
    found = [i for i, line in enumerate(out.splitlines()) if line[6:].startswith(check)]
    assert found, out
    lines = out.splitlines()
    i = found[0]
    return "\n".join(
        lines[i : i + 2] if i + 1 < len(lines) and lines[i + 1].lstrip().startswith("fix:") else lines[i : i + 1]
    )


# --- init ---------------------------------------------------------------------------------------------------


def test_init_makes_a_committed_workspace_with_the_package_files(tmp_path):
    proc = autoloop("init", "exp", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ws = tmp_path / "exp"
    assert "next: cd exp && autoloop doctor && autoloop run" in proc.stdout
    for name in ("train.py", "prepare.py", "evaluate.py", "program.md"):
        assert (ws / name).read_text() == (ROOT / name).read_text()
    assert ".autoloop/" in (ws / ".gitignore").read_text()
    assert "[tool.autoloop]" in (ws / "pyproject.toml").read_text()
    repo = git.Repo(ws)
    assert repo.active_branch.name == "main" and not repo.is_dirty(untracked_files=True)
    assert sorted(b.path for b in repo.head.commit.tree.traverse()) == sorted(
        [".gitignore", "evaluate.py", "prepare.py", "program.md", "pyproject.toml", "train.py"]
    )
    # the [tool.autoloop] table it writes is one `autoloop run` accepts (every line a comment to start from)
    assert autoloop("doctor", "--max-experiments", "3", cwd=ws).returncode == 0

    again = autoloop("init", "exp", cwd=tmp_path)
    assert again.returncode == 1 and "not empty" in again.stderr and "--existing" in again.stderr
    assert "Traceback" not in again.stderr


def test_init_existing_adds_only_what_is_missing(tmp_path):
    up = tmp_path / "autoresearch"
    repo = make_repo(
        up,
        {
            "train.py": "print('upstream')\n",
            "prepare.py": "# upstream's own harness\n",
            "pyproject.toml": '[project]\nname = "autoresearch"\n',
            ".gitignore": ".venv",
        },
    )
    (up / "train.py").write_text("print('upstream, being edited')\n")  # the user's work in progress
    (up / "notes.txt").write_text("mine\n")
    before = repo.head.commit.hexsha

    proc = autoloop("init", "--existing", str(up))
    assert proc.returncode == 0, proc.stderr
    assert "added program.md, .gitignore, pyproject.toml" in proc.stdout
    head = repo.head.commit
    assert head.parents[0].hexsha == before
    assert sorted(head.stats.files) == [".gitignore", "program.md", "pyproject.toml"]
    assert (up / "prepare.py").read_text() == "# upstream's own harness\n"  # theirs, untouched
    assert (up / "train.py").read_text() == "print('upstream, being edited')\n"  # still uncommitted
    assert repo.git.status("--porcelain").splitlines() == [" M train.py", "?? notes.txt"]
    assert (up / ".gitignore").read_text().startswith(".venv\n") and "/results.tsv" in (up / ".gitignore").read_text()
    assert (up / "pyproject.toml").read_text().startswith('[project]\nname = "autoresearch"\n')

    again = autoloop("init", "--existing", str(up))
    assert again.returncode == 0 and "nothing changed" in again.stdout and repo.head.commit == head

    bare = tmp_path / "no-train"
    make_repo(bare, {"README.md": "hi\n"})
    proc = autoloop("init", "--existing", str(bare))
    assert proc.returncode == 1 and "no train.py" in proc.stderr and "Traceback" not in proc.stderr
    proc = autoloop("init", "--existing", str(tmp_path / "nowhere"))
    assert proc.returncode == 1 and "not in a git repository" in proc.stderr
    (up / "sub").mkdir()
    proc = autoloop("init", "--existing", str(up / "sub"))
    assert proc.returncode == 1 and f"init --existing {up}" in proc.stderr


@pytest.mark.parametrize(
    "case, message",
    [
        ("invalid toml", "is not valid TOML"),
        ("dirty pyproject", "uncommitted changes to pyproject.toml"),
        ("untracked train.py", "train.py is not committed"),
        ("table with a comment", None),
        ("dotted table", None),
    ],
)
def test_init_existing_refuses_or_respects_what_it_finds(tmp_path, case, message):
    files = {
        "train.py": "print(1)\n",
        "pyproject.toml": {
            "invalid toml": "[project\nname = 1\n",
            "table with a comment": "[tool.autoloop]  # mine\nbudget = 60\n",
            "dotted table": "[tool]\nautoloop = { budget = 60 }\n",
        }.get(case, '[project]\nname = "x"\n'),
    }
    if case == "untracked train.py":
        files.pop("train.py")
    repo = make_repo(tmp_path / "r", files)
    if case == "untracked train.py":
        (tmp_path / "r" / "train.py").write_text("print(1)\n")
    if case == "dirty pyproject":
        (tmp_path / "r" / "pyproject.toml").write_text('[project]\nname = "mine, not yet committed"\n')
    before = {p.name: p.read_text() for p in (tmp_path / "r").iterdir() if p.is_file()}
    head = repo.head.commit
    proc = autoloop("init", "--existing", str(tmp_path / "r"))
    if message:
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr
        assert repo.head.commit == head
        assert {p.name: p.read_text() for p in (tmp_path / "r").iterdir() if p.is_file()} == before  # untouched
    else:
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "r" / "pyproject.toml").read_text() == before["pyproject.toml"]  # its table is kept
        assert sorted(repo.head.commit.stats.files) == [".gitignore", "evaluate.py", "prepare.py", "program.md"]
        assert autoloop("doctor", "--repo", str(tmp_path / "r")).returncode == 0  # still a valid pyproject.toml


def test_init_accepts_a_directory_holding_only_a_virtualenv(tmp_path):
    (tmp_path / "exp" / ".venv" / "bin").mkdir(parents=True)
    proc = autoloop("init", str(tmp_path / "exp"))
    assert proc.returncode == 0, proc.stderr
    repo = git.Repo(tmp_path / "exp")
    assert not repo.is_dirty(untracked_files=True)  # .venv/ is ignored by the workspace's .gitignore
    bad = autoloop("init", str(tmp_path / "exp" / "train.py" / "sub"))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


# --- doctor -------------------------------------------------------------------------------------------------


@pytest.fixture
def repo(fake_repo):
    return fake_repo(fakes.ok(1.0))


def test_doctor_ready_on_a_healthy_repo(repo):
    proc = autoloop("doctor", "--repo", str(repo), "--max-experiments", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.strip().splitlines()[-1].startswith("doctor: ready")
    for check in ("repository", "git identity", "git signing", "gpu / torch", "data", "disk", "extras", "proposer"):
        assert lines_of(check, out).startswith("ok"), out
    assert "commits as test <test@example.com>" in out


def test_doctor_gpu_torch_cannot_use(repo, tmp_path):
    env = env_with(fake_nvidia_smi(tmp_path / "smi", driver="535.104.05", cuda="12.2"))
    proc = autoloop("doctor", "--repo", str(repo), env=env)
    assert proc.returncode == 1, proc.stdout
    out = proc.stdout
    line = lines_of("gpu / torch", out)
    assert line.startswith("FAIL") and "torch cannot use CUDA" in line and "535.104.05" in line
    assert "--index-url https://download.pytorch.org/whl/cu121" in out  # the command that fixes it
    assert "would stop the loop" in out
    # the CPU chosen on purpose: the loop skips the check, and so does doctor
    for args, extra in ((["--gpus", ""], {}), ([], {"AUTOLOOP_DEVICE": "cpu"})):
        proc = autoloop("doctor", "--repo", str(repo), *args, env={**env, **extra})
        assert proc.returncode == 0 and "the CPU is chosen" in lines_of("gpu / torch", proc.stdout), proc.stdout


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--proposer", "nope"], "unknown proposer 'nope'"),
        (["--proposer", "llm"], "needs a model"),
        (["--proposer", "llm", "--llm-model", "m", "--llm-base-url", "https://api.example.com/v1"], "no API key"),
    ],
)
def test_doctor_fails_on_a_proposer_the_loop_would_refuse(repo, args, expect):
    env = subprocess_env()
    env.pop("OPENAI_API_KEY", None)
    proc = autoloop("doctor", "--repo", str(repo), *args, env=env)
    assert proc.returncode == 1 and expect in lines_of("proposer", proc.stdout), proc.stdout


def test_doctor_signing_with_a_broken_signer_warns_and_the_loop_still_runs(repo, tmp_path):
    signer = tmp_path / "broken-gpg"
    signer.write_text("#!/bin/sh\necho 'gpg: signing failed: No secret key' >&2\nexit 2\n")
    signer.chmod(0o755)
    with git.Repo(repo).config_writer() as cw:
        cw.set_value("commit", "gpgsign", "true")
        cw.set_value("gpg", "program", str(signer))
    proc = autoloop("doctor", "--repo", str(repo))
    assert proc.returncode == 0, proc.stdout
    line = lines_of("git signing", proc.stdout)
    assert line.startswith("warn") and "signing fails" in line and "failed to sign" in line and "fix:" in line
    # the loop's own commits are isolated from the signer: a night is not stopped by it
    run = autoloop("run", "--repo", str(repo), "--tag", "s", "--budget", "1", "--max-experiments", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(read_rows(Paths(repo, "s").ledger)) == 2


def test_doctor_without_a_git_identity_warns(repo, tmp_path):
    with git.Repo(repo).config_writer() as cw:
        cw.remove_section("user")
    env = subprocess_env(GIT_CONFIG_GLOBAL=str(tmp_path / "none"), GIT_CONFIG_NOSYSTEM="1")
    proc = autoloop("doctor", "--repo", str(repo), env=env)
    line = lines_of("git identity", proc.stdout)
    assert proc.returncode == 0 and line.startswith("warn") and "git config --global user.name" in line


def test_doctor_data_not_prepared_then_prepared(tmp_path, tiny_env):
    ws = tmp_path / "ws"
    assert autoloop("init", str(ws)).returncode == 0
    empty = dict(tiny_env, AUTOLOOP_CACHE=str(tmp_path / "empty-cache"))
    proc = autoloop("doctor", "--repo", str(ws), env=empty)
    line = lines_of("data", proc.stdout)
    assert line.startswith("warn") and "not prepared" in line and "python prepare.py" in line
    proc = autoloop("doctor", "--repo", str(ws), env=tiny_env)
    assert lines_of("data", proc.stdout).startswith("ok") and "prepared and verifies" in proc.stdout


def test_doctor_and_run_with_a_missing_or_silent_agent_cli(repo, tmp_path):
    env = subprocess_env(PATH=f"{tmp_path / 'empty'}{os.pathsep}/usr/bin:/bin")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = autoloop("doctor", "--repo", str(repo), "--proposer", "agent", "--agent", "codex", env=env)
    line = lines_of("agent", proc.stdout)
    assert proc.returncode == 1 and line.startswith("FAIL") and "'codex' not found on PATH" in line

    bin_dir = fake_bin(tmp_path, "codex")
    env = subprocess_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    proc = autoloop("doctor", "--repo", str(repo), "--proposer", "agent", "--agent", "codex", env=env)
    assert proc.returncode == 0 and "codex-cli 0.46.0" in lines_of("agent", proc.stdout)

    broken = dict(env, AUTOLOOP_TEST_CLI_BROKEN="1")
    proc = autoloop("doctor", "--repo", str(repo), "--proposer", "agent", "--agent", "codex", env=broken)
    line = lines_of("agent", proc.stdout)
    assert proc.returncode == 1 and "--version failed" in line and "not logged in" in line
    run = autoloop(
        "run", "--repo", str(repo), "--tag", "a", "--proposer", "agent", "--agent", "codex", "--budget", "1", env=broken
    )
    assert run.returncode == 1 and "--version failed" in run.stderr and "autoloop doctor" in run.stderr
    assert not Paths(repo, "a").ledger.exists() or not read_rows(Paths(repo, "a").ledger)


def test_doctor_and_run_refuse_a_night_the_disk_cannot_hold(repo):
    proc = autoloop("doctor", "--repo", str(repo), "--max-experiments", str(10**9))
    line = lines_of("disk", proc.stdout)
    assert proc.returncode == 1 and line.startswith("FAIL") and "1000000000 experiments need" in line
    run = autoloop("run", "--repo", str(repo), "--tag", "d", "--budget", "1", "--max-experiments", str(10**9))
    assert run.returncode == 1 and "GiB free" in run.stderr and "Traceback" not in run.stderr
    assert not Paths(repo, "d").ledger.exists() or not read_rows(Paths(repo, "d").ledger)


def test_doctor_sizes_models_from_this_session_only(repo):
    old = repo / ".autoloop" / "old" / "runs" / "7"
    old.mkdir(parents=True)
    with open(old / "model.pt", "wb") as f:  # sparse: a grown model of another session takes no disk here
        f.truncate(7 << 30)
    proc = autoloop("doctor", "--repo", str(repo), "--tag", "new", "--max-experiments", "1")
    line = lines_of("disk", proc.stdout)
    assert "1 experiment need" in line and "3 models of ~1024 MiB" in line  # fake train.py: no size constants
    proc = autoloop("doctor", "--repo", str(repo), "--tag", "old", "--max-experiments", "1")
    assert "3 models of ~7168 MiB" in lines_of("disk", proc.stdout)


def test_doctor_warns_of_a_tracker_that_would_be_switched_off(repo, tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    env = subprocess_env(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}", HOME=str(tmp_path))  # no ~/.netrc
    for key in ("WANDB_API_KEY", "WANDB_MODE"):
        env.pop(key, None)
    proc = autoloop("doctor", "--repo", str(repo), "--tracker", "mlflow", "--tracker", "wandb", env=env)
    line = lines_of("trackers", proc.stdout)
    assert proc.returncode == 0 and line.startswith("warn"), proc.stdout  # a tracker never stops the loop
    assert f"cannot reach http://127.0.0.1:{port}" in line and "wandb: not logged in" in line
    assert "WANDB_MODE=offline" in line
    env.pop("MLFLOW_TRACKING_URI")
    proc = autoloop(
        "doctor", "--repo", str(repo), "--tracker", "mlflow", "--tracker", "wandb", env={**env, "WANDB_MODE": "offline"}
    )
    assert lines_of("trackers", proc.stdout).startswith("ok"), proc.stdout
