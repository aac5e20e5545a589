"""What an unconfined run leaves behind (P14): no process (however it detached), and no secret of ours in any
encoding in a row, a record or the next prompt. Each test is the attack run for real."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import fakes
import psutil
import pytest
from conftest import subprocess_env

from orchestrator.executors.runner import run_command
from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths


def daemon(marker: str, heartbeat: Path) -> str:
    """train.py code that leaves a daemon: double fork, setsid, argv carrying marker, a heartbeat every 0.1 s."""
    beat = f"import time\nwhile True:\n    open({str(heartbeat)!r}, 'a').write('.')\n    time.sleep(0.1)\n"
    return (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', {beat!r}, {marker!r}])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "import time\n"
        f"while not os.path.exists({str(heartbeat)!r}):  # it runs\n"
        "    time.sleep(0.01)\n"
    )


def marked(marker: str) -> list[psutil.Process]:
    """Live processes with marker in their command line."""
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if marker in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(proc)
    return out


def gone(marker: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not marked(marker)


@pytest.fixture
def no_daemons():
    """Whatever a test leaves running with its marker is killed after it (a failed test must not leak)."""
    markers: list[str] = []
    yield markers.append
    for marker in markers:
        for proc in marked(marker):
            proc.kill()


def test_run_command_ends_a_detached_daemon_and_keeps_stdin_and_exit_codes(tmp_path, no_daemons):
    marker = f"autoloop-test-daemon-{os.getpid()}-a"
    no_daemons(marker)
    code = daemon(marker, tmp_path / "beat") + "print('read', input(), flush=True)\nsys.exit(3)\n"
    result = run_command(
        [sys.executable, "-c", code], tmp_path, dict(os.environ), tmp_path / "log", 30, stdin_text="nonce-123\n"
    )
    assert result.exit_code == 3 and not result.timed_out and (tmp_path / "beat").exists()
    assert "read nonce-123" in (tmp_path / "log").read_text()
    assert not marked(marker)  # at once: run_command returns after the daemon is gone
    killed = run_command(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        tmp_path,
        dict(os.environ),
        tmp_path / "log2",
        30,
    )
    assert killed.exit_code == -signal.SIGKILL
    slow = run_command(
        [sys.executable, "-c", daemon(marker, tmp_path / "beat") + "import time; time.sleep(60)"],
        tmp_path,
        dict(os.environ),
        tmp_path / "log3",
        1.5,
    )
    assert slow.timed_out and not marked(marker)


def test_a_runs_daemon_ends_with_the_run(fake_repo, tmp_path, monkeypatch, no_daemons):
    """Old: kill_tree found a run's processes by parentage and process group: a double-forked setsid daemon
    was in neither and kept running after the run, the loop and the controller. Now it ends with its run."""
    marker = f"autoloop-test-daemon-{os.getpid()}-b"
    no_daemons(marker)
    seen = tmp_path / "seen.json"
    look = (
        "import json, os\nlive = []\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n    try:\n"
        f"        if {marker!r}.encode() in open(f'/proc/{{pid}}/cmdline', 'rb').read():\n"
        "            live.append(pid)\n    except OSError:\n        pass\n"
        f"open({str(seen)!r}, 'w').write(json.dumps(live))\n"
    )
    monkeypatch.setenv(
        "AUTOLOOP_TEST_PLAN",
        str(
            fakes.write_plan(
                tmp_path / "plan.json",
                [
                    {"description": "leaves a daemon", "train": daemon(marker, tmp_path / "beat") + fakes.ok(0.9)},
                    {"description": "looks for it", "train": look + fakes.ok(0.95)},
                ],
            )
        ),
    )
    repo = fake_repo(fakes.ok(1.0))
    run_loop(
        Settings(
            repo=repo,
            tag="d",
            budget=1.0,
            timeout=30.0,
            proposer="fakes:Scripted",
            baseline_repeats=0,
            max_experiments=3,
            sandbox="off",
        ),
        echo=lambda line: None,
    )
    assert (tmp_path / "beat").exists()  # the daemon did start
    assert json.loads(seen.read_text()) == []  # gone by the next run
    assert not marked(marker)  # and after the loop
    assert [r.status for r in read_rows(Paths(repo, "d").ledger)] == ["keep", "keep", "discard"]


@pytest.mark.timeout(120)
def test_a_sigkilled_controller_leaves_nothing_running(fake_repo, tmp_path, no_daemons):
    """The controller dies by SIGKILL while a run trains: the run, and the daemon it detached, end with it (no
    resume needed: the reaper under each run has the controller's death signalled to it)."""
    marker = f"autoloop-test-daemon-{os.getpid()}-c"
    no_daemons(marker)
    beat = tmp_path / "beat"
    plan = fakes.write_plan(
        tmp_path / "plan.json",
        [{"description": "trains long", "train": daemon(marker, beat) + f"# {marker}\n" + fakes.ok(0.9, sleep=120.0)}],
    )
    repo = fake_repo(fakes.ok(1.0))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--repo",
            str(repo),
            "--tag",
            "k",
            "--budget",
            "60",
            "--proposer",
            "fakes:Scripted",
            "--baseline-repeats",
            "0",
        ],
        env=subprocess_env(AUTOLOOP_TEST_PLAN=str(plan)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not (beat.exists() and marked(marker)) and time.monotonic() < deadline:
        assert proc.poll() is None
        time.sleep(0.1)
    assert marked(marker), "the daemon never started"
    trains = [p for p in psutil.process_iter(["cwd"]) if (p.info["cwd"] or "").startswith(str(repo / ".autoloop"))]
    assert trains  # train.py (cwd: its slot's worktree) is training
    proc.kill()
    proc.wait(timeout=30)
    try:
        assert gone(marker)
        deadline = time.monotonic() + 10.0  # (as for the daemon: the reaper's SIGTERM, grace, SIGKILL, under load)
        while (alive := [p for p in trains if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert alive == []
    finally:
        for train in trains:  # a failed test must not leave them
            try:
                train.kill()
            except psutil.Error:
                pass
    size = beat.stat().st_size
    time.sleep(0.5)
    assert beat.stat().st_size == size  # no heartbeat from anywhere


SECRET = "sk-test-Q9w8E7r6T5y4U3i2O1p0Zx"


def leaks(text: str) -> list[str]:
    """The encodings of SECRET found in text (independent of orchestrator.trust.redaction's own list)."""
    raw = SECRET.encode()
    forms = {
        "literal": SECRET,
        "hex": raw.hex(),
        "HEX": raw.hex().upper(),
        "url": urllib.parse.quote(SECRET, safe=""),
        "base64": base64.b64encode(raw).decode()[:-4],
        "base64url": base64.urlsafe_b64encode(raw).decode()[:-4],
    }
    for k in (1, 2):  # the secret inside a longer stream, at the other alignments: its middle is stable
        encoded = base64.b64encode(bytes(k) + raw).decode()
        forms[f"base64+{k}"] = encoded[4:-4]
    return [name for name, form in forms.items() if form in text]


STEAL = """import base64, os, urllib.parse
secret, pid = None, os.getppid()
while pid > 1 and secret is None:  # up the chain of our ancestors to one that has the key
    try:
        env = dict(v.split(b"=", 1) for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\\0") if b"=" in v)
        secret = env.get(b"OPENAI_API_KEY")
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError:
        break
assert secret, "no ancestor had the key"
print("b64", base64.b64encode(secret).decode())
print("b64url", base64.urlsafe_b64encode(secret).decode())
print("shifted", base64.b64encode(b"x" + secret + b"y").decode(), base64.b64encode(b"xy" + secret).decode())
print("hex", secret.hex(), secret.hex().upper(), "url", urllib.parse.quote(secret.decode(), safe=""))
b64, shifted = base64.b64encode(secret).decode(), base64.b64encode(b"xy" + secret).decode()
raise RuntimeError(f"leaked {b64} {secret.hex()} {shifted}")
"""


def test_a_secret_raised_in_any_encoding_reaches_no_row_record_or_prompt(fake_repo, tmp_path, monkeypatch):
    """Old: redaction replaced the literal value only: a key read from the controller's environment and raised
    base64-encoded was in results.tsv (the crash reason) and in the next LLM prompt (the log tail)."""
    from orchestrator.proposers.prompt import build_prompt

    plan = fakes.write_plan(tmp_path / "plan.json", [{"description": "steals the key", "train": STEAL}])
    repo = fake_repo(fakes.ok(1.0))
    proc = subprocess.run(
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
            "1",
            "--timeout",
            "30",
            "--proposer",
            "fakes:Scripted",
            "--max-experiments",
            "2",
        ],
        env=subprocess_env(AUTOLOOP_TEST_PLAN=str(plan), OPENAI_API_KEY=SECRET),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    paths = Paths(repo, "s")
    log = (paths.run_dir(2) / "run.log").read_text()
    assert set(leaks(log)) >= {"base64", "base64url", "hex", "HEX", "url", "base64+1", "base64+2"}  # it got out
    rows = read_rows(paths.ledger)
    assert [r.status for r in rows] == ["keep", "crash"] and "RuntimeError: leaked" in rows[1].description
    assert leaks(paths.ledger.read_text()) == []
    assert leaks((paths.run_dir(2) / "record.json").read_text()) == []
    assert leaks(proc.stdout + proc.stderr) == []
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)  # the controller's environment, where the prompt is built
    history = [read_record(paths.run_dir(n)) for n in (1, 2)]
    prompt = build_prompt("Brief.", fakes.ok(1.0), history, paths, "Propose one change.")
    assert "The last experiment crashed" in prompt and "End of its log" in prompt and "shifted" in prompt
    assert leaks(prompt) == []


def test_unconfined_the_evaluation_never_starts_before_training_has_ended(tmp_path):
    """The evaluation may start early only in the sandbox, where the training step cannot see it. Unconfined, a
    train.py could reach its process (signal it, read its memory as the same user), so it starts as ever: after
    the training step and every process of it have ended, whatever train.py prints."""
    from orchestrator.executors.base import Job, run_steps

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    training = "import time\nprint('training is over', flush=True)\ntime.sleep(1.0)\nprint('ENDED', time.time())\n"
    evaluation = "import sys, time\nprint('STARTED', time.time(), sys.stdin.readline().strip())\n"
    (work / "train.py").write_text(training)
    (work / "evaluate.py").write_text(evaluation)
    job = Job(
        steps=[[sys.executable, "train.py"], [sys.executable, "evaluate.py"]],
        logs=["run.log", "eval.log"],
        env={"PATH": os.environ["PATH"]},
        timeout_s=60,
        workdir=work,
        out_dir=out,
        step_stdin=[None, "go\n"],
        step_start_after=[None, "training is over"],
    )
    result = run_steps(job, work, out, {})
    assert [s.exit_code for s in result.steps] == [0, 0]
    ended = float((out / "run.log").read_text().split("ENDED ")[1].split()[0])
    started, told = (out / "eval.log").read_text().split("STARTED ")[1].split()[:2]
    assert float(started) > ended and told == "go"


@pytest.mark.parametrize("chunks", [["training is over\n"], ["step 1\ntrain", "ing is ov", "er\r\nmore"]])
def test_the_line_that_starts_a_step_early_is_found_however_the_output_is_cut(chunks):
    from orchestrator.executors.runner import LineWatch

    seen: list[int] = []
    watch = LineWatch("training is over", lambda: seen.append(1))
    for chunk in chunks:
        watch(chunk.encode())
    assert seen == [1]
    watch(b"training is over\n")
    assert seen == [1]  # once
    other = LineWatch("training is over", lambda: seen.append(2))
    other(b"print('training is over')\nsaid: training is over\ntraining is over, almost")
    assert seen == [1]  # only as a line of its own


def test_unconfined_the_controller_never_writes_through_a_log_the_run_planted(tmp_path):
    """The run's directory is the run's to write: a train.py that leaves the next step's log as a link to a file
    of the user's does not get the controller (root, in containers) to truncate and fill that file."""
    from orchestrator.executors.base import Job, run_steps

    work, out, victim = tmp_path / "work", tmp_path / "out", tmp_path / "victim"
    work.mkdir()
    victim.write_text("the user's")
    (work / "train.py").write_text(f"import os\nos.symlink({str(victim)!r}, {str(out / 'eval.log')!r})\n")
    job = Job(
        steps=[[sys.executable, "train.py"], [sys.executable, "-c", "print('evaluated')"]],
        logs=["run.log", "eval.log"],
        env={"PATH": os.environ["PATH"]},
        timeout_s=60,
        workdir=work,
        out_dir=out,
    )
    result = run_steps(job, work, out, {})
    assert [s.exit_code for s in result.steps] == [0, 0]
    assert victim.read_text() == "the user's"
    assert not (out / "eval.log").is_symlink() and (out / "eval.log").read_text() == "evaluated\n"


def test_a_step_called_off_at_its_gate_reads_an_empty_stdin(tmp_path):
    """A step held at its gate (it started early) and then called off is told so: its stdin closes with nothing
    written (no nonce), so a harness that waits on it ends by itself, before it is killed."""
    import threading

    told = tmp_path / "told"
    code = (
        "import signal, sys\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(told)!r}, 'w').write(repr(sys.stdin.read()))\n"
    )
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    run = run_command(
        [sys.executable, "-c", code],
        tmp_path,
        dict(os.environ),
        tmp_path / "log",
        60,
        cancel=cancel,
        stdin_text="nonce\n",
        stdin_gate=threading.Event(),  # never opened
    )
    assert run.interrupted and told.read_text() == "''"


def test_a_record_is_never_written_through_a_link_the_run_left(tmp_path):
    """record.json goes into the run's directory, which the run can write. Old: it was written through a
    temporary file of a predictable name (record.json.<pid>.<thread>.tmp), so a link left at that name made
    the controller write into the file it pointed at."""
    import threading

    from orchestrator.store.ledger import Record, read_record, write_record

    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    run_dir.mkdir()
    victim.write_text("the user's")
    (run_dir / f"record.json.{os.getpid()}.{threading.get_ident()}.tmp").symlink_to(victim)
    write_record(run_dir, Record(n=1, commit="abc", parent="", description="d", status="keep"))
    assert victim.read_text() == "the user's"
    assert read_record(run_dir).description == "d" and (run_dir / "record.json").stat().st_mode & 0o777 == 0o644
