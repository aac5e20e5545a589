"""How much could any keep rule that keeps few truly worse changes buy, against upstream's rule? A bound.

An abstract night: each idea's true effect is drawn from the ideas a real night_value.py session met (its
candidates' true gains over the best of their time, in the surrogate's baseline sd; the first 30 ideas of each
session for the early pool, the rest for the late one), every run adds normal noise of sd 1 (times
--noise-scale), and effects add up. Rules, paired on seeds:

- `upstream`: one run per idea, kept when it is lower than the kept run (a single lucky run sets the bar);
- `oracle`: knows the noise, the pool (its prior) and the best's true value: keeps when the posterior chance of no
  gain is <= 5%, runs a candidate again while its posterior mean gain is positive (up to --looks runs);
- `oracle, bundles`: the same, one run per idea, near misses (posterior mean > 0) tried 3 at a time (additive);
- `best measured`: the oracle's rule, but the best is known only from its runs: 2 fresh runs after a keep and,
  with `grow`, one more per 2 ideas judged against it (up to 12; plan.grows) - what the loop can do.

The median true improvement (in baseline sd) after 30, 100 and 300 runs, and the share of keeps truly no better.

    python benchmarks/value_bound.py --from /tmp/nv/v05_20.json --seeds 200
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORSE = 0.05


def pools(path: Path, arm: str, sd: float) -> tuple[np.ndarray, np.ndarray]:
    results = [r for r in json.loads(path.read_text())["results"] if r["arm"] == arm]
    early = [c[0] / sd for r in results for c in r["candidates"][:30]]
    late = [c[0] / sd for r in results for c in r["candidates"][30:]]
    return np.array(early), np.array(late)


def posterior(points: np.ndarray, delta: float, se: float) -> np.ndarray:
    log = -0.5 * ((delta - points) / se) ** 2
    w = np.exp(log - log.max())
    return w / w.sum()


class Night:
    def __init__(self, early: np.ndarray, late: np.ndarray, scale: float, seed: int, runs: int):
        self.early, self.late, self.scale, self.runs = early / scale, late / scale, scale, runs
        self.rng = random.Random(seed)
        self.ideas = 0
        self.true = 0.0  # the best's true improvement over the baseline (sd)
        self.trace: list[float] = []
        self.keeps: list[float] = []

    def idea(self) -> tuple[float, np.ndarray]:
        pool = self.early if self.ideas < 30 else self.late
        self.ideas += 1
        return float(pool[self.rng.randrange(len(pool))]), pool

    def run(self, effect: float) -> float:
        """One run of the best plus `effect`: its measured gain over the baseline, noisy."""
        self.trace.append(self.true)
        return self.true + effect + self.rng.gauss(0, 1)

    def keep(self, effect: float) -> None:
        self.true += effect
        self.keeps.append(effect)
        self.trace[-1] = self.true

    @property
    def left(self) -> bool:
        return len(self.trace) < self.runs


def upstream(night: Night) -> None:
    bar = night.run(0.0)
    while night.left:
        effect, _ = night.idea()
        x = night.run(effect)
        if x > bar:
            night.keep(effect)
            bar = x


def oracle(night: Night, looks: int, bundle: int = 0) -> None:
    parked: list[float] = []
    night.run(0.0)
    while night.left:
        if bundle and len(parked) >= bundle:  # judged on its own runs: kept when one-sided 5% significant
            effect, parked = sum(parked), []
            xs: list[float] = []
            while night.left and len(xs) < looks:
                xs.append(night.run(effect) - night.true)
                z = statistics.fmean(xs) * len(xs) ** 0.5
                if z >= 1.645:
                    night.keep(effect)
                    break
                if z < 0.5:
                    break
            continue
        effect, pool = night.idea()
        xs = []
        while night.left:
            xs.append(night.run(effect) - night.true)
            w = posterior(pool, statistics.fmean(xs), len(xs) ** -0.5)
            mean = float(w @ pool)
            if w[pool <= 0].sum() <= WORSE and mean > 0:
                night.keep(effect)
                break
            if mean <= 0 or len(xs) >= looks:
                if bundle and mean > 0:
                    parked.append(effect)
                break


def measured(night: Night, looks: int, grow: bool) -> None:
    best = [night.run(0.0) for _ in range(3)]  # the baseline and its two repeats
    judged = 0
    while night.left:
        while grow and len(best) < min(12, 2 + 0.5 * judged) and night.left:
            best.append(night.run(0.0))
        effect, pool = night.idea()
        judged += 1
        xs: list[float] = []
        while night.left:
            xs.append(night.run(effect))
            se = (1 / len(xs) + 1 / len(best)) ** 0.5
            w = posterior(pool, statistics.fmean(xs) - statistics.fmean(best), se)
            mean = float(w @ pool)
            if w[pool <= 0].sum() <= WORSE and mean > 0:
                night.keep(effect)
                best = [night.run(0.0) for _ in range(2) if night.left]  # fresh runs of the new best
                judged = 0
                break
            if mean <= 0 or len(xs) >= looks:
                break


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="source", type=Path, required=True, help="a night_value.py --out JSON")
    ap.add_argument("--arm", default="upstream", help="whose candidates make the pools")
    ap.add_argument("--surrogate", type=Path, default=ROOT / "benchmarks" / "surrogate" / "tiny-5s.npz")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--scales", default="1,2", help="noise scales (comma-separated)")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "surrogate")]
    from model import Surrogate

    from orchestrator.proposers.space import read_space

    _, default = read_space((ROOT / "train.py").read_text(), "tiny")
    sd = float(Surrogate.load(args.surrogate).predict([default])[1][0])
    early, late = pools(args.source, args.arm, sd)
    print(
        f"pools from {args.source.name} ({args.arm}): {len(early)} early ideas ({np.mean(early > 0):.0%} better), "
        f"{len(late)} late ({np.mean(late > 0):.0%} better); baseline sd {sd:.4f}"
    )
    rules = {
        "upstream": upstream,
        "oracle, <= 4 runs": lambda n: oracle(n, 4),
        "oracle, <= 8 runs": lambda n: oracle(n, 8),
        "oracle, 1 run, bundles of 3": lambda n: oracle(n, 1, 3),
        "best measured, 2 fresh runs": lambda n: measured(n, 4, False),
        "best measured, grows (plan.grows)": lambda n: measured(n, 4, True),
    }
    checkpoints = [k for k in (30, 100, 300) if k <= args.runs]
    for scale in (float(s) for s in args.scales.split(",")):
        print(f"\nnoise x{scale:g}: median true improvement (baseline sd) after " + ", ".join(map(str, checkpoints)))
        for name, rule in rules.items():
            nights = []
            for seed in range(args.seeds):
                night = Night(early, late, scale, seed, args.runs)
                rule(night)
                nights.append(night)
            at = [statistics.median(n.trace[min(k, len(n.trace)) - 1] for n in nights) for k in checkpoints]
            keeps = [k for n in nights for k in n.keeps]
            false = sum(k <= 0 for k in keeps) / max(1, len(keeps))
            print(
                f"  {name:36s} "
                + "  ".join(f"{v:6.2f}" for v in at)
                + f"   keeps {len(keeps)}, {false:.0%} truly no better"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
