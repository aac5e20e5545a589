"""Parallel experiments, one generation at a time (more than one executor slot).

Each generation starts N runs at once on identical slots, all from the current best (the parent):

- the first generation runs the unmodified baseline on every slot (σ is measured at once);
- a normal generation runs N distinct candidates (after any parent runs σ still needs);
- after a generation whose best candidate beat the parent by the noise margin, a confirmation generation
  runs that candidate again on half the slots and the parent on the others. Picking the best of N noisy runs
  is biased low (the winner's curse), so the branch advances only if the confirmation runs alone, judged
  like any candidate, beat the parent too; the selection run never counts in the parent's mean afterwards.

With pipelining, the next generation's ideas are made while this one trains (start_prefetch).
A slot whose run crashes early (or never started: the idea did not apply) runs the parent again, to refine σ
and the parent's mean. Results are only compared between runs on the same device type. Every run is recorded,
in run-number order, when its generation ends.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from . import LoopError, gitops
from .executors import Handle, Slot, wait_any
from .experiment import (PROGRESS_TICK_S, as_running, build_job, carry, finish, infra_retry, measure,
                         repeat_info, repeat_patch, stage, submit)
from .ledger import Record
from .noise import Sigma, judge, pooled_sigma, significant_lines
from .pipeline import Prefetch, Prepared, make_proposal
from .proposers import Proposer
from .session import write_status

if TYPE_CHECKING:
    from .loop import Session, State

REFILL_BEFORE = 0.5  # a freed slot runs the parent again if the generation is younger than this x budget
MAX_DUPLICATE_ASKS = 3  # ask again this often when a proposal repeats one already in the generation


@dataclass
class Planned:
    prepared: Prepared
    kind: str  # baseline | parent | candidate | confirm


@dataclass
class Run:
    record: Record
    kind: str
    slot: Slot | None = None
    handle: Handle | None = None
    job: object = None
    started: float = 0.0
    reason: str = ""
    done: bool = False


@dataclass
class Generation:
    index: int
    runs: list[Run] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


# ---------------------------------------------------------------------------
# What to run
# ---------------------------------------------------------------------------


def device_runs(state: State, group: int, device: str | None) -> list[float]:
    """val_bpb of the finished runs of `group` on `device` (any device if None), selection runs left out."""
    return [r.val_bpb for r in state.records
            if (r.group or r.n) == group and r.status != "crash" and r.val_bpb is not None
            and not r.gate.get("selection") and (device is None or r.device == device)]


def device_sigma(records: list[Record]) -> Sigma:
    """σ pooled over every (configuration, device) measured more than once."""
    groups: dict[tuple[int, str], list[float]] = {}
    for r in records:
        if r.status != "crash" and r.val_bpb is not None:
            groups.setdefault((r.group or r.n, r.device), []).append(r.val_bpb)
    return pooled_sigma(list(groups.values()))


def parent_run(state: State, why: str) -> Planned:
    best = state.best_commit
    label = "baseline" if state.best_group == 1 else "parent"
    return Planned(Prepared(base=best, description=f"{label} (repeat: {why})", group=state.best_group,
                            info={"repeat": why}), "parent")


def plan(session: Session, proposer: Proposer, state: State, slots: int) -> list[Planned]:
    """The runs of the next generation (at most `slots`); [] when the proposer has no more ideas."""
    best = state.best_commit
    if not state.best_group:
        return [Planned(Prepared(base=best, description="baseline" if i == 0 else f"baseline (slot {i + 1})",
                                 group=state.done + 1), "baseline") for i in range(slots)]
    if state.pending is not None:
        first = next(r for r in state.records if r.n == state.pending)
        patch = repeat_patch(session, first)
        confirm = max(1, math.ceil(slots / 2))
        runs = [Planned(Prepared(base=best, description=f"{first.description} (confirmation {k + 1}/{confirm})",
                                 patch=patch, group=state.pending,
                                 info={**repeat_info(first), "confirm": k + 1}), "confirm")
                for k in range(confirm)]
        return runs + [parent_run(state, "confirmation") for _ in range(slots - confirm)]
    runs: list[Planned] = []
    wanted = 1 + session.settings.baseline_repeats
    have = len(device_runs(state, state.best_group, None))
    runs += [parent_run(state, "measuring σ") for _ in range(min(slots - 1, max(0, wanted - have)))]
    ideas: list[Prepared] = []
    prefetched = session.prefetch.result() if session.prefetch is not None else []
    session.prefetch = None
    for prepared in prefetched:  # made while the last generation trained, maybe on an older best
        if len(runs) + len(ideas) < slots and (prepared := carry(session, prepared, best)) is not None:
            ideas.append(prepared)
    ideas += candidates(session, proposer, best, state.records, slots - len(runs) - len(ideas), ideas)
    runs += [Planned(prepared, "candidate") for prepared in ideas]
    return runs if ideas else []


def candidates(session: Session, proposer: Proposer, best: str, records: list[Record], count: int,
               earlier: list[Prepared] = ()) -> list[Prepared]:
    """Up to `count` distinct ideas on `best` (fewer when the proposer runs dry). Each one sees the ideas made
    before it (`earlier` too) as experiments in flight, with a commit the proposer can read."""
    out: list[Prepared] = []
    history = [*records, *(in_flight(p) for p in earlier)]
    seen = {p.patch for p in earlier}
    while len(out) < count:
        prepared = make_proposal(session, proposer, best, history)
        for _ in range(MAX_DUPLICATE_ASKS - 1):
            if prepared.exhausted or prepared.reason or prepared.patch not in seen:
                break
            prepared = make_proposal(session, proposer, best, history)
        if prepared.exhausted:
            break
        if not prepared.reason:
            prepared.planned = session.commit_proposal(f"autoloop planned: {prepared.description}")
        seen.add(prepared.patch)
        history.append(in_flight(prepared))
        out.append(prepared)
    return out


def in_flight(prepared: Prepared) -> Record:
    return Record(n=0, status="running", description=prepared.description, commit=prepared.planned,
                  parent=prepared.base, info=prepared.info)


def start_prefetch(session: Session, proposer: Proposer, state: State, gen: Generation, count: int) -> None:
    """Make the next generation's ideas while this one trains (LLM and agent proposers are slow), on the
    current best; they are carried over to a new best, or asked again, when that generation is planned."""
    best = state.best_commit
    records = [*state.records, *(as_running(r.record) for r in gen.runs)]
    session.prefetch = Prefetch(lambda: candidates(session, proposer, best, records, count))


# ---------------------------------------------------------------------------
# Running a generation
# ---------------------------------------------------------------------------


def start(session: Session, state: State, planned: Planned, slot: Slot, n: int, proposer_name: str) -> Run:
    """Stage the run in its slot's worktree and submit it; a run whose idea may not run is done at once."""
    prepared = planned.prepared
    record = Record(n=n, status="crash", description=prepared.description, parent=prepared.base,
                    proposer=proposer_name, started=time.time(), best_before=state.best_bpb,
                    info=dict(prepared.info), group=prepared.group or n, slot=slot.index)
    record.timings["propose"] = prepared.seconds
    if prepared.ready:
        record.timings["idea_waited"] = record.started - prepared.ready  # long when made while others trained
    run_dir = session.paths.run_dir(n)
    run_dir.mkdir(parents=True, exist_ok=True)
    if prepared.log:
        (run_dir / "proposer.log").write_text(prepared.log)
    wt = gitops.ensure_detached_worktree(session.repo, session.paths.slot(slot.index), prepared.base)
    gitops.checkout_clean(wt, prepared.base)
    run = Run(record, planned.kind, slot)
    run.reason = stage(session, wt, record, prepared, prepared.reason)
    if run.reason:
        run.done = True
        return run
    run.job = build_job(session, session.paths.slot(slot.index), run_dir)
    run.handle = submit(session, run.job, slot, record)
    run.started = time.monotonic()
    return run


def run_generation(session: Session, proposer: Proposer, state: State, gen: Generation,
                   planned: list[Planned], limit: int | None) -> list[Run]:
    """Start every planned run, refill slots freed early with parent runs, wait for all; runs by number."""
    slots = list(session.executor.slots)
    next_n = state.done + 1
    try:
        for item, slot in zip(planned, slots):
            gen.runs.append(start(session, state, item, slot, next_n, proposer.name))
            next_n += 1
        free = [r.slot for r in gen.runs if r.done] + slots[len(planned):]
        remaining = None if limit is None else limit - len(planned)
        if session.pipeline and session.prefetch is None and (remaining is None or remaining > 0):
            start_prefetch(session, proposer, state, gen, len(slots))
        while True:
            for run in gen.runs:
                if run.done or not run.handle.done():
                    continue
                result = run.handle.result()
                if result.infra_error:
                    infra_retry(session, run.record, result)
                    run.handle = submit(session, run.job, run.slot, run.record)
                    continue
                run.reason, run.done = measure(session, run.record, result), True
                if run.reason:
                    free.append(run.slot)
            young = time.monotonic() - gen.started < REFILL_BEFORE * session.settings.budget
            while free and young and state.best_group and (limit is None or next_n - state.done <= limit):
                gen.runs.append(start(session, state, parent_run(state, "slot freed early"), free.pop(0), next_n,
                                      proposer.name))
                next_n += 1
                free += [r.slot for r in gen.runs[-1:] if r.done]
            if all(r.done for r in gen.runs):
                break
            session.progress.update(progress_text(session, state, gen))
            write_status(session.paths, phase="training", running=[
                {"n": r.record.n, "slot": r.slot.index, "description": r.record.description,
                 "started": r.record.started} for r in gen.runs if not r.done])
            wait_any([r.handle for r in gen.runs if not r.done], poll_s=0.05,
                     until=time.monotonic() + PROGRESS_TICK_S)
    except KeyboardInterrupt:
        for run in gen.runs:
            if not run.done and run.handle is not None:
                run.handle.cancel()
        for run in gen.runs:
            if not run.done and run.handle is not None:
                run.handle.result()
        raise
    return sorted(gen.runs, key=lambda r: r.record.n)


def progress_text(session: Session, state: State, gen: Generation) -> str:
    s = session.settings
    running = [r for r in gen.runs if not r.done]
    parts = [f"generation {gen.index}: {len(running)} running"]
    parts += [f"#{r.record.n} {time.monotonic() - r.started:.0f}s/{s.budget:g}s" for r in running[:8]]
    if state.best_bpb is not None:
        parts.append(f"best {state.best_bpb:.6f}")
    return " | ".join(parts)


# ---------------------------------------------------------------------------
# Deciding a generation
# ---------------------------------------------------------------------------


def decide(session: Session, state: State, runs: list[Run]) -> dict[int, str]:
    """Fill each run's gate and return its status by run number (crashes are left to finish())."""
    gate = session.settings.gate
    ok = [r for r in runs if not r.reason]
    statuses: dict[int, str] = {}
    if not state.best_group:  # the baseline generation: the first good run is the baseline, the rest repeats
        for i, run in enumerate(ok):
            run.record.gate = {"decision": "keep" if i == 0 else "repeat", "runs": i + 1, "why": "baseline"}
            statuses[run.record.n] = "keep" if i == 0 else "discard"
        return statuses
    sigma = device_sigma(state.records + [r.record for r in ok])
    best_source = session.repo.git.show(f"{state.best_commit}:train.py")

    def parent_on(device: str) -> list[float]:
        return device_runs(state, state.best_group, device) + [
            r.record.val_bpb for r in ok if r.kind == "parent" and r.record.device == device]

    def verdict_for(candidate: list[float], record: Record):
        parent = parent_on(record.device)
        if not parent:
            return None
        shorter = significant_lines(session.repo.git.show(f"{record.commit}:train.py")) < \
            significant_lines(best_source)
        return judge(candidate, parent, sigma, gate, shorter), parent

    for run in ok:
        if run.kind == "parent":
            run.record.gate = {"decision": "repeat", "runs": 1, "why": run.record.info.get("repeat", "")}
            statuses[run.record.n] = "discard"

    candidates = [r for r in ok if r.kind == "candidate"]
    eligible = []
    for run in candidates:
        found = verdict_for([run.record.val_bpb], run.record)
        if found is None:
            run.record.gate = {"decision": "discard", "runs": 1,
                               "why": f"no run of the parent on {run.record.device or 'this device'} to compare with"}
        else:
            verdict, parent = found
            run.record.gate = _gate(verdict, [run.record.val_bpb], parent, sigma)
            run.record.gate["decision"] = "discard"
            if verdict.decision == "keep":
                eligible.append(run)
        statuses[run.record.n] = "discard"
    if eligible:
        winner = min(eligible, key=lambda r: r.record.val_bpb)
        winner.record.gate.update(decision="rerun", selection=True,
                                  note=f"best of {len(candidates)}, by {winner.record.gate['delta']:.4f}: confirming")
    for run in eligible:
        if run.record.gate["decision"] == "discard":
            run.record.gate["note"] = "beat the parent, but not the best of its generation"

    confirms = [r for r in runs if r.kind == "confirm"]
    if confirms:
        good = [r for r in confirms if not r.reason]
        for run in good:
            run.record.gate = {"decision": "confirming", "runs": 1, "note": "confirmation run"}
            statuses[run.record.n] = "discard"
        if good:
            final = good[-1]
            values = [r.record.val_bpb for r in good if r.record.device == final.record.device]
            found = verdict_for(values, final.record)
            if found is None:
                final.record.gate.update(decision="discard", note="not confirmed: no parent run on this device")
            else:
                verdict, parent = found
                final.record.gate = _gate(verdict, values, parent, sigma)
                confirmed = verdict.decision == "keep"
                final.record.gate["decision"] = "keep" if confirmed else "discard"
                final.record.gate["confirmation"] = True
                final.record.gate["note"] = (f"confirmed by {len(values)} run(s): {verdict.delta:+.4f} vs the "
                                             f"parent, margin {verdict.margin:.4f}")
                if not confirmed:
                    final.record.gate["note"] = (f"not confirmed: {len(values)} confirmation run(s) "
                                                 f"{verdict.why} ({verdict.delta:+.4f}, margin {verdict.margin:.4f})")
                statuses[final.record.n] = "keep" if confirmed else "discard"
    return statuses


def _gate(verdict, candidate: list[float], parent: list[float], sigma: Sigma) -> dict:
    return {"decision": verdict.decision, "runs": len(candidate), "mean": statistics.fmean(candidate),
            "best_mean": statistics.fmean(parent), "margin": verdict.margin, "delta": verdict.delta,
            "sigma": sigma.value, "sigma_dof": sigma.dof, "why": verdict.why}


def record_generation(session: Session, state: State, runs: list[Run], statuses: dict[int, str],
                      on_record: Callable[[Record], None]) -> None:
    """Write every run of the generation in run-number order (record.json, row, branch), telling on_record."""
    for run in runs:
        finish(session, state, run.record, run.reason, statuses.get(run.record.n))
        on_record(run.record)


def run_generations(session: Session, proposer: Proposer, state: State, stop_reason: Callable[[], str],
                    on_record: Callable[[Record], None], after: Callable[[], None]) -> str:
    """Generations until a stop condition; returns why it stopped."""
    s = session.settings
    index = 0
    while not (stop := stop_reason()):
        index += 1
        limit = None if s.max_experiments is None else s.max_experiments - state.done
        slots = len(session.executor.slots) if limit is None else min(len(session.executor.slots), limit)
        write_status(session.paths, phase="proposing", n=state.done + 1, experiment_started=time.time(),
                     description="", tag=s.tag, budget=s.budget, generation=index, running=[])
        planned = plan(session, proposer, state, slots)
        if not planned:
            return "the proposer has no more ideas"
        first_generation = not state.best_group
        runs = run_generation(session, proposer, state, Generation(index), planned, limit)
        session.progress.clear()
        if session.prefetch is not None:
            session.prefetch.result()  # observe() never runs while propose() does
        statuses = decide(session, state, runs)
        record_generation(session, state, runs, statuses, on_record)
        if first_generation and not state.best_group:
            first = runs[0].record
            raise LoopError(f"the unmodified baseline crashed on every slot ({first.reason}); fix train.py or the "
                            f"environment, see {session.paths.run_dir(first.n) / 'run.log'}")
        after()
    return stop
