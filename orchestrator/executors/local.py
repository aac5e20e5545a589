"""The default executor: N slots on this machine, slot i pinned to its GPU(s) with CUDA_VISIBLE_DEVICES.

Without GPUs the slots share the CPU: each gets an equal share of the cores (OMP_NUM_THREADS), so two CPU
slots do not fight over the same threads.
"""

from __future__ import annotations

import os
import subprocess
import threading

from .base import Executor, Handle, Job, JobResult, Slot, run_steps


def detect_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists; [] without."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")] \
        if out.returncode == 0 else []


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def local_slots(workers: int, gpus: list[str] | None) -> list[Slot]:
    """Slot i gets GPU group i (GPUs dealt out evenly), or 1/workers of the CPU cores when there is no GPU."""
    if gpus:
        if workers > len(gpus):
            raise ValueError(f"--workers {workers} needs at least {workers} GPUs, {len(gpus)} given or detected "
                             f"({','.join(gpus)}); lower --workers or list more with --gpus")
        per = len(gpus) // workers
        return [Slot(i, {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])},
                     f"gpu {','.join(gpus[i * per:(i + 1) * per])}") for i in range(workers)]
    threads = str(max(1, cpu_count() // workers))
    env = {"CUDA_VISIBLE_DEVICES": ""} if workers > 1 else {}
    return [Slot(i, {**env, "OMP_NUM_THREADS": threads} if workers > 1 else dict(env), "cpu")
            for i in range(workers)]


class LocalHandle(Handle):
    def __init__(self, job: Job, slot: Slot):
        self._cancel = threading.Event()
        self._result: JobResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(job, slot), daemon=True,
                                        name=f"autoloop-slot-{slot.index}")
        self._thread.start()

    def _run(self, job: Job, slot: Slot) -> None:
        try:
            self._result = run_steps(job, job.workdir, job.out_dir, slot.env, self._cancel)
            self._result.slot = slot.index
        except Exception as e:  # noqa: BLE001 - reported as an infrastructure failure, never lost
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> JobResult:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the job is still running")
        if self._result is None:
            return JobResult(infra_error=f"{type(self._error).__name__}: {self._error}")
        return self._result

    def cancel(self) -> None:
        self._cancel.set()


class LocalExecutor(Executor):
    name = "local"

    def __init__(self, workers: int = 1, gpus: list[str] | None = None):
        self.slots = local_slots(workers, detect_gpus() if gpus is None else gpus)
        if gpus == []:  # --gpus '': no GPU on purpose, even where one is visible (one slot included)
            for slot in self.slots:
                slot.env.setdefault("CUDA_VISIBLE_DEVICES", "")

    def submit(self, job: Job, slot: Slot) -> Handle:
        return LocalHandle(job, slot)
