"""Run-to-run spread of one configuration: the same train.py run N times with the controller's fixed seed.

Runs the baseline and a high-learning-rate variant (every *_LR doubled), interleaved so machine noise hits
both alike, and prints per configuration: the val_bpb of each run, mean, standard deviation, range and the
optimizer steps each run took. Point --train at an older train.py (e.g. `git show REV:train.py > old.py`) to
measure the spread before a change.

Then the sd of the difference of two runs of one configuration (over every pair of its runs), as measured and
adjusted for the machine's load: val_bpb moved to a CPU share of 1 along the slope of val_bpb on the run's share
of the CPU while it was ready to run (the controller's runner measures it: executors/runner.CpuShare), the slope
fitted on the *other* configuration's runs, so a configuration's own noise never fits its own adjustment. (The
gates do not adjust values so: docs/trust.md, "Values adjusted for the load: measured, refused".)

Each run runs under the controller's runner (executors/runner.py). With --load N, busy processes beside the
runs make the machine's load vary as a shared machine's does: the k-th pair of runs has k mod (N + 1) of them.

    python benchmarks/noise_spread.py --runs 5 --budget 60 --profile cpu
    OMP_NUM_THREADS=1 python benchmarks/noise_spread.py --runs 12 --budget 30 --profile tiny --load 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
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
    from orchestrator.executors.runner import run_command

    env = {**os.environ, "AUTOLOOP_TIME_BUDGET": str(budget), "AUTOLOOP_PROFILE": profile}
    log = workdir / "run.log"
    result = run_command([sys.executable, "train.py"], workdir, env, log, timeout)
    text = log.read_text(errors="replace")
    found = dict(re.findall(r"^(\w+):\s+(\S+)$", text, re.M))
    if result.exit_code or "val_bpb" not in found:
        return {"crash": " | ".join(text.strip().splitlines()[-3:]), "wall": result.wall_s}
    return {
        "val_bpb": float(found["val_bpb"]),
        "steps": int(found["num_steps"]),
        "training_seconds": float(found["training_seconds"]),
        "cpu_share": result.cpu_share,
        "cpu_outside": result.cpu_outside,
        "wall": result.wall_s,
    }


BURN = (  # ends once OWNER has
    "import os\nwhile True:\n    try:\n        os.kill(OWNER, 0)\n    except OSError:\n        break\n"
    "    sum(range(200_000))\n"
)


def load_beside(n: int) -> list[int]:
    """n busy processes (one core each), as other users' jobs: each in a session of its own and orphaned at once,
    so not a descendant of this process (the runner counts the CPU of such processes as the machine's load);
    they end with this benchmark, even a killed one. Returns their pids."""
    code = BURN.replace("OWNER", str(os.getpid()))
    pids = []
    for _ in range(n):
        started = subprocess.run(
            ["sh", "-c", 'setsid "$1" -c "$2" >/dev/null 2>&1 & echo $!', "sh", sys.executable, code],
            capture_output=True,
            text=True,
            check=True,
        )
        pids.append(int(started.stdout))
    return pids


def load_slope(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """The least-squares slope of val_bpb on the CPU share over (share, val_bpb) runs of one configuration and
    its standard error; None where the shares do not vary."""
    if len(points) < 3:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in points) / (len(points) - 2)
    return slope, (residual / sxx) ** 0.5


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
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the k-th pair of runs: k mod (N + 1)")
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
                busy = load_beside(k % (args.load + 1))
                try:
                    r = run_once(d, args.budget, args.profile, timeout=4 * args.budget + 120)
                finally:
                    for pid in busy:
                        os.kill(pid, signal.SIGKILL)
                r["load"] = len(busy)
                runs[name].append(r)
                shown = (
                    f"{r['val_bpb']:.4f} in {r['steps']} steps, CPU share {r['cpu_share'] or 0:.3f}, "
                    f"others {r['cpu_outside'] or 0:.1f} CPUs"
                    if "val_bpb" in r
                    else f"crash: {r['crash']}"
                )
                print(f"[{time.monotonic() - t0:5.0f}s] run {k + 1} {name:10s} {shown} ({len(busy)} busy)", flush=True)
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
    print("\nsd of the difference of two runs of one configuration (every pair), measured -> adjusted for the load")
    points = {
        name: [(r["cpu_share"], r["val_bpb"]) for r in rs if "val_bpb" in r and r.get("cpu_share")]
        for name, rs in runs.items()
    }
    for name, own in points.items():
        if len(own) < 2:
            print(f"{name:10s} fewer than 2 runs")
            continue
        fit = load_slope(own)
        mine = f"its own slope {fit[0]:+.4f} per unit of CPU share (se {fit[1]:.4f}); " if fit else ""
        other = load_slope([p for n, ps in points.items() if n != name for p in ps])  # cross-fitted
        raw = [v for _, v in own]
        adjusted = [v - other[0] * (x - 1.0) for x, v in own] if other else raw
        before, after = pair_sd(raw), pair_sd(adjusted)
        how = f"the other's slope {other[0]:+.4f} (se {other[1]:.4f})" if other else "no slope from the other"
        print(f"{name:10s} {before:.4f} -> {after:.4f} ({after / before:.0%}); {mine}{how}")
    from orchestrator.core.state import CPU_OUTSIDE, CPU_SHARE, waited
    from orchestrator.store.ledger import Record

    def as_record(r: dict) -> Record:  # what the gates read of a run
        measured = {CPU_SHARE: r["cpu_share"], CPU_OUTSIDE: r.get("cpu_outside")}
        return Record(n=0, status="discard", description="", commit="", metrics=measured, timings={"train": r["wall"]})

    usual = statistics.median(x for own in points.values() for x, _ in own)
    print(f"\nthe same, of runs the gates count (not those that waited on a busy machine; usual share {usual:.2f})")
    for name, rs in runs.items():
        done = [r for r in rs if "val_bpb" in r and r.get("cpu_share")]
        counted = [r["val_bpb"] for r in done if not waited(as_record(r), usual)]
        before, after = pair_sd([r["val_bpb"] for r in done]), pair_sd(counted)
        print(f"{name:10s} {before:.4f} -> {after:.4f} ({len(counted)} of {len(done)} runs)")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
