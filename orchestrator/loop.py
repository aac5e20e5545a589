"""The controller loop: propose -> check -> commit -> run -> parse -> decide -> record, resumable at any point."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from . import LoopError, gitops, harness
from .evaluation import artifact_age, audit_clock, compare_printed, harness_evaluate
from .guard import new_violations
from .ledger import Record, Row, append_row, ensure_header, read_record, read_rows, write_json_atomic, write_record
from .noise import Gate, Sigma, judge, pooled_sigma, significant_lines
from .pipeline import Prefetch, Prepared, make_proposal
from .progress import Progress, format_eta, last_step
from .proposers import Context, Proposer, load
from .queue import Queue
from .runner import kill_tree, run_command
from .session import Lock, Paths, read_status, write_status
from .summary import last_error_line, parse_summary, val_bpb_of

DEFAULT_GRACE_S = 120.0  # start-up and evaluation on top of twice the training budget


@dataclass
class Settings:
    repo: Path
    tag: str
    budget: float = 300.0
    timeout: float | None = None  # hard timeout per run (seconds); default 2 x budget + grace
    max_experiments: int | None = None
    max_hours: float | None = None
    proposer: str = "search"
    profile: str | None = None
    dataset: str | None = None
    seed: int = 42
    cache: str | None = None
    pipeline: bool | None = None  # prepare the next idea while one trains; None: as the proposer prefers
    max_tokens: int | None = None  # stop once the proposer's LLM usage reaches this many tokens
    max_cost: float | None = None  # ... or this many dollars (needs prices in the proposer options)
    options: dict = field(default_factory=dict)  # proposer options (agent command, LLM endpoint, ...)
    gate: Gate = field(default_factory=Gate)  # the keep rule (noise-aware by default)
    baseline_repeats: int = 2  # extra runs of the baseline, to measure σ
    startup_allowance: float = 60.0  # seconds of start-up allowed on top of the budget before "budget exceeded"

    @property
    def hard_timeout(self) -> float:
        return self.timeout if self.timeout else 2 * self.budget + DEFAULT_GRACE_S


@dataclass
class State:
    """What the loop knows, rebuilt from the run records (and results.tsv, git) on every start.

    Runs of one candidate form a group (numbered by its first run): the baseline and its repeats are group 1.
    """

    records: list[Record] = field(default_factory=list)
    start_commit: str = ""
    best_commit: str = ""
    best_group: int = 0
    best_run: int = 0  # the run whose saved model stands for the best (its last run)
    groups: dict[int, list[float]] = field(default_factory=dict)  # group -> val_bpb of each finished run
    pending: int | None = None  # a candidate to run again before it is decided

    @property
    def done(self) -> int:
        return len(self.records)

    @property
    def best_bpb(self) -> float | None:
        runs = self.groups.get(self.best_group)
        return statistics.fmean(runs) if runs else None

    @property
    def baseline_bpb(self) -> float | None:
        runs = self.groups.get(1)  # the baseline and its repeats
        return statistics.fmean(runs) if runs else None

    def sigma(self) -> Sigma:
        return pooled_sigma(list(self.groups.values()))

    def add(self, record: Record) -> None:
        self.records.append(record)
        group = record.group or record.n
        decision = record.gate.get("decision", record.status)
        if record.status != "crash" and record.val_bpb is not None:
            self.groups.setdefault(group, []).append(record.val_bpb)
        if decision == "keep":
            self.best_commit, self.best_group, self.best_run, self.pending = record.commit, group, record.n, None
        elif decision == "rerun":
            self.pending = group
        elif self.pending == group:
            self.pending = None


# ---------------------------------------------------------------------------
# Session set-up and resume
# ---------------------------------------------------------------------------


class Session:
    def __init__(self, settings: Settings, echo: Callable[[str], None]):
        self.settings, self.echo = settings, echo
        self.paths = Paths(settings.repo, settings.tag)
        self.repo = gitops.open_repo(settings.repo)
        self.env = harness.run_env(settings.budget, settings.seed, settings.profile, settings.dataset, settings.cache)
        self.wt = None
        self.info: harness.HarnessInfo | None = None
        self.prepare_sha = ""
        self.baseline_source = ""
        self.queue = Queue(self.paths.queue)
        self.progress = Progress()
        self.state: State | None = None  # set once resumed (the progress line reads it)
        self.started = time.time()
        self.pipeline = bool(settings.pipeline)
        self.prefetch: Prefetch | None = None
        self._proposal_wt = None

    def proposal_worktree(self, base: str):
        """The proposers' worktree, reset to base (detached; never on the loop's branch)."""
        if self._proposal_wt is None:
            self._proposal_wt = gitops.ensure_detached_worktree(self.repo, self.paths.proposal, base)
        gitops.checkout_clean(self._proposal_wt, base)
        return self._proposal_wt

    @property
    def profile(self) -> str | None:
        return self.info.profile if self.info and self.info.profile else self.settings.profile

    def open(self) -> None:
        """Check the repo, make the worktree, prepare and pin the harness. Call with the lock held."""
        gitops.require_clean(self.repo)
        gitops.exclude_state(self.repo)
        self.wt = gitops.ensure_worktree(self.repo, self.settings.tag, self.paths.worktree)
        self.paths.runs.mkdir(parents=True, exist_ok=True)
        self.link_results()
        self.info = harness.query(self.paths.worktree, self.env)
        if self.info.manifest is not None and harness.verify(self.info.manifest):
            harness.prepare(self.paths.worktree, self.env, self.echo)
            problems = harness.verify(self.info.manifest)
            if problems:
                raise LoopError(f"prepared data does not verify after prepare.py: {'; '.join(problems)}")
        if self.info.time_budget is not None and abs(self.info.time_budget - self.settings.budget) > 1e-9:
            self.echo(f"autoloop: note: this harness fixes its own budget ({self.info.time_budget:g}s); "
                      f"--budget {self.settings.budget:g} does not reach it")
        pinned = self.paths.worktree / "prepare.py"
        self.prepare_sha = harness.sha256_file(pinned) if pinned.exists() else ""

    def link_results(self) -> None:
        """results.tsv at the repo root points at this session's ledger (an existing file is kept aside)."""
        ensure_header(self.paths.ledger)
        link = self.settings.repo / "results.tsv"
        target = self.paths.ledger.relative_to(self.settings.repo)
        if link.is_symlink() or not link.exists():
            if link.is_symlink() and Path(os.readlink(link)) == target:
                return
            link.unlink(missing_ok=True)
        else:
            kept = self.settings.repo / ".autoloop" / f"results.{time.strftime('%Y%m%d-%H%M%S')}.tsv"
            shutil.move(link, kept)
            self.echo(f"autoloop: moved the existing results.tsv to {kept.relative_to(self.settings.repo)}")
        link.symlink_to(target)

    def resume(self) -> State:
        """Rebuild the state from the ledger; drop half-finished experiments; put the branch at the best."""
        kill_orphan(read_status(self.paths))
        state = State()
        session = self.paths.session
        if session.exists():
            state.start_commit = json.loads(session.read_text())["start_commit"]
        else:
            state.start_commit = self.wt.head.commit.hexsha
            write_json_atomic(session, {"start_commit": state.start_commit, "tag": self.settings.tag,
                                        "prepare_sha256": self.prepare_sha, "created": time.time()})
        state.best_commit = state.start_commit
        for n, row in enumerate(read_rows(self.paths.ledger), start=1):
            record = read_record(self.paths.run_dir(n)) or Record(
                n=n, status=row.status, description=row.description, commit=row.commit,
                val_bpb=row.val_bpb if row.status != "crash" else None)
            state.add(record)
        for run_dir in self.paths.runs.iterdir():
            if run_dir.name.isdigit() and int(run_dir.name) > state.done:
                dest = self.paths.state / "incomplete" / f"{run_dir.name}-{int(time.time())}"
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(run_dir, dest)
        gitops.reset_to(self.wt, state.best_commit)
        self.baseline_source = self.repo.git.show(f"{state.start_commit}:train.py")
        return state

    def integrity_problems(self) -> list[str]:
        """Checks before any training time is spent: harness pinned, prepared data intact."""
        problems = []
        pinned = self.paths.worktree / "prepare.py"
        if self.prepare_sha and (not pinned.exists() or harness.sha256_file(pinned) != self.prepare_sha):
            problems.append("prepare.py differs from the one pinned at session start")
        if self.info and self.info.manifest is not None:
            problems += harness.verify(self.info.manifest)
        return problems


def kill_orphan(status: dict) -> None:
    """A controller killed with SIGKILL leaves its training process running: end it before resuming."""
    pid = status.get("train_pid")
    if not pid:
        return
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - status.get("train_started", 0)) < 2.0:
            kill_tree(pid, pid)
    except psutil.Error:
        pass


# ---------------------------------------------------------------------------
# One experiment
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


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------


def _stop_reason(settings: Settings, state: State, started: float) -> str:
    if settings.max_experiments is not None and state.done >= settings.max_experiments:
        return f"reached --max-experiments {settings.max_experiments}"
    if settings.max_hours is not None and time.time() - started >= settings.max_hours * 3600:
        return f"reached --max-hours {settings.max_hours:g}"
    tokens, cost = usage_totals(state)
    if settings.max_tokens is not None and tokens >= settings.max_tokens:
        return f"reached --max-tokens {settings.max_tokens} ({tokens} used)"
    if settings.max_cost is not None and cost >= settings.max_cost:
        return f"reached --max-cost {settings.max_cost:g} (${cost:.2f} spent)"
    return ""


MAX_FAILED_PROPOSALS = 5  # ideas in a row that fail before training: the proposer is broken, not unlucky


def check_failing_proposer(state: State) -> None:
    recent = state.records[-MAX_FAILED_PROPOSALS:]
    if len(recent) == MAX_FAILED_PROPOSALS and all(r.status == "crash" and "train" not in r.timings
                                                    for r in recent):
        raise LoopError(f"the last {MAX_FAILED_PROPOSALS} ideas all failed before training (last: "
                        f"{recent[-1].reason}); check the proposer's settings and its log in "
                        f"runs/{recent[-1].n}/, then run the same command to resume")


def usage_totals(state: State) -> tuple[int, float]:
    """Tokens and dollars the proposer reported over the session (record.json info.usage)."""
    tokens = sum(int(r.info.get("usage", {}).get("total_tokens", 0)) for r in state.records)
    cost = sum(float(r.info.get("usage", {}).get("cost", 0.0)) for r in state.records)
    return tokens, cost


def _sigterm_to_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_loop(settings: Settings, echo: Callable[[str], None] = print) -> State:
    """Run experiments until a stop condition; returns the final state. Raises LoopError for setup problems."""
    session = Session(settings, echo)
    proposer_cls = load(settings.proposer)
    with Lock(session.paths.lock):
        session.open()
        state = session.state = session.resume()
        proposer = proposer_cls(Context(repo=settings.repo, tag=settings.tag, seed=settings.seed,
                                        profile=session.profile, options=dict(settings.options)))
        session.pipeline = proposer.pipeline if settings.pipeline is None else settings.pipeline
        for record in state.records:
            proposer.observe(record)
        echo(f"autoloop: tag {settings.tag} | branch autoloop/{settings.tag} | budget {settings.budget:g}s | "
             f"timeout {settings.hard_timeout:.0f}s | proposer {settings.proposer}"
             f"{' (pipelined)' if session.pipeline else ''} | {state.done} experiment(s) already recorded")
        echo(console_header())
        started, stop = time.time(), ""
        previous = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
        try:
            while not (stop := _stop_reason(settings, state, started)):
                record = run_experiment(session, proposer, state, state.done + 1)
                if record is None:
                    stop = "the proposer has no more ideas"
                    break
                session.progress.clear()
                echo(console_line(record, state))
                if session.prefetch is not None:
                    session.prefetch.result()  # observe() never runs while propose() does
                proposer.observe(record)
                if record.n == 1 and record.status == "crash":
                    raise LoopError(f"the unmodified baseline crashed ({record.reason}); fix train.py or the "
                                    f"environment, see {session.paths.run_dir(1) / 'run.log'}")
                check_failing_proposer(state)
        except KeyboardInterrupt:
            session.progress.clear()
            proposer.cancelled.set()
            session.prefetch = None
            gitops.reset_to(session.wt, state.best_commit)
            write_status(session.paths, phase="stopped", train_pid=None)
            echo(f"autoloop: interrupted; experiment {state.done + 1} was not recorded. "
                 "Run the same command to resume.")
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            proposer.close()
        write_status(session.paths, phase="finished", train_pid=None)
        echo(session_summary(settings, state, stop))
        holdout_check(session, state, echo)
        return state


def holdout_check(session: Session, state: State, echo: Callable[[str], None]) -> dict | None:
    """Score the baseline's and the best's saved models on the held-out split that no decision ever used, each
    with its own train.py, so that over-fitting the validation split by selection shows."""
    if not (session.info and session.info.artifacts) or state.best_run in (0, 1):
        return None
    result = {}
    for name, n in (("baseline", 1), ("best", state.best_run)):
        record = next(r for r in state.records if r.n == n)
        artifact = session.paths.run_dir(n) / "model.pt"
        if not artifact.exists():
            return None
        session.proposal_worktree(record.commit)
        value, why = harness_evaluate(session.paths.proposal, session.env, artifact, split="holdout",
                                      timeout=session.settings.hard_timeout)
        if value is None:
            echo(f"autoloop: held-out check skipped: {why}")
            return None
        result[name] = {"n": n, "commit": record.commit, "holdout_bpb": value,
                        "val_bpb": state.groups[record.group or record.n][-1] if name == "best" else state.baseline_bpb}
    write_json_atomic(session.paths.state / "holdout.json", result)
    b, w = result["baseline"], result["best"]
    echo(f"autoloop: held-out check: baseline {b['holdout_bpb']:.6f} -> best {w['holdout_bpb']:.6f} "
         f"({w['holdout_bpb'] - b['holdout_bpb']:+.6f}; on validation {w['val_bpb'] - b['val_bpb']:+.6f})")
    return result


def console_header() -> str:
    return f"{'#':>4}  {'commit':7}  {'val_bpb':>9}  {'best':>9}  {'mem_gb':>6}  {'status':7}  description"


def console_line(record: Record, state: State) -> str:
    bpb = f"{record.val_bpb:.6f}" if record.val_bpb is not None else "-"
    best = f"{state.best_bpb:.6f}" if state.best_bpb is not None else "-"
    mem = float(record.metrics.get("peak_vram_mb", 0.0) or 0.0) / 1024
    desc = record.description + (f"  [{record.reason}]" if record.reason else "")
    return f"{record.n:>4}  {record.commit[:7]:7}  {bpb:>9}  {best:>9}  {mem:>6.1f}  {record.status:7}  {desc}"


def session_summary(settings: Settings, state: State, stop: str) -> str:
    keeps = sum(r.status == "keep" for r in state.records)
    crashes = sum(r.status == "crash" for r in state.records)
    line = f"autoloop: stopped ({stop}). {state.done} experiments: {keeps} keep, {crashes} crash."
    if state.baseline_bpb is not None and state.best_bpb is not None:
        delta = state.best_bpb - state.baseline_bpb
        line += (f" val_bpb {state.baseline_bpb:.6f} -> {state.best_bpb:.6f} ({delta:+.6f}, "
                 f"{100 * delta / state.baseline_bpb:+.2f}%) at {state.best_commit[:7]} on autoloop/{settings.tag}")
    return line
