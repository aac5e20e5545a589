"""One experiment: propose -> check -> commit -> run -> measure -> decide -> record.

Every step writes what resume needs before the next one starts: the run record, then the fsync'd row, then the
branch moves. The session (paths, git, harness, queue) and the state (what is known so far) come from loop.py.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import git
import psutil

from . import LoopError, gitops
from .evaluation import audit_clock, compare_printed, read_evaluation
from .executors import OUT, PYTHON, Handle, Job, JobResult, Slot
from .guard import new_violations
from .ledger import Record, Row, append_row, write_record
from .noise import judge, pooled_sigma, significant_lines
from .pipeline import Prefetch, Prepared, make_proposal
from .progress import format_eta, last_step
from .proposers import Proposer
from .session import write_status
from .summary import last_error_line, parse_summary, val_bpb_of

if TYPE_CHECKING:
    from .loop import Session, State

PROGRESS_TICK_S = 1.0
MAX_INFRA_RETRIES = 3  # executor failures (node lost, worker died) of one experiment before the loop stops


# ---------------------------------------------------------------------------


def check_edit(session: Session, wt: git.Repo) -> str:
    """Why the proposed edit in worktree wt may not run ('' if it may): only train.py changed, it compiles, and
    it leaves alone what the controller and prepare.py own (seed, budget, evaluation, validation data)."""
    changed = gitops.changed_files(wt)
    others = [f for f in changed if f != "train.py"]
    if others:
        return f"edited files other than train.py: {', '.join(others[:5])}"
    try:
        source = (Path(wt.working_tree_dir) / "train.py").read_text()
        compile(source, "train.py", "exec")
    except SyntaxError as e:
        return f"train.py does not compile: {e.msg} (line {e.lineno})"
    except (OSError, ValueError) as e:
        return f"train.py unreadable: {e}"
    tampering = new_violations(source, session.baseline_source)
    return f"tampering: {'; '.join(tampering)}" if tampering else ""


def repeat_of(session: Session, state: State) -> Prepared | None:
    """A run of an earlier configuration, when one is due: baseline repeats (for σ), then re-runs."""
    best = state.best_commit
    baseline_runs = [r for r in state.records if (r.group or r.n) == 1]
    wanted = 1 + session.settings.baseline_repeats
    if state.best_group == 1 and len(baseline_runs) < wanted and len(baseline_runs) == state.done:
        k = len(baseline_runs) + 1
        return Prepared(base=best, description=f"baseline (repeat {k}/{wanted})", group=1, info={"repeat": k})
    if state.pending is None:
        return None
    first = next(r for r in state.records if r.n == state.pending)
    k = sum(1 for r in state.records if (r.group or r.n) == state.pending) + 1
    patch = repeat_patch(session, first)
    info = repeat_info(first)
    return Prepared(base=best, description=f"{first.description} (repeat {k}/{session.settings.gate.max_repeats})",
                    patch=patch, group=state.pending, info={**info, "repeat": k})


def repeat_info(first: Record) -> dict:
    """What a repeat run inherits from the first run of its candidate (not its queue item, usage, failures)."""
    return {key: v for key, v in first.info.items() if key not in ("queue_id", "usage", "infra_failures")}


def as_running(record: Record) -> Record:
    """How a proposer sees an experiment still in flight: its idea and commit, no result yet."""
    return Record(n=record.n, status="running", description=record.description, commit=record.commit,
                  parent=record.parent, info=record.info, group=record.group)


def repeat_patch(session: Session, first: Record) -> str:
    """The edit of an earlier run, to run it again (on the same best it was made on)."""
    return (session.paths.run_dir(first.n) / "diff.patch").read_text()


def next_idea(session: Session, proposer: Proposer, state: State, n: int) -> tuple[Prepared, float]:
    """The idea for experiment n on the current best, and how long the loop waited for it.

    The baseline first (and its repeats), re-runs of a candidate inside the noise margin; then a prefetched
    idea if one was prepared while the last experiment trained (re-applied on the new best if that one was
    kept, asked again if it no longer applies); else a fresh one.
    """
    best = state.best_commit
    if not state.best_group:
        session.prefetch = None
        return Prepared(base=best, description="baseline" if n == 1 else "baseline (retry)", group=n), 0.0
    repeat = repeat_of(session, state)
    if repeat is not None:
        return repeat, 0.0
    t = time.monotonic()
    prepared = session.prefetch.result() if session.prefetch is not None else None
    session.prefetch = None
    if prepared is not None:
        prepared = carry(session, prepared, best)
    if prepared is None:
        prepared = make_proposal(session, proposer, best, list(state.records))
    return prepared, time.monotonic() - t


def carry(session: Session, prepared: Prepared, best: str) -> Prepared | None:
    """An idea made on an older best, re-applied on `best` (three-way); None if it does not carry over (or
    had failed: ask again). Uses the branch worktree, which stands at `best`."""
    if prepared.base == best or prepared.exhausted:
        return prepared
    if prepared.reason or gitops.carry_over(session.wt, prepared.patch, prepared.patch_u0):
        return None
    prepared.patch = gitops.diff_all(session.wt, best)
    prepared.base = best
    gitops.reset_to(session.wt, best)
    return prepared


def start_prefetch(session: Session, proposer: Proposer, state: State, running: Record) -> None:
    """Ask for the next idea now, on the current best, while `running` trains."""
    s = session.settings
    if not session.pipeline or session.prefetch is not None or \
            (s.max_experiments is not None and running.n >= s.max_experiments):
        return
    history, best = [*state.records, as_running(running)], state.best_commit
    session.prefetch = Prefetch(lambda: make_proposal(session, proposer, best, history))


def run_experiment(session: Session, proposer: Proposer, state: State, n: int) -> Record | None:
    """One full experiment; returns its record, or None when the proposer has no more ideas."""
    s, paths = session.settings, session.paths
    record = Record(n=n, status="crash", description="", parent=state.best_commit, proposer=proposer.name,
                    started=time.time(), best_before=state.best_bpb)
    run_dir = paths.run_dir(n)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_status(paths, phase="proposing", n=n, experiment_started=record.started, description="",
                 train_pid=None, train_pids={}, pid=os.getpid(), tag=s.tag, budget=s.budget)

    prepared, waited = next_idea(session, proposer, state, n)
    record.timings["propose"], record.timings["propose_wait"] = prepared.seconds, waited
    if prepared.exhausted:
        shutil.rmtree(run_dir, ignore_errors=True)
        return None
    record.description, record.info, reason = prepared.description, prepared.info, prepared.reason
    record.group = prepared.group or n
    if prepared.log:
        (run_dir / "proposer.log").write_text(prepared.log)

    reason = stage(session, session.wt, record, prepared, reason)
    if not reason:
        start_prefetch(session, proposer, state, record)
        reason = train(session, record, run_dir)
    finish(session, state, record, reason)
    return record


def stage(session: Session, wt: git.Repo, record: Record, prepared: Prepared, reason: str) -> str:
    """Apply the idea in worktree wt (at its base), check it, and commit it (a failed idea too, so every row
    has a commit); returns why it may not run, or ''."""
    t = time.monotonic()
    if not reason and (error := gitops.apply_patch(wt, prepared.patch)):
        reason = f"the proposal does not apply: {error}"
    reason = reason or check_edit(session, wt)
    problems = [] if reason else session.integrity_problems()  # an edit outside train.py never runs anyway
    if problems:
        raise LoopError(f"the prepared harness no longer verifies ({'; '.join(problems)}); an earlier run may have "
                        "modified it. Re-run `python prepare.py --force`, then the same autoloop command to resume")
    record.timings["check"] = time.monotonic() - t
    t = time.monotonic()
    record.commit = gitops.commit_all(wt, f"autoloop {session.settings.tag} #{record.n}: {record.description}")
    gitops.mark_tried(session.repo, session.settings.tag, record.n, record.commit)
    (session.paths.run_dir(record.n) / "diff.patch").write_text(gitops.diff(wt, record.parent, record.commit))
    record.timings["git"] = time.monotonic() - t
    return reason


def build_job(session: Session, workdir: Path, run_dir: Path) -> Job:
    """The experiment as the executor runs it: train.py, then (with a harness that saves the model) the
    harness's own evaluation of that model in a process of its own; no step may change a tracked file."""
    steps, logs, step_env = [[PYTHON, "train.py"]], ["run.log"], [{}]
    env = dict(session.env)
    if session.info.artifacts:
        env["AUTOLOOP_EVAL_ARTIFACT"] = f"{OUT}/model.pt"
        steps.append([PYTHON, "prepare.py", "--evaluate", f"{OUT}/model.pt", "--split", "val"])
        logs.append("eval.log")
        step_env.append({"AUTOLOOP_EVAL_ARTIFACT": None})
    watch = tuple(name for name in git.Repo(workdir).git.ls_files("-z").split("\0") if name)
    return Job(steps=steps, logs=logs, env=env, timeout_s=session.settings.hard_timeout, workdir=workdir,
               out_dir=run_dir, watch=watch, step_env=step_env)


def submit(session: Session, job: Job, slot: Slot, record: Record) -> Handle:
    """Start the job; the pids of its processes on this machine go to status.json (resume kills orphans)."""
    def on_start(pid: int) -> None:
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            created = 0.0
        session.track_pid(slot.index, pid, created)

    job.on_start = on_start
    record.timings.setdefault("submitted", time.time())
    return session.executor.submit(job, slot)


def infra_retry(session: Session, record: Record, result: JobResult) -> None:
    """Note an executor failure on the record; give up (LoopError) once it keeps happening."""
    failures = record.info.setdefault("infra_failures", [])
    failures.append(result.infra_error)
    if len(failures) > MAX_INFRA_RETRIES:
        raise LoopError(f"the {session.executor.name} executor failed {len(failures)} times running experiment "
                        f"{record.n} (last: {result.infra_error}); check the executor (cluster, GPUs), then run "
                        "the same command to resume")
    session.echo(f"autoloop: #{record.n}: the executor failed ({result.infra_error}); not the idea's fault, "
                 f"running it again ({len(failures)}/{MAX_INFRA_RETRIES})")


def train(session: Session, record: Record, run_dir: Path) -> str:
    """Run the experiment on the executor's first slot, waiting for it (progress line), retrying executor
    failures; then measure it. Returns a crash reason or ''."""
    job = build_job(session, session.paths.worktree, run_dir)
    slot = session.executor.slots[0]
    write_status(session.paths, phase="training", description=record.description, training_started=time.time())
    while True:
        started = time.monotonic()
        handle = submit(session, job, slot, record)
        try:
            while not handle.wait(PROGRESS_TICK_S):
                elapsed = time.monotonic() - started
                session.progress.update(progress_text(session, record, elapsed, run_dir / "run.log"))
        except KeyboardInterrupt:
            handle.cancel()
            handle.result()
            raise
        result = handle.result()
        if not result.infra_error:
            break
        infra_retry(session, record, result)
    return measure(session, record, result)


def measure(session: Session, record: Record, result: JobResult) -> str:
    """Read what the run left (its summary, the harness's measurement, the clock) into the record; returns a
    crash reason or ''. The number that counts is the harness's, never the one train.py printed."""
    s = session.settings
    record.device = result.device
    if not result.steps:
        return "the run did not start"
    train_step = result.steps[0]
    record.timings["train"] = train_step.wall_s
    if len(result.steps) > 1:
        record.timings["eval"] = result.steps[1].wall_s
    record.exit_code, record.timed_out = train_step.exit_code, train_step.timed_out
    log_text = train_step.log.read_text(errors="replace") if train_step.log.exists() else ""
    record.metrics = parse_summary(log_text)
    printed = val_bpb_of(record.metrics)
    if train_step.timed_out:
        return f"timeout after {s.hard_timeout:.0f}s"
    if train_step.exit_code != 0:
        return f"exit code {train_step.exit_code}: {last_error_line(log_text)}".rstrip(": ")
    if result.modified:
        return f"the run modified {', '.join(result.modified)}"
    if "val_bpb" not in record.metrics:
        return f"no val_bpb in the summary: {last_error_line(log_text)}".rstrip(": ")
    if not session.info.artifacts:  # a harness without artifacts (e.g. upstream's): its printed number
        record.val_bpb = printed
        return "" if printed is not None else f"val_bpb is not finite ({record.metrics['val_bpb']})"
    if "model.pt" not in result.ages:
        return "train.py did not call prepare.evaluate_bpb: no model was saved for the harness to measure"
    if why := audit_clock(record.metrics, s.budget, result.ages["model.pt"], s.startup_allowance):
        return why
    if len(result.steps) < 2:
        return "the harness evaluation did not run"
    eval_step = result.steps[1]
    if eval_step.timed_out:
        return f"the harness evaluation timed out after {s.hard_timeout:.0f}s"
    measured, result, why = read_evaluation(eval_step.log.read_text(errors="replace") if eval_step.log.exists() else "")
    if measured is None:
        return why
    record.metrics["harness_val_bpb"] = measured
    for key, name in (("seconds", "eval_seconds"), ("peak_mb", "eval_peak_mb"), ("eval_tokens", "eval_tokens")):
        if isinstance(result.get(key), (int, float)):
            record.metrics[name] = result[key]
    record.val_bpb = measured
    return compare_printed(printed, measured)


def progress_text(session: Session, record: Record, elapsed: float, log: Path) -> str:
    """#n elapsed/budget | step, budget %, loss | best so far | ETA of the session when it is bounded."""
    s, state = session.settings, session.state
    parts = [f"#{record.n} training {elapsed:.0f}s/{s.budget:g}s"]
    if (step := last_step(log)) is not None:
        parts.append(f"step {step[0]} ({step[1]:.0f}%) loss {step[2]:.4f}")
    if state.best_bpb is not None:
        parts.append(f"best {state.best_bpb:.6f}")
    finished = [r for r in state.records if r.ended]
    per_exp = statistics.fmean(r.ended - r.started for r in finished[-10:]) if finished else s.hard_timeout
    etas = []
    if s.max_experiments is not None:
        etas.append((s.max_experiments - state.done) * per_exp - elapsed)
    if s.max_hours is not None:
        etas.append(s.max_hours * 3600 - (time.time() - session.started))
    if etas:
        parts.append(f"ETA {format_eta(min(etas))}")
    return " | ".join(parts)


def decide(session: Session, state: State, record: Record) -> str:
    """Fill record.gate and return the row's status: the first baseline is kept, its repeats only measure σ,
    a candidate is judged on the mean of its runs against the best (see orchestrator/noise.py)."""
    group = record.group or record.n
    runs = [*state.groups.get(group, []), record.val_bpb]
    if not state.best_group:
        record.gate = {"decision": "keep", "runs": 1, "mean": record.val_bpb, "why": "baseline"}
        return "keep"
    if group == state.best_group:  # a repeat of the best (the baseline): it only sharpens σ
        record.gate = {"decision": "repeat", "runs": len(runs), "mean": statistics.fmean(runs)}
        return "discard"
    best_source = session.repo.git.show(f"{state.best_commit}:train.py")
    shorter = significant_lines(session.repo.git.show(f"{record.commit}:train.py")) < significant_lines(best_source)
    groups = {**state.groups, group: runs}
    sigma = pooled_sigma(list(groups.values()))
    verdict = judge(runs, groups[state.best_group], sigma, session.settings.gate, shorter)
    record.gate = {"decision": verdict.decision, "runs": len(runs), "mean": statistics.fmean(runs),
                   "best_mean": statistics.fmean(groups[state.best_group]), "margin": verdict.margin,
                   "delta": verdict.delta, "sigma": sigma.value, "sigma_dof": sigma.dof, "why": verdict.why}
    return "keep" if verdict.decision == "keep" else "discard"


def row_text(record: Record) -> tuple[float, str]:
    """The row's val_bpb and description: a decided candidate shows its mean, its runs and the margin used."""
    if record.status == "crash":
        return 0.0, f"{record.description} [crash: {record.reason}]"
    g = record.gate
    if g.get("note"):  # parallel generations: selection, confirmation
        value = g.get("mean", record.val_bpb) if record.status == "keep" else record.val_bpb
        return value, f"{record.description} [{g['note']}]"
    if g.get("decision") == "rerun":
        return record.val_bpb, f"{record.description} [inside the margin {g['margin']:.4f}: running again]"
    if g.get("sigma") is not None and (g["decision"] == "keep" or g["runs"] > 1):
        note = "simplification, " if g["why"].startswith("simplification") else ""
        runs = f"mean of {g['runs']} runs" if g["runs"] > 1 else "1 run"
        return g["mean"], f"{record.description} ({note}{runs}, margin {g['margin']:.4f})"
    return record.val_bpb, record.description


def finish(session: Session, state: State, record: Record, reason: str, status: str | None = None) -> None:
    """Decide (unless `status` is given: decided by the caller, gate filled), record (record.json, then the
    fsync'd row), and move the branch; in that order, for resume."""
    t = time.monotonic()
    record.reason = reason
    if reason:
        record.status, record.val_bpb = "crash", None
    else:
        record.status = status or decide(session, state, record)
    record.ended = time.time()
    record.timings["record"] = time.monotonic() - t
    write_record(session.paths.run_dir(record.n), record)
    mem_mb = record.metrics.get("peak_vram_mb", 0.0) if record.status != "crash" else 0.0
    mfu = record.metrics.get("mfu_percent", 0.0) if record.status != "crash" else 0.0
    bpb, description = row_text(record)
    append_row(session.paths.ledger, Row(record.commit, bpb, float(mem_mb) / 1024, float(mfu), record.status,
                                         description))
    previous_best = state.best_run
    state.add(record)
    keep_artifact(session, state, record, previous_best)
    if "queue_id" in record.info:
        session.queue.mark_done(record.info["queue_id"], session.settings.tag, record.n)
    gitops.reset_to(session.wt, state.best_commit)
    sigma = state.sigma()
    session.pids.clear()
    write_status(session.paths, phase="idle", train_pid=None, train_pids={}, last=record.n, sigma=sigma.value, sigma_dof=sigma.dof)


def keep_artifact(session: Session, state: State, record: Record, previous_best: int) -> None:
    """Keep the saved models of the baseline and of the current best (for the held-out check); drop the rest."""
    keep = {1, state.best_run}
    for n in {record.n, previous_best}:
        if n and n not in keep:
            (session.paths.run_dir(n) / "model.pt").unlink(missing_ok=True)


