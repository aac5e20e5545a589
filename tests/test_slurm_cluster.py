"""The test Slurm cluster (tests/slurm_cluster.py) does what the Slurm executor's tests will need of it: one-CPU
jobs run side by side and write their output, scancel cancels, a node set DOWN holds new jobs until RESUME, two
clusters run at once, and stop() leaves no process of its cluster behind, even when its daemons died first."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil
import pytest
from slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slow  # real Slurm daemons

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float = 30.0) -> T:
    """Poll `check` until it returns something true, and return that; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.2)
    pytest.fail(f"not within {timeout:.0f} s: {what}")


def submit(cluster: SlurmCluster, command: str, output: Path) -> str:
    """sbatch a one-CPU job running `command`; its id."""
    return cluster.run("sbatch", "--parsable", "--wrap", command, "-o", str(output), "-c", "1").stdout.strip()


def job(cluster: SlurmCluster, job_id: str) -> dict[str, str]:
    """The job as squeue lists it (id, state, reason, name); {} while it does not."""
    return next((j for j in cluster.jobs() if j["id"] == job_id), {})


def state(cluster: SlurmCluster, job_id: str) -> str:
    return job(cluster, job_id).get("state", "")


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` still running (a zombie has ended)."""
    running = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                running.append(p)
        except psutil.NoSuchProcess:
            pass
    return running


def names(procs: list[psutil.Process]) -> set[str]:
    return {p.name() for p in alive(procs)}


def test_two_one_cpu_jobs_run_at_once_and_write_their_output(slurm_cluster, tmp_path):
    outputs = [tmp_path / "a.out", tmp_path / "b.out"]
    ids = [submit(slurm_cluster, "sleep 3; echo hi", out) for out in outputs]
    wait_for(
        "both jobs RUNNING at once",
        lambda: [state(slurm_cluster, i) for i in ids] == ["RUNNING"] * 2,
        timeout=10,
    )
    wait_for("both jobs COMPLETED", lambda: {state(slurm_cluster, i) for i in ids} == {"COMPLETED"})
    assert [out.read_text() for out in outputs] == ["hi\n", "hi\n"]


def test_scancel_of_a_running_job_leaves_it_cancelled(slurm_cluster, tmp_path):
    job_id = submit(slurm_cluster, "sleep 60", tmp_path / "out")
    wait_for("the job RUNNING", lambda: state(slurm_cluster, job_id) == "RUNNING")
    slurm_cluster.run("scancel", job_id)
    wait_for("the job CANCELLED", lambda: state(slurm_cluster, job_id) == "CANCELLED")
    assert "JobState=CANCELLED" in slurm_cluster.run("scontrol", "show", "job", job_id).stdout


def test_a_down_node_holds_new_jobs_until_resumed(slurm_cluster, tmp_path):
    slurm_cluster.set_node("DOWN")
    try:
        job_id = submit(slurm_cluster, "echo hi", tmp_path / "out")
        wait_for("the job given a reason to pend", lambda: job(slurm_cluster, job_id).get("reason", "None") != "None")
        time.sleep(2)  # and held
        pending = job(slurm_cluster, job_id)
        assert pending["state"] == "PENDING" and "node" in pending["reason"].lower(), pending
    finally:
        slurm_cluster.set_node("RESUME")
    wait_for("the job COMPLETED after RESUME", lambda: state(slurm_cluster, job_id) == "COMPLETED", timeout=15)
    assert (tmp_path / "out").read_text() == "hi\n"


def test_stop_leaves_no_process_of_the_cluster(slurm_cluster, tmp_path):
    """A second cluster beside the session's (ports of its own), stopped with a job running."""
    with SlurmCluster(tmp_path / "c") as other:
        assert other.conf.read_text() != slurm_cluster.conf.read_text()
        job_id = submit(other, "sleep 300", tmp_path / "out")
        wait_for("the job RUNNING", lambda: state(other, job_id) == "RUNNING")
        wait_for("its job step", lambda: "slurmstepd" in names(other.processes()))
        procs = other.processes()
        assert {"slurmctld", "slurmd", "slurmstepd", "sleep"} <= names(procs)
    assert alive(procs) == [] and other.processes() == []
    assert slurm_cluster.run("sinfo", "-h", "-n", slurm_cluster.node, "-o", "%T").stdout.strip() == "idle"


@pytest.mark.usefixtures("slurm_cluster")  # skipped (failed on CI) where it is
def test_stop_kills_the_job_steps_that_outlive_the_daemons(tmp_path):
    """slurmctld and slurmd killed: their running jobs' steps (and the jobs) are orphans that stop() kills."""
    cluster = SlurmCluster(tmp_path / "c")
    cluster.start()
    try:
        job_id = submit(cluster, "sleep 300", tmp_path / "out")
        wait_for("the job RUNNING", lambda: state(cluster, job_id) == "RUNNING")
        wait_for("its job step", lambda: "slurmstepd" in names(cluster.processes()))
        procs = cluster.processes()
        daemons = [p for p in procs if p.name() in ("slurmctld", "slurmd")]
        for p in daemons:
            p.kill()
        psutil.wait_procs(daemons, timeout=10)
        assert {"slurmstepd", "sleep"} <= names(procs) and not {"slurmctld", "slurmd"} & names(procs)
    finally:
        cluster.stop()
    assert alive(procs) == [] and cluster.processes() == []
