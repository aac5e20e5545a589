"""`search` (the default): a screen of one-constant moves, then TPE, over train.py's constants; it learns from
the history.

- The screen (the first STARTUP ideas): each idea moves a single constant one way from the best, a (constant,
  direction) not yet tried from it, the kinds likeliest to matter first (sizes, then rates...), so the night's
  first runs learn which constants matter instead of drawing them at random (a random pick of constants can miss
  the one that matters; TPE's random start-up jumps were all far worse on a tuned default: benchmarks/README.md).
  A kept move makes a new best, screened afresh.
- Then the model: optuna's multivariate TPE over the whole space, fitted to every configuration tried (its mean
  over runs; a crash is a failed constraint, so it learns where configurations crash). The screen gave it a
  model of the default's neighbourhood instead of a random start-up. Its jumps change many constants at once,
  and are described as "jump: ...".
- After a kept local move, the next idea usually pushes the same constants further the same way (pattern
  search; its record says `push`), and the local move below stands in whenever the screen or TPE has nothing
  untried left to propose.

Why not more small steps after the screen: under a noise-aware gate a small step costs the most runs (its
effect is within the noise, so the gate runs it again up to 10 times) and is rarely kept; a jump is usually
decided on one run. A bandit between jumps and small steps was ahead on one surrogate with its runs' noise as
measured, but fell behind TPE with that noise doubled and on the held-out surrogate after 100 experiments; TPE
alone after the screen was at least level with TPE's median after 100 on all three, and ahead after 30 except with
the doubled noise (benchmarks/README.md).

A local move changes one constant (sometimes two) of the current best:
- which constant: drawn in proportion to how often moving it paid off (untried ones, and learning rates and
  schedules before sizes, start ahead); after a kept move, usually the same constant again, further;
- which way: keep going where a move was kept, turn around where it was discarded;
- how far: a per-constant step size that grows after a keep and shrinks after a discard or crash
  (floats move multiplicatively in log space, powers of two by doublings, other ints by steps, strings
  among their declared choices);
- never a configuration that was already tried, and never into a region that crashed: an idea that grew the
  model or the micro-batch and crashed (out of memory, usually) closes every configuration at least as large
  in all of those sizes at once (DEPTH, ASPECT_RATIO, HEAD_DIM, DEVICE_BATCH_SIZE: memory grows with each), so
  a deeper model with a smaller micro-batch stays open, and a region the best ran in is void; any other idea
  that crashed closes the region beyond the value of each constant it moved (a jump: of each size it grew)
  alone. Jumps are held to the same regions.

All of it is rebuilt from the history (train.py at each tried commit, and each row's status) on every call,
so it survives restarts and proposes the same next idea after a resume.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from .. import LoopError
from ..store.ledger import Record
from .base import Context, Proposal, Proposer
from .space import Configs, Param, apply_changes, config_key, describe, read_space, rounded
from .tpe import ask, finished_trials, learnable, tpe_study

INITIAL_STEP = {"log": 0.4, "linear": 0.15, "pow2": 1.0, "int": 0.25, "unit": 0.5, "choice": 1.0}
MIN_STEP = {"log": 0.05, "linear": 0.02, "pow2": 1.0, "int": 0.05, "unit": 0.1, "choice": 1.0}
MAX_STEP = {"log": 1.5, "linear": 0.5, "pow2": 2.0, "int": 1.0, "unit": 1.5, "choice": 1.0}
GROW, SHRINK, CRASH_SHRINK = 1.6, 0.75, 0.6
STARTUP = 10  # screening ideas before TPE's jumps (TPE then has that many configurations to model, no random start)
SHOWN = 4  # changes a jump's description names


# Before any evidence: in a fixed time, what the time is spent on matters most — the model's and the batch's
# sizes and the schedule's shares (names with DEPTH, DIM, RATIO, BATCH, WIDTH, HEAD: WARMUP_RATIO and
# WARMDOWN_RATIO count here too), then learning rates, then the rest of the schedule and the optimizer, anything
# else last. Measured on both surrogates: sizes first reach a better best than rates first (benchmarks/README.md).
# Evidence quickly outweighs this.
SIZE_KEYS = ("DEPTH", "DIM", "RATIO", "BATCH", "WIDTH", "HEAD")
RATE_KEYS = ("LR", "RATE")
SCHEDULE_KEYS = ("WARMUP", "WARMDOWN", "DECAY", "MOMENTUM", "BETA", "FRAC", "CAP")
PRIORS = ((SIZE_KEYS, 3.0), (RATE_KEYS, 2.0), (SCHEDULE_KEYS, 1.5))


def prior(name: str) -> float:
    return next((w for keys, w in PRIORS if any(k in name.upper() for k in keys)), 0.7)


def is_size(name: str) -> bool:
    """A size of the model or batch (what a crash beyond usually is: out of memory), not a share or a rate."""
    upper = name.upper()
    return any(k in upper for k in SIZE_KEYS) and not any(k in upper for k in RATE_KEYS + SCHEDULE_KEYS)


def is_memory(name: str, p: Param) -> bool:
    """A numeric size that a run's memory grows with. Not the total batch (tokens per optimizer step): a bigger
    one is more accumulated micro-steps. (train.py also caps the micro-batch at it, so a total below
    DEVICE_BATCH_SIZE x MAX_SEQ_LEN uses less memory: a region covers every total batch, and may close a
    smaller one that would fit.)"""
    numeric = p.kind != "choice" or all(_number(c) for c in p.choices)
    return is_size(name) and "TOTAL" not in name.upper() and numeric


class Regions:
    """Where growing the model or the micro-batch crashed. Memory grows with each of these sizes, so a
    configuration at least as large as a crashed one in all of them at once is closed; one smaller in any of
    them (a deeper model with fewer sequences per micro-batch) is not. A region the best lies in is void: the
    best ran there, so its crash was not about memory."""

    def __init__(self, space: dict[str, Param]):
        self.names = [n for n, p in space.items() if is_memory(n, p)]
        self.crashed: list[dict] = []

    def grew(self, config: dict, parent: dict) -> bool:
        return any(_number(config.get(n)) and _number(parent.get(n)) and config[n] > parent[n] for n in self.names)

    def add(self, config: dict) -> None:
        self.crashed.append({n: config[n] for n in self.names if _number(config.get(n))})

    def closes(self, config: dict, best: dict) -> bool:
        def within(c: dict, region: dict) -> bool:
            return all(_number(c.get(n)) and c[n] >= v for n, v in region.items())

        return any(within(config, region) for region in self.crashed if region and not within(best, region))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Stats:
    """What the history says about one dimension."""

    def __init__(self, kind: str):
        self.kind = kind
        self.step = INITIAL_STEP[kind]
        self.tries = self.keeps = 0
        self.last_direction = 0  # +1 / -1 of the last kept move: keep going that way
        self.failed_from_best: set[int] = set()  # directions already discarded from the current best
        self.tried_from_best: set = set()  # directions (a choice: its values) tried alone from the current best
        self.crash_above: float | None = None  # moving up to this value (or beyond) crashed
        self.crash_below: float | None = None

    def record(self, outcome: str, direction: int, value, close: bool = True) -> None:
        self.tries += 1
        if outcome == "keep":
            self.keeps += 1
            self.last_direction = direction
            self.step = min(self.step * GROW, MAX_STEP[self.kind])
        else:
            self.step = max(self.step * (CRASH_SHRINK if outcome == "crash" else SHRINK), MIN_STEP[self.kind])
        if outcome == "crash" and close:
            self.crashed(direction, value)

    def crashed(self, direction: int, value) -> None:
        """Moving this way to `value` crashed: beyond it is closed (from the best onwards)."""
        if self.kind == "choice" or not direction:
            return
        if direction > 0:
            self.crash_above = value if self.crash_above is None else min(self.crash_above, value)
        else:
            self.crash_below = value if self.crash_below is None else max(self.crash_below, value)


def _direction(p: Param, before, after) -> int:
    if p.kind == "choice" or before == after or not (_number(before) and _number(after)):
        return 0  # a value edited by hand to another type: no direction
    return 1 if after > before else -1


def step_value(p: Param, value, direction: int, step: float, rng: random.Random):
    """A value `step` (in the dimension's own units, jittered) away from value in the given direction."""
    jitter = rng.uniform(0.6, 1.4)
    if p.kind == "log":
        return value * math.exp(direction * step * jitter)
    if p.kind == "linear":
        return value + direction * step * jitter * (p.high - p.low)
    if p.kind == "pow2":
        return int(value * 2 ** (direction * max(1, round(step * jitter))))
    if p.kind == "int":
        return value + direction * max(1, round(step * jitter * max(abs(value), 1)))
    if p.kind == "unit":  # move 1 - x in log space: 0.9 -> 0.95 -> 0.975 ...
        return 1 - (1 - value) * math.exp(-direction * step * jitter)
    return value


def outcomes(history: list[Record]) -> dict[int, str | None]:
    """Each idea's outcome by its first run's number: keep if any of its runs was kept, crash if its first run
    crashed, discard once the gate decided, None while it is still being run again (or training)."""
    out: dict[int, str | None] = {}
    for rec in history:
        first = rec.group or rec.n
        if rec.status not in ("keep", "discard", "crash"):
            out.setdefault(first, None)
        elif rec.status == "keep" or out.get(first) == "keep":
            out[first] = "keep"
        elif first == rec.n and rec.status == "crash":
            out[first] = "crash"
        else:
            pending = rec.gate.decision in ("rerun", "confirming")
            out[first] = None if pending else "discard"
    return out


class SearchProposer(Proposer):
    name = "search"
    max_attempts = 400

    def __init__(self, context: Context):
        super().__init__(context)
        self.configs = Configs(context.repo, context.profile)
        try:
            import optuna  # noqa: F401  (the model move)
        except ImportError:
            raise LoopError("search needs optuna, a dependency of autoloop: reinstall it (pip install -e .)") from None

    def learn(
        self, space: dict[str, Param], history: list[Record], best: dict
    ) -> tuple[dict[str, Stats], set, Regions]:
        stats = {name: Stats(p.kind) for name, p in space.items()}
        regions = Regions(space)
        tried = set()
        outcome = outcomes(history)
        for rec, cfg, parent in self.configs.moves(history):
            if rec.status != "running" and not learnable(rec):
                continue  # the machine failed or slowed it, not this configuration: nothing learned, may try again
            tried.add(config_key(cfg))
            if (rec.group or rec.n) != rec.n or outcome.get(rec.n) is None:
                continue  # a run again of an idea (learned once, from its first run), or no result yet
            changed = [n for n in space if n in cfg and n in parent and cfg[n] != parent[n]]
            if parent == best and len(changed) == 1:
                name = changed[0]
                p = space[name]
                stats[name].tried_from_best.add(
                    cfg[name] if p.kind == "choice" else _direction(p, parent[name], cfg[name])
                )
            memory = outcome[rec.n] == "crash" and regions.grew(cfg, parent)
            if memory:
                regions.add(cfg)
            if rec.info.get("move") in ("model", "bundle") or len(changed) > 2:
                # a jump says nothing about one constant's step; a crash closes only what a jump's crash
                # usually is, out of memory: the region above, or else each size it grew, alone
                for name in changed if outcome[rec.n] == "crash" and not memory else ():
                    if is_size(name) and _direction(space[name], parent[name], cfg[name]) > 0:
                        stats[name].crashed(1, cfg[name])
                continue
            for name in changed:
                p = space[name]
                d = _direction(p, parent[name], cfg[name])
                # out of memory: the region above is what it closes (no size, shrunk or grown, and no other
                # constant moved with them is closed alone)
                stats[name].record(outcome[rec.n], d, cfg[name], close=not memory)
                if parent == best and outcome[rec.n] != "keep":
                    stats[name].failed_from_best.add(d)
        return stats, tried, regions

    def allowed(self, p: Param, s: Stats, value, best_value) -> bool:
        if p.kind == "choice":
            return value != best_value
        if p.low is not None and value < p.low or p.high is not None and value > p.high:
            return False
        if s.crash_above is not None and value >= s.crash_above and value > best_value:
            return False
        if s.crash_below is not None and value <= s.crash_below and value < best_value:
            return False
        return value != best_value

    def candidate(self, p: Param, s: Stats, best_value, rng: random.Random):
        if p.kind == "choice":
            return rng.choice([c for c in p.choices if c != best_value] or [best_value])
        if s.last_direction and s.last_direction not in s.failed_from_best and rng.random() < 0.75:
            d = s.last_direction
        else:
            options = [d for d in (1, -1) if d not in s.failed_from_best] or [1, -1]
            d = rng.choice(options)
        return rounded(p.clip(step_value(p, best_value, d, s.step, rng)), p.kind)

    def pick(self, names: list[str], stats: dict[str, Stats], rng: random.Random) -> str:
        """A constant to move: likelier when its moves paid off, untried, or of a kind that usually matters."""
        weights = [prior(n) * (stats[n].keeps + 1) / (stats[n].tries + 1) ** 0.7 for n in names]
        return rng.choices(names, weights=weights)[0]

    focus: list[str] | None = None  # only these constants (the hybrid's tuning of a new idea's constants)

    def propose(self, workdir: Path, history: list[Record]) -> Proposal | None:
        path = workdir / "train.py"
        source = path.read_text()
        space, best = read_space(source, self.context.profile)
        if self.focus is not None:
            space = {name: p for name, p in space.items() if name in self.focus}
        if not space:
            return None
        stats, tried, regions = self.learn(space, history, best)
        tried.add(config_key(best))
        closed = lambda config: regions.closes(config, best)  # noqa: E731
        rng = random.Random(f"{self.context.seed}:{len(history)}")  # the same proposal after a resume
        push = self.momentum(space, history, best, stats, tried, closed, rng)
        if push is not None:
            return self.write(path, source, best, push, "local", push=True)
        screening = self.startup(history)
        if not screening:
            changes = self.model(
                space,
                best,
                history,
                tried,
                lambda c: (
                    all(self.allowed(space[n], stats[n], v, best[n]) for n, v in c.items())
                    and not closed({**best, **c})
                ),
            )
            if changes:
                return self.write(path, source, best, changes, "model")
        changes = (
            screening
            and self.screen(space, best, stats, tried, closed, rng)
            or self.local(space, best, history, stats, tried, closed, rng)
        )
        return self.write(path, source, best, changes, "local") if changes else None

    def startup(self, history: list[Record]) -> bool:
        """Still screening: fewer than STARTUP local ideas so far (runs again of an idea not counted)?"""
        first = [rec for rec in history if (rec.group or rec.n) == rec.n]
        return sum(rec.info.get("move") == "local" for rec in first) < STARTUP

    def screen(self, space, best, stats, tried, closed, rng) -> dict | None:
        """One constant moved one way from the best, a (constant, direction) not yet tried from it: of the kind
        likeliest to matter (`prior`), at random among those. A kept move makes a new best, screened afresh."""
        options = []
        for name, p in space.items():
            s = stats[name]
            directions = [c for c in p.choices if c != best[name]] if p.kind == "choice" else [1, -1]
            for d in directions:
                if d in s.tried_from_best:
                    continue
                value = d if p.kind == "choice" else rounded(p.clip(step_value(p, best[name], d, s.step, rng)), p.kind)
                config = {**best, name: value}
                if self.allowed(p, s, value, best[name]) and config_key(config) not in tried and not closed(config):
                    options.append((prior(name), rng.random(), name, value))
        if not options:
            return None
        top = max(o[0] for o in options)
        _, _, name, value = max(o for o in options if o[0] == top)
        return {name: value}

    def model(self, space: dict[str, Param], best: dict, history: list[Record], tried: set, allowed) -> dict | None:
        import optuna

        moves = [(rec, cfg) for rec, cfg, _ in self.configs.moves(history)]
        study = tpe_study(
            self.context.seed + len(history), finished_trials(optuna, space, moves), multivariate=True, startup=0
        )  # the screen is the start-up: no random jumps, however few trials are done
        return ask(study, space, best, tried, allowed)

    def local(self, space, best, history, stats, tried, closed, rng) -> dict | None:
        names = list(space)
        for attempt in range(self.max_attempts):
            count = 2 if len(history) > len(names) and rng.random() < 0.2 or attempt > self.max_attempts // 2 else 1
            chosen = []
            for _ in range(count):
                name = (
                    self.pick([n for n in names if n not in chosen], stats, rng) if len(chosen) < len(names) else None
                )
                if name:
                    chosen.append(name)
            changes = {}
            for name in chosen:
                value = self.candidate(space[name], stats[name], best[name], rng)
                if self.allowed(space[name], stats[name], value, best[name]):
                    changes[name] = value
            if not changes:
                if attempt > 20:  # an untried constant that cannot move must not block the rest
                    for name in chosen:
                        stats[name].tries = max(stats[name].tries, 1)
                continue
            config = {**best, **changes}
            if closed(config):
                continue
            if config_key(config) in tried:
                for name in changes:  # that neighbourhood is explored: look further next time
                    stats[name].step = min(stats[name].step * 1.3, MAX_STEP[space[name].kind])
                    stats[name].tries = max(stats[name].tries, 1)
                continue
            return changes
        return None

    def momentum(self, space, history, best, stats, tried, closed, rng) -> dict | None:
        """After a kept local move, usually push the same constants further the same way (pattern search)."""
        moves = self.configs.moves([r for r in history if r.status != "running"][-1:])
        if not moves or moves[0][0].status != "keep" or rng.random() > 0.7:
            return None
        if moves[0][0].info.get("move") in ("model", "bundle"):  # a jump, or near misses kept together
            return None
        _, cfg, parent = moves[0]
        changes = {}
        for name in (n for n in space if n in cfg and n in parent and cfg[n] != parent[n]):
            p, s = space[name], stats[name]
            d = _direction(p, parent[name], cfg[name])
            if not d:
                return None
            value = rounded(p.clip(step_value(p, best[name], d, s.step, rng)), p.kind)
            if not self.allowed(p, s, value, best[name]):
                return None
            changes[name] = value
        config = {**best, **changes}
        if not changes or config_key(config) in tried or closed(config):
            return None
        return changes

    def write(self, path: Path, source: str, best: dict, changes: dict, move: str, push: bool = False) -> Proposal:
        """Edit train.py. A jump is described by its first SHOWN changes and a count of the rest (the table stays
        readable and a run again's "(repeat n/N)" stays in view); every change is in the record's info, and
        whether the idea pushes a kept local move further."""
        path.write_text(apply_changes(source, self.context.profile, changes))
        shown = dict(list(changes.items())[:SHOWN])
        more = f", +{len(changes) - SHOWN} more" if len(changes) > SHOWN else ""
        description = ("jump: " if move == "model" else "") + describe(best, shown) + more
        info = {"changes": {k: repr(v) for k, v in changes.items()}, "move": move}
        return Proposal(description, {**info, "push": True} if push else info)
