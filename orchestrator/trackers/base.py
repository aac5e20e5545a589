"""Experiment trackers (--tracker NAME): the shared part of every backend, and the manager the loop calls.

A backend is a plugin: a Backend subclass registered in the entry-point group autoloop.trackers (the built-ins
mlflow.py, wandb.py, tensorboard.py, one per file; see pyproject.toml) or named as `module:Class`. A session is a
parent run, each experiment a child run (or, in TensorBoard, a step of the session's run).

A tracker is a mirror, never a dependency of the night: one that fails (a server down, a library missing)
warns once and is switched off, and the loop goes on. The libraries are imported lazily (extras `mlflow`,
`wandb`, `tensorboard`), and their local files default to .autoloop/ (never your repo's root, which the loop
keeps clean).

Every tracker logs the same facts of an experiment (`describe`): train.py's constants at its commit and which
of them changed from its parent's, the summary metrics, the training-loss curve from its log, the gate's
decision, the proposer's cost, and the diff of train.py. A resumed session continues the same parent run:
.autoloop/<tag>/trackers.json keeps each tracker's run ids and the experiments it holds, and `start` logs the
ones it misses (recorded while the tracker was off or failing), so nothing is lost and nothing logged twice.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from git import GitCommandError

from .. import plugins
from ..core.state import State, Status, replay
from ..core.workspace import Workspace
from ..store.hparams import read_constants
from ..store.ledger import Record, write_json_atomic
from ..trust.summary import read_run_file

# train.py's progress line: "step 00042 (12.5%) | loss: 5.123456 | dt: ...", the loss smoothed and debiased
_STEP = re.compile(r"^step (\d+)\b[^\n]*?\bloss: ([^\s|]+)", re.MULTILINE)


@dataclass
class Experiment:
    """One recorded experiment, as every tracker logs it."""

    n: int
    name: str  # "7: MATRIX_LR 0.04 -> 0.0512"
    crashed: bool
    params: dict[str, object]  # train.py's constants at the experiment's commit (the active profile's values)
    changed: list[str]  # the constants whose value differs from the parent commit's
    metrics: dict[str, float]  # val_bpb, the summary block's numbers, tokens_per_s, memory_gb, seconds
    curve: list[tuple[int, float]]  # (step, training loss) from the run's log
    tags: dict[str, str]  # status, description, commits, the gate's decision, the proposer's info and cost
    diff: str  # git diff parent commit -- train.py
    started: float
    ended: float


def describe(ws: Workspace, record: Record) -> Experiment:
    params = constants(ws, record.commit)
    before = constants(ws, record.parent) if record.parent and record.parent != record.commit else params
    changed = [name for name, value in params.items() if before.get(name) != value]
    return Experiment(
        record.n,
        f"{record.n}: {record.description}"[:250],
        record.status == Status.CRASH,
        params,
        changed,
        metrics_of(record),
        loss_curve(ws.paths.run_dir(record.n) / "run.log"),
        tags_of(record, changed),
        diff_of(ws, record),
        record.started,
        record.ended,
    )


def constants(ws: Workspace, commit: str) -> dict[str, object]:
    """train.py's constants at `commit` ({} if it does not parse: a failed idea's may not)."""
    if not commit:
        return {}
    try:
        return {c.name: c.value for c in read_constants(ws.repo.git.show(f"{commit}:train.py"), ws.profile)}
    except (GitCommandError, SyntaxError, ValueError):
        return {}


def diff_of(ws: Workspace, record: Record) -> str:
    if not record.parent or not record.commit or record.parent == record.commit:
        return ""  # the baseline, or a run again of a commit that ran before
    try:
        diff = ws.repo.git.diff(record.parent, record.commit, "--", "train.py")
    except GitCommandError:
        return ""
    return diff + "\n" if diff else ""


def metrics_of(record: Record) -> dict[str, float]:
    """The summary block's numbers, with the val_bpb the loop judged (under the controller train.py prints nan
    and the harness measures it), tokens per second, memory in GB, and seconds per phase and in all."""
    metrics = {"val_bpb": record.val_bpb} if record.val_bpb is not None else {}  # first: UIs default to the first
    metrics.update(
        {
            k: float(v)
            for k, v in record.metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "val_bpb"
        }
    )
    if metrics.get("training_seconds") and "total_tokens_M" in metrics:
        metrics["tokens_per_s"] = metrics["total_tokens_M"] * 1e6 / metrics["training_seconds"]
    if "peak_vram_mb" in metrics:
        metrics["memory_gb"] = metrics["peak_vram_mb"] / 1024
    if record.started and record.ended:
        metrics["wall_seconds"] = record.ended - record.started
    metrics.update({f"seconds_{phase}": float(s) for phase, s in record.timings.items() if isinstance(s, (int, float))})
    return metrics


LOG_BYTES = 4 << 20  # the start of a run's log read for its loss curve (progress lines come early)


def loss_curve(log: Path) -> list[tuple[int, float]]:
    """(step, loss) of each progress line train.py printed (about one a second); [] without a log. The log is
    read as any file a run could have replaced: a link or a FIFO in its place is not followed, at most 4 MiB."""
    data = read_run_file(log, LOG_BYTES, tail=False)
    if data is None:
        return []
    text = data.decode(errors="replace")
    curve = []
    for step, loss in _STEP.findall(text):
        try:
            value = float(loss)
        except ValueError:
            continue
        if math.isfinite(value):
            curve.append((int(step), value))
    return curve


def tags_of(record: Record, changed: list[str]) -> dict[str, str]:
    usage = record.info.get("usage") or {}
    tags = {
        "n": record.n,
        "status": record.status,
        "description": record.description,
        "commit": record.commit,
        "parent_commit": record.parent,
        "changed": ", ".join(changed),
        "proposer": record.proposer,
        "device": record.device,
        "reason": record.reason,
        "phase": record.phase,
        "cause": record.cause,
        "decision": record.gate.decision or None,
        **{f"gate.{k}": v for k, v in record.gate.to_dict().items() if k != "decision"},
        **{f"info.{k}": v for k, v in record.info.items() if isinstance(v, (str, int, float, bool))},
    }
    if usage:  # what the proposer's LLM or agent cost for this idea
        tags.update(llm_tokens=usage.get("total_tokens", 0), llm_cost_usd=usage.get("cost", 0.0))
    return {k: str(v)[:5000] for k, v in tags.items() if v not in ("", None)}


def session_params(ws: Workspace, state: State) -> dict[str, object]:
    """What the session is pinned to (session.json): the same on every resume, so a parent run's params hold."""
    return {**ws.pin(), "tag": ws.settings.tag, "start_commit": state.start_commit}


class Backend:
    """One tracker. `saved` is its part of trackers.json (run ids, `logged`): what a resume continues from.

    `name` is what --tracker called it (the manager sets it); `extra` is the autoloop-ml extra that installs the
    library it imports, so that an ImportError's warning says the pip command."""

    name, extra = "", ""

    def __init__(self, ws: Workspace, saved: dict):
        self.ws, self.everywhere, self.saved = ws, saved, saved
        self.note = ""  # said once on the console after open (e.g. a store other than last time's)

    def store(self, key: str) -> None:
        """Make `saved` the part of trackers.json for this store (a tracking URI, a project): a session mirrored
        to several stores over its resumes continues in each, and never logs an experiment twice in one."""
        stores = self.everywhere.setdefault("stores", {})
        if "logged" in self.everywhere:  # trackers.json as written before stores were kept apart
            old = {k: self.everywhere.pop(k) for k in list(self.everywhere) if k != "stores"}
            stores.setdefault(old.get("uri") or old.get("project") or "", old)
        before = [k for k in stores if k != key]
        if key not in stores and before:
            self.note = (
                f"--tracker {self.name} now logs to {key} (this session was mirrored to {before[-1]} "
                "before); the whole session is logged there"
            )
        self.saved = stores.setdefault(key, {})

    def open(self, state: State) -> None:
        """Open the session's parent run, or continue the one in `saved`."""

    def log(self, experiment: Experiment, state: State) -> None:
        """One experiment as a child run; `state` is the session just after it."""

    def close(self, state: State, stop: str, files: list[Path]) -> None:
        """The end of this invocation: the report's files attached, the parent run closed."""

    def explain(self, error: Exception) -> str:
        """What failed, in a few words (the warning's first half)."""
        return one_line(error)

    def fix(self) -> str:
        """How to make a failing tracker work (the warning's second half)."""
        return ""


def session_totals(ws: Workspace, state: State) -> dict[str, object]:
    """The session's counts, baseline, spend (the proposer's every request, from the spend ledger) and what it
    bought with its compute (`autoloop report`'s improvement per training hour and ideas judged per hour): the
    parent run's tags (MLflow), summary (W&B) or text (TensorBoard); its metrics are the series val_bpb and
    best_val_bpb by experiment. `holdout_disagrees`: the warning when the held-out check disagrees with
    validation beyond the noise (core/holdout.py: disagreement), absent when it agrees."""
    from ..core.holdout import disagreement
    from ..views.report import read_holdout, read_verify, value  # pandas: only when a tracker is on

    counts = {s.value: sum(r.status == s for r in state.records) for s in Status}
    holdout = read_holdout(ws.paths)
    sigma = state.spread().sd
    flag = disagreement(holdout, sigma)
    contradicted = ",".join(f"#{n}" for n, _ in state.contradicted())  # keeps that later runs showed worse
    return {
        **({"holdout_disagrees": flag} if flag else {}),
        **({"contradicted_keeps": contradicted} if contradicted else {}),
        **verify_totals(read_verify(ws.paths)),
        "experiments": state.done,
        **counts,
        "baseline_val_bpb": state.baseline_bpb,
        "llm_tokens": ws.spend.tokens,
        "llm_cost_usd": ws.spend.cost,
        **value(state, holdout, sigma),
    }  # best_val_bpb: the last of its history


def verify_totals(v: dict | None) -> dict[str, object]:
    """`autoloop verify`'s result as the parent run's tags / summary (none before a verification)."""
    if not v:
        return {}
    out: dict[str, object] = {
        "verify_complete": v.get("complete"),
        "verify_runs": v.get("runs"),
        "verify_no_contribution": ",".join(
            f"#{c['n']}" for c in v["changes"] if c["verdict"] == "no measurable contribution"
        ),
    }
    for c in v["changes"]:
        out[f"verify_contribution_{c['n']}"] = c.get("contribution")
    minimal = v.get("minimal") or {}
    out["verify_minimal_branch"] = minimal.get("branch")
    for stack, verdict in ((v.get("transfer") or {}).get("verdicts") or {}).items():
        out[f"verify_transfer_{stack}"] = verdict
    return {k: val for k, val in out.items() if val not in (None, "")}


class Trackers:
    """The session's trackers, each called behind a guard: the first failure warns and switches it off. A name
    that no plugin answers to is a LoopError naming the choices, before anything is logged."""

    def __init__(self, names: tuple[str, ...], ws: Workspace, echo: Callable[[str], None]):
        self.names, self.ws, self.echo = tuple(dict.fromkeys(names)), ws, echo
        self.classes = {name: plugins.load("tracker", name, Backend) for name in self.names}  # the library: at open
        self.backends: list[Backend] = []
        self.saved: dict = {}

    @property
    def path(self) -> Path:
        return self.ws.paths.state / "trackers.json"

    def start(self, state: State) -> None:
        """Open (or, on a resume, continue) the session's parent run in each tracker, then log the experiments
        it does not hold yet."""
        if not self.names:
            return
        self.saved = self._load()
        for name in self.names:
            backend = self.classes[name](self.ws, self.saved.setdefault(name, {}))
            backend.name = name
            self.backends.append(backend)
            if self._guard(backend, "starting", backend.open, state) and backend.note:
                self.echo(f"autoloop: note: {backend.note}")
        self._save()
        so_far = replay([], state.start_commit)  # the state after each experiment: the parent's running best
        for record in state.records:
            so_far.add(record)
            self.record(record, so_far)

    def record(self, record: Record, state: State) -> None:
        """Log one finished experiment as a child run."""
        missing = [b for b in self.backends if record.n not in b.saved.setdefault("logged", [])]
        if not missing:
            return
        experiment = describe(self.ws, record)
        for backend in missing:
            if self._guard(backend, f"logging experiment {record.n}", backend.log, experiment, state):
                backend.saved["logged"].append(record.n)
        self._save()

    def finish(self, state: State, stop: str) -> None:
        """The end of this invocation: final artifacts (progress.png, report.md) and the parent run closed."""
        if not self.backends:
            return
        files = self._report(state)
        for backend in list(self.backends):
            self._guard(backend, "finishing", backend.close, state, stop, files)
        self.backends = []
        self._save()

    def _report(self, state: State) -> list[Path]:
        """`autoloop report`'s progress.png and report.md, in .autoloop/<tag>/report/ (none before experiment 1)."""
        if not state.records:
            return []
        from ..views.report import write_report  # pandas and matplotlib: only when a tracker is on

        out = self.ws.paths.state / "report"
        try:
            with warnings.catch_warnings():  # matplotlib's notes are no business of the console's
                warnings.simplefilter("ignore")
                write_report(self.ws.paths, self.ws.settings.repo, out)
        except Exception as error:  # noqa: BLE001 - the runs are logged already; the report is a bonus
            self.echo(f"autoloop: warning: the trackers get no report ({one_line(error)}); `autoloop report` makes it")
            return []
        return [out / "progress.png", out / "report.md"]

    def _guard(self, backend: Backend, doing: str, call: Callable, *args) -> bool:
        """Run one tracker call; its first failure warns (what failed, how to fix it) and switches it off."""
        try:
            call(*args)
            return True
        except Exception as error:  # noqa: BLE001 - a tracker is a mirror: whatever it raises, the night goes on
            self.backends.remove(backend)
            fix = (
                f'pip install "autoloop-ml[{backend.extra}]"'
                if isinstance(error, ImportError) and backend.extra
                else backend.fix()
            )
            self.echo(
                f"autoloop: warning: --tracker {backend.name} is off for this run ({doing}: "
                f"{backend.explain(error)}); {fix}"
            )
            return False

    def _load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def _save(self) -> None:
        write_json_atomic(self.path, self.saved)


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
