"""Is the hybrid better than its parts? `--proposer hybrid` against the search alone and the (simulated) LLM
alone, on a surrogate of train.py, with paired seeds.

The LLM is simulated (benchmarks/surrogate/simllm.py): informed moves of 2-3 constants at once by large steps,
30% repeats of its own earlier ideas, 10% broken edits; no LLM is called. Each arm drives the real controller
(gate, ledger, git, idea memory) with the surrogate's fake train.py, as search_quality.py does. Reported: the
true improvement (the baseline's noise-free val_bpb minus the kept best's) after 30 and --experiments
runs' worth of compute and after --runs (duplicate rows and edits that did not compile cost nothing; a session
goes on until its compute is spent), median [quartiles]; the paired one-sided Wilcoxon test of the hybrid against
the better of its parts; the repeats the memory caught (rows at no cost); the hybrid's allocation.

    python benchmarks/hybrid_value.py --surrogate benchmarks/surrogate/tiny-5s.npz --seeds 20 --jobs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "surrogate")]

from night_value import improvement, quartiles  # noqa: E402
from search_quality import die_with_parent, surrogate_session  # noqa: E402

SIM = "simllm:SimulatedLLM"
FREE_ROWS = 3  # a session's rows at most, per runs' worth of compute (duplicates and broken edits cost nothing)
ARMS = {  # arm -> (proposer, its options)
    "search": ("search", {}),
    "llm": (SIM, {}),
    "hybrid": ("hybrid", {"hybrid_llm": SIM}),
}


def session(job: tuple) -> dict:
    arm, model, *rest = job
    os.environ["AUTOLOOP_SIM_MODEL"] = model
    result = surrogate_session((model, *rest))
    result["arm"] = arm
    return result


def report(args, results: list[dict], wall: float) -> None:
    from scipy.stats import wilcoxon

    arms = [a for a in ARMS if any(r["arm"] == a for r in results)]
    by = {arm: sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"]) for arm in arms}
    checkpoints = [30, args.runs]
    print(f"\n{args.surrogate.name}: {args.seeds} paired seeds x {args.runs} runs' worth; {wall:.0f} s")
    print(f"{'arm':8s} " + " ".join(f"{'after ' + str(k):>26s}" for k in checkpoints) + "  repeats caught  crashes")
    for arm, runs in by.items():
        print(
            f"{arm:8s} "
            + " ".join(f"{quartiles([improvement(r, k) for r in runs]):>26s}" for k in checkpoints)
            + f"  {sum(r['duplicates'] for r in runs):>14d}  {sum(r['crashes'] for r in runs):>7d}"
        )
    for k in checkpoints if {"hybrid", "search", "llm"} <= set(arms) else []:
        better = max(("search", "llm"), key=lambda a: statistics.median(improvement(r, k) for r in by[a]))
        a = [improvement(r, k) for r in by["hybrid"]]
        b = [improvement(r, k) for r in by[better]]
        diff = [x - y for x, y in zip(a, b)]
        p = wilcoxon(a, b, alternative="greater").pvalue if any(diff) else 1.0
        print(
            f"hybrid vs {better} (the better part) after {k}: better on {sum(d > 0 for d in diff)}/{len(diff)} seeds "
            f"(worse on {sum(d < 0 for d in diff)}), median difference {statistics.median(diff):+.4f}, "
            f"Wilcoxon one-sided p = {p:.3g}"
        )
    sources = Counter(s for r in by.get("hybrid", []) for s in r["sources"])
    print(f"hybrid's ideas by source: {dict(sources)}")
    gains = Counter()
    for r in by.get("hybrid", []):
        for source, gain in r.get("keep_sources", []):
            gains[source] += gain
    keeps = Counter(source for r in by.get("hybrid", []) for source, _ in r.get("keep_sources", []))
    print(f"hybrid's keeps by source: {dict(keeps)}; their true gain: { {k: round(v, 3) for k, v in gains.items()} }")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--surrogate", type=Path, required=True, help="a fitted surrogate (.npz)")
    ap.add_argument("--profile", default="tiny", choices=["gpu", "cpu", "tiny"])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--runs", type=int, default=100, help="runs' worth of compute per session")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"a comma-separated subset of {', '.join(ARMS)}")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--gate", default="noise", choices=["noise", "value"], help="the keep rule of every arm")
    ap.add_argument("--bundle", type=int, default=3, help="near misses per bundle (0: no bundles; --bundle)")
    ap.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON here")
    ap.add_argument(
        "--reuse", type=Path, default=None, help="an earlier --out: its sessions of the arms not run now (same seeds)"
    )
    args = ap.parse_args()
    arms = args.arms.split(",")
    if args.seeds < 1 or args.runs < 31 or args.jobs < 1:
        ap.error("--seeds and --jobs must be 1 or more, --runs more than 30")
    if not arms or set(arms) - set(ARMS):
        ap.error(f"--arms takes a comma-separated subset of {', '.join(ARMS)}, not {args.arms!r}")
    if not args.surrogate.exists():
        ap.error(f"no surrogate at {args.surrogate} (benchmarks/surrogate/ holds the fitted ones)")
    model = str(args.surrogate.resolve())
    if args.reuse:  # its sessions must be of the same landscape and compute
        saved = json.loads(args.reuse.read_text())
        same = {"surrogate": args.surrogate.name, "runs": str(args.runs), "profile": args.profile}
        theirs = {**saved["args"], "surrogate": Path(saved["args"].get("surrogate", "")).name}
        if {k: theirs.get(k) for k in same} != same:
            ap.error(f"--reuse {args.reuse} was run with other settings ({saved['args']}): run every arm again")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs, initializer=die_with_parent) as pool:
        jobs = []
        for seed in range(args.seeds):
            for arm in arms:
                proposer, options = ARMS[arm]
                where = Path(tmp) / arm
                where.mkdir(exist_ok=True)
                jobs.append(
                    (
                        arm,
                        model,
                        args.profile,
                        proposer,
                        args.gate,
                        seed,
                        FREE_ROWS * args.runs,
                        str(where),
                        1.0,
                        None,
                        (0.0, 40),
                        "off",
                        args.runs,
                        options,
                        {"bundle": args.bundle},
                    )
                )
        results = list(pool.map(session, jobs))
    if args.reuse:
        earlier = saved["results"]
        results += [r for r in earlier if r["arm"] not in arms and r["seed"] < args.seeds]
    report(args, results, time.monotonic() - t0)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
