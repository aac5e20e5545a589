"""Proposers: where the idea for the next edit of train.py comes from.

Built-ins and third-party proposers are found the same way, through the entry-point group
`autoloop.proposers` (a name -> a Proposer subclass; see orchestrator/plugins.py).
"""

from __future__ import annotations

from .. import plugins
from .base import Context, Proposal, ProposalFailed, Proposer

__all__ = ["Context", "Proposal", "ProposalFailed", "Proposer", "available", "load"]


def available() -> list[str]:
    return plugins.available("proposer")


def load(name: str) -> type[Proposer]:
    """The Proposer class registered as `name` (or at `module:Class`); a LoopError naming the choices if not."""
    return plugins.load("proposer", name, Proposer)
