"""`hybrid`: an LLM (or coding agent) for structural ideas, the built-in search for the constants, and a bandit
between them by measured improvement per second of compute.

- Each idea comes from one source, recorded as record.json `info.source`: "llm" (the `--hybrid-llm` proposer,
  `llm` or `agent`, with its own options), "search", or "search-tune".
- After the LLM's idea is kept, the search tunes the constants that idea introduced or moved (a new
  constant nobody would tune otherwise): the next idea, and then the search's turns, up to `--hybrid-tune`
  ideas (`info.tuning`: the kept run).
- Otherwise a bandit picks the source: each one's measured improvement (per idea, the best's mean minus the
  idea's: at its keep for a kept idea, at its last look for the others, 0 where it was worse) per second it cost
  (its ideas' training time, all their runs, and the time to make them, plus its dollars at
  `--hybrid-gpu-price` per GPU-hour, so an LLM's tokens count as compute), by Thompson sampling: the source
  whose rate, drawn from what its ideas measured, is higher. The other is explored while its rate is uncertain
  and left once it is clearly lower; until an idea of either measures better than the best, they alternate.
- Both see everything: the LLM's prompt lists the search's results, and the search learns from every tried
  configuration, the LLM's edits included.

Everything is rebuilt from the history on each call, so a resume continues the same allocation.
"""

from __future__ import annotations

import random
from pathlib import Path

import click

from .. import LoopError
from ..plugins import FiniteRange
from ..store.ledger import Record
from . import load
from .base import Context, Proposal, ProposalFailed, Proposer
from .search import SearchProposer
from .space import read_space

DEFAULT_TUNE = 3
DEFAULT_GPU_PRICE = 2.0  # dollars per GPU-hour: what an LLM's dollar is worth in seconds of compute


class HybridProposer(Proposer):
    name = "hybrid"
    pipeline = True
    options = (
        click.Option(
            ["--hybrid-llm"],
            metavar="llm|agent|module:Class",
            help="The proposer of structural ideas in --proposer hybrid (with its own options).  [default: llm]",
        ),
        click.Option(
            ["--hybrid-tune"],
            type=click.IntRange(min=0),
            help=f"Ideas of the search tuning the constants of a kept LLM idea.  [default: {DEFAULT_TUNE}]",
        ),
        click.Option(
            ["--hybrid-gpu-price"],
            type=FiniteRange(min=0, min_open=True),
            help="Dollars per GPU-hour, to weigh the LLM's dollars as compute in the bandit.  "
            f"[default: {DEFAULT_GPU_PRICE:g}]",
        ),
    )

    def __init__(self, context: Context):
        super().__init__(context)
        which = context.options.get("hybrid_llm") or "llm"
        self.llm = load(which)(context)
        self.search = SearchProposer(context)
        tune = context.options.get("hybrid_tune")
        self.tune = DEFAULT_TUNE if tune is None else int(tune)
        self.price = float(context.options.get("hybrid_gpu_price") or DEFAULT_GPU_PRICE)
        self.llm.cancelled = self.search.cancelled = self.cancelled  # the loop's stop reaches both

    def propose(self, workdir: Path, history: list[Record]) -> str | Proposal | None:
        arm, tuning = self.route(history, (workdir / "train.py").read_text())
        if tuning is not None:
            kept, focus, _ = tuning
            self.search.focus = focus
            try:
                idea = self.ask(self.search, "search-tune", workdir, history, tuning=kept)
            finally:
                self.search.focus = None
            if idea is not None:
                return idea
            arm = self.choose(history)
        first, second = (self.llm, self.search) if arm == "llm" else (self.search, self.llm)
        idea = self.ask(first, arm, workdir, history)
        if idea is None:  # the one has nothing left: the other
            other = "search" if arm == "llm" else "llm"
            idea = self.ask(second, other, workdir, history)
        return idea

    def route(self, history: list[Record], source: str) -> tuple[str, tuple[int, list[str], int] | None]:
        """The source of the next idea, and what it tunes: the first tuning idea of a kept LLM idea at once, the
        rest on the search's turns."""
        tuning = self.tuning(history, source)
        arm = self.choose(history)
        if tuning is not None and (tuning[2] == 0 or arm == "search"):
            return "search-tune", tuning
        return arm, None

    def ask(self, proposer: Proposer, source: str, workdir: Path, history: list[Record], **info) -> Proposal | None:
        """The proposer's idea with its source; an idea that failed (a reply that does not apply) is charged to
        its source too, so a source that keeps failing loses its turns."""
        try:
            idea = proposer.propose(workdir, history)
        except ProposalFailed as e:
            e.info = {**e.info, "source": source, **info}
            raise
        return None if idea is None else tagged(idea, source, **info)

    def tuning(self, history: list[Record], source: str) -> tuple[int, list[str], int] | None:
        """(the kept LLM idea, the constants it introduced or moved, its tuning ideas so far) while the search
        may still tune them."""
        keeps = [r for r in history if r.status == "keep"][1:]  # (the first: the baseline)
        if not keeps or not self.tune:
            return None
        by_n = {r.n: r for r in history}

        def idea(r: Record) -> Record:  # the idea's first run, which carries its source (repeats share it)
            return by_n.get(r.group or r.n, r)

        first = idea(keeps[-1])
        if first.info.get("source") == "search-tune" and first.info.get("tuning") in by_n:
            first = idea(by_n[first.info["tuning"]])  # a keep of the tuning itself: the tuning goes on
        if first.info.get("source") != "llm":
            return None
        last = next((r for r in keeps if (r.group or r.n) == first.n), None)  # the run that kept it
        if last is None:
            return None
        since = [r for r in history if r.info.get("tuning") == last.n and (r.group or r.n) == r.n]
        if len(since) >= self.tune:
            return None
        space, _ = read_space(source, self.context.profile)
        try:
            parent = self.search.configs.at(first.parent) or {}
        except Exception:  # noqa: BLE001 - its parent's train.py could not be read: what it moved only
            parent = {}
        moved = {name for name, *_ in first.info.get("moved") or []}
        focus = sorted(n for n in space if n not in parent or n in moved)
        return (last.n, focus, len(since)) if focus else None

    def ideas(self, history: list[Record]) -> dict[str, list[tuple[float, float]]]:
        """Per source, each of its ideas' (improvement, seconds of compute): the improvement is what the gate
        measured, the best's mean minus the idea's (0 where it was worse): at its keep for a kept idea, at its last
        look for the others (an idea that measured better but was not kept yet, or not clearly enough, still tells
        which source makes promising ideas: keeps alone come too rarely to tell early); the seconds all its runs'
        training and the time to make it, its dollars counted at --hybrid-gpu-price."""
        source_of = {
            r.n: "search" if str(r.info.get("source", "")).startswith("search") else r.info.get("source")
            for r in history
            if (r.group or r.n) == r.n
        }
        seconds: dict[int, float] = {}
        kept: dict[int, float] = {}  # idea -> its gain at its keep
        looked: dict[int, float] = {}  # idea -> its measured gain at its last look
        for r in history:
            n = r.group or r.n
            if source_of.get(n) not in ("llm", "search"):
                continue
            cost = float(r.timings.get("train", 0.0)) + float(r.timings.get("propose", 0.0))
            cost += float((r.info.get("usage") or {}).get("cost", 0.0) or 0.0) * 3600 / self.price
            seconds[n] = seconds.get(n, 0.0) + cost
            if r.gate.best_mean is not None and r.gate.mean is not None:
                gain = max(0.0, r.gate.best_mean - r.gate.mean)
                if r.status == "keep":
                    kept[n] = kept.get(n, 0.0) + gain
                else:
                    looked[n] = gain
        out: dict[str, list[tuple[float, float]]] = {"llm": [], "search": []}
        for n, cost in seconds.items():
            out[source_of[n]].append((kept.get(n, looked.get(n, 0.0)), cost))
        return out

    def choose(self, history: list[Record]) -> str:
        """Thompson sampling on improvement per second: each source's rate drawn by a Bayesian bootstrap of its
        ideas (random Dirichlet weights) and two pseudo-ideas as the prior, one as good as the average idea of
        both sources and one that found nothing, each at the mean idea's cost; the higher draw gets the idea. A
        source with few ideas draws widely (it is explored), one with many that found nothing draws near zero (it
        is left)."""
        ideas = self.ideas(history)
        if not any(gain for source in ideas.values() for gain, _ in source):  # nothing measured better: turns
            return min(ideas, key=lambda a: (len(ideas[a]), a != "llm"))
        rng = random.Random(f"{self.context.seed}:hybrid:{len(history)}")
        every = [idea for source in ideas.values() for idea in source]
        seconds = max(sum(c for _, c in every) / len(every), 1e-9)
        prior = [(sum(g for g, _ in every) / len(every), seconds), (0.0, seconds)]  # an average idea, a failure
        draws = {}
        for arm, own in ideas.items():
            weights = [(rng.expovariate(1.0), g, c) for g, c in [*own, *prior]]
            draws[arm] = sum(w * g for w, g, _ in weights) / max(sum(w * c for w, _, c in weights), 1e-9)
        return max(draws, key=lambda a: (draws[a], a == "llm"))

    def observe(self, record: Record) -> None:
        self.llm.observe(record)
        self.search.observe(record)

    def close(self) -> None:
        try:
            self.llm.close()
        finally:
            self.search.close()


def tagged(idea: str | Proposal, source: str, **info) -> Proposal:
    """The idea with its source (and what it tunes) in the record's info."""
    if isinstance(idea, str):
        idea = Proposal(idea)
    if not isinstance(idea, Proposal):
        raise LoopError(f"a proposer of hybrid returned {type(idea).__name__}, not an idea")
    idea.info = {**idea.info, "source": source, **info}
    return idea
