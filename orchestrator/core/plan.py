"""What runs next: the next generation's runs, and the ideas they need.

A generation is as many runs as there are slots (one slot: a generation of one), all from the current best:
the baseline first (on every slot); then its repeats while σ is unmeasured; a pending candidate again (one
run after a promising single candidate; half the slots to confirm a best-of-k pick, the best on the others);
otherwise new candidates: queued ideas first, then the proposer's. With pipelining, the next generation's
ideas are made while one trains (`Ideas.ahead`) and carried over to a new best when it is planned.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..proposers import Proposer
from ..store.ledger import Record
from .bundle import due, parked
from .noise import COMPARISON_RUNS, parent_first
from .pipeline import Prefetch, Prepared, carry, make_proposal
from .state import Decision, Kind, State, group_of

if TYPE_CHECKING:
    from .workspace import Workspace

MAX_DUPLICATE_ASKS = 3  # ask again this often when a proposal repeats one already in the generation
CANCEL_WAIT_S = 15.0  # how long a stop waits for an idea being made to give up (its agent is killed)
REFILL_BEFORE = 0.5  # a slot freed while others train re-runs the best if the generation is younger than this x budget


class Ideas:
    """Where candidates come from, now or made ahead while a generation trains."""

    def __init__(self, ws, proposer: Proposer, pipeline: bool):
        self.ws, self.proposer, self.pipeline = ws, proposer, pipeline
        self.prefetch: Prefetch | None = None

    def take(self, best: str, records: list[Record], count: int) -> list[Prepared]:
        """Up to `count` distinct ideas on `best` (fewer when the proposer runs dry): those made ahead first,
        re-applied on `best` if it moved (asked again when they no longer apply), then fresh ones."""
        ideas: list[Prepared] = []
        if self.prefetch is not None:
            t = time.monotonic()
            made, self.prefetch = self.prefetch.result(), None
            ideas = [p for p in (carry(self.ws, p, best) for p in made) if p is not None][:count]
            for idea in ideas:
                idea.waited = time.monotonic() - t
        fresh = candidates(self.ws, self.proposer, best, records, count - len(ideas), ideas)
        for idea in fresh:
            idea.waited = idea.seconds
        return ideas + fresh

    def ahead(self, best: str, records: list[Record], count: int) -> None:
        """Start making the next generation's ideas now, unless pipelining is off or some are being made."""
        if self.pipeline and self.prefetch is None and count > 0:
            self.prefetch = Prefetch(lambda: candidates(self.ws, self.proposer, best, records, count))

    def settle(self) -> None:
        """Wait for ideas being made (a proposer's observe() never runs while its propose() does)."""
        if self.prefetch is not None:
            self.prefetch.result()

    def stop(self) -> None:
        """Stop making ideas: the proposer is told (an agent's process tree is killed within a second)."""
        self.proposer.cancelled.set()

    def stopped(self) -> bool:
        """Wait (boundedly) for an idea being made to give up; False if the proposer is still busy."""
        prefetch, self.prefetch = self.prefetch, None
        return prefetch is None or prefetch.wait(CANCEL_WAIT_S)


def candidates(
    ws: Workspace, proposer: Proposer, best: str, records: list[Record], count: int, earlier: Sequence[Prepared] = ()
) -> list[Prepared]:
    """Up to `count` distinct ideas on `best`. Each one sees the ideas made before it (`earlier` too) as
    experiments in flight, with a commit the proposer can read."""
    out: list[Prepared] = []
    history = [*records, *(in_flight(p) for p in earlier)]
    seen = {p.patch for p in earlier}
    while len(out) < count:
        prepared = make_proposal(ws, proposer, best, history)
        for _ in range(MAX_DUPLICATE_ASKS - 1):
            if prepared.exhausted or prepared.reason or prepared.patch not in seen:
                break
            prepared = make_proposal(ws, proposer, best, history)
        if prepared.exhausted:
            break
        if not prepared.reason and len(out) + 1 < count:  # a later idea of this batch sees it in flight
            prepared.planned = ws.commit_proposal(f"autoloop planned: {prepared.description}")
        seen.add(prepared.patch)
        history.append(in_flight(prepared))
        out.append(prepared)
    return out


def in_flight(prepared: Prepared) -> Record:
    return Record(
        n=0,
        status="running",
        description=prepared.description,
        commit=prepared.planned,
        parent=prepared.base,
        info=prepared.info,
    )


def as_running(record: Record) -> Record:
    """How a proposer sees an experiment still in flight: its idea and commit, no result yet."""
    return Record(
        n=record.n,
        status="running",
        description=record.description,
        commit=record.commit,
        parent=record.parent,
        info=record.info,
        group=record.group,
    )


def again(ws: Workspace, state: State, first: Record, description: str, info: dict, kind: Kind) -> Prepared:
    """A run of an earlier candidate's edit again, on the best (the one it was made on: a pending candidate
    keeps the best where it is)."""
    dropped = ("queue_id", "usage", "infra_failures", "would_stop", "overran")
    kept = {k: v for k, v in first.info.items() if k not in dropped}
    patch = (ws.paths.run_dir(first.n) / "diff.patch").read_text()
    return Prepared(
        base=state.best_commit, description=description, patch=patch, group=first.n, info={**kept, **info}, kind=kind
    )


def parent_run(state: State, why: str, label: str = "") -> Prepared:
    name = "baseline" if state.best_group == state.baseline_group else "parent"
    return Prepared(
        base=state.best_commit,
        description=label or f"{name} (repeat: {why})",
        group=state.best_group,
        info={"repeat": why},
        kind=Kind.PARENT,
    )


def refill(state: State, free: int, busy: int, age_s: float, budget: float, room: int | None) -> Prepared | None:
    """The run for a slot freed early (its run crashed at once) while `busy` others still train: a repeat of the
    best, which sharpens the noise estimate, if the generation is younger than REFILL_BEFORE of the budget and
    --max-experiments leaves `room` (None: no limit) for it; else None (the slot waits for the generation)."""
    if not (free and busy and state.best_group and age_s < REFILL_BEFORE * budget and (room is None or room > 0)):
        return None
    return parent_run(state, "slot freed early")


def pending_runs(ws: Workspace, state: State, slots: int) -> list[Prepared]:
    """The pending candidate's next generation: its runs again and, on the other slots, the best's. A best-of-k
    pick is confirmed on half the slots; a promising candidate runs once (one slot: the best instead when that
    sharpens the comparison more, `parent_first`). The best runs at most COMPARISON_RUNS times for one
    comparison; slots beyond that run the candidate again (its looks allowing)."""
    first = state.pending or 0
    pending = next(r for r in state.records if r.n == first)
    overran = [r.n for r in state.records if group_of(r) == first and r.info.get("overran")]
    if overran and not any(state.kept_code(r) for r in state.records if r.n > overran[-1]):
        # the clock refused its last run: the best runs first, so that the audit of its next run knows the
        # machine's start-up now (trial.learned_startup), and a second overrun is the idea's own
        return [parent_run(state, f"measuring the start-up after run {overran[-1]} overran") for _ in range(slots)]
    spare = max(0, COMPARISON_RUNS - asked(state))  # runs of the best this comparison may still ask for
    made = sum(1 for r in state.records if group_of(r) == first)
    if pending.gate.selection:
        k = max(1, math.ceil(slots / 2), slots - spare)
        return [
            again(
                ws,
                state,
                pending,
                f"{pending.description} (confirmation {i + 1}/{k})",
                {"confirm": i + 1},
                Kind.CONFIRM,
            )
            for i in range(k)
        ] + [parent_run(state, "confirmation") for _ in range(slots - k)]
    device = state.records[-1].device
    mine = state.runs(first, device)
    parents = state.comparator(device, state.fresh(ws.settings.gate.mode, device))
    others = state.others(device, state.best_group, first)
    alternate = group_of(state.records[-1]) == first  # runs compared are made close in time: never two of the best
    if slots == 1 and alternate and mine and parents and parent_first(mine, parents, others, asked(state)):
        return [parent_run(state, f"sharpening the comparison with pending run {first}")]
    k = min(max(1, slots - spare), max(1, ws.settings.gate.max_repeats - made))
    # its looks are its counted runs: a run slowed from outside is run again, and the count says so
    label = ws.settings.gate.max_repeats + made - len(state.runs(first))
    return [
        again(
            ws,
            state,
            pending,
            f"{pending.description} (repeat {made + i + 1}/{label})",
            {"repeat": made + i + 1},
            Kind.RERUN,
        )
        for i in range(k)
    ] + [parent_run(state, "confirmation") for _ in range(slots - k)]


def tried_afresh(state: State, device: str) -> int:
    """How often the best has run on `device` since it was kept (counted or not: a fresh run that crashed or was
    slowed is not asked for again; the judge then compares with the runs that kept it)."""
    return sum(group_of(r) == state.best_group and r.n > state.kept_at and r.device == device for r in state.records)


FRESH_RUNS = 2  # fresh runs of a new best under the value rule: one lucky run would set the bar for every idea


def fresh_runs(gate) -> int:
    """Fresh runs a new best gets before the next idea (the noise gate: one)."""
    return FRESH_RUNS if gate.mode == "value" else 1


GROW_PER_IDEA = 0.5  # under the value rule the best runs again until it has this many runs per idea judged against it
GROW_CAP = 12  # ... up to this many runs since its keep


def grows(state: State, gate, device: str) -> bool:
    """Under the value rule: is the best due another run before the next idea? Every later idea is compared
    with the best's mean, so a run of it serves them all: it runs again until it has FRESH_RUNS + GROW_PER_IDEA
    runs per idea judged against it since its keep (GROW_CAP at most). SMAC's intensification does the same for
    its incumbent; simulated with σ and the prior known, it is what a night with a best measured twice lacks
    (benchmarks/README.md, "The value rule")."""
    if gate.mode != "value":
        return False
    judged = len(
        {
            group_of(r)
            for r in state.records
            if r.n > state.kept_at and r.device == device and r.gate.decision == Decision.DISCARD
        }
    )
    # its runs tried since the keep, counted or not: a best whose run crashes is not asked again and again
    return tried_afresh(state, device) < min(GROW_CAP, fresh_runs(gate) + GROW_PER_IDEA * judged)


def asked(state: State) -> int:
    """Runs of the best made since the pending candidate's first run: what its comparison has asked for."""
    return sum(1 for r in state.records if r.n > (state.pending or 0) and group_of(r) == state.best_group)


def plan(ws: Workspace, ideas: Ideas, state: State, slots: int) -> list[Prepared]:
    """The runs of the next generation (at most `slots`); [] when the proposer has no more ideas."""
    s, best = ws.settings, state.best_commit
    if not state.best_group:
        first = "baseline" if state.done == 0 else "baseline (retry)"
        return [
            Prepared(
                base=best,
                description=first if i == 0 else f"baseline (slot {i + 1})",
                group=state.done + 1,
                kind=Kind.BASELINE,
            )
            for i in range(slots)
        ]
    if state.pending is not None:
        return pending_runs(ws, state, slots)
    runs: list[Prepared] = []
    wanted, base = 1 + s.baseline_repeats, state.baseline_group
    since = [r for r in state.records if r.n >= base and not r.gate.disturbed]
    have = sum(1 for r in since if group_of(r) == base)
    if state.best_group == base and have == len(since) and have < wanted:  # σ from the baseline, before any idea
        count = slots if wanted - have >= slots else min(wanted - have, slots - 1)
        runs = [parent_run(state, "measuring σ", f"baseline (repeat {have + i + 1}/{wanted})") for i in range(count)]
        for i, run in enumerate(runs):
            run.info = {"repeat": have + i + 1}
    device = state.records[-1].device if state.records else ""
    if not runs and device and not state.runs(state.best_group, device):  # e.g. resumed on another GPU model
        runs = [parent_run(state, f"no run of the best on {device} yet")]
    elif not runs and device and state.fresh(s.gate.mode, device) and tried_afresh(state, device) < fresh_runs(s.gate):
        runs = [parent_run(state, "a fresh run of the new best")]  # its keep's runs are biased low
    elif not runs and device and state.fresh(s.gate.mode, device) and grows(state, s.gate, device):
        runs = [parent_run(state, "the best measured again: every later idea is compared with it")]
    made = None
    if not runs and s.gate.bundle and len(parked(state)) >= s.gate.bundle:
        ideas.settle()  # the proposal worktree is free (an idea being made ahead is kept for later)
        if (made := due(ws, state)) is not None:
            runs = [made]
    if len(runs) == slots:
        return runs
    fresh = ideas.take(best, state.records, slots - len(runs))
    return runs + fresh if fresh or made else []  # the proposer ran dry: the session ends (a bundle due runs)
