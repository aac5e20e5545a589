"""`random`: random search over the same space as `search` (a baseline for benchmarks)."""

from __future__ import annotations

import math
import random
from pathlib import Path

from ..store.ledger import Record
from .base import Context, Proposal, Proposer
from .space import Configs, Param, apply_changes, config_key, describe, read_space, rounded


def sample(p: Param, rng: random.Random):
    """A uniform draw in the dimension's natural scale (log for rates and powers of two)."""
    if p.kind == "choice":
        return rng.choice(p.choices)
    if p.kind == "log":
        return math.exp(rng.uniform(math.log(p.low), math.log(p.high)))
    if p.kind == "linear":
        return rng.uniform(p.low, p.high)
    if p.kind == "pow2":
        return 2 ** rng.randint(math.ceil(math.log2(max(p.low, 1))), math.floor(math.log2(p.high)))
    if p.kind == "int":
        return rng.randint(int(p.low), int(p.high))
    return 1 - math.exp(rng.uniform(math.log(1 - p.high), math.log(1 - p.low)))  # unit


class RandomProposer(Proposer):
    name = "random"

    def __init__(self, context: Context):
        super().__init__(context)
        self.configs = Configs(context.repo, context.profile)

    def propose(self, workdir: Path, history: list[Record]) -> Proposal | None:
        path = workdir / "train.py"
        source = path.read_text()
        space, best = read_space(source, self.context.profile)
        tried = {config_key(cfg) for _, cfg, _ in self.configs.moves(history)} | {config_key(best)}
        rng = random.Random(f"{self.context.seed}:{len(history)}")
        for _ in range(200):
            config = {name: rounded(sample(p, rng), p.kind) for name, p in space.items()}
            changes = {k: v for k, v in config.items() if v != best[k]}
            if changes and config_key({**best, **changes}) not in tried:
                path.write_text(apply_changes(source, self.context.profile, changes))
                return Proposal(describe(best, changes))
        return None
