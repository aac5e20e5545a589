"""The controller loop: plan -> run -> judge -> record, one generation at a time, until a stop condition.

A generation is as many runs as the executor has slots; one slot is a generation of one. The records on disk
are the state (state.replay): a restarted loop resumes where the last one stopped. Whatever ends the loop
(a limit, Ctrl-C, SIGTERM, an error), every run and every proposer process it started is stopped first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator

from . import LoopError
from .core.holdout import due, holdout_check, warning
from .core.judge import Finished, decide
from .core.noise import load_statistics, significant_lines
from .core.plan import Ideas, plan
from .core.progress import Progress
from .core.settings import Settings
from .core.state import Cause, Kind, State, Status, group_of
from .core.trial import Run, run_generation
from .core.workspace import SessionChanged, Workspace
from .doctor import preflight
from .executors import Executor, make_executor
from .proposers import Context, load
from .store import gitops
from .store.ledger import Record
from .store.session import Lock, write_status
from .store.spend import Spend
from .trackers.base import Trackers

__all__ = ["Settings", "Terminated", "run_loop", "verify_session"]


class Terminated(KeyboardInterrupt):
    """SIGTERM: stop like Ctrl-C, but without the held-out check (whoever sent it wants us gone)."""


def _terminate(signum, frame):
    raise Terminated


def run_loop(settings: Settings, echo: Callable[[str], None] = print) -> State:
    """Run experiments until a stop condition; returns the final state. Raises LoopError for setup problems.

    A session resumes only as it was pinned (budget, data, seed, gate, train.py): under a chosen tag a change is
    refused, under the default tag it starts the next session of the day (nov30-2, ...) and says so."""
    tried = []
    while True:
        try:
            return _session(dataclasses.replace(settings, tag=tried[-1] if tried else settings.tag), echo)
        except SessionChanged as changed:
            if settings.tag_given:
                raise LoopError(str(changed)) from None
            tried.append(f"{settings.tag}-{len(tried) + 2}")
            echo(
                f"autoloop: session {changed.tag} was started with other settings ({'; '.join(changed.differences)})"
                f"; this run is session {tried[-1]}"
            )


def _session(settings: Settings, echo: Callable[[str], None]) -> State:
    load_statistics()  # now, not in the middle of a night where a Ctrl-C could land inside the import
    ws = Workspace(settings, echo)
    proposer_cls = load(settings.proposer)
    with Lock(ws.paths.lock), open_executor(settings) as executor, signals(signal.SIGTERM, _terminate):
        preflight(settings, executor.slots)  # free disk, an agent CLI that answers (ws.open: GPU, data)
        ws.open(executor)
        state = ws.resume()
        proposer = proposer_cls(
            Context(
                repo=settings.repo,
                tag=settings.tag,
                seed=settings.seed,
                profile=ws.profile,
                options=dict(settings.options),
                spend=ws.spend,
                pass_env=tuple(settings.pass_env),
            )
        )
        ideas = Ideas(ws, proposer, proposer.pipeline if settings.pipeline is None else bool(settings.pipeline))
        for record in state.records:
            proposer.observe(record)
        for line in header(settings, executor, state, ideas.pipeline):
            echo(line)
        trackers = Trackers(settings.trackers, ws, echo)
        trackers.start(state)
        progress, started, stop = Progress(), time.time(), ""
        try:
            while not (stop := stop_reason(settings, state, started, ws.spend)):
                remaining = None if settings.max_experiments is None else settings.max_experiments - state.done
                planned = plan(ws, ideas, state, start_generation(ws, executor, state, remaining))
                if not planned:
                    stop = ws.spend.exceeded() or "the proposer has no more ideas"
                    break
                runs = run_generation(ws, executor, state, planned, ideas, progress, remaining)
                record_generation(ws, state, runs, ideas, progress, trackers)
                check_health(ws, state, runs)
        except BaseException as error:
            stopped(ws, executor, state, ideas, progress, error)
            trackers.finish(state, f"interrupted ({type(error).__name__})")
            raise
        finally:
            if ideas.prefetch is not None:  # e.g. --max-hours ended the loop while the next ideas were made
                ideas.stop()
                ideas.stopped()
            proposer.close()
        write_status(ws.paths, phase="finished", train_pid=None, train_pids={}, running=[])
        echo(session_summary(settings, state, stop))
        try:
            holdout_check(ws, executor, state, echo)
        finally:  # a Ctrl-C during the held-out check still closes the trackers' runs
            trackers.finish(state, stop)
        if settings.verify:
            if state.best_group in (0, state.baseline_group):
                echo("autoloop: verify: nothing was kept beyond the baseline; nothing to verify")
            else:
                verify_open(ws, executor, state, Trackers(settings.trackers, ws, echo))
        if flag := warning(ws, state):  # the last line: a best that only validation confirms is not missed
            echo(flag)
        return state


def verify_open(ws: Workspace, executor: Executor, state: State, trackers: Trackers) -> dict:
    """`autoloop verify` in an open session (lock held): on any way out no run of it lives on; the trackers get
    the result."""
    from .core.verify import verify

    try:
        result = verify(ws, executor, state, ws.settings.transfer, ws.echo)
    except BaseException as error:
        with signals(signal.SIGINT, signal.SIG_IGN), signals(signal.SIGTERM, signal.SIG_IGN):
            ws.processes.kill_all()
            write_status(ws.paths, phase="stopped", train_pid=None, train_pids={}, running=[])
        if isinstance(error, KeyboardInterrupt):
            ws.echo("autoloop: verify interrupted; its finished runs are kept: the same command resumes it")
        raise
    trackers.start(state)
    trackers.finish(state, "verified")
    return result


def verify_session(settings: Settings, echo: Callable[[str], None] = print) -> dict:
    """`autoloop verify`: the session under settings.tag, with the settings it was pinned to (budget, seed,
    data, gate), verified (or its verification resumed)."""
    from .store.session import Paths

    paths = Paths(settings.repo, settings.tag)
    try:
        pinned = json.loads(paths.session.read_text())
    except (OSError, ValueError):
        raise LoopError(
            f"no autoloop session {settings.tag!r} in {settings.repo} (no {paths.session}); run one with "
            "`autoloop run`, or pass --tag / --repo"
        ) from None
    settings = dataclasses.replace(settings, **pinned_fields(pinned))
    load_statistics()
    ws = Workspace(settings, echo)
    with Lock(ws.paths.lock), open_executor(settings) as executor, signals(signal.SIGTERM, _terminate):
        preflight(settings, executor.slots)
        ws.open(executor)
        state = ws.resume()
        if state.best_group in (0, state.baseline_group):
            raise LoopError(f"session {settings.tag} kept nothing beyond its baseline: there is nothing to verify")
        return verify_open(ws, executor, state, Trackers(settings.trackers, ws, echo))


def pinned_fields(session: dict) -> dict:
    """The Settings a session was pinned to (session.json "pin"): budget, seed, profile, dataset, gate."""
    from .core.noise import Gate

    pin = session.get("pin") or {}
    out: dict = {}
    if isinstance(pin.get("budget"), (int, float)):
        out["budget"] = float(pin["budget"])
    if isinstance(pin.get("seed"), int):
        out["seed"] = pin["seed"]
    for key in ("profile", "dataset"):
        if pin.get(key):
            out[key] = pin[key]
    found = re.match(r"(\w+) alpha (\S+) looks (\d+) min (\S+)( early-stop on)?", str(pin.get("gate", "")))
    if found:
        mode, alpha, looks, floor, early = found.groups()
        out["gate"] = Gate(mode, float(alpha), float(floor), int(looks), "on" if early else "off")
    return out


@contextlib.contextmanager
def signals(signum: int, handler) -> Iterator[None]:
    """`handler` for `signum` while the block runs (main thread only: elsewhere signals are not ours)."""
    try:
        previous = signal.signal(signum, handler)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signum, previous)


def start_generation(ws: Workspace, executor: Executor, state: State, remaining: int | None) -> int:
    """Count the next generation and note its start in status.json; returns how many runs it has (fewer near
    --max-experiments)."""
    slots = len(executor.slots) if remaining is None else min(len(executor.slots), remaining)
    previous = ws.generation
    ws.generation = previous + 1
    write_status(
        ws.paths,
        phase="proposing",
        n=state.done + 1,
        experiment_started=time.time(),
        description="",
        pid=os.getpid(),
        tag=ws.settings.tag,
        budget=ws.settings.budget,
        running=[],
        generation=ws.generation,
    )
    return slots


def record_generation(
    ws: Workspace, state: State, runs: list[Run], ideas: Ideas, progress: Progress, trackers: Trackers
) -> None:
    """Judge the finished generation, record each run (record.json, row, branch, trackers), then let the
    proposer see them (after any idea it is making is done: its observe() never runs while its propose() does)."""
    progress.clear()
    t = time.monotonic()
    judged = decide(state, [finished(ws, state, run) for run in runs], ws.settings.gate)
    for run, judgement in zip(runs, judged):
        run.record.status, run.record.gate = judgement.status, judgement.gate
    for run in runs:
        run.record.timings["record"] = time.monotonic() - t
        ws.record(run.record, state)
        ws.echo(console_line(run.record, state))
        trackers.record(run.record, state)
    ideas.settle()
    for run in runs:
        ideas.proposer.observe(run.record)


@contextlib.contextmanager
def open_executor(settings: Settings) -> Iterator[Executor]:
    try:
        executor = make_executor(settings.executor, settings.workers, settings.executor_options)
    except (ValueError, ImportError) as e:
        raise LoopError(str(e)) from None
    try:
        yield executor
    finally:
        executor.close()


def finished(ws: Workspace, state: State, run: Run) -> Finished:
    """A finished run for the judge: its crash noted on the record, and whether its train.py is shorter."""
    record = run.record
    if run.duplicate:  # an idea already judged from this parent: not run (proposers/memory.py)
        return Finished(record, run.kind, duplicate=run.duplicate)
    if run.crash:
        record.reason, record.phase, record.val_bpb = run.crash.reason, run.crash.phase.value, None
        record.cause = run.crash.cause.value
        return Finished(record, run.kind, crashed=True)
    if run.overran:  # its idea's first overrun of the clock: a disturbed run, not counted, run again
        return Finished(record, run.kind, disturbed=run.overran)
    if run.stopped:  # --early-stop: its curve was clearly behind the best's
        return Finished(record, run.kind, stopped=run.stopped)
    shorter = False
    if run.kind in (Kind.CANDIDATE, Kind.RERUN, Kind.CONFIRM) and state.best_group:
        lines = [
            significant_lines(ws.repo.git.show(f"{commit}:train.py")) for commit in (record.commit, state.best_commit)
        ]
        shorter = lines[0] < lines[1]
    return Finished(record, run.kind, shorter=shorter)


def stopped(
    ws: Workspace, executor: Executor, state: State, ideas: Ideas, progress: Progress, error: BaseException
) -> None:
    """On the way out of the loop: no run still running, no idea still being made, the branch at the best, the
    status file saying so (signals wait meanwhile: a second Ctrl-C cannot cut this short); then, after Ctrl-C,
    the held-out check if one is due (Ctrl-C again skips it)."""
    progress.clear()
    with signals(signal.SIGINT, signal.SIG_IGN), signals(signal.SIGTERM, signal.SIG_IGN):
        ideas.stop()
        ws.processes.kill_all()
        with contextlib.suppress(Exception):
            gitops.reset_to(ws.wt, state.best_commit)
        write_status(ws.paths, phase="stopped", train_pid=None, train_pids={}, running=[])
        if isinstance(error, KeyboardInterrupt):
            lost = (
                "the runs of the current generation were"
                if len(executor.slots) > 1
                else f"experiment {state.done + 1} was"
            )
            ws.echo(f"autoloop: interrupted; {lost} not recorded. Run the same command to resume.")
    try:
        if not ideas.stopped():
            ws.echo("autoloop: warning: the proposer did not stop within 15 s; its thread is abandoned")
        if not isinstance(error, KeyboardInterrupt) or isinstance(error, Terminated) or not due(ws, state):
            return
        ws.echo("autoloop: running the held-out check (Ctrl-C again to skip it) ...")
        holdout_check(ws, executor, state, ws.echo)
        if flag := warning(ws, state):
            ws.echo(flag)
    except KeyboardInterrupt as again:
        ws.processes.kill_all()
        if isinstance(again, Terminated):
            raise
        ws.echo("autoloop: held-out check skipped (`autoloop report` can make it later)")


def stop_reason(settings: Settings, state: State, started: float, spend: Spend) -> str:
    if settings.max_experiments is not None and state.done >= settings.max_experiments:
        return f"reached --max-experiments {settings.max_experiments}"
    if settings.max_hours is not None and time.time() - started >= settings.max_hours * 3600:
        return f"reached --max-hours {settings.max_hours:g}"
    return spend.exceeded()


def check_health(ws: Workspace, state: State, runs: list[Run]) -> None:
    """The circuit breaker: stop (LoopError) when going on cannot help and would only write crash rows all
    night: the baseline crashed, a run of the unchanged best crashed (it ran before: the machine is failing), or
    the last --max-crashes experiments all crashed."""
    if not state.best_group:
        first = runs[0].record
        where = " on every slot" if len(runs) > 1 else ""
        raise LoopError(
            f"the unmodified baseline crashed{where} ({first.reason}); fix train.py or the "
            f"environment, see {ws.paths.run_dir(first.n) / 'run.log'}"
        )
    best_runs = [r for r in state.records if group_of(r) == state.best_group and r.n != state.best_run]
    for run in runs:
        again = best_runs[-2:]
        if (
            run.kind == Kind.PARENT
            and run.crash
            and (
                run.crash.cause == Cause.ENVIRONMENT or len(again) == 2 and all(r.status == Status.CRASH for r in again)
            )
        ):
            raise LoopError(
                f"experiment {run.record.n}, a run of the unchanged best that ran before, crashed "
                f"({run.record.reason}): the environment is failing, not an idea. Fix it (see "
                f"{ws.paths.run_dir(run.record.n) / 'run.log'}), then run the same command to resume"
            )
    k = ws.settings.max_crashes
    recent = state.records[-k:]
    if len(recent) < k or not all(r.status == Status.CRASH for r in recent):
        return
    if all("train" not in r.timings for r in recent):
        raise LoopError(
            f"the last {k} ideas all failed before training (last: {recent[-1].reason}); check the "
            f"proposer's settings and its log in runs/{recent[-1].n}/, then run the same command to resume"
        )
    raise LoopError(
        f"the last {k} experiments all crashed ({common_cause(recent)}); fix the cause (see "
        f"{ws.paths.run_dir(recent[-1].n) / 'run.log'}), then run the same command to resume "
        f"(--max-crashes sets how many crashes in a row stop the loop)"
    )


def common_cause(records: list[Record]) -> str:
    """What a run of crashes shares: the most common reason (exit codes aside), with how many had it."""
    reasons = Counter(re.sub(r"^exit code -?\d+: ", "", r.reason) for r in records)
    reason, count = reasons.most_common(1)[0]
    blamed = sum(r.cause == Cause.ENVIRONMENT for r in records)
    return f"{'all' if count == len(records) else f'{count} of {len(records)}'}: {reason}" + (
        f"; {blamed} blamed on the environment" if blamed else ""
    )


def header(settings: Settings, executor: Executor, state: State, pipeline: bool) -> list[str]:
    slots = executor.slots
    return [
        f"autoloop: tag {settings.tag} | branch autoloop/{settings.tag} | budget {settings.budget:g}s | "
        f"timeout {settings.hard_timeout:.0f}s | proposer {settings.proposer}{' (pipelined)' if pipeline else ''} | "
        f"{state.done} experiment(s) already recorded",
        f"autoloop: executor {executor.name} | {len(slots)} slot(s): "
        f"{', '.join(slot.label for slot in slots[:8])}{' ...' if len(slots) > 8 else ''}"
        f"{' | generations of ' + str(len(slots)) + ' runs' if len(slots) > 1 else ''}",
        f"{'#':>4}  {'commit':7}  {'val_bpb':>9}  {'best':>9}  {'mem_gb':>6}  {'status':7}  description",
    ]


def console_line(record: Record, state: State) -> str:
    bpb = f"{record.val_bpb:.6f}" if record.val_bpb is not None else "-"
    best = f"{state.best_bpb:.6f}" if state.best_bpb is not None else "-"
    mem = float(record.metrics.get("peak_vram_mb", 0.0) or 0.0) / 1024
    desc = record.description + (f"  [{record.reason}]" if record.reason else "")
    if record.gate.note and record.gate.note != record.reason:  # (a duplicate's note is its reason)
        desc += f"  [{record.gate.note}]"
    status = record.status.value if isinstance(record.status, Status) else record.status
    return f"{record.n:>4}  {record.commit[:7]:7}  {bpb:>9}  {best:>9}  {mem:>6.1f}  {status:7}  {desc}"


def session_summary(settings: Settings, state: State, stop: str) -> str:
    keeps = sum(r.status == Status.KEEP for r in state.records)
    crashes = sum(r.status == Status.CRASH for r in state.records)
    line = f"autoloop: stopped ({stop}). {state.done} experiments: {keeps} keep, {crashes} crash."
    if state.baseline_bpb is not None and state.best_bpb is not None:
        delta = state.best_bpb - state.baseline_bpb
        line += (
            f" val_bpb {state.baseline_bpb:.6f} -> {state.best_bpb:.6f} ({delta:+.6f}, "
            f"{100 * delta / state.baseline_bpb:+.2f}%) at {state.best_commit[:7]} on autoloop/{settings.tag}"
        )
    return line
