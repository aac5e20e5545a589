"""Run-to-run spread of one configuration: the same train.py run N times with the controller's fixed seed.

Runs the baseline and a high-learning-rate variant (every *_LR doubled), interleaved so machine noise hits
both alike, and prints per configuration: the val_bpb of each run, mean, standard deviation, range and the
optimizer steps each run took. Point --train at an older train.py (e.g. `git show REV:train.py > old.py`) to
measure the spread before a change.

Then the sd of the difference of two runs of one configuration (over every pair of its runs), as measured and
adjusted for the steps each run reached (core/steps.py: val_bpb moved to the configuration's median step count
along the slope of val_bpb on steps; the slope fitted on the *other* configuration's runs, so a configuration's
own noise never fits its own adjustment).

    python benchmarks/noise_spread.py --runs 5 --budget 60 --profile cpu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LR_NAMES = ("MATRIX_LR", "EMBEDDING_LR", "UNEMBEDDING_LR", "SCALAR_LR")


def variant(source: str, factor: float) -> str:
    """train.py with every learning rate multiplied by `factor`."""
    for name in LR_NAMES:
        pattern = re.compile(rf"^{name} = ([0-9.e-]+)", re.M)
        value = float(pattern.search(source).group(1))
        source = pattern.sub(f"{name} = {value * factor:g}", source, count=1)
    return source


def run_once(workdir: Path, budget: float, profile: str, timeout: float) -> dict:
    env = {**os.environ, "AUTOLOOP_TIME_BUDGET": str(budget), "AUTOLOOP_PROFILE": profile}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "train.py"], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout
    )
    found = dict(re.findall(r"^(\w+):\s+(\S+)$", proc.stdout, re.M))
    if proc.returncode or "val_bpb" not in found:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"crash": " | ".join(tail), "wall": time.monotonic() - t0}
    return {
        "val_bpb": float(found["val_bpb"]),
        "steps": int(found["num_steps"]),
        "training_seconds": float(found["training_seconds"]),
        "wall": time.monotonic() - t0,
    }


def pair_sd(values: list[float]) -> float:
    """The sd of the difference of two runs: the root mean square over every pair (the mean difference is 0)."""
    diffs = [a - b for i, a in enumerate(values) for b in values[i + 1 :]]
    return (sum(d * d for d in diffs) / len(diffs)) ** 0.5 if diffs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs per configuration")
    ap.add_argument("--budget", type=float, default=60.0, help="training seconds per run")
    ap.add_argument("--profile", default="cpu", choices=["gpu", "cpu", "tiny"])
    ap.add_argument("--train", type=Path, default=ROOT / "train.py", help="the train.py to measure")
    ap.add_argument("--lr-factor", type=float, default=2.0, help="the variant's learning rates x this")
    ap.add_argument("--out", type=Path, default=None, help="also write the runs as JSON here")
    args = ap.parse_args()
    source = args.train.read_text()
    configs = {"baseline": source, f"lr x{args.lr_factor:g}": variant(source, args.lr_factor)}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for i, (name, text) in enumerate(configs.items()):
            d = Path(tmp) / f"c{i}"
            d.mkdir()
            shutil.copy(ROOT / "prepare.py", d / "prepare.py")
            shutil.copy(ROOT / "evaluate.py", d / "evaluate.py")
            (d / "train.py").write_text(text)
            dirs[name] = d
        t0 = time.monotonic()
        for k in range(args.runs):
            for name, d in dirs.items():
                r = run_once(d, args.budget, args.profile, timeout=4 * args.budget + 120)
                runs[name].append(r)
                shown = f"{r['val_bpb']:.4f} in {r['steps']} steps" if "val_bpb" in r else f"crash: {r['crash']}"
                print(f"[{time.monotonic() - t0:5.0f}s] run {k + 1} {name:10s} {shown}", flush=True)
    print(f"\n{args.runs} runs x {args.budget:g}s, profile {args.profile}, {args.train}")
    print(f"{'config':10s} {'mean':>7s} {'sd':>7s} {'range':>7s} {'steps':>11s}  runs")
    for name, rs in runs.items():
        v = [r["val_bpb"] for r in rs if "val_bpb" in r]
        steps = [r["steps"] for r in rs if "steps" in r]
        if len(v) < 2:
            print(f"{name:10s} fewer than 2 runs finished")
            continue
        print(
            f"{name:10s} {statistics.fmean(v):7.4f} {statistics.stdev(v):7.4f} {max(v) - min(v):7.4f} "
            f"{min(steps):5d}-{max(steps):<5d}  " + " ".join(f"{x:.4f}" for x in v)
        )
    print("\nsd of the difference of two runs of one configuration (every pair), measured -> adjusted for steps")
    from orchestrator.core import steps

    points = {name: [(float(r["steps"]), r["val_bpb"]) for r in rs if "val_bpb" in r] for name, rs in runs.items()}
    for name, own in points.items():
        others = [p for n, p in points.items() if n != name]
        centre = statistics.median(s for s, _ in own) if own else None
        fit = steps.fit(others, centre)  # the slope from the other configuration's runs only (cross-fitted)
        if len(own) < 2:
            print(f"{name:10s} fewer than 2 runs")
            continue
        raw = [v for _, v in own]
        adjusted = [steps.adjust(fit, s, v) for s, v in own] if fit else raw
        how = (
            f"slope {fit.slope:+.5f}/step (se {fit.se:.5f}) from the other configuration, to {centre:g} steps"
            if fit
            else "no slope clear of zero in the other configuration: nothing adjusted"
        )
        before, after = pair_sd(raw), pair_sd(adjusted)
        print(f"{name:10s} {before:.4f} -> {after:.4f} ({after / before:.0%}); {how}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
