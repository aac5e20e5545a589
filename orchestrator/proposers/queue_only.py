"""`queue`: only the user's queued ideas (`autoloop queue add`); the loop ends when the queue is empty.

The loop itself takes queued ideas before asking any proposer, so this proposer has nothing to add.
"""

from __future__ import annotations

from pathlib import Path

from ..store.ledger import Record
from .base import Proposer


class QueueOnlyProposer(Proposer):
    name = "queue"

    def propose(self, workdir: Path, history: list[Record]) -> None:
        return None
