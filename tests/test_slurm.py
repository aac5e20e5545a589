"""The Slurm executor against a real one-node Slurm (tests/slurm_cluster.py, started by the suite): the executor
contract, jobs lost to the cluster (cancelled by hand, waiting on a DOWN node) run again and never recorded as
the idea's crash, a real tiny session with two jobs at once, Ctrl-C and SIGKILL leaving nothing in the queue,
and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fakes
import pytest
from conftest import CLOCK_SLACK, ROOT, make_repo, subprocess_env

from orchestrator import contract
from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths

slow = pytest.mark.slow  # real Slurm daemons, real jobs

ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")


@pytest.fixture
def slurm(slurm_cluster, monkeypatch):
    """The cluster, its client configuration in this process's environment, and an empty queue after the test."""
    for key, value in slurm_cluster.env.items():
        if key.startswith("SLURM"):
            monkeypatch.setenv(key, value)
    yield slurm_cluster
    left = active(slurm_cluster)
    if left:
        slurm_cluster.run("scancel", *[j["id"] for j in left], check=False)
    if any(n.startswith(("down", "drain")) for n in slurm_cluster.run("sinfo", "-h", "-o", "%t").stdout.split()):
        slurm_cluster.set_node("RESUME")  # (a test that set it DOWN and failed on the way)
    assert not left, f"jobs left in the queue: {left}"


def active(cluster) -> list[dict]:
    return [j for j in cluster.jobs() if j["state"] in ACTIVE]


def wait_for(what, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@slow
@pytest.mark.timeout(300)
def test_the_slurm_executor_passes_the_executor_contract(slurm, tmp_path):
    from orchestrator.executors.slurm import SlurmExecutor

    ex = SlurmExecutor(workdir=tmp_path / "shared")
    try:
        assert [s.label for s in ex.slots] == ["slurm"] * slurm.cpus  # one CPU per run, every CPU of the partition
        contract.check_executor(ex, tmp_path / "contract")
    finally:
        ex.close()
    assert not active(slurm)
    assert not list((tmp_path / "shared" / "jobs").iterdir())  # each job's directory removed once collected


@slow
@pytest.mark.timeout(120)
def test_a_job_gets_the_allowed_environment_never_the_controllers_secrets(slurm, tmp_path, monkeypatch):
    from orchestrator.executors.slurm import SlurmExecutor

    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    monkeypatch.setenv("AUTOLOOP_SHIPPED", "yes")
    monkeypatch.setenv("LANG", "C.UTF-8")
    repo = contract.code_repo(tmp_path / "code")
    ex = SlurmExecutor(workdir=tmp_path / "shared")
    try:
        show = (  # its own environment, and what it can read of every process above it (/proc/PID/environ)
            "import os, json, psutil\n"
            "above = []\n"
            "for p in psutil.Process().parents():\n"
            "    try: above.append(open(f'/proc/{p.pid}/environ', 'rb').read().decode(errors='replace'))\n"
            "    except OSError: pass\n"
            "print(json.dumps({**os.environ, '_above': above}))"
        )
        job = contract.job(repo, tmp_path / "out", [["{python}", "-c", show]])
        result = ex.submit(job, ex.slots[0]).result(timeout=90)
    finally:
        ex.close()
    assert result.ok, result
    seen = json.loads((tmp_path / "out" / "step0.log").read_text())
    assert "HF_TOKEN" not in seen and "hf_secret_value_123" not in json.dumps(seen)
    assert len(seen["_above"]) >= 2  # the node's runner and slurmstepd at least: none of them holds the secret
    assert seen["AUTOLOOP_SHIPPED"] == "yes" and seen["LANG"] == "C.UTF-8" and "PATH" in seen
    assert (tmp_path / "out" / "slurm.log").exists()  # it ran as a Slurm job (whose own variables stay out)


@slow
@pytest.mark.timeout(180)
def test_each_job_sees_the_gpus_slurm_gave_it(tmp_path, monkeypatch):
    """A partition with two (fake) GPUs: one GPU per run by default, a slot per GPU, and each of two jobs at once
    sees its own CUDA_VISIBLE_DEVICES as Slurm set it (the controller's own value never travels)."""
    from slurm_cluster import SlurmCluster, slurm_problem

    from orchestrator.executors.slurm import SlurmExecutor

    if problem := slurm_problem():
        pytest.skip(problem)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with SlurmCluster(tmp_path / "gc", cpus=2, gpus=2) as cluster:
        for key, value in cluster.env.items():
            if key.startswith("SLURM"):
                monkeypatch.setenv(key, value)
        ex = SlurmExecutor(workdir=tmp_path / "shared")
        try:
            assert ex.gpus == 1 and ex.cpus is None and len(ex.slots) == 2
            seen = contract.check_own_gpus(ex, contract.code_repo(tmp_path / "code"), tmp_path / "gpus")
        finally:
            ex.close()
    assert sorted(seen) == ["'0'", "'1'"], seen


# Attacks from the experiment's side: the run (train.py) is not trusted, sandboxed or not (the suite's runs are
# not: the defences below must hold without it).

ATTACK = """
import json, os, sys, time
out = os.environ["AUTOLOOP_OUT"]
job = os.path.dirname(out)
print("spec on disk:", os.path.exists(os.path.join(job, "spec.json")), flush=True)
os.symlink("/proc/self/environ", os.path.join(out, "stolen"))   # the controller's environment, if it follows
os.symlink("/proc/self/mem", os.path.join(out, "crash"))        # a read error, if it follows
forged = {"steps": [[0, False, 1.0, "step0.log"]], "modified": [], "ages": {}, "device": "forged", "node": "x",
          "interrupted": False, "stopped": "", "audited": "", "files": {}}
with open(os.path.join(job, "result.json"), "w") as f:         # a result before the job has ended
    json.dump(forged, f)
time.sleep(4)
sys.exit(3)
"""


@slow
@pytest.mark.timeout(120)
def test_a_run_cannot_forge_its_result_read_the_spec_or_plant_links_for_the_controller(slurm, tmp_path, monkeypatch):
    from orchestrator.executors.slurm import SlurmExecutor

    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    repo = contract.make_git_repo(tmp_path / "code", {"attack.py": ATTACK})
    ex = SlurmExecutor(workdir=tmp_path / "shared")
    try:
        result = ex.submit(contract.job(repo, tmp_path / "out", [["{python}", "attack.py"]]), ex.slots[0]).result(60)
    finally:
        ex.close()
    assert [s.exit_code for s in result.steps] == [3] and result.device != "forged", result  # the node's result
    assert "spec on disk: False" in (tmp_path / "out" / "step0.log").read_text()  # (the nonce is in it)
    assert not (tmp_path / "out" / "stolen").exists() and not (tmp_path / "out" / "crash").exists()
    assert not any("hf_secret_value_123" in p.read_text(errors="replace") for p in (tmp_path / "out").iterdir())


@slow
@pytest.mark.timeout(120)
def test_a_node_that_cannot_sandbox_fails_the_job_instead_of_running_it_bare(slurm, tmp_path):
    """The controller could sandbox (--sandbox auto), the node cannot (no bubblewrap on its PATH): the executor's
    failure, never an unconfined run."""
    from orchestrator.executors.slurm import SlurmExecutor

    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nPATH=/nonexistent exec {sys.executable} "$@"\n')
    bare.chmod(0o755)
    repo = contract.code_repo(tmp_path / "code")
    ex = SlurmExecutor(workdir=tmp_path / "shared", python=str(bare))
    job = contract.job(repo, tmp_path / "out", [["{python}", "show.py"]])
    job.sandbox = {"net": False, "required": False}  # what --sandbox auto gives where the controller can
    try:
        result = ex.submit(job, ex.slots[0]).result(timeout=60)
    finally:
        ex.close()
    assert not result.steps and "the sandbox is required" in result.infra_error, result
    assert "bubblewrap is not installed" in result.infra_error


@slow
@pytest.mark.timeout(120)
def test_a_queue_that_stops_answering_is_the_executors_failure_and_is_not_flooded(slurm, tmp_path, monkeypatch):
    from orchestrator.executors import slurm as executor

    repo = contract.code_repo(tmp_path / "code")
    ex = executor.SlurmExecutor(workdir=tmp_path / "shared")
    handle = ex.submit(contract.job(repo, tmp_path / "out", [["{python}", "hang.py"]], timeout=300), ex.slots[0])
    calls = tmp_path / "calls"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "squeue").write_text(f"#!/bin/sh\necho x >> {calls}\necho 'squeue: error: Unable to contact' >&2\nexit 1\n")
    (fake / "squeue").chmod(0o755)
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{fake}:{path}")
    monkeypatch.setattr(executor, "QUEUE_DOWN_S", 4.0)
    try:
        assert handle.wait(30)
        result = handle.result(timeout=0)
    finally:
        monkeypatch.setenv("PATH", path)  # the queue answers again: close() cancels the job it lost sight of
        ex.close()
    assert "Slurm's queue has not answered for" in result.infra_error and "Unable to contact" in result.infra_error
    assert len(calls.read_text().splitlines()) <= 8  # about one a second, not a busy loop


def settings(repo: Path, tmp_path: Path, **extra) -> Settings:
    options = {"slurm_workdir": tmp_path / "shared", **extra.pop("executor_options", {})}
    return Settings(
        repo=repo,
        tag="s",
        budget=5.0,
        timeout=60.0,
        proposer="fakes:Scripted",
        baseline_repeats=0,
        executor="slurm",
        executor_options=options,
        workers=1,
        **extra,
    )


@slow
@pytest.mark.timeout(240)
def test_a_job_cancelled_by_hand_runs_again_and_is_not_the_ideas_crash(slurm, fake_repo, tmp_path, plan):
    repo = fake_repo(fakes.ok(1.0))
    plan([{"description": "slow idea", "train": fakes.ok(0.9, 6.0)}])
    paths = Paths(repo, "s")
    cancelled: list[str] = []

    def cancel_the_idea() -> None:  # its job, once it runs: the second experiment's
        def training():  # the idea's job, its train.py started (its log on the node)
            logs = [p for p in (tmp_path / "shared" / "jobs").glob("*/out/*.log") if p.name != "prepare.log"]
            running = [j for j in slurm.jobs() if j["state"] == "RUNNING"]
            return len(read_rows(paths.ledger)) == 1 and logs and running

        job = wait_for(training, timeout=120)[0]
        slurm.run("scancel", job["id"])
        cancelled.append(job["id"])

    thread = threading.Thread(target=cancel_the_idea, daemon=True)
    thread.start()
    lines: list[str] = []
    run_loop(settings(repo, tmp_path, max_experiments=2), echo=lines.append)
    thread.join(5)
    assert cancelled, "\n".join(lines)
    rows = read_rows(paths.ledger)
    assert [r.status for r in rows] == ["keep", "keep"], "\n".join(lines)
    record = read_record(paths.run_dir(2))
    failures = record.info.get("infra_failures") or []
    assert len(failures) == 1 and f"Slurm job {cancelled[0]}" in failures[0] and "from outside" in failures[0]
    assert record.val_bpb == 0.9 and record.device
    assert any("the executor failed" in line and "running it again" in line for line in lines)


@slow
@pytest.mark.timeout(240)
def test_a_job_waiting_on_a_down_node_runs_again_once_it_is_back(slurm, fake_repo, tmp_path, plan):
    repo = fake_repo(fakes.ok(1.0))
    plan([{"description": "an idea", "train": fakes.ok(0.9)}])
    paths = Paths(repo, "s")
    slurm.set_node("DOWN", "test: node lost")
    back = threading.Event()
    lines: list[str] = []

    def echo(line: str) -> None:  # the waiting job given up once: the node comes back
        lines.append(line)
        if "the executor failed" in line and not back.is_set():
            slurm.set_node("RESUME")
            back.set()

    run_loop(settings(repo, tmp_path, max_experiments=2, executor_options={"slurm_queue_timeout": 3.0}), echo=echo)
    assert back.is_set()
    rows = read_rows(paths.ledger)
    assert [r.status for r in rows] == ["keep", "keep"], "\n".join(lines)
    failures = read_record(paths.run_dir(1)).info.get("infra_failures") or []
    assert failures and all("waited in the queue over 3s" in f for f in failures), failures


def start_cli(repo: Path, workdir: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "run", "--repo", str(repo), "--tag", "s", "--executor", "slurm"]
        + ["--slurm-workdir", str(workdir), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@slow
@pytest.mark.timeout(300)
def test_sigkill_of_the_controller_then_resume_cancels_its_jobs(slurm, fake_repo, tmp_path):
    repo = fake_repo(fakes.ok(1.0))
    slow = fakes.write_plan(tmp_path / "slow.json", [{"description": "slow", "train": fakes.ok(0.9, 120.0)}])
    env = subprocess_env(**slurm.env, AUTOLOOP_TEST_PLAN=str(slow))
    first = start_cli(repo, tmp_path / "shared", env, "--proposer", "fakes:Scripted", "--budget", "5", "--workers", "1")
    paths = Paths(repo, "s")
    wait_for(lambda: len(read_rows(paths.ledger)) == 1 and active(slurm), timeout=120)
    left = [j["id"] for j in active(slurm)]
    first.kill()
    first.communicate(timeout=30)
    assert [j["id"] for j in active(slurm)] == left  # the killed controller's job is still in the queue
    fast = fakes.write_plan(tmp_path / "fast.json", [{"description": "slow", "train": fakes.ok(0.9)}])
    second = start_cli(
        repo,
        tmp_path / "shared",
        {**env, "AUTOLOOP_TEST_PLAN": str(fast)},
        "--proposer",
        "fakes:Scripted",
        "--budget",
        "5",
        "--max-experiments",
        "2",
        "--workers",
        "1",
    )
    out, _ = second.communicate(timeout=180)
    assert second.returncode == 0, out
    states = {j["id"]: j["state"] for j in slurm.jobs()}
    assert all(states.get(i) == "CANCELLED" for i in left), states  # cancelled by the resumed session
    assert [r.status for r in read_rows(paths.ledger)] == ["keep", "keep"]


@slow
@pytest.mark.timeout(600)
def test_a_real_tiny_session_on_slurm_with_two_jobs_at_once_ctrl_c_and_resume(slurm, tiny_env, tmp_path):
    """Done-when of issue #35: 6 rows, 2 jobs running at once, Ctrl-C leaves the queue empty, resume completes;
    every run sandboxed on the node."""
    repo = tmp_path / "proj"
    make_repo(
        repo, {name: (ROOT / name).read_text() for name in ("train.py", "prepare.py", "evaluate.py", ".gitignore")}
    )
    env = dict(
        tiny_env,
        **slurm.env,
        **CLOCK_SLACK,
        PYTHONPATH=subprocess_env()["PYTHONPATH"],
        AUTOLOOP_PROGRESS_SECONDS="1e9",
    )
    # --sandbox on: each run confined by bubblewrap on the node, or the node's failure (then no row is written)
    args = ("--workers", "2", "--profile", "tiny", "--budget", "5", "--max-experiments", "6", "--sandbox", "on")
    most = [0]
    stop = threading.Event()

    def watch_the_queue() -> None:
        while not stop.is_set():
            most[0] = max(most[0], len([j for j in slurm.jobs() if j["state"] == "RUNNING"]))
            time.sleep(0.3)

    watcher = threading.Thread(target=watch_the_queue, daemon=True)
    watcher.start()
    first = start_cli(repo, tmp_path / "shared", env, *args)
    paths = Paths(repo, "s")
    wait_for(lambda: len(read_rows(paths.ledger)) >= 2 and len(active(slurm)) == 2, timeout=400, every=0.5)
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 130, out
    assert not active(slurm), slurm.jobs()  # Ctrl-C cancelled every job of the generation
    done_before = len(read_rows(paths.ledger))
    assert done_before < 6
    second = start_cli(repo, tmp_path / "shared", env, *args)
    out2, _ = second.communicate(timeout=500)
    stop.set()
    watcher.join(5)
    assert second.returncode == 0, out2
    rows = read_rows(paths.ledger)
    assert len(rows) == 6 and all(r.val_bpb > 0 for r in rows if r.status != "crash"), out2
    assert sum(r.status == "crash" for r in rows) == 0, out2
    assert most[0] == 2  # two jobs ran at once
    assert not active(slurm)
    records = [read_record(paths.run_dir(n)) for n in range(1, 7)]
    assert all(r.device == "cpu" for r in records) and {r.slot for r in records} == {0, 1}
    assert "2 slot(s): slurm, slurm" in out2


# Without a cluster (the fast tier runs these too: they need no daemon)


@pytest.mark.parametrize(
    "gres, gpus",
    [("(null)", 0), ("gpu:4", 4), ("gpu:a100:8(S:0-1)", 8), ("gpu:2,gpu:v100:2", 4), ("shard:8,gpu:1", 1)],
)
def test_the_gpus_of_a_partition_are_read_from_sinfos_gres(gres, gpus):
    from orchestrator.executors.slurm import gres_gpus

    assert gres_gpus(gres) == gpus


def test_slurm_without_a_shared_directory_or_a_cluster_says_what_to_do(tmp_path, monkeypatch):
    from conftest import cli

    make_repo(tmp_path / "r", {"train.py": fakes.ok(1.0)})
    run = ("run", "--repo", str(tmp_path / "r"), "--executor", "slurm", "--max-experiments", "1")
    first = cli(*run)
    assert first.returncode == 1 and "needs --slurm-workdir DIR" in first.stderr and "Traceback" not in first.stderr
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-such.conf"))
    second = cli(*run, "--slurm-workdir", str(tmp_path / "shared"))
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr
    assert "SLURM_CONF names" in second.stderr or "needs Slurm's commands" in second.stderr


@slow
@pytest.mark.timeout(120)
def test_doctor_checks_the_partition_and_the_shared_path_with_a_test_job(slurm, tmp_path):
    from orchestrator.doctor import check_slurm

    shared = tmp_path / "shared dir"  # (a space: the test job's command quotes it)
    found = check_slurm({"slurm_workdir": shared, "slurm_partition": slurm.partition})
    assert found.status == "ok" and f"partition {slurm.partition}: {slurm.cpus} CPUs, 0 GPUs" in found.detail, found
    assert f"a test job on {slurm.node} wrote to {shared}" in found.detail, found
    missing = check_slurm({"slurm_partition": "nope", "slurm_workdir": tmp_path / "shared"})
    assert missing.status == "FAIL" and "nope" in missing.detail, missing
    assert not list(shared.glob(".doctor-*"))


def test_outputs_are_read_as_regular_files_never_through_a_link(tmp_path):
    """The controller copies what a run left (remote.py): a link to another file of the machine (its secrets in
    /proc/self/environ, a device) is neither listed nor opened."""
    from orchestrator.executors.remote import copy_regular, read_regular, regular_files

    (tmp_path / "model.pt").write_bytes(b"weights")
    (tmp_path / "stolen").symlink_to("/proc/self/environ")
    (tmp_path / "folder").mkdir()
    assert regular_files(tmp_path) == {"model.pt": 7}
    assert read_regular(tmp_path / "stolen") is None and read_regular(tmp_path / "model.pt") == b"weights"
    assert not copy_regular(tmp_path / "stolen", tmp_path / "copy") and not (tmp_path / "copy").exists()
    assert (
        copy_regular(tmp_path / "model.pt", tmp_path / "copy", limit=3) and (tmp_path / "copy").read_bytes() == b"wei"
    )
