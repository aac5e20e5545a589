"""One experiment: propose -> check -> commit -> run -> measure -> decide -> record.

Every step writes what resume needs before the next one starts: the run record, then the fsync'd row, then the
branch moves. The session (paths, git, harness, queue) and the state (what is known so far) come from loop.py.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from . import LoopError, gitops
from .evaluation import artifact_age, audit_clock, compare_printed, harness_evaluate
from .guard import new_violations
from .ledger import Record, Row, append_row, write_record
from .noise import judge, pooled_sigma, significant_lines
from .pipeline import Prefetch, Prepared, make_proposal
from .progress import format_eta, last_step
from .proposers import Proposer
from .runner import run_command
from .session import write_status
from .summary import last_error_line, parse_summary, val_bpb_of

if TYPE_CHECKING:
    from .loop import Session, State


# ---------------------------------------------------------------------------


def check_edit(session: Session) -> str:
    """Why the proposed edit may not run ('' if it may): only train.py changed, it compiles, and it leaves
    alone what the controller and prepare.py own (seed, budget, evaluation, validation data)."""
    changed = gitops.changed_files(session.wt)
    others = [f for f in changed if f != "train.py"]
    if others:
        return f"edited files other than train.py: {', '.join(others[:5])}"
    try:
        source = (session.paths.worktree / "train.py").read_text()
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
    patch = (session.paths.run_dir(first.n) / "diff.patch").read_text()
    info = {key: v for key, v in first.info.items() if key not in ("queue_id", "usage")}
    return Prepared(base=best, description=f"{first.description} (repeat {k}/{session.settings.gate.max_repeats})",
                    patch=patch, group=state.pending, info={**info, "repeat": k})


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
    if prepared is not None and prepared.base != best and not prepared.exhausted:
        if prepared.reason or gitops.carry_over(session.wt, prepared.patch, prepared.patch_u0):
            prepared = None  # made for an older best and does not carry over: ask again
        else:
            prepared.patch = gitops.diff_all(session.wt, best)
            gitops.reset_to(session.wt, best)
    if prepared is None:
        prepared = make_proposal(session, proposer, best, list(state.records))
    return prepared, time.monotonic() - t


def start_prefetch(session: Session, proposer: Proposer, state: State, running: Record) -> None:
    """Ask for the next idea now, on the current best, while `running` trains."""
    s = session.settings
    if not session.pipeline or session.prefetch is not None or \
            (s.max_experiments is not None and running.n >= s.max_experiments):
        return
    inflight = Record(n=running.n, status="running", description=running.description, commit=running.commit,
                      parent=running.parent, info=running.info, group=running.group)
    history, best = [*state.records, inflight], state.best_commit
    session.prefetch = Prefetch(lambda: make_proposal(session, proposer, best, history))


def run_experiment(session: Session, proposer: Proposer, state: State, n: int) -> Record | None:
    """One full experiment; returns its record, or None when the proposer has no more ideas."""
    s, paths = session.settings, session.paths
    record = Record(n=n, status="crash", description="", parent=state.best_commit, proposer=proposer.name,
                    started=time.time(), best_before=state.best_bpb)
    run_dir = paths.run_dir(n)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_status(paths, phase="proposing", n=n, experiment_started=record.started, description="",
                 train_pid=None, pid=os.getpid(), tag=s.tag, budget=s.budget)

    prepared, waited = next_idea(session, proposer, state, n)
    record.timings["propose"], record.timings["propose_wait"] = prepared.seconds, waited
    if prepared.exhausted:
        shutil.rmtree(run_dir, ignore_errors=True)
        return None
    record.description, record.info, reason = prepared.description, prepared.info, prepared.reason
    record.group = prepared.group or n
    if prepared.log:
        (run_dir / "proposer.log").write_text(prepared.log)

    t = time.monotonic()
    if not reason and (error := gitops.apply_patch(session.wt, prepared.patch)):
        reason = f"the proposal does not apply: {error}"
    reason = reason or check_edit(session)
    problems = [] if reason else session.integrity_problems()  # an edit outside train.py never runs anyway
    if problems:
        raise LoopError(f"the prepared harness no longer verifies ({'; '.join(problems)}); an earlier run may have "
                        "modified it. Re-run `python prepare.py --force`, then the same autoloop command to resume")
    record.timings["check"] = time.monotonic() - t

    t = time.monotonic()
    record.commit = gitops.commit_all(session.wt, f"autoloop {s.tag} #{n}: {record.description}")
    gitops.mark_tried(session.repo, s.tag, n, record.commit)
    (run_dir / "diff.patch").write_text(gitops.diff(session.wt, state.best_commit, record.commit))
    record.timings["git"] = time.monotonic() - t

    if not reason:
        start_prefetch(session, proposer, state, record)
        reason = train(session, record, run_dir)
    finish(session, state, record, reason)
    return record


def train(session: Session, record: Record, run_dir: Path) -> str:
    """Run train.py under the hard timeout, then have the harness measure the model it saved and audit the
    run's clock. Fills the record's metrics; returns a crash reason or ''."""
    s = session.settings
    artifact = run_dir / "model.pt"
    env = dict(session.env, AUTOLOOP_EVAL_ARTIFACT=str(artifact)) if session.info.artifacts else session.env

    def on_start(pid: int) -> None:
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            created = 0.0
        write_status(session.paths, train_pid=pid, train_started=created)

    write_status(session.paths, phase="training", description=record.description, training_started=time.time())
    t, started_wall = time.monotonic(), time.time()

    def on_tick(elapsed: float) -> None:
        session.progress.update(progress_text(session, record, elapsed, run_dir / "run.log"))

    result = run_command([sys.executable, "train.py"], session.paths.worktree, env, run_dir / "run.log",
                         s.hard_timeout, on_start=on_start, on_tick=on_tick)
    record.timings["train"] = time.monotonic() - t
    record.exit_code, record.timed_out = result.exit_code, result.timed_out
    log_text = result.log_path.read_text(errors="replace")
    record.metrics = parse_summary(log_text)
    printed = val_bpb_of(record.metrics)
    touched = gitops.modified_tracked(session.wt)
    if result.timed_out:
        return f"timeout after {s.hard_timeout:.0f}s"
    if result.exit_code != 0:
        return f"exit code {result.exit_code}: {last_error_line(log_text)}".rstrip(": ")
    if touched:
        return f"the run modified {', '.join(touched)}"
    if "val_bpb" not in record.metrics:
        return f"no val_bpb in the summary: {last_error_line(log_text)}".rstrip(": ")
    if not session.info.artifacts:  # a harness without artifacts (e.g. upstream's): its printed number
        record.val_bpb = printed
        return "" if printed is not None else f"val_bpb is not finite ({record.metrics['val_bpb']})"
    if not artifact.exists():
        return "train.py did not call prepare.evaluate_bpb: no model was saved for the harness to measure"
    if why := audit_clock(record.metrics, s.budget, artifact_age(artifact, started_wall), s.startup_allowance):
        return why
    write_status(session.paths, phase="evaluating")
    t = time.monotonic()
    measured, why = harness_evaluate(session.paths.worktree, session.env, artifact, timeout=s.hard_timeout)
    record.timings["eval"] = time.monotonic() - t
    if measured is None:
        return why
    record.metrics["harness_val_bpb"] = measured
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
    shorter = significant_lines((session.paths.worktree / "train.py").read_text()) < significant_lines(best_source)
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
    if g.get("decision") == "rerun":
        return record.val_bpb, f"{record.description} [inside the margin {g['margin']:.4f}: running again]"
    if g.get("sigma") is not None and (g["decision"] == "keep" or g["runs"] > 1):
        note = "simplification, " if g["why"].startswith("simplification") else ""
        runs = f"mean of {g['runs']} runs" if g["runs"] > 1 else "1 run"
        return g["mean"], f"{record.description} ({note}{runs}, margin {g['margin']:.4f})"
    return record.val_bpb, record.description


def finish(session: Session, state: State, record: Record, reason: str) -> None:
    """Decide, record (record.json, then the fsync'd row), and move the branch; in that order, for resume."""
    t = time.monotonic()
    record.reason = reason
    if reason:
        record.status, record.val_bpb = "crash", None
    else:
        record.status = decide(session, state, record)
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
    write_status(session.paths, phase="idle", train_pid=None, last=record.n, sigma=sigma.value, sigma_dof=sigma.dof)


def keep_artifact(session: Session, state: State, record: Record, previous_best: int) -> None:
    """Keep the saved models of the baseline and of the current best (for the held-out check); drop the rest."""
    keep = {1, state.best_run}
    for n in {record.n, previous_best}:
        if n and n not in keep:
            (session.paths.run_dir(n) / "model.pt").unlink(missing_ok=True)


