"""A session's workspace: .autoloop/<tag>/, its git worktrees, the pinned harness, resume, and recording."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import git

from .. import LoopError
from ..executors import Executor, gpu
from ..proposers.queue import Queue
from ..store import gitops
from ..store.ledger import Record, append_row, ensure_header, write_json_atomic, write_record
from ..store.session import Paths, read_status
from ..store.spend import Spend
from ..trust import confine, harness, redaction
from .judge import row_of
from .processes import Processes, kill_orphan
from .protection import Protection
from .settings import Settings
from .state import State, load_records, replay

# What an unconfined run can do (docs/trust.md: what holds only in the sandbox), said wherever runs go unconfined
UNCONFINED = (
    "a run can read the validation data and train on it, rewrite the packages the evaluator imports, and read "
    "and re-encode any secret this user can read (redaction catches only its usual encodings)"
)
SESSION_ENV = (
    "AUTOLOOP_TIME_BUDGET",
    "AUTOLOOP_SEED",
    "AUTOLOOP_PROFILE",
    "AUTOLOOP_DATASET",
    "AUTOLOOP_CACHE",
    "AUTOLOOP_MANIFEST_DIGEST",
)


class Workspace:
    """A session's place on disk and in git: paths, worktrees, the pinned harness, the queue, and recording.

    Runtime objects (executor, proposer, prefetch, progress) are not here: they are locals of run_loop."""

    def __init__(self, settings: Settings, echo: Callable[[str], None]):
        self.settings, self.echo = settings, echo
        self.paths = Paths(settings.repo, settings.tag)
        self.repo = gitops.open_repo(settings.repo)
        self.env = harness.run_env(
            settings.budget, settings.seed, settings.profile, settings.dataset, settings.cache, tuple(settings.pass_env)
        )
        self.wt: git.Repo  # the session's worktree: set by open()
        self.info: harness.HarnessInfo | None = None
        self.prepare_sha = self.manifest_digest = self.evaluate_sha = ""
        self.baseline_source = ""
        self.queue = Queue(self.paths.queue)
        self.spend = Spend(self.paths.spend, settings.max_tokens, settings.max_cost)
        self.started = time.time()
        self._proposal_wt: git.Repo | None = None
        self.processes = Processes(self.paths)  # what runs on each slot now (status.json; killed on the way out)
        self.generation = 0  # generations started by this process
        self.sandbox: dict | None = None  # the runs' bubblewrap settings (Job.sandbox); None: unconfined
        self.protection = Protection(self.repo, self.paths, settings.repo, settings.tag, echo)

    def proposal_worktree(self, base: str):
        """The proposers' worktree, reset to base (detached; never on the loop's branch)."""
        if self._proposal_wt is None:
            self._proposal_wt = gitops.ensure_detached_worktree(self.repo, self.paths.proposal, base)
        gitops.checkout_clean(self._proposal_wt, base)
        return self._proposal_wt

    def commit_proposal(self, message: str) -> str:
        """Commit what the last proposal left in the proposal worktree (detached; nothing points at it)."""
        if self._proposal_wt is None:
            raise LoopError("no proposal to commit: the proposal worktree was never made")
        return gitops.commit_all(self._proposal_wt, message)

    @property
    def harness_info(self) -> harness.HarnessInfo:
        """What open() found of the pinned harness (prepare.py: profile, data, evaluation)."""
        if self.info is None:
            raise LoopError("the workspace is not open yet: no harness was queried")
        return self.info

    @property
    def profile(self) -> str | None:
        return self.info.profile if self.info and self.info.profile else self.settings.profile

    def open(self, executor: Executor) -> None:
        """Check the repo, make the worktree, prepare and pin the harness. Call with the lock held."""
        gitops.require_clean(self.repo)
        gitops.exclude_state(self.repo)
        self.wt = gitops.ensure_worktree(self.repo, self.settings.tag, self.paths.worktree)
        self.paths.runs.mkdir(parents=True, exist_ok=True)
        self.link_results()
        gpu_check = gpu.Check.start(self.settings, self.env)  # nvidia-smi, before anything touches a GPU
        slot_env = {**self.env, **executor.slots[0].env}  # as a run will see it
        self.info = harness.query(self.paths.worktree, slot_env, torch=gpu_check.needs_torch)
        gpu_check.finish(self.info.torch)  # LoopError: GPUs torch cannot use, or the gpu profile without CUDA
        self.confine()  # the profile is known now; before any data is prepared
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
            fixed = float(self.info.time_budget)
            self.echo(
                f"autoloop: note: this harness fixes its own budget ({fixed:g}s); --budget "
                f"{self.settings.budget:g} does not reach it, so runs are timed, audited and pinned at {fixed:g}s"
            )
            self.settings.budget = fixed  # the hard timeout, the clock audit, the ETA and the pin follow it
            self.env["AUTOLOOP_TIME_BUDGET"] = f"{fixed:g}"
        if not self.info.exported:
            self.echo(
                "autoloop: note: this prepare.py "
                + (
                    "evaluates the model by importing train.py"
                    if self.info.artifacts
                    else "has no harness evaluation (train.py's printed val_bpb is read)"
                )
                + ": its metric is not protected against an edit that games it (README: threat model); "
                "autoloop's prepare.py evaluates an exported graph without running train.py's code"
            )
        if self.info.artifacts and not self.info.result_file:
            self.echo(
                "autoloop: note: this prepare.py predates the evaluation's result file: the metric is read from "
                "its output, which an edit could forge; update prepare.py from autoloop's"
            )
        if self.info.profile == "gpu" and self.info.dataset == "pystdlib" and self.info.smoke_warning:
            self.echo(f"autoloop: {self.info.smoke_warning}")
        if self.info.manifest is not None and harness.scored_on_readable_sources(self.info.manifest):
            self.echo(
                f"autoloop: note: the {self.info.dataset} corpus was split without test suites to score on, "
                "so a run can read the sources of its validation split and train on them (README: threat "
                "model); install this Python's test suite and run prepare.py --force, or use --dataset DIR"
            )
        self.prepare_sha = harness.sha256_file(pinned) if pinned.exists() else ""
        scorer = self.paths.worktree / "evaluate.py"
        self.evaluate_sha = harness.sha256_file(scorer) if self.info.evaluator == "evaluate.py" else ""
        if self.info.manifest is not None:  # the evaluation refuses data that differs from what was pinned
            self.manifest_digest = self.env["AUTOLOOP_MANIFEST_DIGEST"] = harness.manifest_digest(self.info.manifest)

    def confine(self) -> None:
        """Decide the runs' sandbox (self.sandbox) once the profile is known: bubblewrap where it works; where it
        does not, --sandbox on and the gpu profile's night (a GPU's hours are worth a sandbox) stop here with the
        fix, unless --sandbox off says to run unconfined; elsewhere runs are unconfined with a note of what that
        means (README: threat model)."""
        choice = self.settings.sandbox
        if choice == "off":
            self.echo(f"autoloop: note: runs are unconfined (--sandbox off): {UNCONFINED}")
            return
        problem = confine.sandbox_problem()
        if not problem:
            self.sandbox = {"net": self.settings.sandbox_net, "required": choice == "on"}
            if note := confine.sandbox_note():
                self.echo(f"autoloop: note: the sandbox is weaker on this machine: {note}")
            return
        if choice == "on":
            raise LoopError(f"--sandbox on, but {problem}; install it, or run unconfined with --sandbox off")
        if self.profile == "gpu":
            fix = (
                "install bubblewrap (apt-get install bubblewrap, dnf install bubblewrap)"
                if shutil.which("bwrap") is None
                else "make it work here (`autoloop doctor` names the fix: e.g. allow user namespaces)"
            )
            raise LoopError(
                f"the gpu profile runs confined, but {problem.split(' (apt-get')[0]}: {fix}, or run unconfined on "
                f"purpose with --sandbox off (unconfined, {UNCONFINED})"
            )
        self.echo(
            f"autoloop: note: runs are unconfined ({problem}): {UNCONFINED}. Install bubblewrap for the "
            "sandbox (`autoloop doctor` names the fix)"
        )

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

    def pin(self) -> dict:
        """Everything that changes what a val_bpb means: a session resumes only with all of it unchanged."""
        gate = self.settings.gate
        return {
            "budget": self.settings.budget,
            "profile": self.profile,
            "dataset": (self.info.dataset if self.info else None) or self.settings.dataset,
            "seed": self.settings.seed,
            "gate": f"{gate.mode} alpha {gate.alpha:g} looks {gate.max_repeats} min {gate.min_delta:g}"
            + (" early-stop on" if gate.early_stop == "on" else ""),
            "manifest_digest": self.manifest_digest,
            "prepare_sha256": self.prepare_sha,
            **({"evaluate_sha256": self.evaluate_sha} if self.evaluate_sha else {}),
        }

    def differences(self, pinned: dict) -> list[str]:
        """How this run differs from the session as pinned (session.json): settings, data, a new train.py."""
        now, was = self.pin(), pinned.get("pin") or {"manifest_digest": pinned.get("manifest_digest")}
        out = []
        for key, old in was.items():
            new = now.get(key)
            if key in now and old is not None and old != new:
                if key in ("manifest_digest", "prepare_sha256", "evaluate_sha256"):
                    what = {"manifest_digest": "the prepared data (evaluation sizes or files)"}.get(
                        key, key.replace("_sha256", ".py")
                    )
                    out.append(f"{what} differs from the session's")
                else:
                    unit = "s" if key == "budget" else ""
                    out.append(
                        f"{key} {old:g}{unit} (now {new:g}{unit})" if key == "budget" else f"{key} {old} (now {new})"
                    )
        start, head = pinned["start_commit"], self.repo.head.commit.hexsha
        if head != start:
            moved = [
                f
                for f in ("train.py", "prepare.py")
                if gitops.blob_sha(self.repo, start, f) != gitops.blob_sha(self.repo, head, f)
            ]
            if moved:
                out.append(f"{' and '.join(moved)} changed since the session started (HEAD {start[:7]} -> {head[:7]})")
        return out

    def resume(self) -> State:
        """Rebuild the state from the records; set half-finished experiments aside; put the branch at the best.
        SessionChanged if the session was started with other settings, data or train.py."""
        kill_orphan(read_status(self.paths))  # first: whatever follows, nothing of a killed controller runs on
        session = self.paths.session
        if session.exists():
            pinned = json.loads(session.read_text())
            if changes := self.differences(pinned):
                if load_records(self.paths):
                    raise SessionChanged(self.settings.tag, changes)
                self.echo(
                    f"autoloop: session {self.settings.tag} recorded nothing yet; it starts again from HEAD "
                    f"with these settings ({'; '.join(changes)})"
                )
                session.unlink()
                gitops.reset_to(self.wt, self.repo.head.commit.hexsha)
        if session.exists():
            start_commit = pinned["start_commit"]
        else:
            start_commit = self.wt.head.commit.hexsha
            env = {k: v for k, v in self.env.items() if k in SESSION_ENV}  # what `autoloop report` evaluates with
            write_json_atomic(
                session,
                {
                    "start_commit": start_commit,
                    "tag": self.settings.tag,
                    "prepare_sha256": self.prepare_sha,
                    "manifest_digest": self.manifest_digest,
                    "pin": self.pin(),
                    "env": env,
                    "artifacts": bool(self.info and self.info.artifacts),
                    "evaluator": self.info.evaluator if self.info else "",
                    "created": time.time(),
                },
            )
        state = replay(load_records(self.paths), start_commit)
        if not self.paths.spend.exists():  # a session from before the spend ledger: what its records carry
            tokens, cost = state.usage()
            self.spend.add({"total_tokens": tokens, "cost": cost}, "recorded before the spend ledger")
        for run_dir in self.paths.runs.iterdir():
            if run_dir.name.isdigit() and int(run_dir.name) > state.done:
                dest = self.paths.state / "incomplete" / f"{run_dir.name}-{int(time.time())}"
                dest.parent.mkdir(parents=True, exist_ok=True)
                (run_dir / "model.pt").unlink(missing_ok=True)  # logs are kept for a look; models are large
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
        scorer = self.paths.worktree / "evaluate.py"
        if self.evaluate_sha and (not scorer.exists() or harness.sha256_file(scorer) != self.evaluate_sha):
            problems.append("evaluate.py differs from the one pinned at session start")
        if self.info and self.info.manifest is not None:
            problems += harness.verify(self.info.manifest)
            if harness.manifest_digest(self.info.manifest) != self.manifest_digest:
                problems.append("the manifest (evaluation sizes, file hashes) changed since session start")
        return problems

    def restore_harness(self) -> None:
        """After a run changed the harness: the pinned prepare.py checked out again and the data prepared again
        from scratch, so the next run is fine; LoopError if that does not make it verify."""
        try:
            gitops.reset_to(self.wt, self.wt.head.commit.hexsha)
        except Exception as e:  # noqa: BLE001 - git failing here is the end of the night, said clearly
            raise LoopError(
                f"a run changed the pinned harness and it could not be restored ({e}); restore "
                f"{self.paths.worktree} (git -C {self.paths.worktree} reset --hard), then run the same "
                "command to resume"
            ) from None
        if (
            self.info
            and self.info.manifest is not None
            and (
                harness.verify(self.info.manifest)
                or harness.manifest_digest(self.info.manifest) != self.manifest_digest
            )
        ):
            harness.prepare(self.paths.worktree, self.env, self.echo, force=True)
        if problems := self.integrity_problems():
            raise LoopError(
                f"the prepared harness does not verify after preparing it again ({'; '.join(problems)}); "
                "re-run `python prepare.py --force`, then the same autoloop command to resume"
            )

    def record(self, record: Record, state: State) -> None:
        """Write one decided run: record.json, then the fsync'd row, then the branch (in that order, for resume);
        keep the saved models of the baseline and the best only. The record is cleaned first (in place: the
        console, the trackers and the proposer see it so too)."""
        record.ended = time.time()
        redaction.record(record)  # what the run said (its crash, its summary) without a secret of ours
        write_record(self.paths.run_dir(record.n), record)
        append_row(self.paths.ledger, row_of(record))
        previous = {state.best_run, state.baseline_run}
        state.add(record)
        for n in {record.n, *previous} - {state.baseline_run, state.best_run}:
            if n:
                (self.paths.run_dir(n) / "model.pt").unlink(missing_ok=True)
        if "queue_id" in record.info:
            self.queue.mark_done(record.info["queue_id"], self.settings.tag, record.n)
        gitops.reset_to(self.wt, state.best_commit)
        spread = state.spread()
        self.processes.ended(record.slot or 0, phase="idle", last=record.n, sigma=spread.sd, sigma_dof=spread.dof)


class SessionChanged(LoopError):
    """The session under this tag was started with other settings, data or train.py."""

    def __init__(self, tag: str, differences: list[str]):
        super().__init__(
            f"session {tag!r} was started with other settings: {'; '.join(differences)}. Its results "
            f"would not be comparable: run with the session's settings to resume it, or start a new "
            f"session (--tag {tag}-2, or leave out --tag to get a fresh one)"
        )
        self.tag, self.differences = tag, differences
