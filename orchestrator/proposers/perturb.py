"""`perturb`: the simplest honest proposer -- nudge one numeric hyperparameter of train.py at random."""

from __future__ import annotations

import math
import random
from pathlib import Path

from ..store.hparams import Constant, read_constants, set_constant
from ..store.ledger import Record
from .base import Context, Proposer


def nudge(const: Constant, rng: random.Random):
    """A new value near const.value: floats move in log space, powers of two double or halve, ints step."""
    v = const.value
    if isinstance(v, float):
        new = v * math.exp(rng.gauss(0.0, 0.4)) if v != 0 else (const.high or 1.0) * rng.uniform(0.01, 0.2)
        new = float(f"{new:.3g}")
    elif v > 0 and v & (v - 1) == 0 and v >= 4:
        new = v * 2 if rng.random() < 0.5 else v // 2
    else:
        new = v + rng.choice([-1, 1]) * max(1, round(abs(v) * 0.25))
    if const.low is not None:
        new = max(new, type(v)(const.low))
    if const.high is not None:
        new = min(new, type(v)(const.high))
    return new


class PerturbProposer(Proposer):
    name = "perturb"

    def __init__(self, context: Context):
        super().__init__(context)
        self.rng = random.Random(context.seed)
        self.tried: set[tuple[str, object]] = set()

    def propose(self, workdir: Path, history: list[Record]) -> str | None:
        path = workdir / "train.py"
        source = path.read_text()
        numeric = [c for c in read_constants(source, self.context.profile) if c.kind in ("int", "float")]
        for _ in range(100):
            if not numeric:
                return None
            const = self.rng.choice(numeric)
            new = nudge(const, self.rng)
            if new != const.value and (const.name, new) not in self.tried:
                self.tried.add((const.name, new))
                path.write_text(set_constant(source, const, new))
                return f"{const.name} {const.text} -> {new}"
        return None

    def observe(self, record: Record) -> None:
        pass
