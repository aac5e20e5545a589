"""Executors run an experiment's commands: `local` (default; N slots on this machine) or `ray` (a cluster)."""

from __future__ import annotations

from .base import OUT, PYTHON, Executor, Handle, Job, JobResult, Slot, StepResult, run_steps, wait_any
from .local import LocalExecutor, detect_gpus

EXECUTORS = ("local", "ray")

__all__ = ["EXECUTORS", "OUT", "PYTHON", "Executor", "Handle", "Job", "JobResult", "LocalExecutor", "Slot",
           "StepResult", "detect_gpus", "make_executor", "run_steps", "wait_any"]


def make_executor(name: str, workers: int | None = None, gpus: list[str] | None = None,
                  ray_address: str | None = None) -> Executor:
    """The executor by name; ValueError with what to do when it cannot be made."""
    if name == "local":
        detected = detect_gpus() if gpus is None else gpus
        return LocalExecutor(workers or max(1, len(detected)), detected)
    if name == "ray":
        from .ray_executor import RayExecutor

        return RayExecutor(address=ray_address, workers=workers)
    raise ValueError(f"unknown executor {name!r}; choose one of: {', '.join(EXECUTORS)}")
