"""Proposals are made in their own worktree, so the next idea can be prepared while an experiment trains.

`make_proposal` resets the proposal worktree to a base commit, asks for one idea (a queued idea first, else
the proposer), and captures everything the proposer changed as a patch. The loop applies the patch in the
experiment worktree; if the base moved on (the previous experiment was kept) it re-applies the patch on the
new best with a three-way merge, and asks again if that fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..executors.background import Background
from ..proposers import Proposal, ProposalFailed, Proposer
from ..proposers.queue import apply_idea
from ..store import gitops
from ..store.ledger import Record
from .state import Kind

if TYPE_CHECKING:
    from .workspace import Workspace


@dataclass
class Prepared:
    base: str  # the commit the idea was made on
    description: str = ""
    info: dict = field(default_factory=dict)
    patch: str = ""  # everything the proposer changed (binary diff against base)
    patch_u0: str = ""  # the same without context lines, to carry a small edit over to a newer best
    reason: str = ""  # set when the idea could not be made: recorded as a crash without a run
    log: str = ""  # the proposer's own output (e.g. a coding agent's), saved with the run
    seconds: float = 0.0
    exhausted: bool = False  # the proposer has no more ideas
    group: int | None = None  # set for a repeat run of an earlier candidate (or of the baseline)
    planned: str = ""  # a commit of the idea in the proposal worktree (ideas of one generation see each other)
    ready: float = 0.0  # wall-clock time the idea was ready
    waited: float = 0.0  # how long the loop waited for it (0 when it was made while others trained)
    kind: Kind = Kind.CANDIDATE  # why it runs in its generation (the judge reads each kind its own way)


def make_proposal(ws: Workspace, proposer: Proposer, base: str, history: list[Record]) -> Prepared:
    """One idea on top of `base`, made in the session's proposal worktree."""
    t0 = time.monotonic()
    wt = ws.proposal_worktree(base)
    workdir = ws.paths.proposal
    prepared = Prepared(base=base)
    reported = ws.spend.requests
    try:
        idea = ws.queue.next(history, ws.settings.tag)
        result = apply_idea(idea, workdir, ws.profile) if idea else proposer.propose(workdir, history)
    except ProposalFailed as e:
        result = Proposal(e.description, e.info, e.log)
        prepared.reason = e.reason
    except Exception as e:  # a failing proposer is data, not the end of the night
        prepared.reason = f"proposer error: {type(e).__name__}: {e}"
        result = Proposal(prepared.reason)
    if result is None:
        prepared.exhausted = True
    else:
        result = result if isinstance(result, Proposal) else Proposal(str(result))
        prepared.description = " ".join(result.description.split())[:300] or "(no description)"
        prepared.info, prepared.log = dict(result.info), result.log
        if ws.spend.requests == reported and isinstance(prepared.info.get("usage"), dict):
            ws.spend.add(prepared.info["usage"], proposer.name)  # counted now: the idea may never run
        prepared.patch = gitops.diff_all(wt, base)
        prepared.patch_u0 = gitops.diff_all(wt, base, context=0)
    prepared.seconds = time.monotonic() - t0
    prepared.ready = time.time()
    return prepared


def carry(ws: Workspace, prepared: Prepared, best: str) -> Prepared | None:
    """An idea made on an older best, re-applied on `best` (three-way); None if it does not carry over, had
    failed, or is in the best already (the best moved by this very change: run, it would be the best again):
    ask again. Uses the branch worktree, which stands at `best`."""
    if prepared.base == best or prepared.exhausted:
        return prepared
    if prepared.reason or gitops.carry_over(ws.wt, prepared.patch, prepared.patch_u0):
        return None
    prepared.patch = gitops.diff_all(ws.wt, best)
    prepared.base = best
    gitops.reset_to(ws.wt, best)
    return prepared if prepared.patch.strip() else None


class Prefetch(Background):
    """make_proposal (once, or for a generation's ideas) in a daemon thread: a hung LLM call must not block the
    controller's exit."""

    def __init__(self, fn: Callable[[], object]):
        super().__init__(fn, "autoloop-prefetch")

    def result(self):
        """Wait for the idea(s) (repeatable: later calls return the same)."""
        self.wait(None)
        value, error = self.outcome()
        if error is not None:
            raise error
        return value
