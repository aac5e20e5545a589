"""The Ray executor (optional extra `ray`): each job is a Ray task holding one GPU, on any node of a cluster.

The task gets the slot's code (the worktree's tracked files) and inputs as bytes, writes them to a scratch
directory on its node, makes sure the prepared data is there (`python prepare.py --check`, else
`python prepare.py`: use a shared AUTOLOOP_CACHE or let each node prepare once), runs the steps with the same
runner as the local executor (hard timeout, whole tree killed), and sends the logs and outputs back.

Tasks run with max_retries=0: Ray must not re-run an experiment on its own (a crash is data). When the node or
the worker dies, the job comes back with `infra_error` set and the controller runs it again on another slot.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

from .base import Executor, Handle, Job, JobResult, Slot, StepResult, run_steps

SHIPPED_ENV = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")  # besides every AUTOLOOP_* variable
PREPARE_TIMEOUT_S = 3600.0
CANCEL_GRACE_S = 10.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("the ray executor needs Ray: pip install -e '.[ray]' in the autoloop clone (or pip install ray)") from None
    return ray


def _node_job(spec: dict, files: dict[str, bytes], inputs: dict[str, bytes]) -> dict:
    """Runs inside the Ray task, on whichever node Ray chose."""
    from orchestrator.runner import run_command

    scratch = Path(tempfile.mkdtemp(prefix="autoloop-job-"))
    try:
        src, out = scratch / "src", scratch / "out"
        out.mkdir(parents=True)
        for rel, data in files.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data)
        for name, data in inputs.items():
            (out / name).write_bytes(data)
        env = {**os.environ, **spec["env"], "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
        if spec["prepare"] and (src / "prepare.py").exists():
            check = run_command([sys.executable, "prepare.py", "--check"], src, env, out / "prepare.log", 300.0)
            if check.exit_code != 0:
                run_command([sys.executable, "prepare.py"], src, env, out / "prepare.log", PREPARE_TIMEOUT_S)
        job = Job(steps=spec["steps"], logs=spec["logs"], env=env, timeout_s=spec["timeout_s"],
                  workdir=src, out_dir=out, watch=tuple(spec["watch"]), step_env=spec["step_env"])
        result = run_steps(job, src, out, {})
        return {"steps": [(s.exit_code, s.timed_out, s.wall_s, s.log.name) for s in result.steps],
                "modified": result.modified, "ages": result.ages, "device": result.device, "node": result.node,
                "interrupted": result.interrupted, "visible": env["CUDA_VISIBLE_DEVICES"],
                "outputs": {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def tracked_files(workdir: Path) -> dict[str, bytes]:
    """The worktree's code as the task will see it: every file git tracks there."""
    import git

    names = git.Repo(workdir).git.ls_files("-z").split("\0")
    return {name: (workdir / name).read_bytes() for name in names if name and (workdir / name).is_file()}


class RayHandle(Handle):
    def __init__(self, ray, ref, job: Job, slot: Slot):
        self._ray, self._ref, self._job, self._slot = ray, ref, job, slot
        self._result: JobResult | None = None

    def done(self) -> bool:
        return self.wait(0)

    def wait(self, timeout: float) -> bool:
        ready, _ = self._ray.wait([self._ref], timeout=timeout)
        return bool(ready)

    def result(self, timeout: float | None = None) -> JobResult:
        if self._result is not None:
            return self._result
        ray = self._ray
        try:
            data = ray.get(self._ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError("the job is still running") from None
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
        self._result = JobResult(
            steps=[StepResult(code, timed_out, wall, out / log) for code, timed_out, wall, log in data["steps"]],
            modified=data["modified"], ages=data["ages"], device=data["device"], node=data["node"],
            slot=self._slot.index, interrupted=data["interrupted"])
        return self._result

    def cancel(self) -> None:
        """KeyboardInterrupt in the task first (its runner kills the whole tree), then force if it hangs."""
        ray = self._ray
        try:
            ray.cancel(self._ref, force=False)
            ready, _ = ray.wait([self._ref], timeout=CANCEL_GRACE_S)
            if not ready:
                ray.cancel(self._ref, force=True)
        except Exception:  # noqa: BLE001 - already finished or the cluster is gone: nothing left to stop
            pass


class RayExecutor(Executor):
    name = "ray"
    options = (click.Option(["--ray-address"], envvar="AUTOLOOP_RAY_ADDRESS", show_envvar=True,
                            help="Ray cluster to join, e.g. ray://head:10001 or auto.  [default: RAY_ADDRESS, else "
                                 "a local Ray]"),)

    @classmethod
    def create(cls, workers: int | None, options: dict) -> "RayExecutor":
        return cls(address=options.get("ray_address"), workers=workers)

    def __init__(self, address: str | None = None, workers: int | None = None, gpus_per_task: float | None = None,
                 prepare: bool = True, init_kwargs: dict | None = None):
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
        gpus = int(resources.get("GPU", 0))
        self.gpus_per_task = gpus_per_task if gpus_per_task is not None else (1.0 if gpus else 0.0)
        if workers is None:
            workers = gpus if gpus else max(1, int(resources.get("CPU", 1)))
        self.slots = [Slot(i, {}, "ray") for i in range(workers)]
        # each run gets its GPU's share of its node's cores (data loading, OMP threads), at least one
        gpu_nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU")]
        self.cpus_per_task = max(1, min((int(r.get("CPU", 1) // r["GPU"]) for r in gpu_nodes), default=1)) \
            if self.gpus_per_task else 1
        self.prepare = prepare
        self._task = ray.remote(max_retries=0)(_node_job)

    def submit(self, job: Job, slot: Slot) -> Handle:
        env = {k: v for k, v in job.env.items() if k.startswith("AUTOLOOP_") or k in SHIPPED_ENV}
        env.update({k: v for k, v in slot.env.items() if k != "CUDA_VISIBLE_DEVICES"})
        spec = {"steps": job.steps, "logs": job.logs, "env": env, "timeout_s": job.timeout_s,
                "watch": list(job.watch), "step_env": job.step_env, "prepare": self.prepare}
        inputs = {name: Path(path).read_bytes() for name, path in job.inputs.items()}
        options = {"num_gpus": self.gpus_per_task, "num_cpus": self.cpus_per_task}
        ref = self._task.options(**options).remote(spec, tracked_files(job.workdir), inputs)
        return RayHandle(self.ray, ref, job, slot)

    def close(self) -> None:
        if not self._owns_ray:
            return
        try:
            self.ray.shutdown()
        except Exception:  # noqa: BLE001
            pass

