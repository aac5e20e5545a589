"""The Ray executor (optional extra `ray`): each job is a Ray task holding one GPU, on any node of a cluster.

The task gets the slot's code (the worktree's tracked files) and inputs as bytes, writes them to a scratch
directory on its node, makes sure the prepared data is there (`python prepare.py --check`, else
`python prepare.py`, one task at a time per cache directory: use a shared AUTOLOOP_CACHE or let each node
prepare once), runs the steps with the same runner as the local executor (hard timeout, whole tree killed), and
sends the logs and outputs back.

Tasks run with max_retries=0: Ray must not re-run an experiment on its own (a crash is data). When the node or
the worker dies, when prepare.py fails, or when the task has not started within the schedule timeout (its node
lost, no GPU free), the job comes back with `infra_error` set and the controller runs it again on another slot.
Without --workers the slots follow the GPUs of the cluster's alive nodes, re-read at each generation.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import click

from ..plugins import FiniteRange
from ..trust.confine import allowed_env
from ..trust.harness import evaluation_data
from .base import OUT, SCRATCH_DIRS, Executor, Handle, Job, JobResult, Slot, StepResult, run_steps

SHIPPED_ENV = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")  # besides every AUTOLOOP_* variable
PREPARE_TIMEOUT_S = 3600.0
CANCEL_GRACE_S = 10.0
SCHEDULE_TIMEOUT_S = 600.0  # a task not started by then is cancelled and comes back as an infra_error


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(
            'the ray executor needs Ray: pip install "autoloop-ml[ray]" (in a clone: pip install -e ".[ray]")'
        ) from None
    return ray


class Starts:
    """A small actor on the controller's node that tasks tell when they start (for the schedule timeout)."""

    def __init__(self):
        self.started: set[str] = set()

    def mark(self, key: str) -> None:
        self.started.add(key)

    def seen(self, key: str) -> bool:
        found = key in self.started
        self.started.discard(key)
        return found


def prepare_data(src: Path, out: Path, env: dict[str, str]) -> str:
    """`prepare.py --check`, else `prepare.py`, one task at a time per cache directory (they share its temporary
    file names); why it failed, or ''. Runs on the node, the log in out/prepare.log."""
    import fcntl

    from orchestrator.executors.runner import run_command
    from orchestrator.trust.summary import last_error_line, read_tail

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


def _node_job(spec: dict, files: dict[str, bytes], inputs: dict[str, bytes], starts=None) -> dict:
    """Runs inside the Ray task, on whichever node Ray chose."""
    if starts is not None:
        starts.mark.remote(spec["key"])  # no wait: the task never depends on the controller's node
    scratch = Path(tempfile.mkdtemp(prefix="autoloop-job-"))
    try:
        src, out = scratch / "src", scratch / "out"
        out.mkdir(parents=True)
        for rel, data in files.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data)
        for name, data in inputs.items():
            (out / name).write_bytes(data)
        env = {**allowed_env(), **spec["env"], "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
        if spec["prepare"] and (src / "prepare.py").exists() and (error := prepare_data(src, out, env)):
            return {"infra_error": error, "outputs": {"prepare.log": (out / "prepare.log").read_bytes()}}
        # what the training step may not read: the controller's list (valid where the node's paths are the
        # same) and the validation data of every prepared manifest in this node's cache
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
        )
        result = run_steps(job, src, out, {})
        return {
            "steps": [(s.exit_code, s.timed_out, s.wall_s, s.log.name) for s in result.steps],
            "modified": result.modified,
            "ages": result.ages,
            "device": result.device,
            "node": result.node,
            "interrupted": result.interrupted,
            "stopped": result.stopped,
            "audited": result.audited,
            "visible": env["CUDA_VISIBLE_DEVICES"],
            "outputs": {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()},
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def tracked_files(workdir: Path) -> dict[str, bytes]:
    """The worktree's code as the task will see it: every file git tracks there."""
    from ..store import gitops  # with its git directory named by the controller, never read from the worktree

    names = gitops.Repo(workdir).git.ls_files("-z").split("\0")
    return {name: (workdir / name).read_bytes() for name in names if name and (workdir / name).is_file()}


class RayHandle(Handle):
    def __init__(self, executor: RayExecutor, ref, job: Job, slot: Slot, key: str):
        self._ex, self._ray, self._ref, self._job, self._slot, self._key = executor, executor.ray, ref, job, slot, key
        self._result: JobResult | None = None
        timeout = executor.schedule_timeout
        self._deadline = time.monotonic() + timeout if executor.starts is not None and timeout else None

    def done(self) -> bool:
        return self.wait(0)

    def wait(self, timeout: float | None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            stops = [t for t in (end, self._deadline) if t is not None]
            left = max(0.0, min(stops) - time.monotonic()) if stops else None
            if self._ray.wait([self._ref], timeout=left)[0] or self._unscheduled():
                return True
            if end is not None and time.monotonic() >= end:
                return False
        return True

    def _unscheduled(self) -> bool:
        """Past the schedule deadline and not started (its node lost, no GPU free): cancelled, and the job
        comes back as an infra_error; False while there is time left or once it has started."""
        if self._deadline is None or time.monotonic() < self._deadline:
            return False
        self._deadline = None
        try:
            if self._ray.get(self._ex.starts.seen.remote(self._key), timeout=30):
                return False
        except self._ray.exceptions.RayError:  # the controller's node cannot tell: let the task be
            return False
        self.cancel()
        ex = self._ex
        needs = f"{ex.gpus_per_task:g} GPU" if ex.gpus_per_task else f"{ex.cpus_per_task} CPU"
        self._result = JobResult(
            infra_error=f"the Ray task did not start within {ex.schedule_timeout:g}s (no alive "
            f"node with {needs} free; --ray-schedule-timeout): cancelled",
            slot=self._slot.index,
        )
        return True

    def result(self, timeout: float | None = None) -> JobResult:
        if not self.wait(timeout):
            raise TimeoutError("the job is still running")
        if self._result is not None:
            return self._result
        ray = self._ray
        try:
            data = ray.get(self._ref)
        except ray.exceptions.TaskCancelledError:
            self._result = JobResult(interrupted=True, slot=self._slot.index)
            return self._result
        except ray.exceptions.RayError as e:  # node died, worker crashed, object lost, ...: not the idea's fault
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self._result = JobResult(infra_error=f"{type(e).__name__}: {first}"[:300], slot=self._slot.index)
            return self._result
        out = self._job.out_dir
        out.mkdir(parents=True, exist_ok=True)
        for name, blob in data["outputs"].items():
            (out / name).write_bytes(blob)
        if data.get("infra_error"):
            self._result = JobResult(
                infra_error=f"{data['infra_error']}; see {out / 'prepare.log'}", slot=self._slot.index
            )
            return self._result
        self._result = JobResult(
            steps=[StepResult(code, timed_out, wall, out / log) for code, timed_out, wall, log in data["steps"]],
            modified=data["modified"],
            ages=data["ages"],
            device=data["device"],
            node=data["node"],
            slot=self._slot.index,
            interrupted=data["interrupted"],
            stopped=data.get("stopped", ""),
            audited=data.get("audited", ""),
        )
        return self._result

    def cancel(self) -> None:
        """KeyboardInterrupt in the task first (its runner kills the whole tree), then force if it hangs."""
        ray = self._ray
        self._deadline = None
        try:
            ray.cancel(self._ref, force=False)
            ready, _ = ray.wait([self._ref], timeout=CANCEL_GRACE_S)
            if not ready:
                ray.cancel(self._ref, force=True)
        except Exception:  # noqa: BLE001 - already finished or the cluster is gone: nothing left to stop
            pass


class RayExecutor(Executor):
    name = "ray"
    options = (
        click.Option(
            ["--ray-address"],
            help="Ray cluster to join, e.g. ray://head:10001 or auto.  [default: RAY_ADDRESS, else a local Ray]",
        ),
        click.Option(
            ["--ray-schedule-timeout"],
            type=FiniteRange(min=0),
            help="Seconds a Ray task may wait for a node with a free GPU before it is cancelled and "
            "run again (an executor failure); 0: wait forever.  "
            f"[default: {SCHEDULE_TIMEOUT_S:g}]",
        ),
    )

    @classmethod
    def create(cls, workers: int | None, options: dict) -> RayExecutor:
        return cls(
            address=options.get("ray_address"), workers=workers, schedule_timeout=options.get("ray_schedule_timeout")
        )

    def __init__(
        self,
        address: str | None = None,
        workers: int | None = None,
        gpus_per_task: float | None = None,
        prepare: bool = True,
        init_kwargs: dict | None = None,
        schedule_timeout: float | None = None,
    ):
        ray = self.ray = _import_ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kwargs = dict(init_kwargs or {})
            if address:
                kwargs["address"] = address
            # Ship this controller's own orchestrator package, so every node runs the same runner.
            package = str(Path(__file__).resolve().parents[1])
            kwargs.setdefault("runtime_env", {"py_modules": [package]})
            kwargs.setdefault("logging_level", logging.WARNING)
            ray.init(log_to_driver=False, **kwargs)
        resources = ray.cluster_resources()
        if gpus_per_task is None:
            gpus_per_task = 1.0 if resources.get("GPU", 0) >= 1 else 0.0
        self.gpus_per_task = gpus_per_task
        # each run gets its GPU's share of its node's cores (data loading, OMP threads), at least one
        gpu_nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU")]
        self.cpus_per_task = (
            max(1, min((int(r.get("CPU", 1) // r["GPU"]) for r in gpu_nodes), default=1)) if self.gpus_per_task else 1
        )
        self._workers, self._live = workers, 1
        self.prepare = prepare
        self.schedule_timeout = SCHEDULE_TIMEOUT_S if schedule_timeout is None else schedule_timeout
        self._task = ray.remote(max_retries=0)(_node_job)
        self.starts = None  # the actor tasks tell when they start; on this node (a soft affinity may put it on any
        if self.schedule_timeout:  # node, one that can be lost): its loss is the controller's
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.starts = ray.remote(num_cpus=0, scheduling_strategy=here)(Starts).remote()

    @property
    def slots(self) -> list[Slot]:
        """--workers slots, else one per run the alive nodes can hold at once (their GPUs, or their CPUs on a
        cluster without GPUs), read again at each call: a lost node shrinks the next generation."""
        if self._workers is None:
            key, per = ("GPU", self.gpus_per_task) if self.gpus_per_task else ("CPU", self.cpus_per_task)
            try:
                alive = [n["Resources"] for n in self.ray.nodes() if n.get("Alive")]
                self._live = max(1, sum(int(r.get(key, 0) / per + 1e-9) for r in alive))
            except Exception:  # noqa: BLE001 - the cluster cannot answer now: the last count it gave
                pass
        return [Slot(i, {}, "ray") for i in range(self._workers or self._live)]

    def submit(self, job: Job, slot: Slot) -> Handle:
        env = {
            k: v
            for k, v in job.env.items()
            if (k.startswith("AUTOLOOP_") or k in SHIPPED_ENV) and k not in job.local_only
        }
        # the run's own TMPDIR and kernel caches, in its scratch directory on the node (HOME stays the node's)
        env.update(
            {
                k: v.replace("/../../cache/", "/cache/")
                for k, v in job.env.items()
                if k in SCRATCH_DIRS and k != "HOME" and OUT in v
            }
        )
        env.update({k: v for k, v in slot.env.items() if k != "CUDA_VISIBLE_DEVICES"})
        key = uuid.uuid4().hex
        spec = {
            "steps": job.steps,
            "logs": job.logs,
            "env": env,
            "timeout_s": job.timeout_s,
            "key": key,
            "watch": list(job.watch),
            "step_env": job.step_env,
            "prepare": self.prepare,
            "log_cap": job.log_cap,
            "step_stdin": job.step_stdin,
            "sandbox": job.sandbox,
            "step_hidden": [list(hidden) for hidden in job.step_hidden],
            "step_start_after": job.step_start_after,
            "read_only": list(job.read_only),
            "stop_rule": job.stop_rule,
        }
        inputs = {name: Path(path).read_bytes() for name, path in job.inputs.items()}
        options = {"num_gpus": self.gpus_per_task, "num_cpus": self.cpus_per_task}
        ref = self._task.options(**options).remote(spec, tracked_files(job.workdir), inputs, self.starts)
        return RayHandle(self, ref, job, slot, key)

    def close(self) -> None:
        try:
            if self._owns_ray:
                self.ray.shutdown()  # the start actor with it
            elif self.starts is not None:
                self.ray.kill(self.starts)
        except Exception:  # noqa: BLE001
            pass
