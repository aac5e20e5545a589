"""Proposers: where the idea for the next edit of train.py comes from.

Built-ins and third-party proposers are found the same way, through the entry-point group
`autoloop.proposers` (a name -> a Proposer subclass).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from .. import LoopError
from .base import Context, Proposal, ProposalFailed, Proposer

__all__ = ["Context", "Proposal", "ProposalFailed", "Proposer", "available", "load"]

GROUP = "autoloop.proposers"


def _entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def available() -> list[str]:
    return sorted(_entry_points())


def load(name: str) -> type[Proposer]:
    """The Proposer class registered as `name` (or at `module:Class`); a LoopError naming the choices if not."""
    eps = _entry_points()
    try:
        if name in eps:
            cls = eps[name].load()
        elif ":" in name:  # an import path, module:Class, for proposers that are not packaged
            module, _, attr = name.partition(":")
            cls = getattr(importlib.import_module(module), attr)
        else:
            raise LoopError(f"unknown proposer {name!r}; available: {', '.join(available())} "
                            f"(third-party proposers register in the entry-point group '{GROUP}')")
    except LoopError:
        raise
    except Exception as e:  # a broken plugin is reported, never a traceback
        raise LoopError(f"proposer {name!r} failed to load: {type(e).__name__}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise LoopError(f"proposer {name!r} is not a subclass of orchestrator.proposers.Proposer")
    return cls

