"""Experiment trackers (--tracker mlflow|wandb): a session is a parent run, each experiment a child run.

A tracker is a mirror, never a dependency of the night: one that fails (a server down, a library missing)
warns once and is switched off, and the loop goes on. The backends are imported lazily (extras `mlflow`,
`wandb`).
"""

from __future__ import annotations

from typing import Callable

from .ledger import Record
from .state import State

TRACKERS = ("mlflow", "wandb")


class Trackers:
    """The session's trackers, each called behind a guard: the first failure warns and switches it off."""

    def __init__(self, names: tuple[str, ...], ws, echo: Callable[[str], None]):
        self.names, self.ws, self.echo = tuple(names), ws, echo
        self.backends: list = []

    def start(self, state: State) -> None:
        """Open (or, on a resume, continue) the session's parent run in each tracker."""

    def record(self, record: Record, state: State) -> None:
        """Log one finished experiment as a child run."""

    def finish(self, state: State, stop: str) -> None:
        """The end of this invocation: final artifacts (progress.png, report.md) and the parent run closed."""
