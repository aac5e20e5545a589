"""After a night, whose model is really better: autoloop's, or the same proposer under upstream's keep rule?

On a surrogate of train.py (benchmarks/surrogate/, fitted on real runs) each arm drives the real controller (real
proposer, gate, ledger and git) with a fake train.py that answers in milliseconds with the configuration's noise;
its noise-free value (`true_bpb`) is what a night really bought. Arms, with paired seeds (seed s of every arm
sees the same landscape and the same proposer seed):

- `autoloop`: the defaults (today the noise gate, early stopping off);
- `noise`, `noise-es`: the noise gate (baseline measured 3 times, fresh runs of a new best, at most 3 runs of
  the best per comparison, interleaved), early stopping off / on (`--early-stop on`: a run whose training curve
  is clearly behind the best's is stopped; it needs a surrogate fitted with curves);
- `value`, `value-es`: the value rule (`--gate value`, core/value.py), early stopping off / on;
- `upstream`: autoresearch's rule: one run per idea, kept if its val_bpb is lower than the kept run's
  (`--gate strict --baseline-repeats 0`).

Compute is counted in runs' worth: a run trained to the end costs 1, a stopped run the share of its steps it
ran. The table gives the true improvement (the baseline's true val_bpb minus the kept best's) once each
checkpoint's compute is spent: median [quartiles] over the seeds, the paired one-sided Wilcoxon test "better
than upstream", the ratio of medians, and per arm the keeps, the false keeps (kept, and truly not better than
the best it replaced), the ideas judged per 100 runs' worth, and the share of truly better ideas stopped early;
and each arm's median as a share of the landscape's ceiling (`ceiling`: the best configuration the model knows).
`--out` is written as sessions end: an interrupted run keeps them (`--arms '' --reuse FILE` reports them again,
on the seeds every arm has).

    python benchmarks/night_value.py --surrogate benchmarks/surrogate/tiny-5s.npz --seeds 20 --runs 300 --jobs 2
    python benchmarks/night_value.py ... --drift 1.5    # a machine drifting by +-1.5 baseline sd (period 40 runs)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "surrogate")]

from search_quality import die_with_parent, surrogate_session  # noqa: E402

from orchestrator.core.noise import Gate  # noqa: E402

ARMS = {  # arm -> the gate it runs and --early-stop (search_quality's sessions)
    "autoloop": (Gate().mode, Gate().early_stop),  # the defaults
    "value": ("value", "off"),
    "value-es": ("value", "on"),
    "noise": ("noise", "off"),
    "noise-es": ("noise", "on"),
    "upstream": ("strict", "off"),
}
STOPPED_RUNS = 2.5  # an arm that stops runs gets this many runs per runs' worth of compute at most


def session(job: tuple) -> dict:
    arm, *rest = job
    result = surrogate_session(tuple(rest))
    result["arm"] = arm
    return result


def costs(result: dict) -> list[float]:
    """Each run's compute in runs' worth (sessions saved before costs were recorded: 1 each)."""
    return result.get("cost") or [1.0] * len(result["best_true"])


def within(result: dict, compute: float) -> int:
    """How many of the session's runs fit in this much compute (runs' worth: a stopped run counts its share)."""
    spent, n = 0.0, 0
    for cost in costs(result):
        if spent + cost > compute + 1e-9:
            break
        spent, n = spent + cost, n + 1
    return n


def improvement(result: dict, compute: float) -> float:
    """The baseline's true val_bpb minus the true val_bpb of the best kept once `compute` runs' worth is spent
    (0: nothing kept)."""
    values = [v for v in result["best_true"][: within(result, compute)] if v is not None]
    return values[0] - values[-1] if values else 0.0


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{statistics.median(values):.4f} [{q[0]:.4f}, {q[2]:.4f}]"


def grid(p, points: int = 65) -> list:
    """Values of one dimension across its range, as the proposers write them (every choice; powers of two)."""
    from orchestrator.proposers.space import rounded

    if p.kind == "choice":
        return list(p.choices)
    if p.kind == "pow2":
        return [2**k for k in range(math.ceil(math.log2(max(p.low, 1))), math.floor(math.log2(p.high)) + 1)]
    if p.kind == "int":
        return sorted({round(p.low + (p.high - p.low) * i / (points - 1)) for i in range(points)})
    if p.kind == "log":
        return [rounded(p.low * (p.high / p.low) ** (i / (points - 1)), p.kind) for i in range(points)]
    if p.kind == "unit":  # spaced in log(1 - x), as the proposers sample it (a beta near 1)
        low, high = math.log(1 - p.high), math.log(1 - p.low)
        return [rounded(1 - math.exp(low + (high - low) * i / (points - 1)), p.kind) for i in range(points)]
    return [rounded(p.low + (p.high - p.low) * i / (points - 1), p.kind) for i in range(points)]


def worth(surrogate, configs: list[dict]):
    """The model's true val_bpb of each configuration; infinite where it more likely crashes than not."""
    import numpy as np

    mean, _, crash = surrogate.predict(configs)
    return np.where(crash < 0.5, mean, np.inf)


def ceiling(
    model: Path, profile: str, draws: int = 20_000, starts: int = 20, seed: int = 0
) -> tuple[float, float, dict]:
    """(the baseline's true val_bpb, the best value the model knows, its configuration): the best `starts` of
    `draws` random configurations of train.py's space, each improved one dimension at a time (each tried at every
    `grid` value) until no move helps, and the best they reach.
    Their difference is the ceiling of any arm's improvement on this landscape."""
    import random

    from model import Surrogate

    from orchestrator.proposers.random_search import sample
    from orchestrator.proposers.space import read_space, rounded

    space, default = read_space((ROOT / "train.py").read_text(), profile)
    surrogate, rng = Surrogate.load(model), random.Random(seed)
    configs = [{n: rounded(sample(p, rng), p.kind) for n, p in space.items()} for _ in range(draws)]
    configs.append(default)
    values = worth(surrogate, configs)
    found: list[tuple[float, dict]] = []
    for start in [*values.argsort()[:starts], len(configs) - 1]:  # local optima: several starts, the default's
        best, value, improved = configs[int(start)], float(values[start]), True
        while improved:
            improved = False
            for name, p in space.items():
                moves = [{**best, name: v} for v in grid(p)]
                tried = worth(surrogate, moves)
                if float(tried.min()) < value - 1e-9:
                    best, value, improved = moves[int(tried.argmin())], float(tried.min()), True
        found.append((value, best))
    value, best = min(found, key=lambda f: f[0])
    return float(surrogate.predict([default])[0][0]), value, best


def report(args, results: list[dict], wall: float) -> None:
    from scipy.stats import wilcoxon

    checkpoints = [k for k in (int(c) for c in args.checkpoints.split(",")) if k <= args.runs]
    print(
        f"\n{args.surrogate.name}: {args.runs} runs per arm, methods {args.methods}"
        + (f", drift +-{args.drift:g} baseline sd over {args.period} runs" if args.drift else "")
        + (f", noise x{args.noise_scale:g}" if args.noise_scale != 1 else "")
        + f"; {wall:.0f} s"
    )
    arms = [a for a in ARMS if any(r["arm"] == a for r in results)]
    base, top, _ = ceiling(args.surrogate, args.profile)
    print(
        f"the baseline's true val_bpb {base:.4f}; the best configuration the model knows {top:.4f}: the ceiling of "
        f"any arm's improvement is {base - top:.4f}"
    )
    for method in args.methods.split(","):
        mine = [r for r in results if r["method"] == method]
        seeds = set.intersection(*({r["seed"] for r in mine if r["arm"] == arm} for arm in arms)) if arms else set()
        if not seeds:  # paired: the seeds every arm has
            print(f"\n{method}: no seed that every arm has")
            continue
        by = {
            arm: sorted((r for r in mine if r["arm"] == arm and r["seed"] in seeds), key=lambda r: r["seed"])
            for arm in arms
        }
        print(
            f"\n{method} ({len(seeds)} paired seeds): true improvement (baseline minus kept best, noise-free), "
            "median [quartiles]"
        )
        print(f"{'arm':13s} " + " ".join(f"{'after ' + str(k) + ' runs':>26s}" for k in checkpoints))
        for arm, runs in by.items():
            print(f"{arm:13s} " + " ".join(f"{quartiles([improvement(r, k) for r in runs]):>26s}" for k in checkpoints))
        for arm, runs in by.items():
            shares = [statistics.median(improvement(r, k) for r in runs) / max(base - top, 1e-9) for k in checkpoints]
            print(f"{arm:13s} share of the ceiling (its median): " + " / ".join(f"{s:.0%}" for s in shares))
        for arm in (a for a in arms if a != "upstream" and "upstream" in by):
            for k in checkpoints:
                a = [improvement(r, k) for r in by[arm]]
                b = [improvement(r, k) for r in by["upstream"]]
                diff = [x - y for x, y in zip(a, b)]
                p = wilcoxon(a, b, alternative="greater").pvalue if any(diff) else 1.0
                ratio = statistics.median(a) / statistics.median(b) if statistics.median(b) > 0 else float("inf")
                print(
                    f"{arm} vs upstream after {k:3d} runs' worth: better on {sum(d > 0 for d in diff)}/{len(diff)} "
                    f"seeds (worse on {sum(d < 0 for d in diff)}), median difference {statistics.median(diff):+.4f}, "
                    f"ratio of medians {ratio:.2f}, Wilcoxon one-sided p = {p:.3g}"
                )
        for arm, runs in by.items():
            keeps = [k for r in runs for k in r["keeps"] if k[0] is not None]
            false = sum(after >= before for before, after in keeps)
            ideas = sum(len(r["candidates"]) for r in runs)
            compute = sum(sum(costs(r)) for r in runs)
            better = [c for r in runs for c in r["candidates"] if c[0] > 0]
            stopped = sum(bool(c[2:] and c[2]) for c in better)
            strong = [c for c in better if c[0] >= 2 * args.baseline_sd]
            short = sum(sum(costs(r)) < args.runs - 1e-9 for r in runs)
            print(
                f"{arm:13s} keeps {len(keeps)}, false keeps {false} ({100 * false / max(1, len(keeps)):.0f}%), "
                f"ideas judged per 100 runs' worth {100 * ideas / max(compute, 1e-9):.1f}, truly better ideas "
                f"stopped early {stopped}/{len(better)} (of those better by 2 sd or more: kept "
                f"{sum(c[1] for c in strong)}/{len(strong)}, stopped {sum(bool(c[2:] and c[2]) for c in strong)}), "
                "runs stopped early "
                f"{sum(c < 1 for r in runs for c in r.get('cost', []))}"
                + (f"; {short} sessions ran out of runs before {args.runs} runs' worth" if short else "")
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--surrogate", type=Path, required=True, help="a fitted surrogate (.npz)")
    ap.add_argument("--profile", default="tiny", choices=["gpu", "cpu", "tiny"])
    ap.add_argument("--methods", default="search", help="comma-separated proposers (search, tpe, ...)")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=100, help="runs' worth of compute per session")
    ap.add_argument("--checkpoints", default="30,100,300", help="report the improvement after these many runs")
    ap.add_argument("--drift", type=float, default=0.0, help="a drifting machine: amplitude in baseline sd")
    ap.add_argument("--period", type=int, default=40, help="the drift's period, in runs")
    ap.add_argument(
        "--noise-scale", type=float, default=1.0, help="runs this many times noisier than measured (a stress test)"
    )
    ap.add_argument("--jobs", type=int, default=1, help="sessions at once")
    ap.add_argument("--bundle", type=int, default=3, help="near misses per bundle (0: no bundles; --bundle)")
    ap.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON here")
    ap.add_argument(
        "--arms", default=",".join(ARMS), help="the arms to run (comma-separated); others may come from --reuse"
    )
    ap.add_argument(
        "--reuse", type=Path, default=None, help="an earlier --out: its sessions of the arms not run now (same seeds)"
    )
    args = ap.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    if set(args.arms) - set(ARMS) or not (args.arms or args.reuse):
        ap.error(f"--arms: some of {', '.join(ARMS)} (none: only --reuse's, reported again)")
    if args.seeds < 1 or args.runs < 2 or args.period < 1 or args.jobs < 1 or args.noise_scale < 0:
        ap.error("--seeds, --period and --jobs must be 1 or more, --runs 2 or more, --noise-scale 0 or more")
    if not args.surrogate.exists():
        ap.error(f"no surrogate at {args.surrogate} (benchmarks/surrogate/ holds the fitted ones)")
    from model import Surrogate

    from orchestrator.proposers.space import read_space

    _, default = read_space((ROOT / "train.py").read_text(), args.profile)
    baseline_sd = args.baseline_sd = float(Surrogate.load(args.surrogate).predict([default])[1][0])
    drift = (args.drift * baseline_sd, args.period)
    earlier = json.loads(args.reuse.read_text())["results"] if args.reuse else []  # before --out may replace it
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs, initializer=die_with_parent) as pool:
        jobs = [
            (
                arm,
                str(args.surrogate.resolve()),
                args.profile,
                method,
                gate,
                seed,
                args.runs if stop == "off" else int(STOPPED_RUNS * args.runs),
                tmp,
                args.noise_scale,
                None,
                drift,
                stop,
                None if stop == "off" else args.runs,
                {},
                {"bundle": args.bundle},
            )
            for seed in range(args.first_seed, args.first_seed + args.seeds)
            for method in args.methods.split(",")
            for arm, (gate, stop) in ARMS.items()
            if arm in args.arms
        ]
        jobs = [(j[0], *j[1:5], j[5], j[6], str(Path(tmp) / j[0]), *j[8:]) for j in jobs]
        for arm in ARMS:
            (Path(tmp) / arm).mkdir()
        results = [r for r in earlier if r["arm"] not in args.arms]
        for done in as_completed([pool.submit(session, job) for job in jobs]):  # --out kept up as sessions end
            results.append(done.result())
            save(args, results)
    report(args, results, time.monotonic() - t0)
    save(args, results)
    return 0


def save(args, results: list[dict]) -> None:
    """The raw results as JSON at --out, replaced whole (report them again with `--arms '' --reuse FILE`)."""
    if args.out:
        part = args.out.with_name(args.out.name + ".part")
        part.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
        os.replace(part, args.out)


if __name__ == "__main__":
    sys.exit(main())
