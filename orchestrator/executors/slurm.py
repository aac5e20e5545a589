"""The Slurm executor: each experiment is one Slurm job (`sbatch`), on whichever node the scheduler gives it.

The controller stays on the login node (or in a small job of its own). For each experiment it writes a job
directory under --slurm-workdir, a path every node sees (a shared file system): the worktree's tracked files
(src/), the run's inputs (out/) and the spec (spec.json: steps, the shipped environment, timeout, sandbox), and
submits a batch script that runs `python -m orchestrator.executors.slurm JOBDIR` on the node with a copy of this
controller's orchestrator package (the code the node runs is the controller's, as with Ray). On the node the
runner is the local executor's (hard timeout, whole tree killed, sandbox, log cap); the node writes result.json,
and the controller copies the logs and outputs back into the run's directory and removes the job directory.

The job gets what --slurm-gpus/--slurm-cpus/--slurm-mem ask, its time limit from the hard timeout, the
environment allow-list of the local runs (never the controller's secrets: `sbatch --export` names only the
allowed variables), and CUDA_VISIBLE_DEVICES as Slurm sets it; the GPU model it ran on is recorded per run.

Infrastructure failures are run again, never recorded as the idea's crash: a job still waiting in the queue
after --slurm-queue-timeout (cancelled), a job that ends without a result (its node failed, it was preempted
or cancelled from outside, it ran past its time limit), a node that could not prepare the data. Ctrl-C, SIGTERM
and the end of a session cancel every job in flight (`scancel`). Jobs are named after their session
(`autoloop-<key>`): a controller killed with SIGKILL leaves its jobs in the queue, and the resumed session
cancels them before it submits its first.

Why a thin layer over sbatch/squeue/scancel and not submitit: submitit ships a pickled callable and learns a
job's end from sacct, which needs the accounting daemon (many clusters and this project's test cluster run
without one) and leaves its waiter hanging on a job cancelled from outside; the controller needs the state of
all its jobs in one query, cancellation by name after a SIGKILL and the queue's reason for a waiting job - three
commands with stable output formats give all of it, and the node already has the runner it needs.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import click

from .. import __version__
from ..plugins import FiniteRange
from ..trust.confine import allowed_env
from ..trust.summary import last_error_line, read_tail
from .base import Ended, Executor, Handle, Job, JobResult, Slot
from .remote import (
    copy_regular,
    job_result,
    job_spec,
    read_regular,
    regular_files,
    run_spec,
    shipped_env,
    tracked_files,
    write_files,
)

QUEUE_TIMEOUT_S = 3600.0  # a job still waiting in the queue then is cancelled and run again (an infra error)
TIME_MARGIN_S = 1800.0  # the job's time limit beyond its steps' hard timeouts (start-up, the data check or
# a first preparation of it on the node, the wait for another job's)
RESULT_GRACE_S = 90.0  # a job out of the queue without its result visible yet: NFS caches attributes for 60 s
CANCEL_WAIT_S = 60.0
QUEUE_DOWN_S = 600.0  # squeue failing this long: the jobs in flight come back as the executor's failures
RESULT_CAP = 1 << 20  # bytes of a result.json read at most
SLURM_LOG_CAP = 1 << 20  # bytes of a job's slurm.out copied back at most
POLL_S = 1.0  # one squeue for all jobs in flight at most this often
COMMAND_TIMEOUT_S = 60.0
ENDED = {  # squeue states after which a job never runs again
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "REVOKED",
    "SPECIAL_EXIT",
    "TIMEOUT",
}
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING"}


class SlurmError(RuntimeError):
    """A Slurm command failed (its message, and what to do)."""


def command(args: list[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
    """A Slurm client command's output; SlurmError with its message when it fails or cannot start."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(
            f"{args[0]} not found: the slurm executor runs where Slurm's commands are (a login node); "
            "check `which sbatch`"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{shlex.join(args[:3])} ...` did not answer in {timeout:g}s (is slurmctld up?)") from None
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(f"`{shlex.join(args)}` failed: {why[-1] if why else f'exit code {done.returncode}'}")
    return done.stdout


def user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def queue(names: list[str]) -> dict[str, tuple[str, str, str]]:
    """job id -> (state, reason, node) of this user's jobs with these names, finished ones the queue still holds
    included."""
    if not names:
        return {}
    which = ",".join(sorted(set(names)))
    out = command(["squeue", "-h", "-t", "all", "-u", user(), "--name", which, "-o", "%i|%T|%r|%N"])
    jobs = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            jobs[parts[0]] = (parts[1], parts[2], parts[3])
    return jobs


def exported() -> list[str]:
    """The controller's variables a job gets from sbatch: the runs' allow-list (never a secret), less what the
    spec carries (AUTOLOOP_*) and what Slurm sets on the node (CUDA_VISIBLE_DEVICES)."""
    return sorted(k for k in allowed_env() if not k.startswith("AUTOLOOP_") and k != "CUDA_VISIBLE_DEVICES")


def cancel_jobs(ids: list[str]) -> None:
    if ids:
        try:
            command(["scancel", *ids])
        except SlurmError:  # ended already, or the controller cannot answer: nothing more to do from here
            pass


def gres_gpus(gres: str) -> int:
    """The GPUs in an sinfo GRES field ("gpu:4", "gpu:a100:8(S:0-1)", "(null)")."""
    total = 0
    for part in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", part.strip())
        if m:
            total += int(m.group(1))
    return total


def partition_size(partition: str | None) -> tuple[int, int]:
    """(CPUs, GPUs) of the partition's nodes, the default partition's where None; a node that is down counts
    (it may come back: a job waiting for it is run again after --slurm-queue-timeout)."""
    out = command(["sinfo", "-h", "-o", "%P|%D|%c|%G"] + (["-p", partition] if partition else []))
    cpus = gpus = 0
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        name, nodes, per_cpu, gres = parts
        if partition is None and not name.endswith("*"):
            continue
        cpus += int(nodes) * int(re.sub(r"\D.*", "", per_cpu) or 0)
        gpus += int(nodes) * gres_gpus(gres)
    return cpus, gpus


def ship_package(workdir: Path) -> Path:
    """A copy of this controller's orchestrator package under the shared workdir (once per version and content):
    the nodes run the same runner as the controller. The directory to put on PYTHONPATH."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    files = sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for p in files:
        digest.update(str(p.relative_to(package)).encode() + b"\0" + p.read_bytes())
    root = workdir / "code" / f"{__version__}-{digest.hexdigest()[:12]}"
    if not (root / "orchestrator" / "__init__.py").exists():
        tmp = workdir / "code" / f".{uuid.uuid4().hex}"
        shutil.copytree(package, tmp / "orchestrator", ignore=shutil.ignore_patterns("__pycache__"))
        try:
            tmp.rename(root)
        except OSError:  # another controller put the same copy there first
            shutil.rmtree(tmp, ignore_errors=True)
    return root


class SlurmHandle(Handle):
    """A submitted job. It is done once the queue says it has ended (its processes are gone: whatever the run
    left in the job directory is final, a result.json it forged included, which the node's own replaced) and its
    result and every file the result lists are visible here (a shared file system may lag), or when it failed."""

    def __init__(self, executor: SlurmExecutor, job_id: str, name: str, jobdir: Path, job: Job, slot: Slot):
        self._ex, self.job_id, self.name, self.jobdir, self._job, self._slot = executor, job_id, name, jobdir, job, slot
        self.submitted = time.monotonic()
        self._ended: float | None = None  # when the queue first said it ended (or lost it)
        self._cancelled = False
        self._result: JobResult | None = None
        self._data: dict | None = None  # the node's result.json, once it and its files are visible
        self._why = ""  # why the job failed (the executor's failure)

    def done(self) -> bool:
        if self._result is not None or self._why:
            return True
        state = self._ex.state(self)
        now = time.monotonic()
        if state is None:  # the queue cannot answer: ask again, for a while
            down = self._ex.queue_down_s()
            if down > QUEUE_DOWN_S:
                self._why = (
                    f"Slurm's queue has not answered for {down:.0f}s ({self._ex.queue_error}); is slurmctld up? "
                    f"Slurm job {self.job_id} may still be in the queue"
                )
                return True
            return False
        status, reason, node = state
        if status in ACTIVE:
            timeout = self._ex.queue_timeout
            if status == "PENDING" and timeout and now - self.submitted > timeout and not self._cancelled:
                cancel_jobs([self.job_id])
                self._why = (
                    f"Slurm job {self.job_id} waited in the queue over {timeout:g}s ({reason}; "
                    "--slurm-queue-timeout): cancelled"
                )
                return True
            return False
        if self._cancelled:
            return True
        if self._ended is None:
            self._ended = now
        if self._visible():
            return True
        if now - self._ended >= RESULT_GRACE_S:
            where = f" on {node}" if node and node != "(null)" else ""
            gone = "left the queue" if status == "GONE" else f"ended {status}"
            gone += f" ({reason})" if reason not in ("", "None", "(null)") else ""
            self._why = (
                f"Slurm job {self.job_id} {gone}{where} without a result (cancelled from outside, preempted, "
                "its node failed or it ran past its time limit)"
            )
            return True
        return False

    def _visible(self) -> bool:
        """The node's result.json, and every output it lists at its size, can be read here."""
        raw = read_regular(self.jobdir / "result.json", RESULT_CAP)
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            return False
        if not isinstance(data, dict):
            return False
        files = data.get("files") or {}
        seen = regular_files(self.jobdir / "out")
        if any(seen.get(name) != size for name, size in files.items()):
            return False
        self._data = data
        return True

    def result(self, timeout: float | None = None) -> JobResult:
        if timeout is None:
            while not self.done():
                time.sleep(POLL_S / 4)
        elif not self.wait(timeout):
            raise TimeoutError("the job is still running")
        if self._result is None:
            self._result = self._collect()
            self._ex.finished(self)
        return self._result

    def _collect(self) -> JobResult:
        """The run's logs and outputs copied into its directory here (regular files only, never through a link
        the run left), the job directory removed; the result."""
        out = self._job.out_dir
        out.mkdir(parents=True, exist_ok=True)
        data = self._data
        node_out = self.jobdir / "out"
        for name in data.get("files") or {} if data else regular_files(node_out):
            copy_regular(node_out / name, out / name)
        log = self.jobdir / "slurm.out"
        tail = last_error_line(read_tail(log)) if regular_files(self.jobdir).get("slurm.out") else ""
        copy_regular(log, out / "slurm.log", limit=SLURM_LOG_CAP)
        node = str((data or {}).get("node", ""))
        try:
            if self._cancelled:
                return JobResult(interrupted=True, slot=self._slot.index, node=node)
            if data is None:
                why = self._why or f"Slurm job {self.job_id} ended without a result"
                return JobResult(infra_error=why + (f": {tail}" if tail else ""), slot=self._slot.index)
            if data.get("interrupted"):  # stopped by a signal it was not sent by us: preempted, scancel by hand
                return JobResult(
                    infra_error=f"Slurm job {self.job_id} was stopped from outside on {node or '?'} "
                    "(preempted, cancelled or past its time limit)",
                    slot=self._slot.index,
                    node=node,
                )
            return job_result(data, out, self._slot)
        except (KeyError, TypeError, ValueError) as e:  # a result.json that is not the node's
            why = f"Slurm job {self.job_id} left an unreadable result ({e})"
            return JobResult(infra_error=why, slot=self._slot.index)
        finally:
            shutil.rmtree(self.jobdir, ignore_errors=True)

    def cancel(self) -> None:
        """scancel; the job is done once the queue says it has left the running states (wait, or result())."""
        if self._result is not None or self._cancelled:
            return
        self._cancelled = True
        cancel_jobs([self.job_id])


class SlurmExecutor(Executor):
    name = "slurm"
    options = (
        click.Option(
            ["--slurm-workdir"],
            type=click.Path(file_okay=False, path_type=Path),
            help="A directory every node sees (a shared file system) for the jobs' code, logs and outputs.  "
            "[required with --executor slurm]",
        ),
        click.Option(["--slurm-partition"], help="The partition to submit to.  [default: the cluster's default]"),
        click.Option(["--slurm-account"], help="The account to charge (sbatch --account)."),
        click.Option(["--slurm-qos"], help="The quality of service (sbatch --qos)."),
        click.Option(
            ["--slurm-gpus"],
            type=click.IntRange(min=0),
            help="GPUs per run (sbatch --gres=gpu:N).  [default: 1 where the partition has GPUs, else 0]",
        ),
        click.Option(
            ["--slurm-cpus"],
            type=click.IntRange(min=1),
            help="CPUs per run (sbatch --cpus-per-task).  [default: 1 on a partition without GPUs, else the cluster's]",
        ),
        click.Option(["--slurm-mem"], help="Memory per run, e.g. 32G (sbatch --mem).  [default: the cluster's]"),
        click.Option(
            ["--slurm-sbatch-args"],
            metavar="ARGS",
            help='More sbatch arguments for each job, e.g. "--constraint=a100 --exclude=node7".',
        ),
        click.Option(
            ["--slurm-queue-timeout"],
            type=FiniteRange(min=0),
            help="Seconds a job may wait in the queue before it is cancelled and submitted again (an executor "
            f"failure, not the idea's); 0: wait forever.  [default: {QUEUE_TIMEOUT_S:g}]",
        ),
        click.Option(
            ["--slurm-python"],
            metavar="PATH",
            help="The Python the nodes run (with torch and this package's dependencies).  [default: this controller's]",
        ),
    )

    @classmethod
    def create(cls, workers: int | None, options: dict) -> SlurmExecutor:
        return cls(
            workdir=options.get("slurm_workdir"),
            workers=workers,
            partition=options.get("slurm_partition"),
            account=options.get("slurm_account"),
            qos=options.get("slurm_qos"),
            gpus=options.get("slurm_gpus"),
            cpus=options.get("slurm_cpus"),
            mem=options.get("slurm_mem"),
            sbatch_args=options.get("slurm_sbatch_args"),
            queue_timeout=options.get("slurm_queue_timeout"),
            python=options.get("slurm_python"),
        )

    def __init__(
        self,
        workdir: Path | str | None,
        workers: int | None = None,
        partition: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        gpus: int | None = None,
        cpus: int | None = None,
        mem: str | None = None,
        sbatch_args: str | None = None,
        queue_timeout: float | None = None,
        python: str | None = None,
        prepare: bool = True,
    ):
        if not workdir:
            raise ValueError(
                "--executor slurm needs --slurm-workdir DIR: a directory on a file system the compute nodes share "
                "(e.g. /scratch/$USER/autoloop), for the jobs' code, logs and outputs"
            )
        if shutil.which("sbatch") is None:
            raise ValueError(
                "--executor slurm needs Slurm's commands (sbatch, squeue, scancel) on PATH: run autoloop on the "
                "cluster's login node, or `module load slurm` first"
            )
        conf = os.environ.get("SLURM_CONF")
        if conf and not Path(conf).is_file():  # (Slurm's commands take a minute to say so)
            raise ValueError(
                f"SLURM_CONF names {conf}, which does not exist: unset it or name the cluster's slurm.conf"
            )
        self.workdir = Path(os.path.abspath(Path(workdir).expanduser()))  # (links resolved by each node)
        try:
            (self.workdir / "jobs").mkdir(parents=True, exist_ok=True)
            probe = self.workdir / f".write-{uuid.uuid4().hex}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"--slurm-workdir {workdir} cannot be written ({e.strerror}): name another") from None
        try:
            self.extra = shlex.split(sbatch_args or "")
        except ValueError as e:
            raise ValueError(f"--slurm-sbatch-args {sbatch_args!r} cannot be read as arguments ({e})") from None
        try:
            size = partition_size(partition)
        except SlurmError as e:
            raise ValueError(f"the Slurm cluster cannot be read: {e}") from None
        if size == (0, 0):
            where = f"partition {partition!r}" if partition else "the default partition"
            raise ValueError(f"{where} has no nodes (sinfo): name another with --slurm-partition")
        self.partition, self.account, self.qos, self.mem = partition, account, qos, mem
        self.gpus = (1 if size[1] else 0) if gpus is None else int(gpus)
        self.cpus = cpus if cpus is not None else (None if self.gpus else 1)
        per = (size[1] // self.gpus) if self.gpus else (size[0] // (self.cpus or 1))
        self._workers = workers or max(1, min(per, 256))
        self.queue_timeout = QUEUE_TIMEOUT_S if queue_timeout is None else float(queue_timeout)
        self.python = python or sys.executable
        self.prepare = prepare
        self.code = ship_package(self.workdir)
        self._handles: dict[str, SlurmHandle] = {}  # job id -> handle, while in flight
        self._submitted: set[str] = set()  # every job id, and job name, this executor submitted
        self._names: set[str] = set()
        self._swept: set[str] = set()  # job names whose leftovers (a killed controller's) were cancelled
        self._lock = threading.Lock()
        self._queue: dict[str, tuple[str, str, str]] = {}
        self._read = 0.0
        self._failing_since: float | None = None  # since when squeue has failed, without a break
        self.queue_error = ""

    @property
    def slots(self) -> list[Slot]:
        return [Slot(i, {}, "slurm") for i in range(self._workers)]

    def job_name(self, job: Job) -> str:
        """One name per session (the directory of its runs): what a resumed session finds of a killed one."""
        return "autoloop-" + hashlib.sha1(str(job.out_dir.resolve().parent).encode()).hexdigest()[:10]

    def sweep(self, name: str) -> None:
        """Cancel the jobs a killed controller of this session left in the queue (once per name)."""
        if name in self._swept:
            return
        self._swept.add(name)
        mine = set(self._handles)
        try:
            left = [i for i, (state, _, _) in queue([name]).items() if state in ACTIVE and i not in mine]
        except SlurmError:  # the queue cannot answer now: the job's own submission will say so, or pass
            self._swept.discard(name)
            return
        cancel_jobs(left)
        for old in (self.workdir / "jobs").glob(f"{name}-*"):
            if old.name.split("-")[-1] not in {h.jobdir.name.split("-")[-1] for h in self._handles.values()}:
                shutil.rmtree(old, ignore_errors=True)

    def submit(self, job: Job, slot: Slot) -> Handle:
        name = self.job_name(job)
        self.sweep(name)
        job.out_dir.mkdir(parents=True, exist_ok=True)  # (the run's directory here; its logs come back to it)
        jobdir = self.workdir / "jobs" / f"{name}-{uuid.uuid4().hex[:12]}"
        (jobdir / "out").mkdir(parents=True)
        os.chmod(jobdir, 0o700)  # the spec holds the run's nonce
        write_files(jobdir / "src", tracked_files(job.workdir))
        for dest, src in job.inputs.items():
            shutil.copy2(src, jobdir / "out" / dest)
        spec = job_spec(job, shipped_env(job, slot), self.prepare)
        if spec["sandbox"] is not None:  # a node that cannot confine the run fails the job rather than run it bare
            spec["sandbox"] = {**spec["sandbox"], "required": True}  # (the controller could, so auto meant "on")
        (jobdir / "spec.json").write_text(json.dumps(spec))
        script = jobdir / "job.sh"
        script.write_text(
            "#!/bin/sh\n# one autoloop experiment (orchestrator/executors/slurm.py)\n"
            f"PYTHONPATH={shlex.quote(str(self.code))}${{PYTHONPATH:+:$PYTHONPATH}}; export PYTHONPATH\n"
            f"exec {shlex.quote(self.python)} -m orchestrator.executors.slurm {shlex.quote(str(jobdir))}\n"
        )
        minutes = math.ceil((len(job.steps) * job.timeout_s + TIME_MARGIN_S) / 60)
        args = [
            "sbatch",
            "--parsable",
            f"--job-name={name}",
            f"--output={jobdir / 'slurm.out'}",
            f"--chdir={jobdir}",
            f"--time={minutes}",
            "--ntasks=1",
            "--export=" + (",".join(exported()) or "NONE"),
        ]
        args += [f"--partition={self.partition}"] if self.partition else []
        args += [f"--account={self.account}"] if self.account else []
        args += [f"--qos={self.qos}"] if self.qos else []
        args += [f"--gres=gpu:{self.gpus}"] if self.gpus else []
        args += [f"--cpus-per-task={self.cpus}"] if self.cpus else []
        args += [f"--mem={self.mem}"] if self.mem else []
        # last, over any --requeue of the extra arguments: a requeued job would run again after its result was
        # taken, an orphan
        args += [*self.extra, "--no-requeue", str(script)]
        try:
            job_id = command(args).strip().split(";")[0]
        except SlurmError as e:
            shutil.rmtree(jobdir, ignore_errors=True)
            return Ended(JobResult(infra_error=f"sbatch refused the job: {e}", slot=slot.index))
        handle = SlurmHandle(self, job_id, name, jobdir, job, slot)
        self._submitted.add(job_id)
        self._names.add(name)
        with self._lock:
            self._handles[job_id] = handle
        return handle

    def state(self, handle: SlurmHandle) -> tuple[str, str, str] | None:
        """The handle's job as the queue says (one squeue for all jobs in flight, at most every POLL_S, failed
        or not); ("GONE", "", "") once the queue no longer holds it, None while the queue cannot be read."""
        with self._lock:
            if handle.submitted >= self._read or time.monotonic() - self._read >= POLL_S:
                self._read = time.monotonic()
                try:
                    self._queue = queue([h.name for h in self._handles.values()] or [handle.name])
                    self._failing_since, self.queue_error = None, ""
                except SlurmError as e:
                    self._queue, self.queue_error = {}, str(e)
                    if self._failing_since is None:
                        self._failing_since = self._read
            if self._failing_since is not None:
                return None
            return self._queue.get(handle.job_id, ("GONE", "", ""))

    def queue_down_s(self) -> float:
        """Seconds the queue has failed to answer without a break (0 while it answers)."""
        since = self._failing_since
        return 0.0 if since is None else time.monotonic() - since

    def finished(self, handle: SlurmHandle) -> None:
        with self._lock:
            self._handles.pop(handle.job_id, None)

    def close(self) -> None:
        """Cancel every job still in flight, and wait (boundedly) until every job this controller submitted has
        left the running states (one that wrote its result is still exiting): nothing of it stays in the queue."""
        with self._lock:
            left = list(self._handles.values())
        for handle in left:
            handle._cancelled = handle._cancelled or handle._result is None
        if left:
            cancel_jobs([h.job_id for h in left])  # all at once
        deadline = time.monotonic() + CANCEL_WAIT_S
        while self._submitted and time.monotonic() < deadline:
            try:
                states = queue(sorted(self._names))
            except SlurmError:
                break
            active = [i for i in self._submitted if states.get(i, ("GONE",))[0] in ACTIVE]
            if not active:
                break
            cancel_jobs([i for i in active if i not in {h.job_id for h in left}])  # (one not ours to wait for)
            time.sleep(0.25)
        for handle in left:  # their directories removed, their results (interrupted) taken
            if handle._result is None:
                handle._why = handle._why or "cancelled"
                handle.result(timeout=0)


def node_main(argv: list[str]) -> int:
    """On the node, inside the job: run the spec in JOBDIR, write JOBDIR/result.json. SIGTERM (scancel,
    preemption, the time limit) stops the run's whole tree; the result then says interrupted."""
    if len(argv) != 1:
        print("usage: python -m orchestrator.executors.slurm JOBDIR", file=sys.stderr)
        return 2
    jobdir = Path(argv[0])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda *_: stop.set())
    spec = json.loads((jobdir / "spec.json").read_text())
    (jobdir / "spec.json").unlink()  # the run's nonce is in it: never on disk while an (unconfined) step runs
    data = run_spec(spec, jobdir / "src", jobdir / "out", stop)
    data.setdefault("node", os.uname().nodename)
    if stop.is_set():
        data["interrupted"] = True
    tmp = jobdir / f".result-{os.getpid()}"
    tmp.write_text(json.dumps(data))
    tmp.rename(jobdir / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(node_main(sys.argv[1:]))
