"""Deciding a finished generation: a pure function of (state, finished runs, gate settings).

- The first generation: the first good run is the baseline (kept), the others are its repeats.
- A run of the best itself (kind "parent") only measures σ and sharpens the best's mean.
- One candidate in a generation is judged directly against the best: keep, run again (inside the margin), or
  discard. Several candidates at once: the best of them that beats the best is only *selected*, because the
  best of k noisy runs is biased low (the winner's curse); it is run again and its pick never counts.
- Runs again of a pending candidate ("rerun", "confirm") are judged on all its counted runs on that device.
- The best is represented by its fresh runs only (State.comparator): the runs that won its keep are a selected
  sample, biased low, and comparing later candidates with them would discard true improvements.
Comparisons are made only between runs on the same device type. See noise.py for the margin.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from ..store.ledger import Evidence, Record, Row
from ..trust import redaction
from .bundle import near_miss
from .noise import Gate, Verdict, judge
from .state import (
    CPU_OUTSIDE,
    DISTURBED,
    Cause,
    Decision,
    Kind,
    State,
    Status,
    busy_outside,
    cpu_share,
    group_of,
    throughput,
    waited,
)


@dataclass
class Finished:
    record: Record
    kind: Kind
    crashed: bool = False
    shorter: bool = False  # its train.py has fewer significant lines than the best's
    disturbed: str = ""  # why it was slowed from outside: its throughput (set by decide), or a first overrun of
    #                      the clock (trial.overrun)
    stopped: str = ""  # why --early-stop stopped it: no val_bpb, a discard on its curve's evidence
    duplicate: int = 0  # the earlier run whose idea it repeats exactly: not run (proposers/memory.py)


def disturbance(state: State, run: Finished) -> str:
    """Why this run looks slowed from outside (another process on the CPU, a shared or throttled GPU), or '':
    its share of the CPU while it was ready to run far below the median of the session's counted runs on its
    device, its throughput far below the median of its twins (counted runs of its configuration on its device),
    or, for a new configuration, of the best's runs when the model has the same size. Either only while other
    users' processes kept the machine busy (`busy_outside`, the runner's measure): a run can lower its own share
    or print a low step count, never raise the others' load. A configuration is given the benefit of the doubt
    once: a second slow run is its own speed."""
    r = run.record
    group = group_of(r)
    if any(x.gate.disturbed and not x.info.get("overran") for x in state.records if group_of(x) == group):
        return ""  # (an overrun of the clock is another matter: trial.overrun)
    same = [x for x in state.records if state.counted(x) and x.device == r.device]
    # the CPU the machine left it, a new configuration's run too: measured by the controller, not the edit's doing
    shares = [s for s in map(cpu_share, same) if s]
    if len(shares) >= 2 and waited(r, usual := statistics.median(shares)):
        busy = r.metrics[CPU_OUTSIDE]
        return (
            f"disturbed: it had the CPU {cpu_share(r):.0%} of the time it was ready to run (usual {usual:.0%}) while "
            f"other users' processes kept {busy:.1f} CPUs busy"
        )
    twins, unit, whose = [x for x in same if group_of(x) == group], "steps", "its twins'"
    if not twins and run.kind == Kind.CANDIDATE:
        size = r.metrics.get("num_params_M")
        twins = [x for x in same if group_of(x) == state.best_group and x.metrics.get("num_params_M") == size]
        unit, whose = "tokens", "the best's (same model size)"
    mine = throughput(r, unit)
    speeds = [s for s in (throughput(x, unit) for x in twins) if s]
    if mine is None or not speeds or mine >= DISTURBED * statistics.median(speeds) or not busy_outside(r):
        return ""  # (its steps and tokens are what train.py printed: believed only beside others' load)
    busy = r.metrics[CPU_OUTSIDE]
    return (
        f"disturbed: {unit} per second {mine / statistics.median(speeds):.0%} of {whose} median while other users' "
        f"processes kept {busy:.1f} CPUs busy"
    )


@dataclass(frozen=True)
class Judgement:
    """What the judge decided of one run: its status and the gate's evidence (record.json's "gate")."""

    status: Status
    gate: Evidence


def decide(state: State, runs: list[Finished], gate: Gate) -> list[Judgement]:
    """Each run's status and evidence, in the order of `runs`; the records themselves are left as they are
    (the loop writes the judgements into them). A disturbed run is not judged: it is run again."""
    work = [replace(r, record=replace(r.record, gate=replace(r.record.gate))) for r in runs]
    _judge(state, work, gate)
    return [Judgement(Status(r.record.status), r.record.gate) for r in work]


def _judge(state: State, runs: list[Finished], gate: Gate) -> None:
    """decide() on working copies: fills each copy's gate and status."""
    if state.best_group:
        for run in runs:
            if not run.crashed and not run.stopped and not run.duplicate and not run.disturbed:
                run.disturbed = disturbance(state, run)
    ok = [r for r in runs if not r.crashed and not r.disturbed and not r.stopped and not r.duplicate]
    for run in runs:
        run.record.status = Status.CRASH if run.crashed else Status.DISCARD
        if run.duplicate:  # the earlier idea's result, at no cost; a repeat of a crash is a crash row
            same = [r for r in runs if r.record.n == run.duplicate]  # (made in this generation)
            earlier = same[0].record if same else next(r for r in state.records if r.n == run.duplicate)
            crashed = same[0].crashed if same else earlier.status == Status.CRASH
            value = earlier.gate.mean if not same and earlier.gate.mean is not None else earlier.val_bpb
            run.record.status = Status.CRASH if crashed else Status.DISCARD
            why = run.record.reason
            run.record.gate = Evidence(Decision.DUPLICATE, mean=value, why=why, note=why)
    if not state.best_group:
        for i, run in enumerate(ok):
            run.record.gate = Evidence(Decision.KEEP if i == 0 else Decision.REPEAT, runs=i + 1, why="baseline")
        if ok:
            ok[0].record.status = Status.KEEP
        return
    extra = [r.record for r in ok]

    def others(run: Finished) -> list[list[float]]:
        return state.others(run.record.device, state.best_group, group_of(run.record), extra=extra)

    def parent_on(device: str) -> list[float]:  # the best's fresh runs (State.comparator), this generation's too
        runs = state.comparator(device, state.fresh(gate.mode, device)) + [
            r.record.bpb for r in ok if r.kind == Kind.PARENT and r.record.device == device
        ]
        # its fresh run crashed or was slowed: the runs that kept it (biased low) rather than no comparison at all
        return runs or state.comparator(device, fresh=False)

    for run in ok:
        if run.kind == Kind.PARENT:
            parent = parent_on(run.record.device)
            run.record.gate = Evidence(
                Decision.REPEAT,
                runs=len(parent),
                mean=statistics.fmean(parent),
                why=str(run.record.info.get("repeat", "")),
            )
            if gate.mode != "strict" and (against := contradiction(state, run.record.device, parent)):
                run.record.gate.note = against[1]
                run.record.gate.stats["contradicts"] = against[0]
    candidates = [r for r in ok if r.kind == Kind.CANDIDATE]
    for run in candidates:
        parent = parent_on(run.record.device)
        if not parent:
            why = f"no run of the best on {run.record.device or 'this device'} to compare with"
            run.record.gate = Evidence(Decision.DISCARD, runs=1, why=why, note=why)
            continue
        ideas = idea_effects(state, run.record.device, group_of(run.record)) if gate.mode == "value" else None
        verdict = judge([run.record.bpb], parent, others(run), gate, run.shorter, ideas)
        run.record.gate = gate_fields(verdict, [run.record.bpb], parent)
    if len(candidates) > 1:
        select(candidates)
    followups = [r for r in ok if r.kind in (Kind.RERUN, Kind.CONFIRM)]
    stopped = [r for r in runs if r.stopped and not r.crashed]
    for run in stopped:  # evidence against it, never for it: discarded (a pending candidate with it)
        run.record.gate = Evidence(Decision.DISCARD, runs=1, why="stopped early", note=run.stopped)
    # a run of it that crashed (the idea's doing, not the machine's) ends it, as with one slot: else a train.py
    # could crash its unlucky confirmation runs away and be judged on its lucky ones
    broke = [
        r for r in runs if r.crashed and r.kind in (Kind.RERUN, Kind.CONFIRM) and r.record.cause != Cause.ENVIRONMENT
    ]
    if any(r.kind in (Kind.RERUN, Kind.CONFIRM) for r in stopped):
        for run in followups:
            run.record.gate = Evidence(Decision.DISCARD, runs=1, note="discarded: another run of it was stopped early")
    elif broke:
        for run in followups:
            note = f"discarded: run {broke[0].record.n} of it crashed"
            run.record.gate = Evidence(Decision.DISCARD, runs=1, note=note)
    elif followups:
        settle(state, followups, parent_on, others(followups[-1]), gate)
    if followups and any(r.record.gate.decision == Decision.RERUN for r in followups):
        for run in runs:  # a crashed run of the candidate does not undo "run it again"
            if run.crashed and run.kind in (Kind.RERUN, Kind.CONFIRM):
                run.record.gate = Evidence(Decision.CONFIRMING, note="crashed confirmation run")
    for run in ok:
        if run.record.gate.decision == Decision.KEEP:
            run.record.status = Status.KEEP
        elif gate.bundle and run.kind != Kind.PARENT and near_miss(run.record.gate, gate.mode):
            run.record.gate.stats["parked"] = True  # measured better, not proven: a bundle may hold it (bundle.py)
    rerun_taken = any(r.record.gate.decision == Decision.RERUN for r in ok) or (
        state.pending is not None and not followups
    )
    for run in (r for r in runs if r.disturbed):
        if run.kind in (Kind.RERUN, Kind.CONFIRM):  # the pending candidate stays pending: it runs again
            decision = Decision.CONFIRMING
        elif run.kind == Kind.CANDIDATE and not rerun_taken:
            decision, rerun_taken = Decision.RERUN, True
        else:
            decision = Decision.REPEAT if run.kind in (Kind.PARENT, Kind.BASELINE) else Decision.DISCARD
        again = decision != Decision.DISCARD
        run.record.gate = Evidence(
            decision,
            runs=1,
            disturbed=run.disturbed,
            note=f"{run.disturbed}: {'not counted, running again' if again else 'not judged'}",
        )


CONTRADICTED_T = 1.645  # fresh runs of a kept change this many standard errors worse than what it replaced


def contradiction(state: State, device: str, fresh: list[float]) -> tuple[int, str] | None:
    """(the keep, why) when the best's fresh runs on `device` (made after its keep, unbiased) say that the kept
    change is worse than the best it replaced: their mean above that best's mean by more than CONTRADICTED_T
    standard errors (one-sided, 5%). None otherwise, or for the baseline."""
    if not fresh or state.best_group == state.baseline_group:
        return None
    keep = next((r for r in reversed(state.records) if r.n == state.kept_at), None)
    if keep is None or keep.gate.best_mean is None or keep.device != device:
        return None
    figures = [keep.gate.stats.get(k) for k in ("ref_sd", "best_sd", "best_runs")]
    if not all(isinstance(x, (int, float)) and x > 0 for x in figures):
        return None
    sd, before_sd, before_runs = (float(x) for x in figures)  # type: ignore[arg-type]
    mean = statistics.fmean(fresh)
    se = (sd**2 / len(fresh) + before_sd**2 / before_runs) ** 0.5
    t = (mean - keep.gate.best_mean) / se
    if t <= CONTRADICTED_T:
        return None
    return keep.n, (
        f"contradicts keep #{keep.n}: its {len(fresh)} fresh run(s) average {mean:.6f}, worse than the "
        f"{keep.gate.best_mean:.6f} it replaced by {t:.1f} standard errors"
    )


def idea_effects(state: State, device: str, exclude: int) -> list[tuple[float, float]]:
    """The session's decided candidates on `device` (not `exclude`'s group, nor bundles): each one's measured
    improvement over the best it was judged against, and its standard error, at its last decision (the value
    rule's prior)."""
    latest: dict[int, tuple[float, float]] = {}
    for r in state.records:
        g, group = r.gate, group_of(r)
        se = g.stats.get("se")
        if (
            r.device == device
            and group not in (exclude, state.baseline_group)
            and g.decision in (Decision.KEEP, Decision.DISCARD)
            and g.delta is not None
            and "bundle" not in r.info  # ideas chosen for measuring better: their parts are in already
            and isinstance(se, (int, float))
            and se > 0
        ):
            latest[group] = (float(g.delta), float(se))
    return list(latest.values())


def select(candidates: list[Finished]) -> None:
    """Of several candidates, the best of those that beat the best or are promising (better, and not hopeless)
    is selected to run again; none is kept now."""
    eligible = [
        r
        for r in candidates
        if r.record.gate.decision in (Decision.KEEP, Decision.RERUN) and (r.record.gate.delta or 0) > 0
    ]
    for run in candidates:
        run.record.gate.decision = Decision.DISCARD
    if not eligible:
        return
    winner = min(eligible, key=lambda r: r.record.bpb)
    evidence = winner.record.gate
    evidence.decision, evidence.selection = Decision.RERUN, True
    evidence.note = f"best of {len(candidates)}, by {evidence.delta or 0:.4f}: confirming"
    for run in eligible:
        if run is not winner:
            run.record.gate.note = "beat the parent, but not the best of its generation"


def settle(state: State, followups: list[Finished], parent_on, others: list[list[float]], gate: Gate) -> None:
    """Decide a pending candidate on all its counted runs on the last run's device."""
    final = followups[-1]
    group, device = group_of(final.record), final.record.device
    confirming = any(r.gate.selection for r in state.records if group_of(r) == group)
    for run in followups[:-1]:
        run.record.gate = Evidence(Decision.CONFIRMING, runs=1, note="confirmation run")
    values = state.runs(group, device) + [r.record.bpb for r in followups if r.record.device == device]
    parent = parent_on(device)
    if not parent:
        final.record.gate = Evidence(
            Decision.DISCARD, runs=len(values), note="not confirmed: no parent run on this device"
        )
        return
    ideas = idea_effects(state, device, group) if gate.mode == "value" else None  # the value rule's prior only
    verdict = judge(values, parent, others, gate, final.shorter, ideas)
    final.record.gate = gate_fields(verdict, values, parent)
    if confirming:
        final.record.gate.confirmation = True
        n, figures = len(values), f"{verdict.delta:+.4f}, margin {verdict.margin:.4f}"
        if verdict.decision == Decision.KEEP:
            note = f"confirmed by {n} run(s): {verdict.delta:+.4f} vs the parent, margin {verdict.margin:.4f}"
        elif verdict.decision == Decision.RERUN:
            note = f"inside the margin after {n} run(s) ({figures}): running again"
        else:
            note = f"not confirmed: {n} confirmation run(s) {verdict.why} ({figures})"
        final.record.gate.note = note


def gate_fields(verdict: Verdict, candidate: list[float], parent: list[float]) -> Evidence:
    """The decision and its evidence: both means, spreads and run counts, the test, its statistic and the
    threshold it had to clear at this look."""
    return Evidence(
        Decision(verdict.decision),
        runs=len(candidate),
        mean=statistics.fmean(candidate),
        best_mean=statistics.fmean(parent),
        margin=verdict.margin,
        delta=verdict.delta,
        why=verdict.why,
        stats=dict(verdict.evidence),
    )


def row_of(record: Record) -> Row:
    """The record's row in results.tsv (no secret of ours in it, in any encoding: redaction.redact)."""
    crashed = record.status == Status.CRASH
    bpb, description = row_text(record)
    return Row(
        record.commit,
        bpb,
        0.0 if crashed else float(record.metrics.get("peak_vram_mb", 0.0)) / 1024,
        0.0 if crashed else float(record.metrics.get("mfu_percent", 0.0)),
        str(record.status),
        redaction.redact(description),
    )


def row_text(record: Record) -> tuple[float, str]:
    """The row's val_bpb and description: a decided candidate shows its mean, its runs and the margin used; a
    near miss says it is parked (bundle.py)."""
    bpb, description = _row_text(record)
    return bpb, description + (" [near miss: parked]" if record.gate.stats.get("parked") else "")


def _row_text(record: Record) -> tuple[float, str]:
    if record.status == Status.CRASH:  # the reason is the run's own words: cleaned (redaction.clean)
        return 0.0, f"{record.description} [crash: {redaction.clean(record.reason)}]"
    g = record.gate
    if g.note:  # several at once: selection, confirmation; a duplicate (the earlier idea's result)
        value = g.mean if record.status == Status.KEEP or g.decision == Decision.DUPLICATE else record.val_bpb
        return value or 0.0, f"{record.description} [{g.note}]"
    if g.decision == Decision.RERUN:
        return record.val_bpb or 0.0, f"{record.description} [inside the margin {g.margin or 0:.4f}: running again]"
    if g.stats.get("test") == "welch-t" and g.mean is not None and (g.decision == Decision.KEEP or g.runs > 1):
        note = "simplification, " if g.why.startswith("simplification") else ""
        runs = f"mean of {g.runs} runs" if g.runs > 1 else "1 run"
        return g.mean, f"{record.description} ({note}{runs}, margin {g.margin or 0:.4f})"
    return record.val_bpb or 0.0, record.description
