"""A simulated LLM proposer for the surrogate benchmarks (hybrid_value.py): ideas from a fixed distribution.

An LLM knows what usually helps but cannot tune: each idea is, by its seeded draw,
- a repeat (REPEAT): an idea it already proposed from the same best, written again (the loop's memory should
  catch it: a row at no cost);
- broken (BROKEN): a train.py that does not compile (a crash before training, as a bad edit is);
- informed (the rest): a move of 2-3 constants at once, by large steps, the most promising of CANDIDATES such
  moves as the surrogate judges them with a judgment error of JUDGMENT baseline sd: good on average, never
  fine-tuned.
It reads the surrogate from $AUTOLOOP_SIM_MODEL (set by the benchmark); no real LLM is called.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

from model import Surrogate

from orchestrator.proposers.base import Proposal, Proposer
from orchestrator.proposers.space import Configs, apply_changes, describe, read_space, rounded

REPEAT, BROKEN = 0.3, 0.1
CANDIDATES = 12
JUDGMENT = 1.0  # the error of its judgment of a move, in baseline sd


class SimulatedLLM(Proposer):
    name = "simllm"

    def __init__(self, context):
        super().__init__(context)
        self.model = Surrogate.load(Path(os.environ["AUTOLOOP_SIM_MODEL"]))
        self.configs = Configs(context.repo, context.profile)

    def propose(self, workdir: Path, history: list) -> Proposal | None:
        path = workdir / "train.py"
        source = path.read_text()
        space, best = read_space(source, self.context.profile)
        rng = random.Random(f"{self.context.seed}:simllm:{len(history)}")
        parent = next((r.commit for r in reversed(history) if r.status == "keep"), "")
        mine = [
            r for r in history if r.parent == parent and r.info.get("sim") == "informed" and (r.group or r.n) == r.n
        ]
        draw = rng.random()
        if draw < REPEAT:
            for earlier in rng.sample(mine, len(mine)):
                config = self.configs.at(earlier.commit) or {}
                changes = {k: v for k, v in config.items() if k in best and best[k] != v}
                if changes:
                    path.write_text(apply_changes(source, self.context.profile, changes))
                    return Proposal("sim-llm (again): " + describe(best, changes), {"sim": "repeat"})
        elif draw < REPEAT + BROKEN:
            path.write_text(source + "\ndef broken(:\n")
            return Proposal("sim-llm: a refactor with a syntax error", {"sim": "broken"})
        names = [n for n in space if space[n].kind != "choice" or len(space[n].choices or ()) > 1]
        moves = []
        for _ in range(CANDIDATES):
            changes = {}
            for name in rng.sample(names, k=min(len(names), rng.choice([2, 3]))):
                p = space[name]
                if p.kind == "choice":
                    changes[name] = rng.choice([c for c in p.choices if c != best[name]] or [best[name]])
                    continue
                value = float(best[name])
                step = rng.choice([-1, 1]) * rng.uniform(0.3, 1.0)
                if p.kind in ("log", "pow2") and value > 0:
                    value *= math.exp(step)
                else:
                    span = (p.high - p.low) if p.high is not None and p.low is not None else abs(value) or 1.0
                    value += step * 0.3 * span
                changes[name] = rounded(p.clip(value), p.kind)
            changes = {k: v for k, v in changes.items() if v != best[k]}
            if changes:
                moves.append(changes)
        if not moves:
            return None
        mean, sd, _ = self.model.predict([{**best, **m} for m in moves])
        judged = [m + JUDGMENT * s * rng.gauss(0, 1) for m, s in zip(mean, sd)]
        pick = moves[min(range(len(moves)), key=lambda i: judged[i])]
        path.write_text(apply_changes(source, self.context.profile, pick))
        return Proposal("sim-llm: " + describe(best, pick), {"sim": "informed"})
