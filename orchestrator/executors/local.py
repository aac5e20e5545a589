"""The default executor: N slots on this machine, slot i pinned to its GPU(s) with CUDA_VISIBLE_DEVICES.

Without GPUs the slots share the CPU: each gets an equal share of the cores (OMP_NUM_THREADS), so two CPU
slots do not fight over the same threads.
"""

from __future__ import annotations

import os
import threading

import click

from .background import Background
from .base import Executor, Handle, Job, JobResult, Slot, run_steps
from .gpu import parse_list, smi


def detect_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists; [] without."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i in range(len(parse_list(smi(["-L"], timeout=20) or "")))]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def local_slots(workers: int, gpus: list[str] | None) -> list[Slot]:
    """Slot i gets GPU group i (GPUs dealt out evenly), or 1/workers of the CPU cores when there is no GPU."""
    if gpus:
        if workers > len(gpus):
            raise ValueError(
                f"--workers {workers} needs at least {workers} GPUs, {len(gpus)} given or detected "
                f"({','.join(gpus)}); lower --workers or list more with --gpus"
            )
        per = len(gpus) // workers
        return [
            Slot(
                i,
                {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per : (i + 1) * per])},
                f"gpu {','.join(gpus[i * per : (i + 1) * per])}",
            )
            for i in range(workers)
        ]
    threads = str(max(1, cpu_count() // workers))
    env = {"CUDA_VISIBLE_DEVICES": ""} if workers > 1 else {}
    return [Slot(i, {**env, "OMP_NUM_THREADS": threads} if workers > 1 else dict(env), "cpu") for i in range(workers)]


class LocalHandle(Handle):
    """A job running in a thread of this process (waited for with an Event: orchestrator/executors/background.py)."""

    def __init__(self, job: Job, slot: Slot):
        self._cancel = threading.Event()
        self._job = Background(lambda: self._run(job, slot), f"autoloop-slot-{slot.index}")

    def _run(self, job: Job, slot: Slot) -> JobResult:
        result = run_steps(job, job.workdir, job.out_dir, slot.env, self._cancel)
        result.slot = slot.index
        return result

    def done(self) -> bool:
        return self._job.done()

    def wait(self, timeout: float) -> bool:
        return self._job.wait(timeout)

    def result(self, timeout: float | None = None) -> JobResult:
        if not self._job.wait(timeout):
            raise TimeoutError("the job is still running")
        value, error = self._job.outcome()
        if error is not None:  # reported as an infrastructure failure, never lost
            return JobResult(infra_error=f"{type(error).__name__}: {error}")
        return value

    def cancel(self) -> None:
        self._cancel.set()


def check_gpus(ctx, param, value):
    """'0,1,3' -> ['0', '1', '3']; '' -> [] (no GPU: CPU slots)."""
    if value is None or isinstance(value, list):
        return value
    if not str(value).strip():
        return []
    ids = [part.strip() for part in str(value).split(",") if part.strip()]
    if not ids or not all(part.isdigit() for part in ids) or len(set(ids)) != len(ids):
        raise click.BadParameter(f"{value!r} is not a list of distinct GPU ids such as 0,1,2,3")
    return ids


class LocalExecutor(Executor):
    name = "local"
    options = (
        click.Option(
            ["--gpus"],
            callback=check_gpus,
            help="GPU ids for the local executor, e.g. 0,1,2,3; '' for CPU slots.  [default: detected]",
        ),
    )

    @classmethod
    def create(cls, workers: int | None, options: dict) -> LocalExecutor:
        gpus = options.get("gpus")
        detected = detect_gpus() if gpus is None else gpus
        return cls(workers or max(1, len(detected)), gpus if gpus is not None else detected or None)

    def __init__(self, workers: int = 1, gpus: list[str] | None = None):
        self.slots = local_slots(workers, detect_gpus() if gpus is None else gpus)
        if gpus == []:  # --gpus '': no GPU on purpose, even where one is visible (one slot included)
            for slot in self.slots:
                slot.env.setdefault("CUDA_VISIBLE_DEVICES", "")

    def submit(self, job: Job, slot: Slot) -> Handle:
        return LocalHandle(job, slot)
