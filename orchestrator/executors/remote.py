"""What the executors that run a job on another machine share (Ray, Slurm): the job as a plain spec the node can
read, the code it runs, the data it needs, the run itself on the node, and its result back as a JobResult.

The controller sends the worktree's tracked files, the job's inputs and a spec (steps, the shipped environment,
timeout, sandbox, ...); the node writes them where it works, makes sure the prepared data is there
(`python prepare.py --check`, else `python prepare.py`, one node process at a time per cache directory), runs the
steps with the same runner as the local executor (hard timeout, whole tree killed) and reports what it observed.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import sys
import threading
from pathlib import Path

from ..trust.confine import allowed_env
from ..trust.harness import evaluation_data
from .base import OUT, SCRATCH_DIRS, Job, JobResult, Slot, StepResult, run_steps

SHIPPED_ENV = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")  # besides every AUTOLOOP_* variable
PREPARE_TIMEOUT_S = 3600.0


def shipped_env(job: Job, slot: Slot) -> dict[str, str]:
    """The part of the job's environment that travels to the node: AUTOLOOP_*, SHIPPED_ENV and the --pass-env
    names (never the controller's other secrets), the run's own TMPDIR and kernel caches (in its directory on the
    node; HOME stays the node's), the slot's variables except the GPUs, which the node's scheduler gives."""
    env = {
        k: v
        for k, v in job.env.items()
        if (k.startswith("AUTOLOOP_") or k in SHIPPED_ENV or k in job.pass_env) and k not in job.local_only
    }
    scratch = [k for k, v in job.env.items() if k in SCRATCH_DIRS and k != "HOME" and OUT in v]
    env.update({k: job.env[k].replace("/../../cache/", "/cache/") for k in scratch})
    env.update({k: v for k, v in slot.env.items() if k != "CUDA_VISIBLE_DEVICES"})
    return env


def job_spec(job: Job, env: dict[str, str], prepare: bool) -> dict:
    """The job as JSON-able data for the node."""
    return {
        "steps": job.steps,
        "logs": job.logs,
        "env": env,
        "timeout_s": job.timeout_s,
        "watch": list(job.watch),
        "step_env": job.step_env,
        "prepare": prepare,
        "log_cap": job.log_cap,
        "step_stdin": job.step_stdin,
        "sandbox": job.sandbox,
        "step_hidden": [list(hidden) for hidden in job.step_hidden],
        "step_start_after": job.step_start_after,
        "read_only": list(job.read_only),
        "stop_rule": job.stop_rule,
    }


def tracked_files(workdir: Path) -> dict[str, bytes]:
    """The worktree's code as the node will see it: every file git tracks there."""
    from ..store import gitops  # with its git directory named by the controller, never read from the worktree

    names = gitops.Repo(workdir).git.ls_files("-z").split("\0")
    return {name: (workdir / name).read_bytes() for name in names if name and (workdir / name).is_file()}


def open_regular(path: Path):
    """`path` opened for reading if it is a regular file, never through a link (a run may leave a link to any
    file of the machine that reads it, /proc/self/environ included); None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        return None
    return f


def read_regular(path: Path, limit: int = -1) -> bytes | None:
    """The bytes (at most `limit`) of a regular file, never through a link; None for anything else."""
    f = open_regular(path)
    if f is None:
        return None
    with f:
        try:
            return f.read(limit)
        except OSError:
            return None


def regular_files(folder: Path) -> dict[str, int]:
    """name -> size of the regular files directly in `folder` (links and everything else left out)."""
    out = {}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return {}
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False):
                out[entry.name] = entry.stat(follow_symlinks=False).st_size
        except OSError:
            pass
    return out


def copy_regular(src: Path, dest: Path, limit: int | None = None) -> bool:
    """Copy a regular file (never through a link; at most `limit` bytes) to `dest`, replacing what is there;
    False where src is not a regular file or cannot be read."""
    f = open_regular(src)
    if f is None:
        return False
    with f:
        try:
            dest.unlink(missing_ok=True)
            with open(dest, "xb") as out:
                if limit is None:
                    shutil.copyfileobj(f, out)
                else:
                    out.write(f.read(limit))
        except OSError:
            return False
    return True


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def prepare_data(src: Path, out: Path, env: dict[str, str]) -> str:
    """`prepare.py --check`, else `prepare.py`, one process at a time per cache directory (they share its temporary
    file names); why it failed, or ''. Runs on the node, the log in out/prepare.log."""
    import fcntl

    from ..trust.summary import last_error_line, read_tail
    from .runner import run_command

    cache = Path(env.get("AUTOLOOP_CACHE") or "~/.cache/autoloop").expanduser()  # prepare.py's CACHE_DIR
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        check = run_command([sys.executable, "prepare.py", "--check"], src, env, out / "prepare.log", 300.0)
        if check.exit_code == 0:
            return ""
        run = run_command([sys.executable, "prepare.py"], src, env, out / "prepare.log", PREPARE_TIMEOUT_S)
    if run.exit_code == 0 and not run.timed_out:
        return ""
    how = f"timed out after {PREPARE_TIMEOUT_S:.0f}s" if run.timed_out else f"exit code {run.exit_code}"
    last = last_error_line(read_tail(out / "prepare.log"))
    return f"prepare.py failed on {socket.gethostname()} ({how}{': ' + last if last else ''})"


def run_spec(spec: dict, src: Path, out: Path, cancel: threading.Event | None = None) -> dict:
    """Run a job's spec on this node, the code in src, logs and outputs to out; what happened, as JSON-able data
    (`infra_error` where the node could not run it)."""
    env = {**allowed_env(), **spec["env"], "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    if spec["prepare"] and (src / "prepare.py").exists() and (error := prepare_data(src, out, env)):
        return {"infra_error": error, "files": regular_files(out)}
    # what the training step may not read: the controller's list (valid where the node's paths are the same) and
    # the validation data of every prepared manifest in this node's cache
    cache = Path(env.get("AUTOLOOP_CACHE") or "~/.cache/autoloop").expanduser()
    node_hidden = [p for m in sorted(cache.glob("*/manifest-*.json")) for p in evaluation_data(m)]
    step_hidden = [tuple(spec["step_hidden"][0] if spec["step_hidden"] else ()) + tuple(node_hidden)]
    job = Job(
        steps=spec["steps"],
        logs=spec["logs"],
        env=env,
        timeout_s=spec["timeout_s"],
        workdir=src,
        out_dir=out,
        watch=tuple(spec["watch"]),
        step_env=spec["step_env"],
        log_cap=spec["log_cap"],
        step_stdin=spec["step_stdin"],
        sandbox=spec["sandbox"],
        step_hidden=step_hidden,
        step_start_after=spec.get("step_start_after") or [],
        read_only=tuple(spec.get("read_only") or ()),
        stop_rule=spec.get("stop_rule"),
        every_gpu=bool(os.environ.get("SLURM_JOB_GPUS")),  # (see Job.every_gpu)
    )
    result = run_steps(job, src, out, {}, cancel)
    return {
        "steps": [
            (s.exit_code, s.timed_out, s.wall_s, s.log.name, s.killed, s.cpu_share, s.cpu_outside) for s in result.steps
        ],
        "modified": result.modified,
        "ages": result.ages,
        "device": result.device,
        "node": result.node,
        "interrupted": result.interrupted,
        "stopped": result.stopped,
        "audited": result.audited,
        "visible": env["CUDA_VISIBLE_DEVICES"],
        "infra_error": result.infra_error,
        "files": regular_files(out),  # what the controller must see before it reads the outputs
    }


def job_result(data: dict, out: Path, slot: Slot) -> JobResult:
    """The node's report (run_spec's) as the controller's JobResult, the logs and outputs already in out."""
    if data.get("infra_error"):
        where = f"; see {out / 'prepare.log'}" if (out / "prepare.log").exists() else ""
        return JobResult(infra_error=f"{data['infra_error']}{where}", slot=slot.index, node=data.get("node", ""))
    return JobResult(
        steps=[
            StepResult(code, timed_out, wall, out / log, *more) for code, timed_out, wall, log, *more in data["steps"]
        ],
        modified=data["modified"],
        ages=data["ages"],
        device=data["device"],
        node=data["node"],
        slot=slot.index,
        interrupted=data["interrupted"],
        stopped=data.get("stopped", ""),
        audited=data.get("audited", ""),
    )
