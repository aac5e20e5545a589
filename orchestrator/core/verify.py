"""`autoloop verify`: which of the kept changes matter, and does the stack hold at a longer budget?

Three phases, each decided from the verification's own runs (records under .autoloop/<tag>/verify/runs/, so a
resume after Ctrl-C repeats nothing finished):

1. Leave-one-out ablation: for each kept change, the best with that change reverted (on top of the best; a
   revert that conflicts with a later change is made together with it: "entangled with #k"), run alongside
   fresh runs of the best. A change *matters* when the best beats its ablation by the gate's test (Welch's t,
   the session's false-keep rate spent evenly over --max-repeats looks); it has *no measurable contribution*
   when, after MIN_LOOKS runs or more, the t is not above the gate's futility bound, or at the last look.
2. The minimal stack: the best without the changes of no measurable contribution, measured the same way;
   when it is not worse, the branch autoloop/<tag>-minimal.
3. Transfer: the baseline, the best (and the minimal stack) at the session's budget and at --transfer times it,
   each run's saved model scored on the held-out split (a harness without saved models: val_bpb); the
   improvement at each budget and a verdict: holds, shrinks, reverses.

The result is verify.json beside holdout.json; report, status and the trackers read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import LoopError
from ..executors import Executor, Handle, Slot, wait_any
from ..store import gitops
from ..store.ledger import Record, read_record, write_json_atomic, write_record
from ..store.session import write_status
from ..trust import harness, redaction
from . import holdout
from .noise import FUTILITY, Gate, samples, t_quantile, welch
from .progress import format_eta
from .state import State, counts
from .trial import build_job, learned_startup, measure_safely, stop_handles, submit

if TYPE_CHECKING:
    from .workspace import Workspace

MIN_LOOKS = 3  # runs of an ablation before it may be called "no measurable contribution" (2 before "matters")
TICK_S = 1.0


@dataclass
class Config:
    """One configuration the verification measures: a commit at a budget."""

    key: str  # best | baseline | without-<n> | minimal, and <key>@<factor>x for the transfer
    commit: str
    budget: float
    what: str  # what the console and the report call it
    removed: list[int] = field(default_factory=list)  # the kept changes (their runs' numbers) it reverts
    held_out: bool = False  # each run's saved model is also scored on the held-out split


@dataclass
class Change:
    n: int  # the run that kept it (0: a commit of the branch no record names)
    commit: str
    parent: str
    description: str


@dataclass
class Plan:
    tag: str
    best: str
    baseline: str
    budget: float
    factor: float  # transfer budget / session budget (0: no transfer)
    changes: list[Change]
    configs: dict[str, Config]
    notes: dict[str, str] = field(default_factory=dict)  # change n (as str) -> why it could not be ablated alone

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        data = dict(data)
        data["changes"] = [Change(**c) for c in data["changes"]]
        data["configs"] = {k: Config(**c) for k, c in data["configs"].items()}
        return cls(**data)


# ---------------------------------------------------------------------------------------------------------------
# The plan: the kept changes and the configurations that ablate them


def kept_changes(ws: Workspace, state: State) -> list[Change]:
    """The commits between the session's start and its best, oldest first (the branch holds kept commits only),
    each named by the run that kept it."""
    baseline = next(r.commit for r in state.records if r.n == state.baseline_run)  # run 1's commit (no change)
    commits = ws.repo.git.rev_list("--first-parent", "--reverse", f"{baseline}..{state.best_commit}")
    by_commit = {r.commit: r for r in state.records if (r.gate.decision or r.status) == "keep"}
    changes = []
    for commit in commits.split():
        parent = ws.repo.commit(commit).parents[0].hexsha
        record = by_commit.get(commit)
        description = record.description if record else str(ws.repo.commit(commit).summary)
        changes.append(Change(record.n if record else 0, commit, parent, description))
    return changes


def revert(ws: Workspace, base: str, changes: list[Change], message: str) -> str | None:
    """A commit of `base` with these changes reverted (latest first), or None when a revert does not apply. Kept
    alive by a ref (refs/autoloop/<tag>/verify/...): nothing else points at it."""
    wt = ws.proposal_worktree(base)
    for change in sorted(changes, key=lambda c: -c.n):
        # a three-way merge, else without context: edits of neighbouring lines (two constants) do not conflict
        patch, patch_u0 = (
            gitops.diff(wt, change.commit, change.parent),
            gitops.diff(wt, change.commit, change.parent, 0),
        )
        if gitops.carry_over(wt, patch, patch_u0):
            gitops.checkout_clean(wt, base)
            return None
        gitops.commit_all(wt, f"{message} (revert of {change.commit[:7]})")
    commit = wt.head.commit.hexsha
    ws.repo.git.update_ref(f"refs/autoloop/{ws.settings.tag}/verify/{commit[:12]}", commit)
    return commit


def make_plan(ws: Workspace, state: State, factor: float) -> Plan:
    changes = kept_changes(ws, state)
    baseline = next(r.commit for r in state.records if r.n == state.baseline_run)
    budget = ws.settings.budget
    configs = {"best": Config("best", state.best_commit, budget, "the best", held_out=True)}
    notes = {}
    for i, change in enumerate(changes):
        label = f"#{change.n}" if change.n else change.commit[:7]
        commit = revert(ws, state.best_commit, [change], f"autoloop {ws.settings.tag} verify: without {label}")
        removed = [change]
        if commit is None:  # entangled: reverted together with a later change it conflicts with
            for later in changes[i + 1 :]:
                commit = revert(ws, state.best_commit, [change, later], f"autoloop verify: without {label}")
                if commit is not None:
                    removed = [change, later]
                    notes[str(change.n)] = f"entangled with #{later.n}: ablated together"
                    break
        if commit is None:
            notes[str(change.n)] = "its revert conflicts with the later changes: not ablated"
            continue
        what = f"without {label} ({change.description[:60]})" + (f" and #{removed[1].n}" if len(removed) > 1 else "")
        configs[f"without-{change.n}"] = Config(f"without-{change.n}", commit, budget, what, [c.n for c in removed])
    return Plan(ws.settings.tag, state.best_commit, baseline, budget, factor, changes, configs, notes)


# ---------------------------------------------------------------------------------------------------------------
# Decisions: a pure function of the plan and the runs so far


@dataclass
class Verdict:
    decision: str  # matters | none (no measurable contribution) | undecided
    delta: float | None = None  # ablated mean - best mean: the change's contribution (positive: it helps)
    se: float | None = None
    t: float | None = None
    runs: int = 0
    best_runs: int = 0
    # the figures of all the runs, where runs after the deciding look (the best's, made for another comparison)
    # moved them: the verdict stands on the look that made it, and reads with that look's figures
    latest: Verdict | None = None


def values(records: list[Record], key: str, metric: str = "val") -> list[float]:
    """The measured values of one configuration's runs (val_bpb, or the held-out bits per byte)."""
    out = []
    for r in records:
        if r.info.get("verify") != key or not counts(r):
            continue
        v = r.bpb if metric == "val" else r.metrics.get("holdout_bpb")
        if isinstance(v, (int, float)) and math.isfinite(v):
            out.append(float(v))
    return out


def compare(ablated: list[float], best: list[float], others: list[list[float]], gate: Gate) -> Verdict:
    """Does the best beat this ablation beyond the noise (the change matters), or not (no measurable
    contribution), or is it too early to say?"""
    if not ablated or not best:
        return Verdict("undecided", runs=len(ablated), best_runs=len(best))
    a, b, ref = samples(ablated, best, others)
    delta = a.mean - b.mean
    if ref.var is None:  # nothing to measure the noise with yet (one run each, no other configuration twice)
        return Verdict("undecided", delta, None, None, len(ablated), len(best))
    se, dof = welch(a, b)
    se = max(se, 1e-6)
    t = delta / se
    look = len(ablated)
    verdict = Verdict("undecided", delta, se, t, look, len(best))
    if t > t_quantile(1.0 - gate.alpha / gate.max_repeats, dof) and min(look, len(best)) >= 2:
        verdict.decision = "matters"  # (on two runs of each at least: their own spread, not only the reference)
    elif look >= gate.max_repeats or look >= MIN_LOOKS and t <= FUTILITY[min(look, len(FUTILITY)) - 1]:
        verdict.decision = "none"
    return verdict


def others_for(state: State, records: list[Record], plan: Plan, exclude: set[str], budget: float) -> list[list[float]]:
    """The groups that give the reference spread: the session's configurations, and the verification's own at
    the same budget but those compared."""
    groups = [v for v in state.groups().values() if len(v) >= 2] if budget == plan.budget else []
    for key, config in plan.configs.items():
        if key not in exclude and config.budget == budget and len(v := values(records, key)) >= 2:
            groups.append(v)
    return groups


def first_decision(records: list[Record], keys: set[str], verdict_of: Callable[[list[Record]], Verdict]) -> Verdict:
    """A sequential test's verdict: the decision of the first look that made one (looks: the runs of `keys`, in
    order), with that look's figures, so that verdict and figures read alike (report.md once showed "matters"
    beside +0.190 ± 0.365: a decision of look 2 beside the figures of 6 runs). Later runs (the best's, made for
    another comparison) never change the decision; their figures are its `latest`."""
    final = verdict_of(records)
    for i, r in enumerate(records):
        if r.info.get("verify") in keys and counts(r):
            decided = verdict_of(records[: i + 1])
            if decided.decision != "undecided":
                if (decided.runs, decided.best_runs) != (final.runs, final.best_runs):
                    decided.latest = final
                return decided
    final.decision = "undecided"
    return final


def ablation_verdicts(state: State, records: list[Record], plan: Plan, gate: Gate) -> dict[str, Verdict]:
    def verdict(key: str) -> Verdict:
        return first_decision(
            records,
            {key, "best"},
            lambda recs: compare(
                values(recs, key), values(recs, "best"), others_for(state, recs, plan, {key, "best"}, plan.budget), gate
            ),
        )

    return {key: verdict(key) for key in plan.configs if key.startswith("without-")}


def transfer_repeats(ws: Workspace) -> int:
    return 1 + ws.settings.baseline_repeats if ws.settings.baseline_repeats else 2


def attempts(records: list[Record], key: str) -> int:
    return sum(r.info.get("verify") == key for r in records)


MAX_FAILED = 3  # crashed runs of one configuration (with none measured since) before it is given up on


def given_up(records: list[Record], key: str, metric_name: str = "val") -> bool:
    """Has this configuration crashed MAX_FAILED times more than it measured? (Its runs stop; it is reported.)"""
    return attempts(records, key) - len(values(records, key, metric_name)) >= MAX_FAILED


def next_runs(ws: Workspace, state: State, records: list[Record], plan: Plan) -> list[str]:
    """The configurations to run next (one entry per run; one budget at a time), [] when the verification is
    done. Adds the minimal stack and the transfer configurations to the plan when their phase comes."""
    gate = ws.settings.gate
    verdicts = ablation_verdicts(state, records, plan, gate)
    pending = [k for k, v in verdicts.items() if v.decision == "undecided" and not given_up(records, k)]
    minimal = plan.configs.get("minimal")
    if minimal is not None and minimal.commit and minimal_verdict(state, records, plan, gate).decision == "undecided":
        if not given_up(records, "minimal"):
            pending.append("minimal")
    if pending and not given_up(records, "best"):
        rounds = min(len(values(records, k)) for k in pending)
        todo = [k for k in pending if len(values(records, k)) == rounds]
        if len(values(records, "best")) <= rounds:
            todo.insert(0, "best")
        return todo
    flagged = ",".join(sorted(k for k, v in verdicts.items() if v.decision == "none"))
    if minimal is None or plan.notes.get("flagged") != flagged:  # (planned under an older rule: again)
        for key in [k for k in plan.configs if k.startswith("minimal")]:
            del plan.configs[key]
        plan.notes.pop("minimal", None)
        plan.notes["flagged"] = flagged
        add_minimal(ws, plan, verdicts)
        return next_runs(ws, state, records, plan)
    stacks = {k.split("@")[0] for k in plan.configs if "@" in k}
    if plan.factor and (not stacks or "minimal" not in stacks and minimal.held_out):
        worse = minimal.commit and minimal_verdict(state, records, plan, gate).decision != "none"
        add_transfer(ws, plan, with_minimal=bool(minimal.commit) and not worse)
    repeats = transfer_repeats(ws)
    for budget in sorted({c.budget for c in plan.configs.values() if c.held_out}):
        todo = [
            k
            for k, c in plan.configs.items()
            if c.held_out and c.budget == budget and not given_up(records, k, metric(ws))
            for _ in range(repeats - len(values(records, k, metric(ws))))
        ]
        if todo:
            return todo
    return []


def metric(ws: Workspace) -> str:
    """What the transfer compares: the held-out split where the harness saves models, else val_bpb."""
    return "holdout" if ws.harness_info.artifacts else "val"


def add_minimal(ws: Workspace, plan: Plan, verdicts: dict[str, Verdict]) -> None:
    """The best without every change of no measurable contribution (the latest first; one whose revert does
    not apply is kept, and said so). Nothing flagged: no minimal stack."""
    flagged = [c for c in plan.changes if verdicts.get(f"without-{c.n}", Verdict("")).decision == "none"]
    flagged_n = {n for c in flagged for n in plan.configs[f"without-{c.n}"].removed}
    drop = [c for c in plan.changes if c.n in flagged_n]
    commit, dropped = plan.best, list[int]()
    for change in sorted(drop, key=lambda c: -c.n):
        after = revert(ws, commit, [change], f"autoloop {plan.tag} verify: minimal stack") if commit else None
        if after is not None:
            commit, dropped = after, [*dropped, change.n]
        else:
            plan.notes[str(change.n)] = "flagged, but its revert conflicts once others are dropped: kept"
    if not dropped:
        plan.configs["minimal"] = Config("minimal", "", plan.budget, "the minimal stack (nothing to drop)")
        return
    same = next(  # the tree of an ablation already measured: its runs count
        (
            k
            for k, c in plan.configs.items()
            if k.startswith("without-") and ws.repo.commit(c.commit).tree == ws.repo.commit(commit).tree
        ),
        None,
    )
    what = f"the minimal stack (without {', '.join(f'#{n}' for n in sorted(dropped))})"
    plan.configs["minimal"] = Config("minimal", commit, plan.budget, what, sorted(dropped), held_out=True)
    if same:
        plan.notes["minimal"] = f"the same train.py as {same}: its runs count"
    write_plan(ws, plan)


def minimal_verdict(state: State, records: list[Record], plan: Plan, gate: Gate) -> Verdict:
    config = plan.configs.get("minimal")
    if config is None or not config.commit:
        return Verdict("none")
    same = plan.notes.get("minimal", "")
    key = same.split("as ", 1)[1].split(":")[0] if same.startswith("the same train.py as ") else "minimal"
    keys = {key, "minimal"}

    def verdict_of(recs: list[Record]) -> Verdict:
        runs = [v for k in sorted(keys) for v in values(recs, k)]
        return compare(runs, values(recs, "best"), others_for(state, recs, plan, {*keys, "best"}, plan.budget), gate)

    return first_decision(records, {*keys, "best"}, verdict_of)


def add_transfer(ws: Workspace, plan: Plan, with_minimal: bool) -> None:
    """Baseline, best and (where accepted) the minimal stack, at the session's budget and at factor times it."""
    longer = plan.budget * plan.factor
    if ws.harness_info.time_budget is not None and (
        harness.query(ws.paths.worktree, {**ws.env, "AUTOLOOP_TIME_BUDGET": f"{longer:g}"}).time_budget != longer
    ):
        plan.notes["transfer"] = "this harness fixes its own budget: no transfer to a longer one"
        plan.factor = 0.0
        write_plan(ws, plan)
        return
    minimal = plan.configs["minimal"]
    stacks = [("baseline", plan.baseline, "the baseline"), ("best", plan.best, "the best")]
    if with_minimal:
        stacks.append(("minimal", minimal.commit, minimal.what))
    else:
        minimal.held_out = False  # worse than the best, or nothing dropped: not measured further
    plan.configs["baseline"] = Config("baseline", plan.baseline, plan.budget, "the baseline", held_out=True)
    for key, commit, what in stacks:
        budget = plan.budget * plan.factor
        plan.configs[f"{key}@{plan.factor:g}x"] = Config(
            f"{key}@{plan.factor:g}x", commit, budget, f"{what} at {budget:g}s", held_out=True
        )
    write_plan(ws, plan)


# ---------------------------------------------------------------------------------------------------------------
# Running


def write_plan(ws: Workspace, plan: Plan) -> None:
    write_json_atomic(ws.paths.verify / "plan.json", plan.to_dict())


def load_plan(ws: Workspace, state: State, factor: float) -> Plan:
    """The verification in progress for this best, or a new one (an earlier verification of another best is
    moved aside). Another --transfer factor keeps the runs made so far and plans the longer runs anew."""
    path = ws.paths.verify / "plan.json"
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        plan = Plan.from_dict(json.loads(path.read_text()))
        if plan.best == state.best_commit and plan.budget == ws.settings.budget:
            if factor != plan.factor and "transfer" not in plan.notes:  # another --transfer: its own runs
                plan.configs = {k: c for k, c in plan.configs.items() if "@" not in k}
                plan.factor = factor
                write_plan(ws, plan)
            return plan
        aside = ws.paths.state / f"verify.{time.strftime('%Y%m%d-%H%M%S')}"
        ws.paths.verify.rename(aside)
        ws.echo(f"autoloop: verify: the best moved since the last verification; that one is kept in {aside.name}/")
        with contextlib.suppress(Exception):  # its minimal stack is of another best
            ws.repo.git.update_ref("-d", f"refs/heads/autoloop/{ws.settings.tag}-minimal")
    ws.paths.verify.mkdir(parents=True, exist_ok=True)
    plan = make_plan(ws, state, factor)
    write_plan(ws, plan)
    return plan


def load_runs(ws: Workspace) -> list[Record]:
    """The verification's recorded runs, by number; a run directory without a record (cut short) is removed."""
    root = ws.paths.verify / "runs"
    records = []
    for run_dir in (
        sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)) if root.is_dir() else []
    ):
        record = read_record(run_dir)
        if record is None or record.n != int(run_dir.name):
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)
            continue
        records.append(record)
    return records


@contextlib.contextmanager
def budget_of(ws: Workspace, budget: float) -> Iterator[None]:
    """Runs made inside train for `budget` seconds (their timeout and clock audit follow)."""
    settings, env = ws.settings, dict(ws.env)
    if budget != settings.budget:
        scale = budget / settings.budget
        ws.settings = dataclasses.replace(
            settings, budget=budget, timeout=settings.timeout and settings.timeout * scale
        )
        ws.env["AUTOLOOP_TIME_BUDGET"] = f"{budget:g}"
    try:
        yield
    finally:
        ws.settings, ws.env = settings, env


def run_configs(
    ws: Workspace, executor: Executor, state: State, plan: Plan, keys: list[str], records: list[Record]
) -> None:
    """One generation: each key run once on a slot of its own; each finished run recorded at once."""
    startup = learned_startup(state, plan.budget)
    verify = ws.paths.verify
    protected = ws.protection.snapshot(
        state,
        (verify / "plan.json", ws.paths.verify_json, *(ws.paths.verify_run_dir(r.n) / "record.json" for r in records)),
        hooks=ws.sandbox is None,
    )
    live: list[tuple[Handle, Record, Config, object, Slot]] = []
    n = max((r.n for r in records), default=0)
    budget = plan.configs[keys[0]].budget
    with budget_of(ws, budget):
        try:
            for key, slot in zip(keys, executor.slots):
                config = plan.configs[key]
                n += 1
                run_dir = ws.paths.verify_run_dir(n)
                run_dir.mkdir(parents=True, exist_ok=True)
                record = Record(
                    n=n,
                    status="crash",
                    description=f"verify: {config.what}",
                    commit=config.commit,
                    parent=plan.best,
                    proposer="verify",
                    started=time.time(),
                    info={"verify": key, "budget": budget},
                    slot=slot.index,
                )
                record.gate.decision = "verify"
                wt = gitops.ensure_detached_worktree(ws.repo, ws.paths.slot(slot.index), config.commit)
                gitops.checkout_clean(wt, config.commit)
                job = build_job(ws, gitops.tree(wt), run_dir)
                live.append((submit(ws, executor, job, slot, record), record, config, job, slot))
            status_running(ws, live)
            pending = list(live)
            while pending:
                for item in [p for p in pending if p[0].done()]:
                    pending.remove(item)
                    finish(ws, executor, state, item, startup, protected, records)
                if pending:
                    wait_any([p[0] for p in pending], poll_s=0.05, until=time.monotonic() + TICK_S)
        except BaseException:
            stop_handles([h for h, *_ in live])
            raise


def status_running(ws: Workspace, live: list) -> None:
    write_status(
        ws.paths,
        phase="verifying",
        running=[
            {
                "n": record.n,
                "slot": slot.index,
                "description": record.description,
                "started": record.started,
                "log": str(ws.paths.verify_run_dir(record.n) / "run.log"),
            }
            for _, record, _, _, slot in live
        ],
    )


def finish(ws, executor, state, item, startup, protected, records: list[Record]) -> None:
    handle, record, config, job, slot = item
    result = handle.result()
    crash = None if result.infra_error else measure_safely(ws, record, result, job, startup, True)
    if result.infra_error:
        record.reason, record.phase = f"the executor failed: {result.infra_error}", "train"
    elif problems := ws.integrity_problems():
        record.reason, record.phase = f"the run changed the harness: {'; '.join(problems)}", "audit"
        ws.restore_harness()
    elif touched := ws.protection.touched(protected):
        record.reason, record.phase = f"the run touched what it may not (restored): {', '.join(touched[:5])}", "audit"
    elif crash is not None:
        record.reason, record.phase, record.cause = crash.reason, crash.phase.value, crash.cause.value
    else:
        record.status = "verify"
    if record.status == "crash":
        record.val_bpb = None
    run_dir = ws.paths.verify_run_dir(record.n)
    if record.status == "verify" and config.held_out and ws.harness_info.artifacts:
        value, why = holdout.evaluate(ws, executor, config.commit, run_dir / "model.pt", run_dir / "holdout")
        if value is None:
            record.info["holdout_error"] = why
        else:
            record.metrics["holdout_bpb"] = value
    (run_dir / "model.pt").unlink(missing_ok=True)
    record.ended = time.time()
    redaction.record(record)
    write_record(run_dir, record)
    records.append(record)
    ws.processes.ended(slot.index, phase="verifying")
    shown = f"{record.val_bpb:.6f}" if record.val_bpb is not None else "crash"
    held = record.metrics.get("holdout_bpb")
    ws.echo(
        f"verify {record.n:>3}  {config.commit[:7]}  {shown:>9}"
        + (f"  held-out {held:.6f}" if isinstance(held, float) else "")
        + f"  {config.what}"
        + (f"  [{record.reason}]" if record.reason else "")
    )


# ---------------------------------------------------------------------------------------------------------------
# The result


def summary(ws: Workspace, state: State, records: list[Record], plan: Plan, complete: bool) -> dict:
    gate = ws.settings.gate
    verdicts = ablation_verdicts(state, records, plan, gate)
    changes = []
    for change in plan.changes:
        key = f"without-{change.n}"
        v = verdicts.get(key)
        changes.append(
            {
                "n": change.n,
                "commit": change.commit[:7],
                "description": change.description,
                "verdict": (
                    "not ablated"
                    if v is None
                    else {"matters": "matters", "none": "no measurable contribution"}.get(v.decision, "undecided")
                ),
                "contribution": v.delta if v else None,
                "se": v.se if v else None,
                "t": v.t if v else None,
                "runs": v.runs if v else 0,
                "best_runs": v.best_runs if v else 0,
                **latest_figures(v),
                "removed_with": [n for n in plan.configs[key].removed if n != change.n] if v else [],
                "note": plan.notes.get(str(change.n), ""),
            }
        )
    out: dict = {
        "tag": plan.tag,
        "best_commit": plan.best[:7],
        "budget": plan.budget,
        "complete": complete,
        "changes": changes,
        "runs": len(records),
        "crashes": sum(r.status == "crash" for r in records),
        "train_seconds": sum(float(r.timings.get("train", 0.0)) for r in records),
        "minimal": None,
        "transfer": None,
    }
    minimal = plan.configs.get("minimal")
    if minimal is not None:
        m = minimal_verdict(state, records, plan, gate)
        accepted = bool(minimal.commit) and m.decision == "none"
        out["minimal"] = {
            "commit": minimal.commit[:7] if minimal.commit else None,
            "dropped": minimal.removed,
            "verdict": (
                "nothing to drop"
                if not minimal.commit
                else "not worse: kept as the minimal stack"
                if accepted
                else "worse than the best: the dropped changes matter together"
                if m.decision == "matters"
                else "undecided"
            ),
            "delta": m.delta,
            "se": m.se,
            "branch": f"autoloop/{plan.tag}-minimal" if accepted and complete else None,
        }
    if plan.factor or "transfer" in plan.notes:
        out["transfer"] = transfer_table(ws, records, plan)
    return out


def latest_figures(v: Verdict | None) -> dict:
    """The figures of all the runs, where later runs moved them past the deciding look (summary's "latest")."""
    if v is None or v.latest is None or v.latest.delta is None:
        return {}
    late = v.latest
    return {"latest": {"contribution": late.delta, "se": late.se, "runs": late.runs, "best_runs": late.best_runs}}


def later_text(late: dict) -> str:
    """How the console and report.md show a verdict's later figures (summary's "latest")."""
    return f"with all {late['best_runs']} runs of the best: {late['contribution']:+.6f} ± {late['se']:.6f}"


def transfer_table(ws: Workspace, records: list[Record], plan: Plan) -> dict:
    if "transfer" in plan.notes:
        return {"skipped": plan.notes["transfer"]}
    what = metric(ws)
    rows = []
    verdicts = {}
    for factor in (1.0, plan.factor):
        suffix = "" if factor == 1.0 else f"@{plan.factor:g}x"
        base = values(records, "baseline" + suffix, what)
        row: dict = {"budget": plan.budget * factor, "baseline": _mean(base), "baseline_runs": len(base)}
        for stack in ("best", "minimal"):
            if stack + suffix not in plan.configs or not plan.configs[stack + suffix].held_out:
                continue
            runs = values(records, stack + suffix, what)
            d, se = improvement(base, runs)
            row[stack] = {"mean": _mean(runs), "runs": len(runs), "improvement": d, "se": se}
        rows.append(row)
    for stack in ("best", "minimal"):
        if all(stack in r for r in rows) and all(r[stack]["improvement"] is not None for r in rows):
            short, long = rows[0][stack], rows[1][stack]
            verdicts[stack] = transfer_verdict(short["improvement"], short["se"], long["improvement"], long["se"])
    return {
        "metric": "held-out bpb" if what == "holdout" else "val_bpb",
        "factor": plan.factor,
        "rows": rows,
        "verdicts": verdicts,
    }


def _mean(v: list[float]) -> float | None:
    return statistics.fmean(v) if v else None


def improvement(base: list[float], runs: list[float]) -> tuple[float | None, float | None]:
    """Baseline mean minus the stack's, with its standard error (each side's own spread)."""
    if not base or not runs:
        return None, None
    d = statistics.fmean(base) - statistics.fmean(runs)
    var = sum(statistics.variance(v) / len(v) for v in (base, runs) if len(v) >= 2)
    return d, math.sqrt(var) if var else None


def transfer_verdict(d1: float, se1: float | None, d3: float, se3: float | None) -> str:
    """holds: still an improvement, not clearly smaller; shrinks: clearly smaller, or no longer clear of noise;
    reverses: worse than the baseline at the longer budget."""
    se = math.sqrt((se1 or 0.0) ** 2 + (se3 or 0.0) ** 2)
    if d3 <= 0:
        return "reverses"
    if d3 < d1 - 2 * se or (se3 is not None and d3 < 2 * se3):
        return "shrinks"
    return "holds"


def finish_minimal(ws: Workspace, result: dict, plan: Plan) -> None:
    minimal = result.get("minimal") or {}
    if minimal.get("branch"):
        commit = plan.configs["minimal"].commit
        ref = f"refs/heads/{minimal['branch']}"
        ws.repo.git.update_ref(ref, commit)
        gitops.guard_of(ws.repo).expect_ref(ref, commit)


def text(result: dict) -> list[str]:
    """The console's and report's lines for a verification."""
    lines = []
    for c in result["changes"]:
        d = c["contribution"]
        fig = f"{d:+.6f} ± {c['se']:.6f}" if d is not None and c["se"] is not None else "-"
        extra = f"; {c['note']}" if c["note"] else ""
        runs = f"{c['runs']} run{'s' * (c['runs'] != 1)}"
        if (late := c.get("latest")) and late.get("se") is not None:
            extra += f"; decided on those runs; {later_text(late)}"
        lines.append(f"#{c['n']} {c['description'][:60]}: contribution {fig} ({runs}): {c['verdict']}{extra}")
    m = result.get("minimal")
    if m:
        lines.append(
            f"minimal stack: {m['verdict']}"
            + (f" (dropped {', '.join(f'#{n}' for n in m['dropped'])})" if m["dropped"] else "")
            + (f"; branch {m['branch']}" if m.get("branch") else "")
        )
    t = result.get("transfer")
    if t and "skipped" in t:
        lines.append(f"transfer: {t['skipped']}")
    elif t:
        for row in t["rows"]:
            parts = [
                f"{stack} {row[stack]['improvement']:+.6f}" + (f" ± {row[stack]['se']:.6f}" if row[stack]["se"] else "")
                for stack in ("best", "minimal")
                if stack in row and row[stack]["improvement"] is not None
            ]
            lines.append(f"transfer at {row['budget']:g}s ({t['metric']} improvement): {', '.join(parts) or '-'}")
        for stack, verdict in t["verdicts"].items():
            lines.append(f"transfer of the {stack}: {verdict}")
    return lines


def estimate(ws: Workspace, state: State, plan: Plan, records: list[Record], slots: int) -> str:
    """The ETA line: the runs left, at least and at most, and their time (from the session's own runs)."""
    walls = [r.ended - r.started for r in state.records if r.ended and r.started and counts(r)]
    per_run = statistics.median(walls) if walls else plan.budget + 30.0
    ablations = sum(k.startswith("without-") for k in plan.configs)
    looks = ws.settings.gate.max_repeats
    repeats = transfer_repeats(ws) if plan.factor else 0
    longer = per_run + (plan.factor - 1) * plan.budget if plan.factor else 0.0
    low = max(0, (ablations + 1) * MIN_LOOKS - len(records)) + repeats  # then the baseline at the budget
    high = max(0, (ablations + 2) * looks - len(records)) + 2 * repeats
    extra = (2 * repeats * longer, 3 * repeats * longer)  # two or three stacks at the longer budget
    return (
        f"autoloop: verify {plan.tag}: {len(plan.changes)} kept change(s), {ablations} to ablate"
        + (f", then the transfer at {plan.factor:g}x the budget" if plan.factor else "")
        + f"; {len(records)} run(s) done, about {low}-{high} to go at the budget"
        + (f" and {2 * repeats}-{3 * repeats} at {plan.budget * plan.factor:g}s" if plan.factor else "")
        + f": ETA {format_eta((low * per_run + extra[0]) / slots)} to {format_eta((high * per_run + extra[1]) / slots)}"
        + f" on {slots} slot(s)"
    )


def verify(ws: Workspace, executor: Executor, state: State, factor: float, echo: Callable[[str], None]) -> dict:
    """Run (or resume) the verification of the session's best; returns what verify.json holds."""
    if not state.best_group or state.best_group == state.baseline_group:
        raise LoopError(f"session {ws.settings.tag} has kept nothing beyond its baseline: there is nothing to verify")
    plan = load_plan(ws, state, factor)
    records = load_runs(ws)
    echo(estimate(ws, state, plan, records, len(executor.slots)))
    for n, note in plan.notes.items():
        if n.isdigit():
            echo(f"autoloop: verify: #{n}: {note}")
    while keys := next_runs(ws, state, records, plan):
        run_configs(ws, executor, state, plan, keys[: len(executor.slots)], records)
        write_json_atomic(ws.paths.verify_json, summary(ws, state, records, plan, complete=False))
        if sum(r.status == "crash" for r in records[-ws.settings.max_crashes :]) >= ws.settings.max_crashes:
            raise LoopError(
                f"the last {ws.settings.max_crashes} verification runs crashed (last: {records[-1].reason}); fix "
                f"the cause (see {ws.paths.verify_run_dir(records[-1].n) / 'run.log'}), then run the same command"
            )
    result = summary(ws, state, records, plan, complete=True)
    finish_minimal(ws, result, plan)
    write_json_atomic(ws.paths.verify_json, result)
    write_status(ws.paths, phase="verified", running=[], train_pid=None, train_pids={})
    for line in text(result):
        echo(f"autoloop: verify: {line}")
    return result


def read_verify(paths) -> dict | None:
    try:
        data = json.loads(Path(paths.verify_json).read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
