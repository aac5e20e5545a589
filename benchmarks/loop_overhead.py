"""Measure the controller's own cost: overhead per experiment and duty cycle of the training slot.

A fake train.py sleeps for the budget and prints the summary block, so everything else is the loop's doing.
--propose-seconds makes the proposer as slow as an LLM; compare --pipeline with --no-pipeline. --workers N
also runs N slots at once (CPU slots, generations) for N times as many experiments, and compares experiments
per hour with N times the single slot's.

    python benchmarks/loop_overhead.py --budget 30 --experiments 6
    python benchmarks/loop_overhead.py --budget 30 --experiments 6 --propose-seconds 20 --no-pipeline
    python benchmarks/loop_overhead.py --budget 10 --experiments 6 --workers 4
    python benchmarks/loop_overhead.py --budget 5 --experiments 6 --confinement   # the sandbox's and the
                                                                # protected-state check's cost per experiment
    python benchmarks/loop_overhead.py --budget 5 --experiments 6 --executor slurm --start-slurm
        # one Slurm job per experiment (a one-node Slurm started here, tests/slurm_cluster.py; or the cluster
        # SLURM_CONF names, with --slurm-workdir) against the local executor, in one run
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from orchestrator.loop import Settings, run_loop
from orchestrator.proposers.perturb import PerturbProposer
from orchestrator.store.ledger import read_record
from orchestrator.store.session import Paths


class SlowProposer(PerturbProposer):
    """perturb, but each idea takes $AUTOLOOP_BENCH_PROPOSE_S seconds (like an LLM)."""

    name = "slow"
    pipeline = True

    def propose(self, workdir, history):
        time.sleep(float(os.environ.get("AUTOLOOP_BENCH_PROPOSE_S", "0")))
        return super().propose(workdir, history)


FAKE_TRAIN = '''"""fake train.py: sleeps for the budget, prints the summary"""
import os, time

# Hyperparameters (as many as a real train.py has, so two ideas rarely touch the same line)
LR = 0.01  # learning rate  [0.0001, 1.0]
WIDTH = 64  # [8, 4096]
DEPTH = 4  # [1, 32]
WARMUP = 0.1  # [0.01, 0.5]
DECAY = 0.2  # [0.01, 1.0]
MOMENTUM = 0.9  # [0.5, 0.99]
CAP = 15.0  # [1.0, 50.0]
BATCH = 16  # [1, 512]

time.sleep(float(os.environ.get("AUTOLOOP_TIME_BUDGET", "1")))
score = abs(LR - 0.02) + abs(WIDTH - 100) / 1e4 + abs(DEPTH - 6) / 100 + abs(WARMUP - 0.05) + abs(DECAY - 0.1)
print("---")
print(f"val_bpb:          {1.0 + score:.6f}")
print("training_seconds: 1.0")
print("peak_vram_mb:     10.0")
print("mfu_percent:      0.00")
'''


def session(
    args,
    workers: int,
    experiments: int,
    sandbox: str = "off",
    fingerprint: list | None = None,
    executor: str = "local",
) -> tuple[float, list]:
    """One session on a fresh repo holding the fake train.py; (wall seconds, run records). `fingerprint`, if
    given, gets the seconds one protected-state snapshot and check take on the finished session."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        (repo / "train.py").write_text(FAKE_TRAIN)
        for cmd in (
            ["git", "init", "-q"],
            ["git", "add", "-A"],
            ["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "init"],
        ):
            subprocess.run(cmd, cwd=repo, check=True)
        settings = Settings(
            repo=repo,
            tag="bench",
            budget=args.budget,
            max_experiments=experiments,
            proposer="__main__:SlowProposer",
            pipeline=args.pipeline,
            baseline_repeats=0,
            workers=workers,
            executor=executor,
            executor_options={"gpus": []}
            if executor == "local"
            else {"slurm_workdir": args.slurm_workdir or Path(tmp) / "shared"},
            sandbox=sandbox,
        )
        t0 = time.monotonic()
        state = run_loop(settings, echo=lambda line: None)
        wall = time.monotonic() - t0
        if fingerprint is not None:
            from orchestrator.core.workspace import Workspace

            ws = Workspace(settings, lambda line: None)
            t = time.perf_counter()
            for _ in range(20):
                ws.protection.touched(ws.protection.snapshot(state))
            fingerprint.append((time.perf_counter() - t) / 20)
        return wall, [read_record(Paths(repo, "bench").run_dir(n)) for n in range(1, experiments + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=30.0, help="training seconds per experiment")
    ap.add_argument("--experiments", type=int, default=6)
    ap.add_argument("--propose-seconds", type=float, default=0.0, help="seconds the proposer takes per idea")
    ap.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prepare the next idea while one trains (matters with --propose-seconds)",
    )
    ap.add_argument(
        "--confinement",
        action="store_true",
        help="also measure the cost of the sandbox (a session with --sandbox on against off) and of "
        "the protected-state check, per experiment",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="also run this many slots at once (workers x experiments) and compare throughput",
    )
    ap.add_argument(
        "--executor",
        choices=["local", "slurm"],
        default="local",
        help="slurm: also run the session as Slurm jobs and compare the overhead per experiment with local's",
    )
    ap.add_argument("--slurm-workdir", type=Path, default=None, help="a shared directory (default: a temporary one)")
    ap.add_argument(
        "--start-slurm", action="store_true", help="start a one-node Slurm here for it (tests/slurm_cluster.py)"
    )
    args = ap.parse_args()
    os.environ["AUTOLOOP_BENCH_PROPOSE_S"] = str(args.propose_seconds)
    if args.executor == "slurm" and args.start_slurm:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from slurm_cluster import SlurmCluster, slurm_problem

        if problem := slurm_problem():
            raise SystemExit(f"loop_overhead.py: no Slurm to start: {problem}")
        with tempfile.TemporaryDirectory() as root, SlurmCluster(Path(root)) as cluster:
            os.environ.update({k: v for k, v in cluster.env.items() if k.startswith("SLURM")})
            measure(args)
        return
    measure(args)


def overhead_of(wall: float, records: list) -> float:
    """(session wall - training - waiting for ideas) / experiments."""
    train = sum(r.timings.get("train", 0.0) for r in records)
    waited = sum(r.timings.get("propose_wait", 0.0) for r in records)
    return (wall - train - waited) / len(records)


def measure(args) -> None:
    wall, records = session(args, 1, args.experiments)
    train = [r.timings.get("train", 0.0) for r in records]
    waited = [r.timings.get("propose_wait", 0.0) for r in records]
    per_exp = [
        (r.ended - r.started) - r.timings.get("train", 0.0) - r.timings.get("propose_wait", 0.0) for r in records
    ]
    overhead = (wall - sum(train) - sum(waited)) / len(records)
    print(
        f"experiments:                  {len(records)} at a {args.budget:g}s budget, proposer "
        f"{args.propose_seconds:g}s per idea, pipeline {'on' if args.pipeline else 'off'}"
    )
    print(f"session wall time:            {wall:.2f}s (includes session start-up)")
    print(f"waiting for ideas:            {sum(waited):.2f}s in all")
    print(f"controller overhead / exp:    {overhead:.3f}s (session wall - training - waiting for ideas) / experiments")
    print(f"  within an experiment:       median {statistics.median(per_exp):.3f}s, max {max(per_exp):.3f}s")
    print(f"duty cycle:                   {100 * sum(train) / wall:.2f}% of wall time with a training process")
    single = 3600 * len(records) / wall
    print(f"experiments per hour:         {single:.1f} (1 slot)")
    if args.confinement:
        from orchestrator.trust.confine import sandbox_problem

        if problem := sandbox_problem():
            print(f"confinement:                  not measured: {problem}")
        else:
            cost = []
            for sandbox in ("off", "on"):
                wall_s, recs = session(args, 1, args.experiments, sandbox, cost)
                cost.append(statistics.median(r.timings.get("train", 0.0) for r in recs))
                cost.append(wall_s / len(recs))
            print(
                f"sandbox:                      +{cost[4] - cost[1]:.3f}s per train step (median "
                f"{cost[4]:.3f}s on, {cost[1]:.3f}s off); +{cost[5] - cost[2]:.3f}s per experiment of wall time"
            )
            print(
                f"protected-state check:        {cost[3]:.4f}s per run ({args.experiments} records; snapshot "
                "before the generation and check after each run)"
            )
    if args.executor == "slurm":
        wall_s, recs = session(args, 1, args.experiments, executor="slurm")
        slurm = overhead_of(wall_s, recs)
        train_s = statistics.median(r.timings.get("train", 0.0) for r in recs)
        print(
            f"slurm executor:               {slurm:.3f}s overhead per experiment (local {overhead:.3f}s: "
            f"+{slurm - overhead:.3f}s); the train step {train_s:.2f}s median (local "
            f"{statistics.median(train):.2f}s); {3600 * len(recs) / wall_s:.1f} experiments "
            "per hour"
        )
    if args.workers > 1:
        n = args.workers * args.experiments
        wall_n, records_n = session(args, args.workers, n)
        busy = sum(r.timings.get("train", 0.0) for r in records_n)
        parallel = 3600 * n / wall_n
        print(
            f"{args.workers} slots:                      {n} experiments in {wall_n:.2f}s, "
            f"slot duty cycle {100 * busy / (args.workers * wall_n):.2f}%"
        )
        print(
            f"experiments per hour:         {parallel:.1f} ({args.workers} slots) = "
            f"{parallel / single:.2f}x the single slot ({100 * parallel / (args.workers * single):.1f}% of "
            f"{args.workers}x; target >= 90%)"
        )


if __name__ == "__main__":
    main()
