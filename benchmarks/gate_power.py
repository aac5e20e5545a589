"""The keep gate's false-keep rate and power, simulated with its own code (orchestrator/core/noise.py).

Each candidate has normal noise (σ = 1) and a true gain (0: a no-op; 2: a real gain of 2 σ; -1: worse) over a
best measured `--best-runs` times, with `--others` other configurations of 2-3 runs measured (they give the
reference spread). Runs are allocated as the loop does: after each look the gate keeps, discards, or asks for
another run, of the candidate or of the best (`parent_first`; never two of the best in a row, at most
`COMPARISON_RUNS` of them per candidate). Prints, per setting, how often each kind of
candidate is kept and the runs it cost.

    python benchmarks/gate_power.py                                   # the default gate
    python benchmarks/gate_power.py --looks 6 8 10 --spend 2 3        # a grid
    python benchmarks/gate_power.py --mode value --mix 0:0.5,-2:0.3,2:0.2   # the value rule in a session
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.core import noise  # noqa: E402
from orchestrator.core.noise import Gate, judge, parent_first  # noqa: E402

ALTERNATE = True  # --no-alternate: the best may run twice in a row (within its cap)


def candidate(
    gain: float, gate: Gate, rng: random.Random, others: int, best_runs: int, ideas: list | None = None
) -> tuple[bool, int]:
    """One candidate judged to the end: (kept, runs spent on it and on the best). `ideas`: the session's earlier
    candidates as the value rule learns its prior from them (this one is added once decided)."""
    best = [rng.gauss(0, 1) for _ in range(best_runs)]
    other = [[rng.gauss(0, 1) for _ in range(rng.choice([2, 3]))] for _ in range(others)]
    runs, last_best = [rng.gauss(-gain, 1)], False
    while True:
        verdict = judge(runs, best, other, gate, False, ideas)
        if verdict.decision != "rerun":
            if ideas is not None and "se" in verdict.evidence:
                ideas.append((verdict.delta, verdict.evidence["se"]))
            return verdict.decision == "keep", len(runs) + len(best) - best_runs
        # as the loop plans it: never two runs of the best in a row, at most COMPARISON_RUNS for this candidate
        last_best = (ALTERNATE is False or not last_best) and parent_first(runs, best, other, len(best) - best_runs)
        if last_best:
            best.append(rng.gauss(0, 1))
        else:
            runs.append(rng.gauss(-gain, 1))


def rate(gain: float, gate: Gate, n: int, others: int, best_runs: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    results = [candidate(gain, gate, rng, others, best_runs) for _ in range(n)]
    return sum(k for k, _ in results) / n, statistics.fmean(r for _, r in results)


def night(mix: list[tuple[float, float]], gate: Gate, n: int, others: int, best_runs: int, seed: int) -> dict:
    """A session of n candidates whose true effects are drawn from `mix` ((effect in σ, share), ...), judged one
    after another, the value rule's prior learned from the earlier ones: per effect, (share kept, runs each)."""
    rng = random.Random(seed)
    ideas: list = []
    effects, shares = zip(*mix)
    out: dict[float, list] = {e: [] for e in effects}
    for _ in range(n):
        effect = rng.choices(effects, shares)[0]
        out[effect].append(candidate(effect, gate, rng, others, best_runs, ideas))
    return {e: (statistics.fmean(k for k, _ in r), statistics.fmean(c for _, c in r)) for e, r in out.items() if r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--looks", type=int, nargs="+", default=[Gate().max_repeats], help="--max-repeats values")
    ap.add_argument("--spend", type=float, nargs="+", default=[noise.SPEND], help="look k's share grows as k**SPEND")
    ap.add_argument("--futility", default=",".join(map(str, noise.FUTILITY)), help="t bounds at looks 1, 2, 3+")
    ap.add_argument("--others", type=int, nargs="+", default=[0, 5], help="other configurations measured")
    ap.add_argument("--best-runs", type=int, default=3)
    ap.add_argument("--alpha", type=float, nargs="+", default=[Gate().alpha], help="--false-keep-rate values")
    ap.add_argument("--null", type=int, default=2000, help="no-op candidates per cell")
    ap.add_argument("--gains", type=int, default=1000, help="2 σ gains per cell")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--floor", type=float, default=noise.FLOOR, help="added to every look's weight")
    ap.add_argument("--no-alternate", action="store_true", help="let the best run twice in a row (within its cap)")
    ap.add_argument("--mode", default=Gate().mode, choices=["noise", "value"], help="the gate (--gate)")
    ap.add_argument(
        "--mix",
        default="0:0.5,-2:0.3,2:0.2",
        help="value rule: a session's ideas, effect in σ (positive: better) and share; its prior is learned from them",
    )
    ap.add_argument("--ideas", type=int, default=600, help="value rule: candidates in the session")
    args = ap.parse_args()
    if args.mode == "value":
        mix = [(float(e), float(w)) for e, w in (part.split(":") for part in args.mix.split(","))]
        print(
            f"value rule, a session of {args.ideas} ideas (effect in σ: share) {mix}, best measured {args.best_runs}x"
        )
        for others in args.others:
            found = night(mix, Gate(mode="value"), args.ideas, others, args.best_runs, args.seed)
            print(
                f"others {others}: "
                + ", ".join(
                    f"effect {e:+g} σ kept {100 * k:.1f}% ({r:.1f} runs)" for e, (k, r) in sorted(found.items())
                ),
                flush=True,
            )
        return 0
    global ALTERNATE
    ALTERNATE = not args.no_alternate
    noise.FLOOR = args.floor
    noise.FUTILITY = tuple(float(x) for x in args.futility.split(","))
    print(f"futility {noise.FUTILITY}, best measured {args.best_runs} times")
    print(
        f"{'alpha':>6s} {'looks':>5s} {'spend':>5s} {'others':>6s} {'no-op kept':>18s} {'2σ gain kept':>18s} "
        f"{'worse costs':>12s}"
    )
    for alpha, looks, spend, others in itertools.product(args.alpha, args.looks, args.spend, args.others):
        noise.SPEND = spend
        gate = Gate(max_repeats=looks, alpha=alpha)
        null, null_runs = rate(0.0, gate, args.null, others, args.best_runs, args.seed)
        power, power_runs = rate(2.0, gate, args.gains, others, args.best_runs, args.seed)
        _, worse_runs = rate(-1.0, gate, 300, others, args.best_runs, args.seed)
        print(
            f"{alpha:6g} {looks:5d} {spend:5g} {others:6d} {100 * null:8.1f}% ({null_runs:.1f} runs) "
            f"{100 * power:8.1f}% ({power_runs:.1f} runs) {worse_runs:7.1f} runs",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
