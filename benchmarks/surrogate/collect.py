"""Collect real runs of the real train.py for a surrogate benchmark: what a configuration scores, how much that
varies between runs of it, and whether it crashes.

Three kinds of configurations, over the ranges train.py declares for the profile:
- a space-filling sample (a scrambled Sobol' sequence, in each dimension's natural scale: log for rates),
- local moves around the default (one dimension at a time, a step either way), the neighbourhood a search
  spends most of its runs in,
- repeats: the default and a few of the above run `--repeats` times, for the spread *per configuration*.

Runs are interleaved in a seeded random order (drift in the machine's speed hits every kind alike) and
appended to a CSV as they finish, so an interrupted collection resumes where it stopped. Each row: the
configuration, val_bpb (empty for a crash), the crash's last line, optimizer steps, training seconds, wall
time, and the training loss curve: loss@0.1 .. loss@1.0, the smoothed loss train.py printed at those fractions
of its planned steps (orchestrator/core/progress.py: parse_curve; empty where it printed none near one, a
crash's up to where it failed).

    python benchmarks/surrogate/collect.py --profile tiny --budget 10 --out benchmarks/surrogate/tiny-10s.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from orchestrator.core.progress import CURVE_KEYS, parse_curve  # noqa: E402
from orchestrator.proposers.space import Param, apply_changes, read_space, rounded  # noqa: E402

CURVE_COLUMNS = {key: f"loss@{key}" for key in CURVE_KEYS}  # the record's curve key -> the CSV column


def from_unit(p: Param, u: float):
    """The value at quantile u in [0, 1) of the dimension, in its natural scale (as random search samples it)."""
    if p.kind == "choice":
        return p.choices[min(int(u * len(p.choices)), len(p.choices) - 1)]
    if p.kind == "log":
        return math.exp(math.log(p.low) + u * (math.log(p.high) - math.log(p.low)))
    if p.kind == "linear":
        return p.low + u * (p.high - p.low)
    if p.kind == "pow2":
        lo, hi = math.ceil(math.log2(max(p.low, 1))), math.floor(math.log2(p.high))
        return 2 ** min(hi, lo + int(u * (hi - lo + 1)))
    if p.kind == "int":
        lo, hi = int(p.low), int(p.high)
        return min(hi, lo + int(u * (hi - lo + 1)))
    return 1 - math.exp(math.log(1 - p.low) + u * (math.log(1 - p.high) - math.log(1 - p.low)))  # unit


def neighbours(p: Param, value) -> list:
    """One step either way from `value`: x/2 and x*2 for rates and powers of two, +-1 for integers, +-10% of
    the range for linear values, every other choice."""
    if p.kind == "choice":
        return [c for c in p.choices if c != value]
    if p.kind in ("log", "pow2"):
        out = [value / 2, value * 2]
    elif p.kind == "int":
        out = [value - 1, value + 1]
    elif p.kind == "linear":
        out = [value - 0.1 * (p.high - p.low), value + 0.1 * (p.high - p.low)]
    else:  # unit: a tuple element such as a beta, stepped in 1 - x
        out = [1 - (1 - value) * 2, 1 - (1 - value) / 2]
    out = [rounded(p.clip(v), p.kind) for v in out]
    return [v for i, v in enumerate(out) if v != value and v not in out[:i]]


def design(space: dict[str, Param], default: dict, sobol: int, repeats: int, repeated: int, seed: int) -> list[dict]:
    """The runs to make: [{"kind", "config_id", "config"}], in a seeded random order."""
    from scipy.stats import qmc

    names = sorted(space)
    points = qmc.Sobol(d=len(names), scramble=True, seed=seed).random(sobol)
    filling = [{n: rounded(from_unit(space[n], float(u)), space[n].kind) for n, u in zip(names, row)} for row in points]
    local = [{**default, n: v} for n in names for v in neighbours(space[n], default[n])]
    rng = random.Random(seed)
    configs = [("default", default)] + [("sobol", c) for c in filling] + [("local", c) for c in local]
    runs = [{"kind": kind, "config_id": i, "config": c} for i, (kind, c) in enumerate(configs)]
    chosen = (
        [0]
        + rng.sample(range(1, 1 + sobol), min(repeated // 2, sobol))
        + rng.sample(range(1 + sobol, len(configs)), min(repeated - repeated // 2 - 1, len(local)))
    )
    runs += [dict(runs[i]) for i in chosen for _ in range(repeats - 1)]
    rng.shuffle(runs)
    return runs


def run_once(workdir: Path, budget: float, profile: str, timeout: float, env: dict | None = None) -> dict:
    """One run of workdir/train.py (`env` adds to the environment, e.g. AUTOLOOP_SEED): its result as a row."""
    env = {**os.environ, "AUTOLOOP_TIME_BUDGET": str(budget), "AUTOLOOP_PROFILE": profile, **(env or {})}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "train.py"], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout
        )
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, code = f"{e.stdout or ''}\ntimeout after {timeout:.0f}s", -9
    found = dict(re.findall(r"^(\w+):\s+(\S+)$", out, re.M))
    wall = time.monotonic() - t0
    curve = parse_curve(out)
    losses = {column: curve.get(key, "") for key, column in CURVE_COLUMNS.items()}
    if code or "val_bpb" not in found or not math.isfinite(float(found["val_bpb"])):
        last = next((line for line in reversed(out.strip().splitlines()) if line.strip()), f"exit code {code}")
        return {
            "val_bpb": "",
            "crash": last.strip()[:200],
            "steps": "",
            "training_seconds": "",
            "wall": f"{wall:.1f}",
            **losses,
        }
    return {
        "val_bpb": found["val_bpb"],
        "crash": "",
        "steps": found.get("num_steps", ""),
        "training_seconds": found.get("training_seconds", ""),
        "params_M": found.get("num_params_M", ""),
        "wall": f"{wall:.1f}",
        **losses,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", choices=["gpu", "cpu", "tiny"])
    ap.add_argument("--budget", type=float, default=10.0, help="training seconds per run")
    ap.add_argument("--sobol", type=int, default=64, help="space-filling configurations")
    ap.add_argument("--repeats", type=int, default=4, help="runs of each repeated configuration")
    ap.add_argument("--repeated", type=int, default=8, help="configurations run --repeats times (the default too)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="stop after this many runs (all: leave out)")
    ap.add_argument("--out", type=Path, required=True, help="the CSV to append to (resumed if it exists)")
    args = ap.parse_args()
    source = (ROOT / "train.py").read_text()
    space, default = read_space(source, args.profile)
    runs = design(space, default, args.sobol, args.repeats, args.repeated, args.seed)
    names = sorted(space)
    fields = [
        "run",
        "kind",
        "config_id",
        *names,
        "val_bpb",
        "crash",
        "steps",
        "training_seconds",
        "params_M",
        "wall",
        "budget",
        "profile",
        *CURVE_COLUMNS.values(),
    ]
    done = 0
    if args.out.exists():
        with args.out.open() as f:
            reader = csv.DictReader(f)
            done = sum(1 for _ in reader)
            if reader.fieldnames:  # rows go on under the file's own header (one from before a column was added)
                if missing := [c for c in fields if c not in reader.fieldnames]:
                    print(
                        f"{args.out} predates the columns {', '.join(missing)}: its new rows go without them",
                        flush=True,
                    )
                fields = list(reader.fieldnames)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            csv.DictWriter(f, fields).writeheader()
    todo = runs[done : args.limit]
    print(
        f"{len(runs)} runs planned ({len(space)} dimensions, profile {args.profile}, {args.budget:g}s each); "
        f"{done} done, {len(todo)} to go",
        flush=True,
    )
    prepared = subprocess.run(
        [sys.executable, str(ROOT / "prepare.py"), "--profile", args.profile], text=True, capture_output=True
    )
    if prepared.returncode:  # every run would crash on the missing data: say so once instead
        sys.exit(f"collect.py: prepare.py --profile {args.profile} failed:\n{prepared.stdout}{prepared.stderr}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shutil.copy(ROOT / "prepare.py", work / "prepare.py")
        shutil.copy(ROOT / "evaluate.py", work / "evaluate.py")
        for k, run in enumerate(todo, start=done + 1):
            config = run["config"]
            changes = {n: v for n, v in config.items() if v != default[n]}
            (work / "train.py").write_text(apply_changes(source, args.profile, changes))
            result = run_once(work, args.budget, args.profile, timeout=3 * args.budget + 60)
            row = {
                "run": k,
                "kind": run["kind"],
                "config_id": run["config_id"],
                **config,
                **result,
                "budget": args.budget,
                "profile": args.profile,
            }
            with args.out.open("a", newline="") as f:
                csv.DictWriter(f, fields, extrasaction="ignore").writerow(row)
            shown = f"val_bpb {result['val_bpb']}" if result["val_bpb"] else f"crash: {result['crash'][:80]}"
            print(
                f"[{time.monotonic() - t0:6.0f}s] {k}/{len(runs)} {run['kind']:7s} #{run['config_id']:<3d} {shown}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
