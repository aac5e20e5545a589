"""Compare proposers at equal budget on this machine: `search` vs random search vs optuna's TPE.

Each (method, seed) runs a fresh session of the real train.py from the same baseline commit and reports the
best val_bpb improvement over that session's own baseline. Methods are interleaved per seed, so machine noise
hits them alike.

    python benchmarks/search_quality.py --budget 8 --experiments 16 --seeds 3 --profile tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.contract import make_git_repo
from orchestrator.ledger import read_rows
from orchestrator.loop import Settings, run_loop
from orchestrator.noise import Gate

ROOT = Path(__file__).resolve().parent.parent


def fresh_repo(where: Path) -> Path:
    return make_git_repo(where, {name: (ROOT / name).read_text() for name in ("prepare.py", "train.py", ".gitignore")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=8.0, help="training seconds per experiment")
    ap.add_argument("--experiments", type=int, default=16, help="experiments per session (baseline included)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--profile", default="tiny", choices=["gpu", "cpu", "tiny"])
    ap.add_argument("--timeout", type=float, default=None,
                    help="hard limit per run (default 3 x budget + 30 s): huge sampled models time out alike")
    ap.add_argument("--methods", default="search,random,tpe")
    ap.add_argument("--gate", default="strict", choices=["noise", "strict"],
                    help="keep rule for every method (strict: short sessions keep something to compare)")
    ap.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON here")
    args = ap.parse_args()
    methods = args.methods.split(",")
    results: dict[str, list[float]] = {m: [] for m in methods}
    crashes: dict[str, int] = {m: 0 for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("AUTOLOOP_CACHE", str(Path(tmp) / "cache"))
        t0 = time.monotonic()
        for seed in range(args.seeds):
            for method in methods:
                repo = fresh_repo(Path(tmp) / f"{method}-{seed}")
                settings = Settings(repo=repo, tag="bench", budget=args.budget, max_experiments=args.experiments,
                                    proposer=method, profile=args.profile, seed=seed,
                                    timeout=args.timeout or 3 * args.budget + 30, gate=Gate(mode=args.gate),
                                    baseline_repeats=0 if args.gate == "strict" else 2)
                run_loop(settings, echo=lambda line: None)
                rows = read_rows(repo / "results.tsv")
                kept = [r.val_bpb for r in rows if r.status == "keep"]
                results[method].append(kept[0] - min(kept))
                crashes[method] += sum(r.status == "crash" for r in rows)
                print(f"[{time.monotonic() - t0:6.0f}s] seed {seed} {method:7s} baseline {kept[0]:.4f} "
                      f"best {min(kept):.4f} improvement {kept[0] - min(kept):.4f} "
                      f"crashes {sum(r.status == 'crash' for r in rows)}", flush=True)
    print(f"\n{args.seeds} seeds x {args.experiments} experiments x {args.budget:g}s, profile {args.profile}")
    print(f"{'method':8s} {'median':>8s} {'min':>8s} {'max':>8s} {'crashes':>8s}  per seed")
    for m in methods:
        v = results[m]
        print(f"{m:8s} {statistics.median(v):8.4f} {min(v):8.4f} {max(v):8.4f} {crashes[m]:8d}  "
              + " ".join(f"{x:.4f}" for x in v))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "improvement": results,
                                        "crashes": crashes}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
