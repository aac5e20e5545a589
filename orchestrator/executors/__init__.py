"""Executors run an experiment's commands: `local` (default; N slots on this machine) or `ray` (a cluster)."""

from __future__ import annotations

from .base import OUT, PYTHON, Executor, Handle, Job, JobResult, Slot, StepResult, run_steps, wait_any
from .local import LocalExecutor, detect_gpus

__all__ = [
    "OUT",
    "PYTHON",
    "Executor",
    "Handle",
    "Job",
    "JobResult",
    "LocalExecutor",
    "Slot",
    "StepResult",
    "detect_gpus",
    "make_executor",
    "run_steps",
    "wait_any",
]


def make_executor(name: str, workers: int | None = None, options: dict | None = None) -> Executor:
    """The executor registered as `name` (entry-point group autoloop.executors) with its option values;
    LoopError (unknown, broken) or ValueError / ImportError with what to do when it cannot be made."""
    from .. import plugins

    return plugins.load("executor", name, Executor).create(workers, dict(options or {}))
