"""Experiment trackers (--tracker mlflow|wandb): a session is a parent run, each experiment a child run.

A tracker is a mirror, never a dependency of the night: one that fails (a server down, a library missing)
warns once and is switched off, and the loop goes on. The backends are imported lazily (extras `mlflow`,
`wandb`), and their local files default to .autoloop/ (never your repo's root, which the loop keeps clean).

Every tracker logs the same facts of an experiment (`describe`): train.py's constants at its commit and which
of them changed from its parent's, the summary metrics, the training-loss curve from its log, the gate's
decision, the proposer's cost, and the diff of train.py. A resumed session continues the same parent run:
.autoloop/<tag>/trackers.json keeps each tracker's run ids and the experiments it holds, and `start` logs the
ones it misses (recorded while the tracker was off or failing), so nothing is lost and nothing logged twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from git import GitCommandError

from ..store.hparams import read_constants
from ..store.ledger import Record, write_json_atomic
from ..core.state import State, Status, replay
from ..core.workspace import Workspace

TRACKERS = ("mlflow", "wandb")

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
    return Experiment(record.n, f"{record.n}: {record.description}"[:250], record.status == Status.CRASH, params,
                      changed, metrics_of(record), loss_curve(ws.paths.run_dir(record.n) / "run.log"),
                      tags_of(record, changed), diff_of(ws, record), record.started, record.ended)


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
    metrics.update({k: float(v) for k, v in record.metrics.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "val_bpb"})
    if metrics.get("training_seconds") and "total_tokens_M" in metrics:
        metrics["tokens_per_s"] = metrics["total_tokens_M"] * 1e6 / metrics["training_seconds"]
    if "peak_vram_mb" in metrics:
        metrics["memory_gb"] = metrics["peak_vram_mb"] / 1024
    if record.started and record.ended:
        metrics["wall_seconds"] = record.ended - record.started
    metrics.update({f"seconds_{phase}": float(s) for phase, s in record.timings.items() if isinstance(s, (int, float))})
    return metrics


def loss_curve(log: Path) -> list[tuple[int, float]]:
    """(step, loss) of each progress line train.py printed (about one a second); [] without a log."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
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
    tags = {"n": record.n, "status": record.status, "description": record.description, "commit": record.commit,
            "parent_commit": record.parent, "changed": ", ".join(changed), "proposer": record.proposer,
            "device": record.device, "reason": record.reason, "phase": record.phase, "cause": record.cause,
            "decision": record.gate.get("decision"),
            **{f"gate.{k}": v for k, v in record.gate.items() if k != "decision"},
            **{f"info.{k}": v for k, v in record.info.items() if isinstance(v, (str, int, float, bool))}}
    if usage:  # what the proposer's LLM or agent cost for this idea
        tags.update(llm_tokens=usage.get("total_tokens", 0), llm_cost_usd=usage.get("cost", 0.0))
    return {k: str(v)[:5000] for k, v in tags.items() if v not in ("", None)}


def session_params(ws: Workspace, state: State) -> dict[str, object]:
    """What the session is pinned to (session.json): the same on every resume, so a parent run's params hold."""
    return {**ws.pin(), "tag": ws.settings.tag, "start_commit": state.start_commit}


class Backend:
    """One tracker. `saved` is its part of trackers.json (run ids, `logged`): what a resume continues from."""

    name = ""

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
            self.note = (f"--tracker {self.name} now logs to {key} (this session was mirrored to {before[-1]} "
                         "before); the whole session is logged there")
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


class MLflow(Backend):
    """The session is a parent run named by its tag, in experiment $MLFLOW_EXPERIMENT_NAME (default
    autoloop-<repo directory>); each experiment is a child run (tag mlflow.parentRunId) named "n: description".

    Tracking URI: $MLFLOW_TRACKING_URI (a server: http://host:5000), else sqlite:///<repo>/.autoloop/mlflow.db
    with artifacts in .autoloop/mlartifacts, as mlflow's own default (./mlflow.db) would land in your repo; see it
    with `mlflow ui --backend-store-uri sqlite:///.autoloop/mlflow.db`. MlflowClient with explicit run ids: no
    fluent active-run state to leak into other code."""

    name, uri = "mlflow", ""
    # mlflow retries a failing request for minutes by default: a server that is down must cost seconds, once; and
    # it prints two "View run ... at" lines per run to stdout, on the loop's quiet console
    ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}

    def open(self, state: State) -> None:
        for key, value in self.ENV.items():
            os.environ.setdefault(key, value)  # yours win
        from mlflow import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # after its import: no INFO lines (creating tables)

        local = self.ws.settings.repo.resolve() / ".autoloop"
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{local / 'mlflow.db'}"
        self.client = MlflowClient(self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or f"autoloop-{self.ws.settings.repo.resolve().name}"
        found = self.client.get_experiment_by_name(name)
        self.experiment = found.experiment_id if found else self.client.create_experiment(
            name, artifact_location=None if os.environ.get("MLFLOW_TRACKING_URI") else (local / "mlartifacts").as_uri())
        self.store(f"{self.uri} (experiment {name})")
        if self._active(self.saved.get("parent")):
            self.client.update_run(self.saved["parent"], status="RUNNING")
            self._drop_half_logged()
        else:  # a new session, or a store that lost it: everything is logged there
            self.saved.clear()
            self.saved.update(uri=self.uri, parent=self._new_parent(state), logged=[])

    def _active(self, run_id: str | None) -> bool:
        from mlflow.exceptions import MlflowException

        if not run_id:
            return False
        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return False

    def _new_parent(self, state: State) -> str:
        from mlflow.entities import Param

        s = self.ws.settings
        run = self.client.create_run(self.experiment, run_name=s.tag, tags={
            "mlflow.note.content": f"autoloop session {s.tag}: branch autoloop/{s.tag} of {s.repo.resolve()}",
            "branch": f"autoloop/{s.tag}", "proposer": s.proposer, "executor": s.executor})
        params = [Param(k, str(v)) for k, v in session_params(self.ws, state).items()]
        self.client.log_batch(run.info.run_id, params=params)
        return run.info.run_id

    def _drop_half_logged(self) -> None:
        """A child run the controller was killed while logging is deleted: `start` logs that experiment again."""
        parent = self.saved["parent"]
        for run in self.client.search_runs([self.experiment], f"tags.mlflow.parentRunId = '{parent}'",
                                           max_results=1000):
            if int(run.data.tags.get("n", 0)) not in self.saved["logged"]:
                self.client.delete_run(run.info.run_id)

    def log(self, e: Experiment, state: State) -> None:
        from mlflow.entities import Metric, Param

        t = int(e.ended * 1000)
        run_id = self.client.create_run(self.experiment, start_time=int(e.started * 1000) or None, run_name=e.name,
                                        tags={"mlflow.parentRunId": self.saved["parent"],
                                              "mlflow.note.content": e.tags.get("description", ""), **e.tags}
                                        ).info.run_id
        metrics = [Metric(k, v, t, 0) for k, v in e.metrics.items()]
        metrics += [Metric("train_loss", loss, t, step) for step, loss in e.curve]
        self.client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in e.params.items()])
        if e.diff:
            self.client.log_text(run_id, e.diff, "train.py.diff")
        self.client.set_terminated(run_id, "FAILED" if e.crashed else "FINISHED", end_time=t)
        progress = {"val_bpb": e.metrics.get("val_bpb"), "best_val_bpb": state.best_bpb}
        self.client.log_batch(self.saved["parent"],
                              metrics=[Metric(k, v, t, e.n) for k, v in progress.items() if v is not None])

    def close(self, state: State, stop: str, files: list[Path]) -> None:
        from mlflow.entities import RunTag

        parent = self.saved["parent"]
        for path in files:
            self.client.log_artifact(parent, str(path))
        totals = {**session_totals(self.ws, state), "stop": stop, "best_commit": state.best_commit}
        self.client.log_batch(parent, tags=[RunTag(k, str(v)) for k, v in totals.items() if v is not None])
        self.client.set_terminated(parent, "KILLED" if stop.startswith("interrupted") else "FINISHED")

    def explain(self, error: Exception) -> str:
        if "Max retries exceeded" in str(error) or "Connection refused" in str(error):
            return f"cannot reach {self.uri}"
        return one_line(error)

    def fix(self) -> str:
        return ("start the MLflow server, or point MLFLOW_TRACKING_URI at one (unset: a local store in .autoloop/); "
                "the experiments it misses are logged when you run the same command again")


class WandB(Backend):
    """One W&B run per experiment (job_type "experiment": train.py's constants as config, the loss curve as
    history, the summary metrics and tags in its summary), all in group <tag>: W&B's usual shape for a search, whose
    runs table, parallel-coordinates and parameter-importance panels compare them. Plus one run per session
    (job_type "session", its id kept in trackers.json and resumed with resume="allow") with val_bpb and the running
    best by experiment number, and, at the end, a table of the experiments, progress.png and report.md.

    Project: $WANDB_PROJECT, else autoloop-<repo directory>; entity, mode (WANDB_MODE=offline) and credentials as
    wandb reads them; local files under $WANDB_DIR, else .autoloop/wandb/ (offline: `wandb sync` them later)."""

    name = "wandb"

    def open(self, state: State) -> None:
        # no suggestions of W&B's other products on the loop's console (wandb prints them when, say, openai is
        # imported, as with --proposer llm); yours win
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.wandb = wandb
        if wandb.setup().settings.mode not in ("offline", "dryrun", "disabled") and \
                not wandb.login(prompt=False, verify=False):  # never an interactive prompt in the middle of a night
            raise RuntimeError("not logged in")
        self.dir = Path(os.environ.get("WANDB_DIR") or self.ws.settings.repo.resolve() / ".autoloop")
        self.dir.mkdir(parents=True, exist_ok=True)
        project = os.environ.get("WANDB_PROJECT") or f"autoloop-{self.ws.settings.repo.resolve().name}"
        self.store(project)
        if not self.saved.get("session"):
            self.saved.clear()
            self.saved.update(project=project, session=secrets.token_hex(4), logged=[])
        self.session = self._init(id=self.saved["session"], name=self.ws.settings.tag, job_type="session",
                                  config=session_params(self.ws, state))

    def _init(self, stats: bool = True, **kw):
        settings = self.wandb.Settings(console="off", silent=True, disable_git=True, x_save_requirements=False,
                                       x_disable_stats=not stats, init_timeout=15)
        return self.wandb.init(project=self.saved["project"], group=self.ws.settings.tag, dir=self.dir,
                               resume="allow", reinit="create_new", settings=settings, **kw)

    def log(self, e: Experiment, state: State) -> None:
        # logged after the run: the machine's stats now would not be the run's
        run = self._init(stats=False, id=f"{self.saved['session']}-{e.n}", name=e.name, job_type="experiment",
                         notes=e.tags.get("description"), tags=[e.tags["status"]],
                         config={**e.params, "changed": e.changed})
        for step, loss in e.curve:
            run.log({"train_loss": loss}, step=step)
        run.summary.update({**e.tags, **e.metrics})
        if e.diff:
            (Path(run.dir) / "train.py.diff").write_text(e.diff)  # files in run.dir are uploaded with the run
        run.finish(exit_code=1 if e.crashed else 0)
        progress = {"val_bpb": e.metrics.get("val_bpb"), "best_val_bpb": state.best_bpb}
        self.session.log({k: v for k, v in progress.items() if v is not None}, step=e.n)

    def close(self, state: State, stop: str, files: list[Path]) -> None:
        columns = ["n", "commit", "status", "val_bpb", "description"]
        rows = [[r.n, r.commit[:7], str(r.status), r.val_bpb, r.description] for r in state.records]
        final = {"experiments": self.wandb.Table(columns=columns, data=rows)}
        for path in files:
            if path.suffix == ".png":
                final["progress"] = self.wandb.Image(str(path))
            else:
                shutil.copy(path, Path(self.session.dir) / path.name)
        self.session.log(final, step=state.done)
        self.session.summary.update({**session_totals(self.ws, state), "stop": stop,
                                     "best_commit": state.best_commit})
        self.session.finish(exit_code=1 if stop.startswith("interrupted") else 0)

    def explain(self, error: Exception) -> str:
        text = str(error)
        if any(s in text for s in ("dial tcp", "context deadline", "lookup ", "timed out", "Connection")):
            self.offline_hint = True
            return "cannot reach W&B's server"
        return one_line(error)

    def fix(self) -> str:
        first = ("check the network, or log offline (WANDB_MODE=offline) and `wandb sync .autoloop/wandb/offline-run-*` "
                 "later" if getattr(self, "offline_hint", False) else
                 "log in (`wandb login` or WANDB_API_KEY) or log offline (WANDB_MODE=offline)")
        return first + "; the experiments it misses are logged when you run the same command again"


def session_totals(ws: Workspace, state: State) -> dict[str, object]:
    """The session's counts, baseline and spend (the proposer's every request, from the spend ledger): the parent
    run's tags (MLflow) or summary (W&B); its metrics are the series val_bpb and best_val_bpb by experiment."""
    counts = {s.value: sum(r.status == s for r in state.records) for s in Status}
    return {"experiments": state.done, **counts, "baseline_val_bpb": state.baseline_bpb,
            "llm_tokens": ws.spend.tokens, "llm_cost_usd": ws.spend.cost}  # best_val_bpb: the last of its history


BACKENDS: dict[str, type[Backend]] = {"mlflow": MLflow, "wandb": WandB}


class Trackers:
    """The session's trackers, each called behind a guard: the first failure warns and switches it off."""

    def __init__(self, names: tuple[str, ...], ws: Workspace, echo: Callable[[str], None]):
        self.names, self.ws, self.echo = tuple(dict.fromkeys(names)), ws, echo
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
            backend = BACKENDS[name](self.ws, self.saved.setdefault(name, {}))
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
            fix = f'pip install "autoloop-ml[{backend.name}]"' if isinstance(error, ImportError) else backend.fix()
            self.echo(f"autoloop: warning: --tracker {backend.name} is off for this run ({doing}: "
                      f"{backend.explain(error)}); {fix}")
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
