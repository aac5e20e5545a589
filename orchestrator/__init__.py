"""autoloop: the controller that runs the research loop over train.py (git, clock, runs, decisions, ledger)."""

__version__ = "0.1.0"


class LoopError(Exception):
    """An orchestrator failure (not an experiment's): its message says how to fix it; the CLI exits 1."""
