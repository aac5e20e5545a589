"""--tracker tensorboard: the session is one TensorBoard run, each experiment a step of it (extra `tensorboard`,
written through torch.utils.tensorboard, imported lazily).

The run is <root>/<tag>, root $TENSORBOARD_LOGDIR, else <repo>/.autoloop/tensorboard: `tensorboard --logdir
<root>` shows the repo's sessions side by side. At step n (the experiment's number): `val_bpb`, `best_val_bpb`
(the running best) and the summary block's other numbers as `metrics/<name>`, and a text `experiment` (its
status, the constants it changed, the diff of train.py). The HParams tab holds one row per session: what it is
pinned to (session.json) and its best val_bpb (the last `best_val_bpb`). At the end: progress.png and report.md.

A resumed session appends to the same run from the first step it misses (SummaryWriter's purge_step): an
experiment written by an invocation that was killed before trackers.json said so is hidden, then logged again.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from ..core.state import State
from .base import Backend, Experiment, one_line, session_params, session_totals

LOGDIR = Path(".autoloop") / "tensorboard"  # under the repo, when TENSORBOARD_LOGDIR is unset


class TensorBoard(Backend):
    """A SummaryWriter on the session's run directory, flushed after every experiment, closed at the end."""

    name = extra = "tensorboard"

    def open(self, state: State) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        root = Path(os.environ.get("TENSORBOARD_LOGDIR") or self.ws.settings.repo / LOGDIR).expanduser().resolve()
        self.logdir = root / self.ws.settings.tag
        self.store(str(self.logdir))
        if not any(self.logdir.glob("events.out.tfevents.*")):  # a new session, or a run directory deleted since
            self.saved.clear()
        fresh = not self.saved
        self.saved.setdefault("logdir", str(self.logdir))
        logged = self.saved.setdefault("logged", [])
        # events from step purge_step on, left by an earlier writer, are hidden: nothing is shown twice
        self.writer = SummaryWriter(str(self.logdir), purge_step=max(logged, default=0) + 1)
        if fresh:  # TensorBoard keeps a tag's first metadata, and the session's params are pinned: once is all
            experiment, start, _ = self._hparams(state)
            self.writer.file_writer.add_summary(experiment, 0)
            self.writer.file_writer.add_summary(start, 0)
        self.writer.flush()

    def _hparams(self, state: State) -> tuple:
        """The hparams plugin's experiment, session-start and session-end summaries: the session's pinned params
        (numbers and strings as they are, anything else as text) and its metric, the final best val_bpb."""
        from torch.utils.tensorboard.summary import hparams

        params = {
            k: v if isinstance(v, (int, float, str)) else str(v)
            for k, v in session_params(self.ws, state).items()
            if v is not None
        }
        return hparams(params, {"best_val_bpb": state.best_bpb})

    def log(self, e: Experiment, state: State) -> None:
        if "val_bpb" in e.metrics:
            self.writer.add_scalar("val_bpb", e.metrics["val_bpb"], e.n, walltime=e.ended or None)
        if state.best_bpb is not None:
            self.writer.add_scalar("best_val_bpb", state.best_bpb, e.n, walltime=e.ended or None)
        for key, value in e.metrics.items():
            if key != "val_bpb":
                self.writer.add_scalar(f"metrics/{key}", value, e.n, walltime=e.ended or None)
        self.writer.add_text("experiment", experiment_text(e), e.n, walltime=e.ended or None)
        self.writer.flush()  # a night's chart, live: `tensorboard --logdir` reloads what is on disk

    def close(self, state: State, stop: str, files: list[Path]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        totals = {**session_totals(self.ws, state), "stop": stop, "best_commit": state.best_commit}
        self.writer.add_text(
            "session", "\n".join(f"- {k}: {v}" for k, v in totals.items() if v is not None), state.done
        )
        for path in files:
            if path.suffix == ".png":
                png = path.read_bytes()
                width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk, first in every PNG
                image = Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=png)
                self.writer.file_writer.add_summary(
                    Summary(value=[Summary.Value(tag="progress", image=image)]), state.done
                )
            else:
                self.writer.add_text(path.stem, path.read_text(), state.done)
        if not stop.startswith("interrupted"):  # a Ctrl-C'd session stays open: a resume may still finish it
            self.writer.file_writer.add_summary(self._hparams(state)[2], state.done)
        self.writer.close()

    def explain(self, error: Exception) -> str:
        if isinstance(error, ImportError):
            return "the tensorboard package is not installed (torch.utils.tensorboard needs it)"
        return one_line(error)

    def fix(self) -> str:
        return (
            f"make TENSORBOARD_LOGDIR (unset: {LOGDIR}/ in the repo) a writable directory; the experiments "
            "it misses are logged when you run the same command again"
        )


def experiment_text(e: Experiment) -> str:
    """The Text tab's note of one experiment (markdown): its name, status and decision, what changed, the diff."""
    tags = e.tags
    lines = [
        f"**{e.name}**",
        "",
        f"status {tags.get('status', '')}, decision {tags.get('decision', '-')}, commit {tags.get('commit', '')[:7]}",
    ]
    if e.changed:
        lines.append("changed: " + ", ".join(f"{name} = {e.params[name]!r}" for name in e.changed))
    if tags.get("reason"):
        lines.append(f"reason: {tags['reason']}")
    if e.diff:
        lines += ["", "```diff", e.diff.rstrip("\n"), "```"]
    return "\n".join(lines)
