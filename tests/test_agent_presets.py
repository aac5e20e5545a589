"""Agent presets that work: fake aider / Claude Code / Codex CLIs run through the shipped presets, placeholders that
never reach a shell, usage read from the CLIs' JSON, and the real aider against a local fake OpenAI server."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import fakes
import pytest
from conftest import TESTS, subprocess_env
from fake_openai import FakeOpenAI

from orchestrator import LoopError
from orchestrator.loop import Settings, run_loop
from orchestrator.proposers.agent import DESCRIPTION, agent_argv, read_json_output
from orchestrator.store import gitops
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths

# The aider preset before this fix: its history file made every idea a crash row, and --yes-always said yes to
# analytics and to a self-upgrade that exits.
OLD_AIDER = [
    "aider",
    "--yes-always",
    "--no-git",
    "--no-auto-commits",
    "--no-show-model-warnings",
    "--message-file",
    "{prompt_file}",
    "train.py",
]


def fake_bin(tmp_path: Path, *names: str) -> Path:
    """A directory with wrappers named like the real CLIs that run agent_fake_cli.py."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        wrapper = bin_dir / name
        wrapper.write_text(
            f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
            f'{shlex.quote(str(TESTS / "agent_fake_cli.py"))} {name} "$@"\n'
        )
        wrapper.chmod(0o755)
    return bin_dir


def autoloop_run(repo: Path, tag: str, *args: str, env: dict, n: int = 3) -> list:
    """`autoloop run` in a subprocess (no pipelining: each idea starts from the previous best); its rows."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--repo",
            str(repo),
            "--tag",
            tag,
            "--budget",
            "1",
            "--timeout",
            "30",
            "--max-experiments",
            str(n),
            "--no-pipeline",
            "--proposer",
            "agent",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return read_rows(Paths(repo, tag).ledger)


def run_agent(repo: Path, n: int = 3, **options) -> list:
    run_loop(
        Settings(
            repo=repo,
            tag="a",
            budget=1.0,
            timeout=20.0,
            proposer="agent",
            baseline_repeats=0,
            max_experiments=n,
            pipeline=False,
            options=options,
        ),
        echo=lambda line: None,
    )
    return read_rows(Paths(repo, "a").ledger)


def leftovers(repo: Path, tag: str) -> list[str]:
    """Files in the proposal worktree that git does not know (ignored ones included)."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "-uall"],
        cwd=Paths(repo, tag).proposal,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")]


def test_aider_preset_keeps_its_files_out_of_the_worktree_and_says_no_to_questions(fake_repo, tmp_path):
    repo = fake_repo(fakes.ok(1.0), {".aider.conf.yml": "# the user's aider settings, tracked\n"})
    home = tmp_path / "home"
    env = subprocess_env(PATH=f"{fake_bin(tmp_path, 'aider')}{os.pathsep}{os.environ['PATH']}", HOME=str(home))
    # what the old preset leaves in a worktree: the controller's check takes it for an edit besides train.py
    prompt = tmp_path / "prompt.md"
    prompt.write_text(f"Lower BPB; then write one line to this file: {repo / DESCRIPTION}\n")
    old = [str(prompt) if arg == "{prompt_file}" else arg for arg in OLD_AIDER]
    subprocess.run(old, cwd=repo, env=env, check=True, capture_output=True)
    assert gitops.changed_files(gitops.Repo(repo)) == [".aider.chat.history.md", DESCRIPTION, "train.py"]
    assert json.loads((home / ".aider" / "analytics.json").read_text())["asked_opt_in"]  # --yes-always opted in
    subprocess.run("git checkout -q -- . && git clean -fdq", shell=True, cwd=repo, check=True)
    rows = autoloop_run(
        repo, "upgrade", "--agent-cmd", " ".join(OLD_AIDER), env={**env, "AUTOLOOP_TEST_AIDER_NEWER": "1"}
    )
    assert [r.status for r in rows] == ["keep", "crash", "crash"]
    assert all("the agent did not change train.py" in r.description for r in rows[1:])  # it upgraded and left
    rows = autoloop_run(repo, "backstop", "--agent-cmd", " ".join(OLD_AIDER), env=env)
    assert [r.status for r in rows] == ["keep", "keep", "keep"]  # its history file deleted, the tracked one kept

    (home / ".aider" / "analytics.json").unlink()
    rows = autoloop_run(repo, "new", "--agent", "aider", env={**env, "AUTOLOOP_TEST_AIDER_NEWER": "1"})
    assert [r.status for r in rows] == ["keep", "keep", "keep"]
    assert [r.description for r in rows[1:]] == ["lower BPB from 1.0 to 0.9", "lower BPB from 0.9 to 0.81"]
    assert [r.val_bpb for r in rows] == [1.0, 0.9, 0.81]
    assert not (home / ".aider" / "analytics.json").exists()
    assert leftovers(repo, "new") == []  # no history, no description file left behind


def test_claude_preset_writes_only_in_its_workdir_and_reports_usage(fake_repo, tmp_path, monkeypatch):
    repo, bin_dir = fake_repo(fakes.ok(1.0)), fake_bin(tmp_path, "claude")
    # the fake refuses what Claude Code would ask permission for: a description file outside its workdir
    outside = subprocess.run(
        [
            str(bin_dir / "claude"),
            "-p",
            f"write to this file: {tmp_path / 'desc.txt'}",
            "--permission-mode",
            "acceptEdits",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert outside.returncode == 1 and "requested permissions" in outside.stderr
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    rows = run_agent(repo, agent="claude")
    assert [r.status for r in rows] == ["keep", "keep", "keep"]
    assert rows[1].description == "lower BPB from 1.0 to 0.9"  # from the description file
    record = read_record(Paths(repo, "a").run_dir(2))
    assert record.info == {
        "agent": "claude",
        "usage": {"prompt_tokens": 12012, "completion_tokens": 450, "total_tokens": 12462, "cost": 0.0421},
        "fingerprint": record.info["fingerprint"],  # what the idea is, for the memory (proposers/memory.py)
        "moved": [["BPB", "1.0", "0.9"]],
    }
    assert not (Paths(repo, "a").proposal / DESCRIPTION).exists()


def test_agent_usage_counts_for_max_cost_and_the_answer_is_the_fallback_description(fake_repo, tmp_path, monkeypatch):
    repo = fake_repo(fakes.ok(1.0))
    monkeypatch.setenv("PATH", f"{fake_bin(tmp_path, 'claude')}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("AUTOLOOP_TEST_NO_DESCRIPTION", "1")
    run_loop(
        Settings(
            repo=repo,
            tag="a",
            budget=1.0,
            timeout=20.0,
            proposer="agent",
            baseline_repeats=0,
            max_experiments=10,
            max_cost=0.05,
            pipeline=False,
            options={"agent": "claude"},
        ),
        echo=lambda line: None,
    )
    rows = read_rows(Paths(repo, "a").ledger)
    assert len(rows) == 3  # two ideas at $0.0421 each cross $0.05
    assert rows[1].description == "lower BPB from 1.0 to 0.9 (said the result)"  # not the raw JSON


def test_codex_preset_reads_its_jsonl_events(fake_repo, tmp_path, monkeypatch):
    repo = fake_repo(fakes.ok(1.0))
    monkeypatch.setenv("PATH", f"{fake_bin(tmp_path, 'codex')}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("AUTOLOOP_TEST_NO_DESCRIPTION", "1")
    rows = run_agent(repo, n=2, agent="codex")
    assert [r.status for r in rows] == ["keep", "keep"]
    assert rows[1].description == "lower BPB from 1.0 to 0.9 (said codex)"
    assert read_record(Paths(repo, "a").run_dir(2)).info["usage"] == {
        "prompt_tokens": 5000,
        "completion_tokens": 300,
        "total_tokens": 5300,
        "cost": 0.0,
    }


def test_placeholders_are_whole_arguments_and_the_prompt_never_reaches_a_shell(fake_repo, tmp_path, monkeypatch):
    for cmd in ["sh -c 'mytool {prompt}'", "mytool --file={prompt_file}"]:
        with pytest.raises(LoopError, match="must be a whole argument"):
            agent_argv({"agent_cmd": cmd})
    brief = "Lower val_bpb. $(touch pwned) ; touch pwned2 `touch pwned3` {x} {prompt_file}\n"
    repo = fake_repo(fakes.ok(1.0), {"program.md": brief})
    monkeypatch.setenv("PATH", f"{fake_bin(tmp_path, 'claude')}{os.pathsep}{os.environ['PATH']}")
    # literal braces inside sh -c stay as they are; the prompt arrives as one argument ($3), untouched
    script = (
        'echo "{x} {} {{y}}" > "$AUTOLOOP_WORKDIR/../braces.txt"; '
        'printf %s "$3" > "$AUTOLOOP_WORKDIR/../got.txt"; '
        'cmp -s "$AUTOLOOP_PROMPT_FILE" "$AUTOLOOP_WORKDIR/../got.txt" && exec "$@"'
    )
    cmd = f"sh -c {shlex.quote(script)} sh claude -p {{prompt}} --permission-mode acceptEdits --output-format json"
    rows = run_agent(repo, agent_cmd=cmd)
    assert [r.status for r in rows] == ["keep", "keep", "keep"], [r.description for r in rows]
    state = Paths(repo, "a").state
    assert (state / "braces.txt").read_text() == "{x} {} {{y}}\n"
    assert brief.strip() in (state / "got.txt").read_text()
    for place in (repo, Paths(repo, "a").proposal, Paths(repo, "a").worktree, Path.cwd(), state):
        assert not list(place.glob("pwned*")), place


def test_read_json_output_is_defensive():
    assert read_json_output("plain text\nDone.\n") == (None, "", "")
    stream = "\n".join(
        [
            "warning: something on stderr",
            json.dumps({"type": "system", "subtype": "init"}),
            json.dumps(
                {
                    "type": "result",
                    "is_error": True,
                    "subtype": "error_max_turns",
                    "result": "",
                    "usage": {"input_tokens": "x"},
                    "total_cost_usd": None,
                }
            ),
        ]
    )
    assert read_json_output(stream) == (
        {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cost": 0.0},
        "",
        "error_max_turns",
    )
    failed = json.dumps({"type": "turn.failed", "error": {"message": "stream disconnected"}})
    assert read_json_output(failed)[2] == "stream disconnected"
    assert read_json_output('[1, 2]\n{"type": 3}\n') == (None, "", "")


# ---------------------------------------------------------------------------
# the real aider
# ---------------------------------------------------------------------------

AIDER_VERSION = "0.86.2"
NETWORK = re.compile(
    r"NewConnectionError|Name or service not known|Temporary failure in name resolution|"
    r"Network is unreachable|ConnectTimeout|ReadTimeout|No matching distribution found|"
    r"Could not fetch URL|ProxyError"
)


def real_aider() -> Path:
    """aider-chat in a virtualenv cached across runs (~/.cache/autoloop-tests); skips when PyPI is unreachable."""
    if sys.version_info >= (3, 13):
        pytest.skip(f"aider-chat=={AIDER_VERSION} supports Python 3.10 to 3.12")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autoloop-tests"
    venv = cache / f"aider-{AIDER_VERSION}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "aider.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once install it once
        if not (venv / "installed").exists():  # a venv's scripts name its path: built in place, marked when done
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            t = time.monotonic()
            pip = subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"aider-chat=={AIDER_VERSION}"],
                capture_output=True,
                text=True,
                timeout=900,
            )
            if pip.returncode != 0:
                if NETWORK.search(pip.stdout + pip.stderr):
                    pytest.skip(
                        f"cannot install aider-chat=={AIDER_VERSION} (no network to PyPI): "
                        f"{pip.stderr.strip().splitlines()[-1]}"
                    )
                pytest.fail(f"pip install aider-chat=={AIDER_VERSION} failed:\n{pip.stdout}\n{pip.stderr}")
            (venv / "installed").write_text(f"{time.monotonic() - t:.0f}s\n")
    return venv / "bin" / "aider"


def aider_reply(old: float, new: float) -> dict:
    """An answer in aider's diff edit format: a SEARCH/REPLACE block for train.py and a new description file."""
    return {
        "content": f"Lowering BPB.\n\ntrain.py\n```python\n<<<<<<< SEARCH\nBPB = {old!r}  # [0.1, 10.0]\n"
        f"=======\nBPB = {new!r}  # [0.1, 10.0]\n>>>>>>> REPLACE\n```\n\n{DESCRIPTION}\n```\n"
        f"<<<<<<< SEARCH\n=======\nset BPB to {new} via aider\n>>>>>>> REPLACE\n```\n"
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_real_aider_through_the_preset(fake_repo, tmp_path):
    aider = real_aider()
    help_text = subprocess.run([str(aider), "--help"], capture_output=True, text=True).stdout
    for flag in [a for a in agent_argv({"agent": "aider"}) if a.startswith("--")]:  # all exist in this aider
        assert re.search(rf"{re.escape(flag)}(?![\w-])", help_text), flag
    repo = fake_repo(fakes.ok(1.0))
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    (bin_dir / "aider").symlink_to(aider)  # only aider: the venv's python must not shadow the project's
    (home / ".aider" / "caches").mkdir(parents=True)
    # aider fetches model metadata from GitHub unless its cache knows some: this one knows the fake model
    (home / ".aider" / "caches" / "model_prices_and_context_window.json").write_text(
        json.dumps(
            {
                "fake-model": {
                    "litellm_provider": "openai",
                    "mode": "chat",
                    "max_input_tokens": 128000,
                    "max_output_tokens": 4096,
                    "input_cost_per_token": 1e-6,
                    "output_cost_per_token": 2e-6,
                }
            }
        )
    )
    with FakeOpenAI([aider_reply(1.0, 0.9), aider_reply(0.9, 0.8)]) as server:
        env = subprocess_env(
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            HOME=str(home),
            AIDER_MODEL="openai/fake-model",
            AIDER_OPENAI_API_BASE=server.base_url,
            AIDER_EDIT_FORMAT="diff",
            OPENAI_API_KEY="dummy",
            LITELLM_LOCAL_MODEL_COST_MAP="True",
        )
        rows = autoloop_run(repo, "real", "--agent", "aider", env=env)
        asked = server.prompts()
    log = (Paths(repo, "real").run_dir(2) / "proposer.log").read_text()
    assert [r.status for r in rows] == ["keep", "keep", "keep"], [r.description for r in rows] + [log]
    assert [r.description for r in rows[1:]] == ["set BPB to 0.9 via aider", "set BPB to 0.8 via aider"]
    assert [r.val_bpb for r in rows] == [1.0, 0.9, 0.8]
    assert len(asked) == 2 and "# Current best train.py" in asked[0]
    assert leftovers(repo, "real") == []
    assert "raw.githubusercontent.com" not in log and "Applied edit to train.py" in log
    assert not (home / ".aider" / "analytics.json").exists() or not json.loads(
        (home / ".aider" / "analytics.json").read_text()
    ).get("asked_opt_in")
