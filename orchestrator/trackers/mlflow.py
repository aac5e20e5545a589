"""--tracker mlflow: the session is a parent run, each experiment a child run (extra `mlflow`, imported lazily:
this module's name is the library's, so only absolute imports inside the methods reach it)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..core.state import State
from .base import Backend, Experiment, one_line, session_params, session_totals


class MLflow(Backend):
    """The session is a parent run named by its tag, in experiment $MLFLOW_EXPERIMENT_NAME (default
    autoloop-<repo directory>); each experiment is a child run (tag mlflow.parentRunId) named "n: description".

    Tracking URI: $MLFLOW_TRACKING_URI (a server: http://host:5000), else sqlite:///<repo>/.autoloop/mlflow.db
    with artifacts in .autoloop/mlartifacts, as mlflow's own default (./mlflow.db) would land in your repo; see it
    with `mlflow ui --backend-store-uri sqlite:///.autoloop/mlflow.db`. MlflowClient with explicit run ids: no
    fluent active-run state to leak into other code."""

    name, extra, uri = "mlflow", "mlflow", ""
    # mlflow retries a failing request for minutes by default: a server that is down must cost seconds, once; and
    # it prints two "View run ... at" lines per run to stdout, on the loop's quiet console
    ENV = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    }

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
        self.experiment = (
            found.experiment_id
            if found
            else self.client.create_experiment(
                name,
                artifact_location=None if os.environ.get("MLFLOW_TRACKING_URI") else (local / "mlartifacts").as_uri(),
            )
        )
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
        run = self.client.create_run(
            self.experiment,
            run_name=s.tag,
            tags={
                "mlflow.note.content": f"autoloop session {s.tag}: branch autoloop/{s.tag} of {s.repo.resolve()}",
                "branch": f"autoloop/{s.tag}",
                "proposer": s.proposer,
                "executor": s.executor,
            },
        )
        params = [Param(k, str(v)) for k, v in session_params(self.ws, state).items()]
        self.client.log_batch(run.info.run_id, params=params)
        return run.info.run_id

    def _drop_half_logged(self) -> None:
        """A child run the controller was killed while logging is deleted: `start` logs that experiment again."""
        parent = self.saved["parent"]
        for run in self.client.search_runs(
            [self.experiment], f"tags.mlflow.parentRunId = '{parent}'", max_results=1000
        ):
            if int(run.data.tags.get("n", 0)) not in self.saved["logged"]:
                self.client.delete_run(run.info.run_id)

    def log(self, e: Experiment, state: State) -> None:
        from mlflow.entities import Metric, Param

        t = int(e.ended * 1000)
        run_id = self.client.create_run(
            self.experiment,
            start_time=int(e.started * 1000) or None,
            run_name=e.name,
            tags={
                "mlflow.parentRunId": self.saved["parent"],
                "mlflow.note.content": e.tags.get("description", ""),
                **e.tags,
            },
        ).info.run_id
        metrics = [Metric(k, v, t, 0) for k, v in e.metrics.items()]
        metrics += [Metric("train_loss", loss, t, step) for step, loss in e.curve]
        self.client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in e.params.items()])
        if e.diff:
            self.client.log_text(run_id, e.diff, "train.py.diff")
        self.client.set_terminated(run_id, "FAILED" if e.crashed else "FINISHED", end_time=t)
        progress = {"val_bpb": e.metrics.get("val_bpb"), "best_val_bpb": state.best_bpb}
        self.client.log_batch(
            self.saved["parent"], metrics=[Metric(k, v, t, e.n) for k, v in progress.items() if v is not None]
        )

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
        return (
            "start the MLflow server, or point MLFLOW_TRACKING_URI at one (unset: a local store in .autoloop/); "
            "the experiments it misses are logged when you run the same command again"
        )
