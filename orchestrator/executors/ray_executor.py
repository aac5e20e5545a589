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
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import click

from ..plugins import FiniteRange
from .base import Executor, Handle, Job, JobResult, Slot
from .remote import (
    job_result,
    job_spec,
    read_regular,
    regular_files,
    run_spec,
    shipped_env,
    tracked_files,
    write_files,
)

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


def _node_job(spec: dict, files: dict[str, bytes], inputs: dict[str, bytes], starts=None) -> dict:
    """Runs inside the Ray task, on whichever node Ray chose: the job in a scratch directory, its outputs back."""
    if starts is not None:
        starts.mark.remote(spec["key"])  # no wait: the task never depends on the controller's node
    scratch = Path(tempfile.mkdtemp(prefix="autoloop-job-"))
    try:
        src, out = scratch / "src", scratch / "out"
        out.mkdir(parents=True)
        write_files(src, files)
        write_files(out, inputs)
        data = run_spec(spec, src, out)
        data["outputs"] = {name: blob for name in regular_files(out) if (blob := read_regular(out / name)) is not None}
        return data
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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
        for name, blob in data.pop("outputs", {}).items():
            (out / name).write_bytes(blob)
        self._result = job_result(data, out, self._slot)
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
        key = uuid.uuid4().hex
        spec = {**job_spec(job, shipped_env(job, slot), self.prepare), "key": key}
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
