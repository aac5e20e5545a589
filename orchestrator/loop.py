"""The controller loop: settings, the state rebuilt on every start, the session, and run_loop.

One experiment's steps live in experiment.py; run_loop repeats them until a stop condition.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from . import LoopError, gitops, gpu, harness
from .evaluation import holdout_text, parse_evaluation
from .executors import OUT, PYTHON, Executor, Job, make_executor
from .experiment import MAX_INFRA_RETRIES, run_experiment
from .generations import run_generations
from .ledger import Record, ensure_header, read_record, read_rows, write_json_atomic
from .noise import Gate, Sigma, pooled_sigma
from .pipeline import Prefetch
from .progress import Progress
from .proposers import Context, load
from .queue import Queue
from .runner import kill_tree
from .session import Lock, Paths, read_status, write_status

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
    executor: str = "local"  # local | ray
    workers: int | None = None  # experiments at once; default: one per GPU (local) or per cluster GPU (ray)
    gpus: list[str] | None = None  # local GPU ids to use (default: detected)
    ray_address: str | None = None

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
        if record.status != "crash" and record.val_bpb is not None and not record.gate.get("selection"):
            self.groups.setdefault(group, []).append(record.val_bpb)  # (a best-of-N pick is biased low)
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
        self.prepare_sha = self.manifest_digest = ""
        self.baseline_source = ""
        self.queue = Queue(self.paths.queue)
        self.progress = Progress()
        self.state: State | None = None  # set once resumed (the progress line reads it)
        self.started = time.time()
        self.pipeline = bool(settings.pipeline)
        self.prefetch: Prefetch | None = None
        self._proposal_wt = None
        self.executor: Executor | None = None
        self.pids: dict[str, list[float]] = {}  # slot -> [pid, create time] of the process it runs here

    def track_pid(self, slot: int, pid: int, created: float) -> None:
        self.pids[str(slot)] = [pid, created]
        write_status(self.paths, train_pid=pid, train_started=created, train_pids=dict(self.pids))

    def open_executor(self) -> Executor:
        s = self.settings
        try:
            self.executor = make_executor(s.executor, s.workers, s.gpus, s.ray_address)
        except (ValueError, ImportError) as e:
            raise LoopError(str(e)) from None
        return self.executor

    def proposal_worktree(self, base: str):
        """The proposers' worktree, reset to base (detached; never on the loop's branch)."""
        if self._proposal_wt is None:
            self._proposal_wt = gitops.ensure_detached_worktree(self.repo, self.paths.proposal, base)
        gitops.checkout_clean(self._proposal_wt, base)
        return self._proposal_wt

    def commit_proposal(self, message: str) -> str:
        """Commit what the last proposal left in the proposal worktree (detached; nothing points at it)."""
        return gitops.commit_all(self._proposal_wt, message)

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
        gpu_check = gpu.Check.start(self.settings, self.env)  # nvidia-smi, before anything touches a GPU
        slot_env = {**self.env, **(self.executor.slots[0].env if self.executor else {})}  # as a run will see it
        self.info = harness.query(self.paths.worktree, slot_env, torch=gpu_check.needs_torch)
        gpu_check.finish(self.info.torch)  # LoopError: GPUs torch cannot use, or the gpu profile without CUDA
        for key, value in (("AUTOLOOP_PROFILE", self.info.profile), ("AUTOLOOP_DATASET", self.info.dataset)):
            if value and not self.env.get(key):
                self.env[key] = value  # one harness size and corpus for every slot, as the query found them
        pinned = self.paths.worktree / "prepare.py"
        if self.info.manifest is not None and harness.verify(self.info.manifest, pinned):
            harness.prepare(self.paths.worktree, slot_env, self.echo)
            problems = harness.verify(self.info.manifest, pinned)
            if problems:
                raise LoopError(f"prepared data does not verify after prepare.py: {'; '.join(problems)}")
        if self.info.time_budget is not None and abs(self.info.time_budget - self.settings.budget) > 1e-9:
            self.echo(f"autoloop: note: this harness fixes its own budget ({self.info.time_budget:g}s); "
                      f"--budget {self.settings.budget:g} does not reach it")
        if self.info.profile == "gpu" and self.info.dataset == "pystdlib" and self.info.smoke_warning:
            self.echo(f"autoloop: {self.info.smoke_warning}")
        self.prepare_sha = harness.sha256_file(pinned) if pinned.exists() else ""
        if self.info.manifest is not None:  # the evaluation refuses data that differs from what was pinned
            self.manifest_digest = self.env["AUTOLOOP_MANIFEST_DIGEST"] = harness.manifest_digest(self.info.manifest)

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
            pinned = json.loads(session.read_text())
            state.start_commit = pinned["start_commit"]
            if pinned.get("manifest_digest", self.manifest_digest) != self.manifest_digest:
                raise LoopError(f"the prepared data differs from the data session {self.settings.tag!r} started "
                                "with (evaluation sizes or files): its results would not be comparable. Start a "
                                "new session (--tag NEW), or restore the data it was prepared with")
        else:
            state.start_commit = self.wt.head.commit.hexsha
            write_json_atomic(session, {"start_commit": state.start_commit, "tag": self.settings.tag,
                                        "prepare_sha256": self.prepare_sha, "manifest_digest": self.manifest_digest,
                                        "created": time.time()})
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
            if harness.manifest_digest(self.info.manifest) != self.manifest_digest:
                problems.append("the manifest (evaluation sizes, file hashes) changed since session start")
        return problems


def kill_orphan(status: dict) -> None:
    """A controller killed with SIGKILL leaves its training processes running: end them before resuming."""
    running = [tuple(v) for v in (status.get("train_pids") or {}).values()]
    if status.get("train_pid"):
        running.append((status["train_pid"], status.get("train_started", 0)))
    for pid, created in set(running):
        try:
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - created) < 2.0:
                kill_tree(int(pid), int(pid))
        except psutil.Error:
            pass


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
        executor = session.open_executor()
        session.open()
        state = session.state = session.resume()
        proposer = proposer_cls(Context(repo=settings.repo, tag=settings.tag, seed=settings.seed,
                                        profile=session.profile, options=dict(settings.options)))
        session.pipeline = proposer.pipeline if settings.pipeline is None else settings.pipeline
        for record in state.records:
            proposer.observe(record)
        parallel = len(executor.slots) > 1
        echo(f"autoloop: tag {settings.tag} | branch autoloop/{settings.tag} | budget {settings.budget:g}s | "
             f"timeout {settings.hard_timeout:.0f}s | proposer {settings.proposer}"
             f"{' (pipelined)' if session.pipeline else ''} | {state.done} experiment(s) already recorded")
        echo(f"autoloop: executor {executor.name} | {len(executor.slots)} slot(s): "
             f"{', '.join(slot.label for slot in executor.slots[:8])}{' ...' if len(executor.slots) > 8 else ''}"
             f"{' | generations of ' + str(len(executor.slots)) + ' runs' if parallel else ''}")
        echo(console_header())
        started, stop = time.time(), ""
        previous = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)

        def on_record(record: Record) -> None:
            echo(console_line(record, state))
            proposer.observe(record)

        try:
            if parallel:
                stop = run_generations(session, proposer, state, lambda: _stop_reason(settings, state, started),
                                       on_record, lambda: check_failing_proposer(state))
            while not parallel and not (stop := _stop_reason(settings, state, started)):
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
            write_status(session.paths, phase="stopped", train_pid=None, train_pids={}, running=[])
            unrecorded = "the runs of the current generation were" if parallel else \
                f"experiment {state.done + 1} was"
            echo(f"autoloop: interrupted; {unrecorded} not recorded. Run the same command to resume.")
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            proposer.close()
            executor.close()
        write_status(session.paths, phase="finished", train_pid=None, train_pids={}, running=[])
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
        value, why = evaluate_holdout(session, record.commit, artifact, session.paths.state / "holdout" / str(n))
        result[name] = {"n": n, "commit": record.commit, "holdout_bpb": value,
                        "val_bpb": state.groups[record.group or record.n][-1] if name == "best" else state.baseline_bpb}
        if value is None:
            result["error"] = f"{name} (#{n}): {why}"
            break
    write_json_atomic(session.paths.state / "holdout.json", result)
    echo(f"autoloop: held-out check: {holdout_text(result)}")
    return result


def evaluate_holdout(session: Session, commit: str, artifact: Path, out: Path) -> tuple[float | None, str]:
    """The held-out bits per byte of a saved model, measured by prepare.py at `commit`, on the executor's first
    slot (on a cluster the model travels to a GPU node; nothing is evaluated on the controller's CPU)."""
    session.proposal_worktree(commit)
    job = Job(steps=[[PYTHON, "prepare.py", "--evaluate", f"{OUT}/model.pt", "--split", "holdout"]],
              logs=["eval.log"], env={k: v for k, v in session.env.items() if k != "AUTOLOOP_EVAL_ARTIFACT"},
              timeout_s=session.settings.hard_timeout, workdir=session.paths.proposal, out_dir=out,
              inputs={"model.pt": artifact})
    for _ in range(MAX_INFRA_RETRIES + 1):
        result = session.executor.submit(job, session.executor.slots[0]).result()
        if not result.infra_error:
            break
    if result.infra_error or not result.steps:
        return None, f"the executor failed: {result.infra_error}"
    step = result.steps[0]
    if step.timed_out:
        return None, f"the harness evaluation timed out after {job.timeout_s:.0f}s"
    value, why = parse_evaluation(step.log.read_text(errors="replace") if step.log.exists() else "", "holdout")
    (out / "model.pt").unlink(missing_ok=True)  # a copy of the input
    return value, why


def console_header() -> str:
    return f"{'#':>4}  {'commit':7}  {'val_bpb':>9}  {'best':>9}  {'mem_gb':>6}  {'status':7}  description"


def console_line(record: Record, state: State) -> str:
    bpb = f"{record.val_bpb:.6f}" if record.val_bpb is not None else "-"
    best = f"{state.best_bpb:.6f}" if state.best_bpb is not None else "-"
    mem = float(record.metrics.get("peak_vram_mb", 0.0) or 0.0) / 1024
    desc = record.description + (f"  [{record.reason}]" if record.reason else "")
    if record.gate.get("note"):
        desc += f"  [{record.gate['note']}]"
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
