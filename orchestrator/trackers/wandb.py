"""--tracker wandb: a W&B run per experiment in the session's group, and a session run (extra `wandb`, imported
lazily: this module's name is the library's, so only absolute imports inside the methods reach it)."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from ..core.state import State
from .base import Backend, Experiment, one_line, session_params, session_totals


class WandB(Backend):
    """One W&B run per experiment (job_type "experiment": train.py's constants as config, the loss curve as
    history, the summary metrics and tags in its summary), all in group <tag>: W&B's usual shape for a search, whose
    runs table, parallel-coordinates and parameter-importance panels compare them. Plus one run per session
    (job_type "session", its id kept in trackers.json and resumed with resume="allow") with val_bpb and the running
    best by experiment number, and, at the end, a table of the experiments, progress.png and report.md.

    Project: $WANDB_PROJECT, else autoloop-<repo directory>; entity, mode (WANDB_MODE=offline) and credentials as
    wandb reads them; local files under $WANDB_DIR, else .autoloop/wandb/ (offline: `wandb sync` them later)."""

    name = extra = "wandb"

    def open(self, state: State) -> None:
        # no suggestions of W&B's other products on the loop's console (wandb prints them when, say, openai is
        # imported, as with --proposer llm); yours win
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.wandb = wandb
        if wandb.setup().settings.mode not in ("offline", "dryrun", "disabled") and not wandb.login(
            prompt=False, verify=False
        ):  # never an interactive prompt in the middle of a night
            raise RuntimeError("not logged in")
        self.dir = Path(os.environ.get("WANDB_DIR") or self.ws.settings.repo.resolve() / ".autoloop")
        self.dir.mkdir(parents=True, exist_ok=True)
        project = os.environ.get("WANDB_PROJECT") or f"autoloop-{self.ws.settings.repo.resolve().name}"
        self.store(project)
        if not self.saved.get("session"):
            self.saved.clear()
            self.saved.update(project=project, session=secrets.token_hex(4), logged=[])
        self.session = self._init(
            id=self.saved["session"],
            name=self.ws.settings.tag,
            job_type="session",
            config=session_params(self.ws, state),
        )

    def _init(self, stats: bool = True, **kw):
        settings = self.wandb.Settings(
            console="off",
            silent=True,
            disable_git=True,
            x_save_requirements=False,
            x_disable_stats=not stats,
            init_timeout=15,
        )
        return self.wandb.init(
            project=self.saved["project"],
            group=self.ws.settings.tag,
            dir=self.dir,
            resume="allow",
            reinit="create_new",
            settings=settings,
            **kw,
        )

    def log(self, e: Experiment, state: State) -> None:
        # logged after the run: the machine's stats now would not be the run's
        run = self._init(
            stats=False,
            id=f"{self.saved['session']}-{e.n}",
            name=e.name,
            job_type="experiment",
            notes=e.tags.get("description"),
            tags=[e.tags["status"]],
            config={**e.params, "changed": e.changed},
        )
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
        self.session.summary.update({**session_totals(self.ws, state), "stop": stop, "best_commit": state.best_commit})
        self.session.finish(exit_code=1 if stop.startswith("interrupted") else 0)

    def explain(self, error: Exception) -> str:
        text = str(error)
        if any(s in text for s in ("dial tcp", "context deadline", "lookup ", "timed out", "Connection")):
            self.offline_hint = True
            return "cannot reach W&B's server"
        return one_line(error)

    def fix(self) -> str:
        first = (
            "check the network, or log offline (WANDB_MODE=offline) and `wandb sync .autoloop/wandb/offline-run-*` "
            "later"
            if getattr(self, "offline_hint", False)
            else "log in (`wandb login` or WANDB_API_KEY) or log offline (WANDB_MODE=offline)"
        )
        return first + "; the experiments it misses are logged when you run the same command again"
