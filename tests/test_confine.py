"""Untrusted code stays in its box (P11): each test is one attack an edit of train.py could make, run for real."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import fakes
import pytest
from conftest import subprocess_env

from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths

SECRETS = {
    "OPENAI_API_KEY": "sk-test-0123456789",
    "HF_TOKEN": "hf_abcdefghijkl",
    "AWS_SECRET_ACCESS_KEY": "aws/secret/xyz",
    "SSH_AUTH_SOCK": "/tmp/ssh-agent.sock",
    "CUDA_TOKEN_X": "tok-under-an-allowed-prefix",
}


def autoloop(repo, *args, env=None, timeout=180):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--repo",
            str(repo),
            "--timeout",
            "60",
            "--budget",
            "1",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env or subprocess_env(),
        timeout=timeout,
    )


PRINTS_ENV = 'import os, sys\nprint("ENV", sorted(os.environ.items()))\nprint("TMPDIR", os.environ.get("TMPDIR"))\n'


@pytest.mark.parametrize("sandbox", ["on", "off"])
def test_a_run_that_prints_the_environment_sees_no_secret(fake_repo, sandbox):
    """Old: every step got the controller's whole environment (API keys, tokens, cloud credentials)."""
    from orchestrator.trust.confine import sandbox_problem

    if sandbox == "on" and sandbox_problem():
        pytest.skip(sandbox_problem())
    repo = fake_repo(PRINTS_ENV + fakes.ok(1.0))
    proc = autoloop(
        repo,
        "--tag",
        "e",
        "--max-experiments",
        "1",
        "--pass-env",
        "MY_SETTING",
        "--sandbox",
        sandbox,
        env=subprocess_env(**SECRETS, MY_SETTING="passed-on-purpose"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (Paths(repo, "e").run_dir(1) / "run.log").read_text()
    assert "ENV [" in log and "'PATH'" in log and "passed-on-purpose" in log
    for name, value in SECRETS.items():
        assert value not in log and name not in log, name
    tmp = log.split("TMPDIR ", 1)[1].splitlines()[0]
    assert tmp.endswith("/runs/1/tmp")  # its own TMPDIR (deleted afterwards; HOME too, with autoloop's harness)
    assert not (Paths(repo, "e").run_dir(1) / "tmp").exists()


def test_nothing_sent_to_an_llm_holds_a_secret_of_ours(fake_repo, monkeypatch):
    pytest.importorskip("openai")
    from fake_openai import FakeOpenAI, edit

    from orchestrator.loop import Settings, run_loop

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    repo = fake_repo(fakes.ok(1.0), {"program.md": f"Brief. Our key is {SECRETS['OPENAI_API_KEY']}, do not leak.\n"})
    with FakeOpenAI([edit("BPB = 1.0  # [0.1, 10.0]", "BPB = 0.9  # [0.1, 10.0]", "lower")]) as server:
        run_loop(
            Settings(
                repo=repo,
                tag="r",
                budget=1.0,
                timeout=20.0,
                proposer="llm",
                baseline_repeats=0,
                max_experiments=2,
                options={"llm_base_url": server.base_url, "llm_model": "m"},
            ),
            echo=lambda _: None,
        )
        prompts = server.prompts()
    assert prompts and all(SECRETS["OPENAI_API_KEY"] not in p for p in prompts)
    assert "[redacted OPENAI_API_KEY]" in prompts[0]
    assert [r.status for r in read_rows(Paths(repo, "r").ledger)] == ["keep", "keep"]


def test_an_agent_gets_its_presets_key_and_nothing_else(fake_repo, tmp_path):
    """A custom --agent-cmd gets the allow-list and --pass-env only; the codex preset also OPENAI_API_KEY."""
    agent = tmp_path / "agent.py"
    agent.write_text(
        "import os, sys\nfrom pathlib import Path\n"
        "Path(os.environ['DUMP']).write_text(repr(sorted(os.environ)))\n"
        "p = Path('train.py'); p.write_text(p.read_text().replace('BPB = 1.0', 'BPB = 0.9'))\n"
    )
    repo = fake_repo(fakes.ok(1.0))
    dump = tmp_path / "env.txt"
    proc = autoloop(
        repo,
        "--tag",
        "a",
        "--max-experiments",
        "2",
        "--proposer",
        "agent",
        "--agent-cmd",
        f"{sys.executable} {agent}",
        "--pass-env",
        "DUMP",
        env=subprocess_env(**SECRETS, DUMP=str(dump)),
    )
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


@pytest.mark.slow
def test_the_metric_cannot_be_set_by_the_edit(tiny_env, tmp_path, monkeypatch):
    """Old: the harness took the first AUTOLOOP_EVAL line of the evaluation's stdout, without its exit code; a
    malformed one raised out of the loop and crashed every resume; later, code of train.py's that ran when the
    evaluator imported it could write the result file itself. Now the evaluator never imports train.py (it scores
    the exported graph), so none of these forgeries runs at all: each row is the model's honest value, and the
    result is a file with this run's nonce; resumes after them go on."""
    from conftest import ROOT, make_repo
    from test_trust import after_imports

    from orchestrator.loop import Settings, run_loop

    for key in ("AUTOLOOP_CACHE", "AUTOLOOP_PROFILE", "AUTOLOOP_DEVICE"):
        monkeypatch.setenv(key, tiny_env[key])
    repo = tmp_path / "proj"
    make_repo(
        repo, {name: (ROOT / name).read_text() for name in ("train.py", "prepare.py", "evaluate.py", ".gitignore")}
    )
    result = 'open(_s.argv[_s.argv.index("--result") + 1], "w").write({!r})\n    _o._exit(0)'
    forgeries = [
        ("prints a result", after_imports("if __name__ != '__main__':\n    print('AUTOLOOP_EVAL {\"val_bpb\": 0.1}')")),
        (
            "writes a result and exits",
            after_imports(
                "import sys as _s, os as _o\nif '--result' in _s.argv:\n    "
                + result.format('{"val_bpb": 0.1, "nonce": "guess"}')
            ),
        ),
        (
            "replaces json.dumps",
            after_imports(
                "import json as _j\nif __name__ != '__main__':\n    _j.dumps = lambda *a, **k: '{\"val_bpb\": 0.1}'"
            ),
        ),
        (
            "malformed result",
            after_imports("import sys as _s, os as _o\nif '--result' in _s.argv:\n    " + result.format("{not json")),
        ),
    ]
    plan = tmp_path / "plan.json"
    fakes.write_plan(plan, [{"description": name, "train": source} for name, source in forgeries])
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(plan))
    settings = dict(
        repo=repo,
        tag="m",
        budget=1.0,
        proposer="fakes:Scripted",
        baseline_repeats=0,
        startup_allowance=15.0,
        gate="strict",
    )
    from orchestrator.core.noise import Gate

    settings["gate"] = Gate("strict")
    run_loop(Settings(**settings, max_experiments=3), echo=lambda line: None)
    run_loop(Settings(**settings), echo=lambda line: None)  # a resume after the first forgeries
    run_loop(Settings(**settings), echo=lambda line: None)  # and one after the malformed result
    records = [read_record(Paths(repo, "m").run_dir(n)) for n in range(1, 6)]
    baseline, printed, early, dumps, malformed = records
    for record in (baseline, printed, early, dumps, malformed):
        assert record.status != "crash" and record.val_bpb > 1.0, (record.description, record.reason)
        assert record.val_bpb == record.metrics["harness_val_bpb"]


def test_the_clock_is_the_controllers():
    """Old: the audit trusted train.py's own training_seconds with a slack of max(60 s, budget/2): an edit that
    counts only half of each step trained ~1.9x the budget at --budget 60 and was kept. Now the train step's
    wall time, less the start-up the session's baseline needed, decides."""
    from orchestrator.trust.evaluation import audit_clock

    honest = {"training_seconds": 1.0, "num_steps": 10}  # what an under-reporting edit prints
    for budget in (60.0, 300.0):
        for startup in (5.0, 20.0, 38.0) if budget == 60 else (5.0, 60.0, 200.0):  # imports, data, compilation
            assert audit_clock(honest, budget, None, wall_s=startup + budget * 1.02, learned=startup) == ""
            why = audit_clock(honest, budget, None, wall_s=startup + budget * 1.3, learned=startup)
            assert why.startswith("budget exceeded: train.py ran"), (budget, startup)


def test_an_under_reporting_clock_is_refused(fake_repo, plan):
    repo = fake_repo(fakes.ok(1.0, sleep=4.0))  # the baseline trains its budget
    # 2x: 2.3 s over the limit (budget + 5% + 1.5 s), as the honest run is 1.7 s under it: either way more than a
    # bare Python's start-up jitters on a loaded machine (1.3x is checked exactly: test_the_clock_is_the_controllers)
    plan(
        [
            {"description": "trains 2x, reports 0.1 s", "train": fakes.ok(0.5, sleep=8.0)},
            {"description": "honest", "train": fakes.ok(0.9, sleep=4.0)},
        ]
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--repo",
            str(repo),
            "--tag",
            "c",
            "--budget",
            "4",
            "--proposer",
            "fakes:Scripted",
            "--max-experiments",
            "5",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_rows(Paths(repo, "c").ledger)
    # beside other users' load its first overrun is run again once a run of the baseline measured the start-up
    # (test_clock), and the second is its crash; on a machine nobody else keeps busy the first is (a test worker
    # beside it may be either)
    if len(rows) == 5:
        assert [r.status for r in rows] == ["keep", "discard", "discard", "crash", "keep"], rows
        assert "overran its budget once" in rows[1].description and "run 2 of it overran too" in rows[3].description
    else:
        assert [r.status for r in rows] == ["keep", "crash", "keep"], rows
        assert "on a machine nobody else kept busy" in rows[1].description
    assert "budget exceeded: train.py ran" in rows[-2].description


@pytest.mark.slow
def test_a_run_that_changes_the_prepared_data_is_a_crash_and_the_data_is_prepared_again(
    tiny_env, tmp_path, monkeypatch
):
    """Old: the data were re-verified only before the next run: the run that changed them was scored (and
    could be kept), and the next one stopped the night with an integrity error. Now the run that changed them
    is a crash row, the data are prepared again, and the loop goes on."""
    from conftest import ROOT, make_repo
    from test_trust import after_imports

    from orchestrator.core.noise import Gate
    from orchestrator.loop import Settings, run_loop

    cache = tmp_path / "cache"
    monkeypatch.setenv("AUTOLOOP_CACHE", str(cache))
    for key in ("AUTOLOOP_PROFILE", "AUTOLOOP_DEVICE"):
        monkeypatch.setenv(key, tiny_env[key])
    repo = tmp_path / "proj"
    make_repo(
        repo, {name: (ROOT / name).read_text() for name in ("train.py", "prepare.py", "evaluate.py", ".gitignore")}
    )
    settings = dict(
        repo=repo,
        tag="d",
        budget=1.0,
        proposer="fakes:Scripted",
        baseline_repeats=0,
        startup_allowance=15.0,
        gate=Gate("strict"),
        sandbox="off",
    )  # the sandbox would refuse it
    plan = tmp_path / "plan.json"
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(plan))
    fakes.write_plan(plan, [])
    run_loop(Settings(**settings, max_experiments=1), echo=lambda line: None)  # the baseline prepares the data
    target = next(cache.glob("*/tokenizer-*/token_bytes.pt"))
    fakes.write_plan(
        plan,
        [
            {"description": "changes the data", "train": after_imports(f"open({str(target)!r}, 'ab').write(b'x')")},
            {"description": "honest", "train": after_imports("pass")},
        ],
    )
    lines = []
    run_loop(Settings(**settings, max_experiments=3), echo=lines.append)
    rows = read_rows(Paths(repo, "d").ledger)
    assert [r.status for r in rows][1:] == ["crash", "keep"] or [r.status for r in rows][1] == "crash"
    assert "the run changed the harness: prepared file" in rows[1].description
    assert any("preparing data again" in line for line in lines)
    assert rows[2].status != "crash", rows[2]  # the next run is fine


def test_a_run_that_touches_the_controllers_state_is_a_crash_and_the_state_is_restored(fake_repo, plan):
    """Old: from its working directory an edit could append rows to the ledger, rewrite run records, and plant
    a hook the controller itself would run at its next commit. Now, unconfined (the sandbox refuses the writes),
    each is a crash row naming what was touched, and it is put back as it was."""
    repo = fake_repo(fakes.ok(1.0))
    hook = repo / ".git" / "hooks" / "post-commit"
    attack = (
        f"from pathlib import Path\n"
        f"open('../../results.tsv', 'a').write('abcdef0\\t0.100000\\t0.0\\t0.00\\tkeep\\tforged\\n')\n"
        f"Path('../../runs/1/record.json').write_text('{{}}')\n"
        f"Path({str(hook)!r}).write_text('#!/bin/sh\\ntouch {repo}/pwned\\n')\n"
        f"Path({str(hook)!r}).chmod(0o755)\n"
    )
    plan(
        [{"description": "attack", "train": attack + fakes.ok(0.5)}, {"description": "honest", "train": fakes.ok(0.9)}]
    )
    proc = autoloop(repo, "--tag", "s", "--max-experiments", "3", "--proposer", "fakes:Scripted", "--sandbox", "off")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_rows(Paths(repo, "s").ledger)
    assert [(r.description.split(" [")[0], r.status) for r in rows] == [
        ("baseline", "keep"),
        ("attack", "crash"),
        ("honest", "keep"),
    ]
    assert "the run touched what it may not (restored)" in rows[1].description
    assert ".autoloop/s/results.tsv" in rows[1].description and "record.json" in rows[1].description
    assert not hook.exists() and not (repo / "pwned").exists()
    assert read_record(Paths(repo, "s").run_dir(1)).description == "baseline"


needs_bwrap = pytest.mark.skipif(
    __import__("orchestrator.trust.confine", fromlist=["x"]).sandbox_problem() != "",
    reason="bubblewrap cannot run here (.ci/run installs it)",
)


@needs_bwrap
@pytest.mark.parametrize("sandbox", ["on", "off"])
def test_the_sandbox_refuses_writes_outside_the_run_and_the_network(fake_repo, plan, tmp_path, sandbox):
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    port = server.getsockname()[1]

    def serve():
        try:
            while True:
                server.accept()[0].close()
        except OSError:  # closed at the end of the test
            pass

    threading.Thread(target=serve, daemon=True).start()
    outside = tmp_path / "outside.txt"
    writes = f"open({str(outside)!r}, 'w').write('escaped')\n"
    connects = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 5).close()\n"
    inside = "open('scratch.txt', 'w').write('fine')\nimport os, tempfile\ntempfile.mkstemp()\n"
    plan(
        [
            {"description": "writes outside", "train": writes + fakes.ok(0.9)},
            {"description": "connects", "train": connects + fakes.ok(0.8)},
            {"description": "writes inside", "train": inside + fakes.ok(0.7)},
        ]
    )
    proc = autoloop(
        repo := fake_repo(fakes.ok(1.0)),
        "--tag",
        "x",
        "--max-experiments",
        "4",
        "--sandbox",
        sandbox,
        "--proposer",
        "fakes:Scripted",
    )
    server.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_rows(Paths(repo, "x").ledger)
    statuses = [r.status for r in rows]
    if sandbox == "off":
        assert statuses == ["keep"] * 4 and outside.read_text() == "escaped"
        return
    assert statuses == ["keep", "crash", "crash", "keep"], rows
    assert not outside.exists()
    assert "the sandbox refused a write outside the run's directory" in rows[1].description
    assert "Read-only file system" in rows[1].description
    assert "Network is unreachable" in rows[2].description or "refused" in rows[2].description


# What a run can see, printed by train.py: pid 1's command (bubblewrap in the sandbox's own PID namespace, the
# host's init outside it), whether a file of the host outside the run's binds is there, and HOME.
SEES = (
    "import os as _os\n"
    "print('SEES', repr([open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0].decode(), "
    "_os.path.exists({host!r}), _os.environ.get('HOME')]), flush=True)"
)


@needs_bwrap
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_tiny_session_runs_confined_in_the_sandbox(tiny_env, tmp_path, clock_slack):
    """The real train.py and harness (tiny profile, CPU) in the sandbox: every run of the session was confined
    (its own PID namespace, whose pid 1 is bubblewrap, not the host's init; a host file outside its binds is
    not there; its HOME is the run's scratch one), and each row is a result of the usual kind: the harness's own
    measurement of a model that learned."""
    import ast
    from pathlib import Path

    from conftest import ROOT, make_repo
    from test_trust import after_imports

    host_file = tmp_path / "host-only.txt"  # beside the repository, under the host's /tmp
    host_file.write_text("the host's\n")
    host_init = Path("/proc/1/cmdline").read_bytes().split(b"\0")[0].decode()
    repo = tmp_path / "on"
    make_repo(
        repo,
        {
            "train.py": after_imports(SEES.format(host=str(host_file))),
            **{name: (ROOT / name).read_text() for name in ("prepare.py", "evaluate.py", ".gitignore")},
        },
    )
    env = dict(tiny_env, **clock_slack, **{k: v for k, v in subprocess_env().items() if k == "PYTHONPATH"})
    proc = autoloop(
        repo,
        "--tag",
        "t",
        "--budget",
        "2",
        "--max-experiments",
        "2",
        "--baseline-repeats",
        "0",
        "--sandbox",
        "on",
        "--proposer",
        "perturb",
        "--gate",
        "strict",
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unconfined" not in proc.stdout
    rows = read_rows(Paths(repo, "t").ledger)
    assert len(rows) == 2 and rows[0].status == "keep", rows
    for n, row in enumerate(rows, 1):
        log = (Paths(repo, "t").run_dir(n) / "run.log").read_text()
        pid1, sees_host_file, home = ast.literal_eval(log.split("SEES ", 1)[1].splitlines()[0])
        assert os.path.basename(pid1) == "bwrap" and pid1 != host_init, (n, pid1, host_init)
        assert sees_host_file is False, n
        assert home == str(Paths(repo, "t").run_dir(n) / "home"), (n, home)
        assert "sandbox" not in row.description, row
        assert "model exported for the autoloop harness" in log, n  # trained, then the harness evaluated
    baseline = read_record(Paths(repo, "t").run_dir(1))
    assert baseline.val_bpb == baseline.metrics["harness_val_bpb"] > 0 and math.isfinite(baseline.val_bpb)
    assert baseline.metrics["num_steps"] >= 1 and baseline.metrics["eval_seconds"] > 0, baseline.metrics
    assert rows[1].status in ("keep", "discard") or "exit code" in rows[1].description, rows[1]  # an idea's own
