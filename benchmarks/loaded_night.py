"""A session on a machine that becomes busy during the night (issue #44's third Done-when).

A fresh workspace (`autoloop init`), honest ideas queued with `autoloop queue add --set`, then `autoloop run
--proposer queue` until the queue runs dry; once the baseline's runs are in results.tsv, --load CPU-bound
processes start beside the loop (as when other jobs land on the machine). Prints every row and counts what an
honest session must never show: a "budget exceeded" crash or a refused model.

    python benchmarks/loaded_night.py --budget 30 --profile tiny --load 2
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (description, --set assignments): honest changes, the kind a search proposes, a few of them large
IDEAS = [
    ("lower matrix LR", ["MATRIX_LR=0.03"]),
    ("higher matrix LR", ["MATRIX_LR=0.06"]),
    ("rates /20", ["MATRIX_LR=0.002", "EMBEDDING_LR=0.03", "UNEMBEDDING_LR=0.0002", "SCALAR_LR=0.025"]),
    ("more warmdown", ["WARMDOWN_RATIO=0.7"]),
    ("no warmdown", ["WARMDOWN_RATIO=0.0"]),
    ("depth 1", ["DEPTH=1"]),
    ("depth 3", ["DEPTH=3"]),
    ("wider", ["ASPECT_RATIO=96"]),
    ("logit cap 30", ["LOGIT_CAP=30.0"]),
    ("weight decay 0", ["WEIGHT_DECAY=0.0"]),
]


def burn() -> None:
    os.setsid()  # a session of its own, as another user's job (the kernel shares the CPU between sessions first)
    parent = os.getppid()
    while os.getppid() == parent:  # (ends with the benchmark, even one killed)
        sum(range(100_000))


def autoloop(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, env=env, text=True, capture_output=True
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--profile", default="tiny", choices=["tiny", "cpu"])
    ap.add_argument("--load", type=int, default=2, help="CPU-bound processes started after the baseline's runs")
    ap.add_argument("--ideas", type=int, default=len(IDEAS))
    ap.add_argument("--workdir", default=None, help="where the workspace goes (default: a temporary directory)")
    ap.add_argument("--cache", default=None, help="AUTOLOOP_CACHE (default: prepare.py's)")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.cache:
        env["AUTOLOOP_CACHE"] = args.cache
    root = Path(args.workdir or tempfile.mkdtemp(prefix="loaded-night-"))
    root.mkdir(parents=True, exist_ok=True)
    work = root / "ws"
    made = autoloop("init", str(work), cwd=root, env=env)
    assert made.returncode == 0, made.stdout + made.stderr
    for description, sets in IDEAS[: args.ideas]:
        added = autoloop("queue", "add", description, *(a for s in sets for a in ("--set", s)), cwd=work, env=env)
        assert added.returncode == 0, added.stdout + added.stderr
    log = open(root / "run.log", "w")
    t0 = time.monotonic()
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--budget",
            f"{args.budget:g}",
            "--profile",
            args.profile,
            "--proposer",
            "queue",
            "--tag",
            "loaded",
        ],
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    burners: list[multiprocessing.Process] = []
    ledger = work / "results.tsv"
    try:
        while run.poll() is None:
            rows = list(csv.DictReader(open(ledger), delimiter="\t")) if ledger.exists() else []
            if not burners and len(rows) >= 3:  # the baseline and its repeats: the machine becomes busy now
                burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.load)]
                for b in burners:
                    b.start()
                print(f"{time.monotonic() - t0:.0f}s: {len(rows)} rows in; {args.load} CPU-bound processes started")
            time.sleep(2)
    finally:
        for b in burners:
            b.terminate()
        if run.poll() is None:
            run.terminate()
    rows = list(csv.DictReader(open(ledger), delimiter="\t"))
    overran = [r for r in rows if "budget exceeded" in r["description"]]
    refused = [r for r in rows if "was refused" in r["description"]]
    for r in rows:
        print(f"{r['commit']}  {r['val_bpb']}  {r['status']:8}  {r['description'][:150]}")
    print(
        f"\n{len(rows)} rows in {time.monotonic() - t0:.0f}s (exit {run.returncode}); budget exceeded: "
        f"{len(overran)}, refused models: {len(refused)}; workspace {work}, console log {root / 'run.log'}"
    )
    return 1 if overran or refused else 0


if __name__ == "__main__":
    sys.exit(main())
