"""The Proposer contract: one required method, optional hooks that do nothing by default."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..ledger import Record


@dataclass
class Context:
    """What a proposer may know about the session."""

    repo: Path  # the user's checkout
    tag: str
    profile: str | None  # harness profile (gpu | cpu | tiny) or None when the harness has none
    seed: int = 42
    options: dict = field(default_factory=dict)


class Proposer:
    """Edits train.py in a work directory to try one idea.

    `propose` must leave the edited train.py in `workdir` and return a one-line description of the idea,
    or None when it has no more ideas. It must not touch git, run training or write the ledger: the
    controller owns all of that and checks whatever the proposer changed.
    """

    name = "proposer"

    def __init__(self, context: Context):
        self.context = context

    def propose(self, workdir: Path, history: list[Record]) -> str | None:
        raise NotImplementedError

    def observe(self, record: Record) -> None:
        """Called with every finished experiment's record (including the baseline). Optional."""

    def close(self) -> None:
        """Called once when the loop ends. Optional."""
