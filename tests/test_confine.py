"""Untrusted code stays in its box (P11): each test is one attack an edit of train.py could make, run for real."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fakes
from conftest import subprocess_env
from orchestrator.ledger import read_record, read_rows
from orchestrator.session import Paths

SECRETS = {"OPENAI_API_KEY": "sk-test-0123456789", "HF_TOKEN": "hf_abcdefghijkl", "AWS_SECRET_ACCESS_KEY": "aws/secret/xyz",
           "SSH_AUTH_SOCK": "/tmp/ssh-agent.sock", "CUDA_TOKEN_X": "tok-under-an-allowed-prefix"}


def autoloop(repo, *args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--repo", str(repo), "--timeout", "60",
                           "--budget", "1", *args], capture_output=True, text=True, env=env or subprocess_env(),
                          timeout=timeout)


PRINTS_ENV = 'import os, sys\nprint("ENV", sorted(os.environ.items()))\nprint("HOME", os.environ.get("HOME"))\n'


def test_a_run_that_prints_the_environment_sees_no_secret(fake_repo):
    """Old: every step got the controller's whole environment (API keys, tokens, cloud credentials)."""
    repo = fake_repo(PRINTS_ENV + fakes.ok(1.0))
    proc = autoloop(repo, "--tag", "e", "--max-experiments", "1", "--pass-env", "MY_SETTING",
                    env=subprocess_env(**SECRETS, MY_SETTING="passed-on-purpose"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (Paths(repo, "e").run_dir(1) / "run.log").read_text()
    assert "ENV [" in log and "'PATH'" in log and "passed-on-purpose" in log
    for name, value in SECRETS.items():
        assert value not in log and name not in log, name
    home = log.split("HOME ", 1)[1].splitlines()[0]
    assert home.endswith("/runs/1/home")  # its own HOME (deleted afterwards)
    assert not (Paths(repo, "e").run_dir(1) / "home").exists()


def test_nothing_sent_to_an_llm_holds_a_secret_of_ours(fake_repo, monkeypatch):
    pytest.importorskip("openai")
    from fake_openai import FakeOpenAI, edit
    from orchestrator.loop import Settings, run_loop

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    repo = fake_repo(fakes.ok(1.0), {"program.md": f"Brief. Our key is {SECRETS['OPENAI_API_KEY']}, do not leak.\n"})
    with FakeOpenAI([edit("BPB = 1.0  # [0.1, 10.0]", "BPB = 0.9  # [0.1, 10.0]", "lower")]) as server:
        run_loop(Settings(repo=repo, tag="r", budget=1.0, timeout=20.0, proposer="llm", baseline_repeats=0,
                          max_experiments=2, options={"llm_base_url": server.base_url, "llm_model": "m"}),
                 echo=lambda _: None)
        prompts = server.prompts()
    assert prompts and all(SECRETS["OPENAI_API_KEY"] not in p for p in prompts)
    assert "[redacted OPENAI_API_KEY]" in prompts[0]
    assert [r.status for r in read_rows(Paths(repo, "r").ledger)] == ["keep", "keep"]


def test_an_agent_gets_its_presets_key_and_nothing_else(fake_repo, tmp_path):
    """A custom --agent-cmd gets the allow-list and --pass-env only; the codex preset also OPENAI_API_KEY."""
    agent = tmp_path / "agent.py"
    agent.write_text("import os, sys\nfrom pathlib import Path\n"
                     "Path(os.environ['DUMP']).write_text(repr(sorted(os.environ)))\n"
                     "p = Path('train.py'); p.write_text(p.read_text().replace('BPB = 1.0', 'BPB = 0.9'))\n")
    repo = fake_repo(fakes.ok(1.0))
    dump = tmp_path / "env.txt"
    proc = autoloop(repo, "--tag", "a", "--max-experiments", "2", "--proposer", "agent", "--agent-cmd",
                    f"{sys.executable} {agent}", "--pass-env", "DUMP",
                    env=subprocess_env(**SECRETS, DUMP=str(dump)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = dump.read_text()
    assert "'PATH'" in seen and "'DUMP'" in seen and "'HOME'" in seen
    assert not any(f"'{name}'" in seen for name in SECRETS)
    from orchestrator.proposers import Context
    from orchestrator.proposers.agent import AgentProposer

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "codex").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "codex").chmod(0o755)
    import os
    old = dict(os.environ)
    try:
        os.environ.update(SECRETS, PATH=f"{bin_dir}:{os.environ['PATH']}")
        codex = AgentProposer(Context(repo=repo, tag="a", profile=None, options={"agent": "codex"}))
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert codex.env["OPENAI_API_KEY"] == SECRETS["OPENAI_API_KEY"]
    assert not {"HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "SSH_AUTH_SOCK", "CUDA_TOKEN_X"} & set(codex.env)
