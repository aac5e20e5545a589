"""Measure the controller's own cost: overhead per experiment and duty cycle of the training slot.

A fake train.py sleeps for the budget and prints the summary block, so everything else is the loop's doing.

    python benchmarks/loop_overhead.py --budget 30 --experiments 6
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from orchestrator.ledger import read_record
from orchestrator.loop import Settings, run_loop
from orchestrator.session import Paths

FAKE_TRAIN = '''"""fake train.py: sleeps for the budget, prints the summary"""
import os, time

# Hyperparameters
LR = 0.01  # learning rate  [0.0001, 1.0]
WIDTH = 64  # [8, 4096]

time.sleep(float(os.environ.get("AUTOLOOP_TIME_BUDGET", "1")))
print("---")
print(f"val_bpb:          {1.0 + abs(LR - 0.02) + abs(WIDTH - 100) / 1e4:.6f}")
print("training_seconds: 1.0")
print("peak_vram_mb:     10.0")
print("mfu_percent:      0.00")
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=30.0, help="training seconds per experiment")
    ap.add_argument("--experiments", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        (repo / "train.py").write_text(FAKE_TRAIN)
        for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                    ["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "init"]):
            subprocess.run(cmd, cwd=repo, check=True)
        settings = Settings(repo=repo, tag="bench", budget=args.budget, max_experiments=args.experiments,
                            proposer="perturb")
        t0 = time.monotonic()
        run_loop(settings, echo=lambda line: None)
        wall = time.monotonic() - t0
        records = [read_record(Paths(repo, "bench").run_dir(n)) for n in range(1, args.experiments + 1)]
    train = [r.timings.get("train", 0.0) for r in records]
    propose = [r.timings.get("propose", 0.0) for r in records]
    per_exp = [(r.ended - r.started) - r.timings.get("train", 0.0) - r.timings.get("propose", 0.0) for r in records]
    overhead = (wall - sum(train) - sum(propose)) / len(records)
    print(f"experiments:                  {len(records)} at a {args.budget:g}s budget")
    print(f"session wall time:            {wall:.2f}s (includes session start-up)")
    print(f"controller overhead / exp:    {overhead:.3f}s (session wall - training - proposing) / experiments")
    print(f"  within an experiment:       median {statistics.median(per_exp):.3f}s, max {max(per_exp):.3f}s")
    print(f"duty cycle:                   {100 * sum(train) / wall:.2f}% of wall time with a training process")


if __name__ == "__main__":
    main()
