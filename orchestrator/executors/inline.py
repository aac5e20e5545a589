"""`inline`: the debug executor. It runs a job's steps at once, in the calling thread, on one slot of this machine:
no threads, nothing at the same time. The second cheap implementation of the executor contract, and a way to
step through a run in a debugger (`autoloop run --executor inline`)."""

from __future__ import annotations

from .base import Ended, Executor, Handle, Job, Slot, run_steps


class InlineExecutor(Executor):
    name = "inline"
    cancellable = False  # submit() returns once the job has ended: there is nothing left to cancel

    def __init__(self, workers: int | None = None):
        if workers not in (None, 1):
            raise ValueError("the inline executor has one slot: leave out --workers (or use --executor local)")
        self.slots = [Slot(0, {}, "inline")]

    def submit(self, job: Job, slot: Slot) -> Handle:
        result = run_steps(job, job.workdir, job.out_dir, slot.env)
        result.slot = slot.index
        return Ended(result)  # (Ctrl-C during run_steps kills its tree: nothing is left to cancel)
