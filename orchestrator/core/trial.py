"""Running one generation: each run staged in its slot's worktree (apply, check, commit), submitted, waited for
and measured. Whatever happens (Ctrl-C, SIGTERM, an error), every run it started is cancelled and waited for.

What counts is the harness's measurement of the saved model, never the number train.py printed.
"""

from __future__ import annotations

import math
import random
import secrets
import site
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import git
import psutil

from .. import LoopError
from ..executors import OUT, PYTHON, Executor, Handle, Job, JobResult, Slot, wait_any
from ..proposers import memory
from ..store import gitops
from ..store.ledger import Record
from ..store.session import write_status
from ..trust import redaction
from ..trust.curve import CURVE_KEYS, StopRule
from ..trust.evaluation import (
    OVERRAN,
    RESULT,
    audit_clock,
    compare_printed,
    evaluator_args,
    evaluator_code,
    read_evaluation,
    read_result,
    startup_allowance,
)
from ..trust.guard import new_violations
from ..trust.harness import evaluation_data
from ..trust.summary import environment_error, last_error_line, parse_summary, read_tail, val_bpb_of
from .pipeline import Prepared
from .plan import Ideas, as_running, refill
from .progress import Progress, format_eta, last_step, read_curve
from .state import CPU_OUTSIDE, CPU_SHARE, Cause, Crash, Kind, Phase, State, Status, busy_outside, group_of

if TYPE_CHECKING:
    from .workspace import Workspace

PROGRESS_TICK_S = 1.0
MAX_INFRA_RETRIES = 3  # executor failures (node lost, worker died) of one experiment before the loop stops
STOP_WAIT_S = 30.0  # how long a stop waits for cancelled runs to end (their trees are killed: SIGTERM, SIGKILL)


@dataclass
class Run:
    record: Record
    kind: Kind
    slot: Slot
    handle: Handle | None = None
    job: Job | None = None
    started: float = 0.0
    crash: Crash | None = None
    done: bool = False
    stopped: str = ""  # why --early-stop stopped it (a discard, judged as such; no val_bpb)
    duplicate: int = 0  # the earlier run whose idea this one repeats (not run: a row at no cost)
    overran: str = ""  # the clock audit refused it, the first time for its idea: disturbed, run again (overrun)


def check_edit(ws: Workspace, wt: git.Repo) -> str:
    """Why the proposed edit in worktree wt may not run ('' if it may): only train.py changed, it compiles, and
    it leaves alone what the controller and prepare.py own (seed, budget, evaluation, validation data)."""
    changed = gitops.changed_files(wt)
    others = [f for f in changed if f != "train.py"]
    if others:
        return f"edited files other than train.py: {', '.join(others[:5])}"
    try:
        source = (gitops.tree(wt) / "train.py").read_text()
        compile(source, "train.py", "exec")
    except SyntaxError as e:
        return f"train.py does not compile: {e.msg} (line {e.lineno})"
    except (OSError, ValueError) as e:
        return f"train.py unreadable: {e}"
    tampering = new_violations(source, ws.baseline_source)
    return f"tampering: {'; '.join(tampering)}" if tampering else ""


def stage(ws: Workspace, wt: git.Repo, record: Record, prepared) -> Crash | None:
    """Apply the idea in worktree wt (at its base), check it, and commit it (a failed idea too, so every row
    has a commit); returns why it may not run, or None."""
    t = time.monotonic()
    crash = Crash(prepared.reason, Phase.PROPOSE) if prepared.reason else None
    if crash is None and (error := gitops.apply_patch(wt, prepared.patch)):
        crash = Crash(f"the proposal does not apply: {error}", Phase.PROPOSE)
    if crash is None and (why := check_edit(ws, wt)):
        crash = Crash(why, Phase.CHECK)
    problems = [] if crash else ws.integrity_problems()  # an edit outside train.py never runs anyway
    if problems:
        raise LoopError(
            f"the prepared harness no longer verifies ({'; '.join(problems)}); an earlier run may have "
            "modified it. Re-run `python prepare.py --force`, then the same autoloop command to resume"
        )
    record.timings["check"] = time.monotonic() - t
    t = time.monotonic()
    if crash is not None:  # a failed idea is committed as its train.py alone: no stray files in the object store
        gitops.keep_only(wt, "train.py")
    record.commit = gitops.commit_all(wt, f"autoloop {ws.settings.tag} #{record.n}: {record.description}")
    gitops.mark_tried(ws.repo, ws.settings.tag, record.n, record.commit)
    (ws.paths.run_dir(record.n) / "diff.patch").write_text(gitops.diff(wt, record.parent, record.commit))
    record.timings["git"] = time.monotonic() - t
    return crash


# A run's HOME, TMPDIR and kernel caches are its own (deleted after it): a cache shared by the session's runs
# would be a channel between them (weights saved there by one run were loaded by later ones). Compilation is
# start-up, which the clock audit does not count against the budget.
SCRATCH = {
    "HOME": f"{OUT}/home",
    "TMPDIR": f"{OUT}/tmp",
    "TORCHINDUCTOR_CACHE_DIR": f"{OUT}/tmp/inductor",
    "TRITON_CACHE_DIR": f"{OUT}/tmp/triton",
    "XDG_CACHE_HOME": f"{OUT}/tmp/xdg",
}


def build_job(ws: Workspace, workdir: Path, run_dir: Path) -> Job:
    """The experiment as the executor runs it: train.py, then (with a harness that saves the model) the
    harness's own evaluation of that model in a process of its own; no step may change a tracked file."""
    steps, logs = [[PYTHON, "train.py"]], ["run.log"]
    step_env: list[dict[str, str | None]] = [{}]
    # a harness that finds its data through AUTOLOOP_CACHE (one with a manifest) lets the run have its own HOME
    # (told where the data and the user's site-packages are, as resolved with ours); another (upstream's keeps
    # its data under ~/.cache) keeps the user's
    env = {**ws.env, **{k: v for k, v in SCRATCH.items() if k != "HOME" or ws.harness_info.manifest is not None}}
    local_only: tuple[str, ...] = ()
    if "HOME" in env and env["HOME"] == SCRATCH["HOME"]:
        local_only = tuple(k for k in ("AUTOLOOP_CACHE", "PYTHONUSERBASE") if k not in ws.env)
        env.setdefault("AUTOLOOP_CACHE", ws.harness_info.cache)
        env.setdefault("PYTHONUSERBASE", site.getuserbase())
    stdin: list[str | None] = [None]
    start_after: list[str | None] = [None]
    if ws.harness_info.artifacts:
        env["AUTOLOOP_EVAL_ARTIFACT"] = f"{OUT}/model.pt"
        steps.append([PYTHON, *evaluator_args(ws.harness_info, f"{OUT}/model.pt", "val", f"{OUT}/{RESULT}")])
        logs.append("eval.log")
        step_env.append({"AUTOLOOP_EVAL_ARTIFACT": None})
        stdin.append(secrets.token_hex(16) + "\n")  # the result counts only with this run's nonce
        # sandboxed, the evaluation gets ready while train.py exports the model; the nonce is its go
        start_after.append(ws.harness_info.export_line if ws.harness_info.result_file else None)
    watch = tuple(name for name in gitops.Repo(workdir).git.ls_files("-z").split("\0") if name)
    return Job(
        steps=steps,
        logs=logs,
        env=env,
        timeout_s=ws.settings.hard_timeout,
        workdir=workdir,
        out_dir=run_dir,
        watch=watch,
        step_env=step_env,
        log_cap=int(ws.settings.max_log_mb * (1 << 20)),
        step_stdin=stdin,
        step_start_after=start_after,
        sandbox=ws.sandbox,
        read_only=evaluator_code(ws.harness_info),  # the evaluation may start while train.py still runs
        local_only=local_only,
        pass_env=tuple(ws.settings.pass_env),
        step_hidden=[evaluation_data(ws.harness_info.manifest) + corpus_source(ws)],
    )  # what it is scored on


WARMDOWN = "WARMDOWN_RATIO"  # train.py's share of the steps the learning rate warms down over, at the end
LAST_LOOK = 0.8  # early stopping never looks later than this share of the planned steps


AUDIT_SHARE = 0.1  # of the runs the rule judges: applied, never obeyed (they train to the end: is it right?)


def stop_rule(ws: Workspace, state: State, kind: Kind, wt: git.Repo, n: int) -> StopRule | None:
    """--early-stop on: the rule run n (a new idea's, or a pending one's again) is stopped by, from the curves of
    the best's counted runs; None for the best's own runs, before the best has two runs with curves, or when off.
    It looks only before the warm-down of either (train.py's WARMDOWN_RATIO; without one, before half-way).

    One run in ten (AUDIT_SHARE, drawn from the session's seed and n) is an audit: it trains to the end, and
    its record says whether the rule would have stopped it (info "would_stop"). Once an audited run the rule
    would have stopped scores below the best's mean, nothing more is stopped against that best: its curves
    mislead (an edit whose curve runs low for its val_bpb; or printed low on purpose: the curves are the
    runs' own output)."""
    if ws.settings.gate.early_stop != "on" or kind not in (Kind.CANDIDATE, Kind.RERUN, Kind.CONFIRM):
        return None
    mean = state.best_bpb
    if mean is not None and any(
        r.n > state.kept_at and r.info.get("would_stop") and state.counted(r) and r.bpb < mean for r in state.records
    ):
        return None
    device = state.records[-1].device if state.records else ""  # curves are compared on one device type only
    best = [
        r
        for r in state.records
        if group_of(r) == state.best_group and state.counted(r) and r.curve and r.device == device
    ]
    curves = {key: [r.curve[key] for r in best if key in r.curve] for key in CURVE_KEYS}
    spread = curve_spread([r for r in state.records if state.counted(r) and r.curve and r.device == device])
    if not any(len(v) >= (1 if k in spread else 2) for k, v in curves.items()):
        return None
    ratios = [  # the run's train.py and the best's
        warmdown(ws, (gitops.tree(wt) / "train.py").read_text(errors="replace")),
        warmdown(ws, ws.repo.git.show(f"{state.best_commit}:train.py")),
    ]
    known = [r for r in ratios if r is not None]
    last = min(LAST_LOOK, 1 - max(known)) if known else 0.5
    audit = random.Random(f"{ws.settings.seed}:audit:{n}").random() < AUDIT_SHARE
    return StopRule({k: v for k, v in curves.items() if v}, last=last, spread=spread, audit=audit)


SPREAD_DOF = 4  # runs' worth (beyond one per configuration) a pooled curve spread needs before it is used


def curve_spread(records: list) -> dict[str, float]:
    """Per curve fraction, the sd of the log of the loss between runs of one configuration, pooled over every
    configuration with two runs or more there (a relative sd: configurations' losses differ in level, hardly in
    relative noise); only where SPREAD_DOF degrees of freedom or more back it."""
    by: dict[tuple[int, str], list[float]] = {}
    for r in records:
        for key, loss in r.curve.items():
            if isinstance(loss, (int, float)) and loss > 0 and math.isfinite(loss):
                by.setdefault((group_of(r), key), []).append(math.log(loss))
    out = {}
    for key in CURVE_KEYS:
        groups = [v for (_, k), v in by.items() if k == key and len(v) >= 2]
        dof = sum(len(v) - 1 for v in groups)
        if dof >= SPREAD_DOF:
            ss = sum(sum((x - sum(v) / len(v)) ** 2 for x in v) for v in groups)
            out[key] = math.sqrt(ss / dof)
    return out


def warmdown(ws: Workspace, source: str) -> float | None:
    """train.py's WARMDOWN_RATIO for this session's profile, or None (not a number in [0, 1], or absent)."""
    from ..store.hparams import read_constants

    try:
        found = {c.name: c.value for c in read_constants(source, ws.profile)}
    except Exception:  # noqa: BLE001  (an edit that does not parse is the run's crash, found elsewhere)
        return None
    value = found.get(WARMDOWN)
    return float(value) if isinstance(value, (int, float)) and 0 <= value <= 1 else None


def corpus_source(ws: Workspace) -> tuple[str, ...]:
    """A local corpus (`--dataset DIR`): the training step needs only the prepared shards, and from the source
    it could rebuild the validation split. (The offline corpora, made of the machine's own Python files that a
    run needs to run at all, are scored on test suites only, hidden through the manifest: evaluation_data.)
    Never a directory that holds the repository or the prepared data."""
    info = ws.info
    dataset = Path(str(info.dataset or "") if info else "").expanduser()
    if info is None or not dataset.is_absolute() or not dataset.is_dir():
        return ()
    inside = [ws.settings.repo, Path(info.cache or "/")]
    if any(path.resolve().is_relative_to(dataset.resolve()) for path in inside):
        return ()
    return (str(dataset),)


def remember(ws: Workspace, state: State, wt: git.Repo, record: Record, runs: list[Run]) -> Record | None:
    """Note what the idea changed (record.info: its fingerprint, and the constants it moved as "moved"); return
    the earlier idea it repeats exactly from the same parent, judged or in this generation, if any (memory.py)."""
    source = (gitops.tree(wt) / "train.py").read_text(errors="replace")
    record.info["fingerprint"] = fp = memory.fingerprint(source, record.parent)
    moved = memory.changes(ws.repo.git.show(f"{record.parent}:train.py"), source, ws.profile)
    if moved:
        record.info["moved"] = moved
    running = [as_running(r.record) for r in runs if r.record is not record and not r.duplicate]
    return memory.duplicate_of([*state.records, *running], fp)


def submit(ws: Workspace, executor: Executor, job: Job, slot: Slot, record: Record) -> Handle:
    """Start the job; the pids of its processes on this machine go to status.json (resume kills orphans)."""

    def on_start(pid: int) -> None:
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            created = 0.0
        ws.processes.started(slot.index, pid, created)

    job.on_start = on_start
    record.timings.setdefault("submitted", time.time())
    return executor.submit(job, slot)


def start(
    ws: Workspace,
    executor: Executor,
    state: State,
    prepared: Prepared,
    slot: Slot,
    n: int,
    proposer: str,
    runs: list[Run],
) -> None:
    """Stage the run in its slot's worktree and submit it, listed in `runs` before it starts (whatever stops
    the generation cancels it); a run whose idea may not run is done at once."""
    record = Record(
        n=n,
        status="crash",
        description=prepared.description,
        parent=prepared.base,
        proposer=proposer,
        started=time.time() - prepared.waited,
        best_before=state.best_bpb,
        info=dict(prepared.info),
        group=prepared.group or n,
        slot=slot.index,
    )
    record.timings["propose"], record.timings["propose_wait"] = prepared.seconds, prepared.waited
    if prepared.ready:
        record.timings["idea_waited"] = time.time() - prepared.ready  # long when made while others trained
    run_dir = ws.paths.run_dir(n)
    run_dir.mkdir(parents=True, exist_ok=True)
    if prepared.log:
        (run_dir / "proposer.log").write_text(prepared.log)
    # a detached worktree per slot: the branch itself only ever holds decided-kept commits
    wt = gitops.ensure_detached_worktree(ws.repo, ws.paths.slot(slot.index), prepared.base)
    gitops.checkout_clean(wt, prepared.base)
    run = Run(record, prepared.kind, slot, done=True)
    runs.append(run)
    run.crash = stage(ws, wt, record, prepared)
    if run.crash:
        return
    if prepared.kind == Kind.CANDIDATE and (earlier := remember(ws, state, wt, record, runs)):
        run.duplicate = earlier.n  # an idea already judged from this parent (or running now): not run again
        record.reason = memory.duplicate_note(earlier)
        return
    run.job = build_job(ws, gitops.tree(wt), run_dir)
    rule = stop_rule(ws, state, prepared.kind, wt, n)
    run.job.stop_rule = rule.to_dict() if rule else None
    run.handle, run.done = submit(ws, executor, run.job, slot, record), False
    run.started = time.monotonic()


def run_generation(
    ws: Workspace,
    executor: Executor,
    state: State,
    planned: list[Prepared],
    ideas: Ideas,
    progress: Progress,
    remaining: int | None,
) -> list[Run]:
    """Start every planned run, and on a slot freed early what the planner gives it (plan.refill); wait for all;
    runs by number.
    With pipelining the next generation's ideas are made meanwhile."""
    runs: list[Run] = []
    slots, born = list(executor.slots), time.monotonic()
    startup = learned_startup(state, ws.settings.budget)  # the clock audit's start-up allowance (kept code's, now)
    protected = ws.protection.snapshot(state, hooks=ws.sandbox is None)  # checked after every run, restored
    next_n = state.done + 1
    try:
        for item, slot in zip(planned, slots):
            start(ws, executor, state, item, slot, next_n, ideas.proposer.name, runs)
            next_n += 1
        free = [r.slot for r in runs if r.done] + slots[len(planned) :]
        if remaining is None or remaining > len(planned):
            ideas.ahead(state.best_commit, [*state.records, *(as_running(r.record) for r in runs)], len(slots))
        while True:
            for run in runs:
                if run.done or run.handle is None or run.job is None:
                    continue
                if run.handle.done():
                    result = run.handle.result()
                    if result.infra_error:
                        infra_retry(ws, executor, run.record, result)
                        run.handle = submit(ws, executor, run.job, run.slot, run.record)
                        continue
                    run.crash, run.done = (
                        measure_safely(
                            ws, run.record, result, run.job, startup, run.kind not in (Kind.BASELINE, Kind.PARENT)
                        ),
                        True,
                    )
                    if run.crash and run.record.info.get("overran"):  # the clock's refusal: the machine or the idea?
                        run.crash, run.overran = overrun(state, run.record, run.crash)
                    if problems := ws.integrity_problems():  # the run changed prepare.py or the data
                        run.crash = Crash(f"the run changed the harness: {'; '.join(problems)}", Phase.AUDIT)
                        ws.restore_harness()
                    if touched := ws.protection.touched(protected):  # put back as it was
                        run.crash = Crash(
                            f"the run touched what it may not (restored): {', '.join(touched[:5])}", Phase.AUDIT
                        )
                    if run.crash or run.overran:
                        free.append(run.slot)
                    elif result.stopped:
                        run.stopped = result.stopped
            while extra := refill(
                state,
                len(free),
                sum(1 for r in runs if not r.done),
                time.monotonic() - born,
                ws.settings.budget,
                None if remaining is None else remaining - (next_n - 1 - state.done),
            ):
                start(ws, executor, state, extra, free.pop(0), next_n, ideas.proposer.name, runs)
                next_n += 1
                free += [r.slot for r in runs[-1:] if r.done]
            if all(r.done for r in runs):
                break
            progress.update(progress_text(ws, state, runs))
            write_status(
                ws.paths,
                phase="training",
                running=[
                    {
                        "n": r.record.n,
                        "slot": r.slot.index,
                        "description": r.record.description,
                        "started": r.record.started,
                    }
                    for r in runs
                    if not r.done
                ],
            )
            wait_any(
                [r.handle for r in runs if not r.done and r.handle],
                poll_s=0.05,
                until=time.monotonic() + PROGRESS_TICK_S,
            )
    except BaseException:  # Ctrl-C, SIGTERM, LoopError, a bug: nothing this generation started may outlive it
        stop_runs(runs)
        raise
    return sorted(runs, key=lambda r: r.record.n)


def stop_runs(runs: list[Run]) -> None:
    """Cancel every unfinished run and wait (boundedly) until its process tree is gone."""
    stop_handles([r.handle for r in runs if not r.done and r.handle is not None])


def stop_handles(live: list[Handle]) -> None:
    """Cancel these jobs and wait (boundedly, STOP_WAIT_S in all) until their process trees are gone."""
    for handle in live:
        handle.cancel()
    deadline = time.monotonic() + STOP_WAIT_S
    for handle in live:
        try:
            handle.result(timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            pass  # reported by the caller's last sweep over the pids it started


def infra_retry(ws: Workspace, executor: Executor, record: Record, result: JobResult) -> None:
    """Note an executor failure on the record; give up (LoopError) once it keeps happening."""
    failures = record.info.setdefault("infra_failures", [])
    failures.append(result.infra_error)
    if len(failures) > MAX_INFRA_RETRIES:
        raise LoopError(
            f"the {executor.name} executor failed {len(failures)} times running experiment "
            f"{record.n} (last: {result.infra_error}); check the executor (cluster, GPUs), then run "
            "the same command to resume"
        )
    ws.echo(
        f"autoloop: #{record.n}: the executor failed ({result.infra_error}); not the idea's fault, "
        f"running it again ({len(failures)}/{MAX_INFRA_RETRIES})"
    )


def measure_safely(
    ws: Workspace, record: Record, result: JobResult, job: Job, startup: float | None, audit: bool
) -> Crash | None:
    """measure(), where anything unreadable a run left is its crash, never an exception out of the loop (which
    a resume would meet again: a poison pill)."""
    try:
        return measure(ws, record, result, job, startup, audit)
    except Exception as e:  # noqa: BLE001
        return Crash(
            f"what the run left could not be read: {type(e).__name__}: {redaction.line(str(e), 200)}", Phase.EVALUATE
        )


STARTUP_WINDOW = 10  # the clock audit follows the start-ups of kept code among the session's last this many runs


def learned_startup(state: State, budget: float) -> float | None:
    """Seconds beyond the budget (start-up, compilation, saving) the clock audit allows every edit now (None
    until the baseline has run): the baseline's own (the most its first runs needed, before any other ran), or,
    on a machine that became slower since, the most that code already kept needed among the last STARTUP_WINDOW
    runs (the baseline's repeats, the best's runs: the audit never refuses them), grown by a bounded amount
    (evaluation.startup_allowance). A candidate's own runs never count, so no edit buys itself or a later one
    more time; a run of the best is made to measure it after an edit overran (plan.pending_runs)."""
    first_other = min(  # the first run of another configuration after the baseline's (not a crashed baseline)
        (r.n for r in state.records if r.n > state.baseline_group and group_of(r) != state.baseline_group),
        default=None,
    )
    walls = [
        r.timings["train"]
        for r in state.records
        if state.baseline_group
        and group_of(r) == state.baseline_group
        and (first_other is None or r.n < first_other)
        and state.counted(r)
        and "train" in r.timings
    ]
    if not walls:
        return None
    recent = [
        r.timings["train"] - budget
        for r in state.records[-STARTUP_WINDOW:]
        if "train" in r.timings and r.status != Status.CRASH and state.kept_code(r)
    ]
    return startup_allowance(max(0.0, max(walls) - budget), recent, budget)


def overrun(state: State, record: Record, crash: Crash) -> tuple[Crash | None, str]:
    """A run the clock audit refused (record.info "overran"): (its crash, '') if a run of its idea overran in an
    earlier generation too, or if no other user kept the machine busy meanwhile (state.busy_outside: the runner's
    measure, which a run cannot raise); else (None, why it is a disturbed run): the machine's load is not the
    idea's crash, so it is not counted and is run again, once a run of the best has measured the start-up now."""
    earlier = [r.n for r in state.records if group_of(r) == group_of(record) and r.info.get("overran")]
    if earlier:
        why = f"{crash.reason}; run {earlier[-1]} of it overran too: refused after two overruns"
        return Crash(why, Phase.AUDIT), ""
    if not busy_outside(record):  # else a train.py could overrun at will the run whose loss it found unlucky
        outside = record.metrics.get(CPU_OUTSIDE)
        busy = f"other users' processes kept {outside:.1f} CPUs busy" if outside is not None else "load not measured"
        return Crash(f"{crash.reason}; on a machine nobody else kept busy ({busy}): the idea's own", Phase.AUDIT), ""
    return None, f"overran its budget once ({crash.reason.removeprefix('budget exceeded: ')})"


def measure(
    ws: Workspace, record: Record, result: JobResult, job: Job, startup: float | None = None, audit: bool = True
) -> Crash | None:
    """Read what the run left (its summary, the harness's measurement, the clock) into the record; returns why
    it is a crash, or None. The number that counts is the harness's, never the one train.py printed."""
    s = ws.settings
    record.device = result.device
    if not result.steps:
        return Crash("the run did not start", Phase.TRAIN, Cause.ENVIRONMENT)
    train_step = result.steps[0]
    record.timings["train"] = train_step.wall_s
    if len(result.steps) > 1:
        record.timings["eval"] = result.steps[1].wall_s
    record.exit_code, record.timed_out = train_step.exit_code, train_step.timed_out
    log_text = read_tail(train_step.log)
    record.metrics = parse_summary(log_text)
    for key, measured in ((CPU_SHARE, train_step.cpu_share), (CPU_OUTSIDE, train_step.cpu_outside)):
        record.metrics.pop(key, None)  # the controller's measurements, never a line train.py printed
        if measured is not None:
            record.metrics[key] = round(measured, 4)
    # The loss at fractions of the planned steps, crashed runs' too (where they diverged). It is what the run
    # printed: information, and at most a reason to stop or discard a run early, never to keep one.
    record.curve = read_curve(train_step.log)
    printed = val_bpb_of(record.metrics)
    if result.audited:  # an audit of --early-stop: it trained on; would the rule have stopped it?
        record.info["would_stop"] = result.audited
    if result.stopped:  # --early-stop ended its training: no evaluation, a discard on its curve's evidence
        return Crash(f"the run modified {', '.join(result.modified)}", Phase.AUDIT) if result.modified else None
    if train_step.timed_out:
        return Crash(f"timeout after {s.hard_timeout:.0f}s", Phase.TRAIN)
    if train_step.killed:  # past its memory limit (runner.memory_note)
        return Crash(train_step.killed, Phase.TRAIN)
    if train_step.exit_code != 0:
        line = last_error_line(log_text)
        if ws.sandbox is not None and "Read-only file system" in log_text:
            return Crash(
                f"exit code {train_step.exit_code}: the sandbox refused a write outside the run's directory ({line})",
                Phase.TRAIN,
            )
        blamed = environment_error(log_text)
        return Crash(
            f"exit code {train_step.exit_code}: {blamed or line}".rstrip(": "),
            Phase.TRAIN,
            Cause.ENVIRONMENT if blamed else Cause.IDEA,
        )
    if result.modified:
        return Crash(f"the run modified {', '.join(result.modified)}", Phase.AUDIT)
    if "val_bpb" not in record.metrics:
        return Crash(f"no val_bpb in the summary: {last_error_line(log_text)}".rstrip(": "), Phase.TRAIN)
    if audit and (
        why := audit_clock(
            record.metrics, s.budget, result.ages.get("model.pt"), s.startup_allowance, train_step.wall_s, startup
        )
    ):
        if startup is not None and why.startswith(OVERRAN):  # the controller's clock: perhaps the machine's load
            record.info["overran"] = why
        return Crash(why, Phase.AUDIT)
    if not ws.harness_info.artifacts:  # a harness without artifacts (e.g. upstream's): its printed number
        record.val_bpb = printed
        return (
            None
            if printed is not None
            else Crash(f"val_bpb is not finite ({record.metrics['val_bpb']})", Phase.EVALUATE)
        )
    if "model.pt" not in result.ages:
        return Crash(
            "train.py did not call prepare.evaluate_bpb: no model was saved for the harness to measure", Phase.AUDIT
        )
    if len(result.steps) < 2:
        return Crash("the harness evaluation did not run", Phase.EVALUATE)
    eval_step = result.steps[1]
    if eval_step.timed_out:
        return Crash(f"the harness evaluation timed out after {s.hard_timeout:.0f}s", Phase.EVALUATE)
    if eval_step.killed:  # a model whose evaluation reached the step's memory limit
        return Crash(f"the harness evaluation: {eval_step.killed}", Phase.EVALUATE)
    nonce = (job.step_stdin[1] or "").strip() if len(job.step_stdin) > 1 else ""
    if ws.harness_info.result_file:
        measured, found, why = read_result(Path(eval_step.log).parent / RESULT, nonce, eval_step.exit_code)
    else:  # a prepare.py from before the result file: its printed line (see the note at start)
        measured, found, why = read_evaluation(read_tail(eval_step.log))
    if isinstance(found.get("probe"), dict):  # the probes' figures: how far this model was from a refusal
        record.info["probe"] = {k: v for k, v in found["probe"].items() if isinstance(v, (int, float))}
    if measured is None:
        blamed = environment_error(read_tail(eval_step.log)) if eval_step.exit_code else ""
        return Crash(f"{why}: {blamed}" if blamed else why, Phase.EVALUATE, Cause.ENVIRONMENT if blamed else Cause.IDEA)
    record.metrics["harness_val_bpb"] = record.val_bpb = measured
    for key, name in (("seconds", "eval_seconds"), ("peak_mb", "eval_peak_mb"), ("eval_tokens", "eval_tokens")):
        if isinstance(found.get(key), (int, float)):
            record.metrics[name] = found[key]
    why = compare_printed(printed, measured)
    return Crash(why, Phase.AUDIT) if why else None


def progress_text(ws: Workspace, state: State, runs: list[Run]) -> str:
    """One run: #n elapsed/budget | step, budget %, loss. Several: each one's time. Then the best so far and the
    session's ETA when it is bounded."""
    s = ws.settings
    running = [r for r in runs if not r.done]
    if len(running) == 1:
        run = running[0]
        parts = [f"#{run.record.n} training {time.monotonic() - run.started:.0f}s/{s.budget:g}s"]
        if (step := last_step(ws.paths.run_dir(run.record.n) / "run.log")) is not None:
            parts.append(f"step {step[0]} ({step[1]:.0f}%) loss {step[2]:.4f}")
    else:
        parts = [f"{len(running)} running"] + [
            f"#{r.record.n} {time.monotonic() - r.started:.0f}s/{s.budget:g}s" for r in running[:8]
        ]
    if state.best_bpb is not None:
        parts.append(f"best {state.best_bpb:.6f}")
    finished = [r for r in state.records if r.ended]
    per_run = statistics.fmean(r.ended - r.started for r in finished[-10:]) if finished else s.budget + 30.0
    elapsed = max((time.monotonic() - r.started for r in running), default=0.0)
    etas = []
    if s.max_experiments is not None:
        etas.append((s.max_experiments - state.done) * per_run / max(1, len(runs)) - elapsed)
    if s.max_hours is not None:
        etas.append(s.max_hours * 3600 - (time.time() - ws.started))
    if etas:
        parts.append(f"ETA {format_eta(min(etas))}")
    return " | ".join(parts)
