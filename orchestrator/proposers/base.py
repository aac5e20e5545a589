"""The Proposer contract: one required method, optional hooks that do nothing by default."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..store.ledger import Record
from ..store.spend import Spend


@dataclass
class Context:
    """What a proposer may know about the session."""

    repo: Path  # the user's checkout (its git objects hold every tried commit)
    tag: str
    profile: str | None  # harness profile (gpu | cpu | tiny) or None when the harness has none
    seed: int = 42
    options: dict = field(default_factory=dict)
    pass_env: tuple[str, ...] = ()  # --pass-env: variables an agent may get besides the allow-listed ones
    spend: Spend | None = None  # the session's spend: add() each request's usage, check exceeded() before one


@dataclass
class Proposal:
    """A description plus facts the proposer wants kept in the run record (record.json `info`)."""

    description: str
    info: dict = field(default_factory=dict)
    log: str = ""  # the proposer's own output (e.g. a coding agent's), saved as proposer.log with the run


class ProposalFailed(Exception):
    """The idea could not be applied (e.g. a queued patch no longer applies): recorded as a crash row."""

    def __init__(self, description: str, reason: str, info: dict | None = None, log: str = ""):
        super().__init__(reason)
        self.description, self.reason, self.info, self.log = description, reason, info or {}, log


class Proposer:
    """Edits train.py in a work directory to try one idea.

    A proposer that pays per request (an LLM, an agent) reports each request's usage to `context.spend` as it
    is made and makes no request once `context.spend.exceeded()`; usage it only attaches to a Proposal's or a
    ProposalFailed's info ("usage") is counted when the idea is returned.

    `propose` must leave the edited train.py in `workdir` (which holds the current best commit) and return a
    one-line description of the idea (or a Proposal), or None when it has no more ideas. It must not touch
    git, run training or write the ledger: the controller owns all of that and checks what it changed.
    `history` lists every recorded experiment of the session in order, the baseline first, so a proposer
    can rebuild its state from it after a restart. With pipelining, its last entry may be the experiment
    still training (status "running"): count it as tried, not as a result.
    """

    name = "proposer"
    pipeline = False  # slow proposers (LLMs, agents) set True: the next idea is prepared while one trains
    options: tuple = ()  # click.Option objects `autoloop run` offers for it (each gets its AUTOLOOP_<NAME> twin:
    #                      options.with_env_twin); their values are context.options

    def __init__(self, context: Context):
        self.context = context
        self.cancelled = threading.Event()  # set when the loop stops; long-running proposers should give up

    def propose(self, workdir: Path, history: list[Record]) -> str | Proposal | None:
        raise NotImplementedError

    def observe(self, record: Record) -> None:
        """Called with every finished experiment's record (the baseline and resumed ones included). Optional."""

    def close(self) -> None:
        """Called once when the loop ends. Optional."""
