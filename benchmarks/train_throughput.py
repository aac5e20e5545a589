"""Tokens/s, MFU and peak memory of train.py on the current device for a short run.

python benchmarks/train_throughput.py                 # 20 s of training, default profile for this device
python benchmarks/train_throughput.py --budget 60 --profile cpu
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=20.0, help="training seconds")
    ap.add_argument("--profile", choices=["gpu", "cpu", "tiny"], default=None)
    args = ap.parse_args()
    env = dict(os.environ, AUTOLOOP_TIME_BUDGET=f"{args.budget:g}")
    if args.profile:
        env["AUTOLOOP_PROFILE"] = args.profile
    subprocess.run([sys.executable, "prepare.py"], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    proc = subprocess.run([sys.executable, "train.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"train.py failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    out = proc.stdout
    rates = [float(x.replace(",", "")) for x in re.findall(r"tok/sec: ([\d,]+)", out)][1:]  # skip the first step
    summary = dict(re.findall(r"^(\w+):\s+(\S+)$", out[out.rindex("\n---\n") :], re.M))
    startup = re.search(r"startup ([\d.]+)s", out)
    print(f"device:          {summary.get('device')} ({summary.get('dtype')}, profile {summary.get('profile')})")
    print(f"tokens/s:        {statistics.median(rates):,.0f} (median over {len(rates)} progress lines)")
    print(f"mfu_percent:     {summary['mfu_percent']} (0.00 = peak FLOPs unknown for this device)")
    print(f"peak memory:     {float(summary['peak_vram_mb']):.1f} MB ({summary.get('memory_kind')})")
    print(
        f"steps:           {summary['num_steps']} in {summary['training_seconds']}s of training; "
        f"total {summary['total_seconds']}s; start-up {startup.group(1) if startup else '?'}s"
    )
    print(f"val_bpb:         {summary['val_bpb']}")


if __name__ == "__main__":
    main()
