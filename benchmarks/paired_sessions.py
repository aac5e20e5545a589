"""Real sessions, paired: autoloop's defaults against upstream's rule on the same machine (issue #45, item 3).

Each pair is two fresh workspaces (`autoloop init`) run side by side with the same `--seed` and proposer, one
with the defaults and one with upstream's rule (`--gate strict --baseline-repeats 0`), `--runs` experiments
each: running at once, the same load hits both. Once every session is done, the baseline's train.py and each
session's kept best are trained again `--remeasure` times each, interleaved (round k: every configuration once,
on a fresh seed shared by all of them), and each trained model is scored on the held-out split no decision
used (`evaluate.py --split holdout`). A session's improvement is the baseline's held-out mean minus its best's;
a session that kept nothing has improved by 0 (no runs needed). Also shown: each session's own figures (its
first row against its best's row) and its keeps.

    python benchmarks/paired_sessions.py --pairs 3 --budget 30 --runs 30 --profile tiny --remeasure 3
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {
    "default": [],
    "upstream": ["--gate", "strict", "--baseline-repeats", "0"],
    "value": ["--gate", "value"],
}


def autoloop(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, env=env, text=True, capture_output=True
    )


def run_all(commands: list[tuple[str, list[str], Path, Path]], parallel: int, env: dict, t0: float) -> dict:
    """Run (name, argv, cwd, log) commands, `parallel` at a time in order; their exit codes by name."""
    waiting, running, codes = list(commands), {}, {}
    while waiting or running:
        while waiting and len(running) < parallel:
            name, argv, cwd, log = waiting.pop(0)
            running[name] = subprocess.Popen(argv, cwd=cwd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
            print(f"[{time.monotonic() - t0:5.0f}s] started {name}", flush=True)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                codes[name] = proc.returncode
                del running[name]
                print(f"[{time.monotonic() - t0:5.0f}s] {name} ended (exit {proc.returncode})", flush=True)
        time.sleep(1)
    return codes


def session_facts(ws: Path, tag: str) -> dict:
    """What a finished session says of itself: its rows, keeps, and the best's train.py."""
    rows = list(csv.DictReader(open(ws / "results.tsv"), delimiter="\t")) if (ws / "results.tsv").exists() else []
    keeps = [r for r in rows if r["status"] == "keep"]
    branch = f"autoloop/{tag}"
    best = subprocess.run(["git", "show", f"{branch}:train.py"], cwd=ws, capture_output=True, text=True)
    own = [float(r["val_bpb"]) for r in rows if r["status"] != "crash" and float(r["val_bpb"] or 0) > 0]
    return {
        "rows": len(rows),
        "keeps": len(keeps) - 1 if keeps else 0,  # the baseline's keep is not a change
        "crashes": sum(r["status"] == "crash" for r in rows),
        "first": own[0] if own else None,
        "best_row": float(keeps[-1]["val_bpb"]) if keeps else None,
        "kept": [r["description"][:80] for r in keeps[1:]],
        "train": best.stdout if best.returncode == 0 else None,
    }


def fresh_run(d: Path, budget: float, profile: str, seed: int, env: dict, timeout: float) -> dict:
    """train.py in `d` once (exporting its model), then the held-out split scored by evaluate.py."""
    artifact = d / "model.pt"
    artifact.unlink(missing_ok=True)
    run_env = {
        **env,
        "AUTOLOOP_TIME_BUDGET": f"{budget:g}",
        "AUTOLOOP_PROFILE": profile,
        "AUTOLOOP_SEED": str(seed),
        "AUTOLOOP_EVAL_ARTIFACT": str(artifact),
    }
    t0 = time.monotonic()
    train = subprocess.run(
        [sys.executable, "train.py"], cwd=d, env=run_env, capture_output=True, text=True, timeout=timeout
    )
    if train.returncode or not artifact.exists():
        tail = (train.stdout + train.stderr).strip().splitlines()[-2:]
        return {"crash": " | ".join(tail)}
    score = subprocess.run(
        [sys.executable, "-I", "-S", "evaluate.py", str(artifact), "--split", "holdout"],
        cwd=d,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    line = next((x for x in score.stdout.splitlines() if x.startswith("AUTOLOOP_EVAL ")), None)
    result = json.loads(line.split(" ", 1)[1]) if line else {"error": (score.stdout + score.stderr)[-300:]}
    if "holdout_bpb" not in result:
        return {"crash": str(result.get("error"))}
    steps = next((x.split()[-1] for x in train.stdout.splitlines() if x.startswith("num_steps:")), "?")
    return {"holdout_bpb": result["holdout_bpb"], "steps": steps, "wall": time.monotonic() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1, help="pair i runs with --seed first-seed + i")
    ap.add_argument("--budget", type=float, default=30.0, help="training seconds per run")
    ap.add_argument("--runs", type=int, default=30, help="experiments per session (--max-experiments)")
    ap.add_argument("--profile", default="tiny", choices=["tiny", "cpu"])
    ap.add_argument("--proposer", default="search")
    ap.add_argument("--arms", default="default,upstream", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--remeasure", type=int, default=3, help="fresh runs of the baseline and of every best")
    ap.add_argument("--parallel", type=int, default=2, help="sessions (and fresh runs) at once")
    ap.add_argument("--workdir", default=None, help="where the workspaces go (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON here")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        ap.error(f"unknown arm(s) {', '.join(unknown)}: choose from {', '.join(ARMS)}")
    env = dict(os.environ)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="paired-sessions-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    commands, sessions = [], {}
    for i in range(args.pairs):
        seed = args.first_seed + i
        for arm in arms:
            name, tag = f"{arm}-{seed}", f"p{seed}"
            ws = root / name
            if not ws.exists():
                made = autoloop("init", str(ws), cwd=root, env=env)
                if made.returncode:
                    sys.exit(f"autoloop init failed: {made.stdout}{made.stderr}")
            argv = [sys.executable, "-m", "orchestrator.cli", "run", "--budget", f"{args.budget:g}"]
            argv += ["--profile", args.profile, "--proposer", args.proposer, "--max-experiments", str(args.runs)]
            argv += ["--seed", str(seed), "--tag", tag, "--no-verify", *ARMS[arm]]
            commands.append((name, argv, ws, root / f"{name}.log"))
            sessions[name] = {"arm": arm, "seed": seed, "ws": ws, "tag": tag}
    codes = run_all(commands, args.parallel, env, t0)
    sessions_wall = time.monotonic() - t0
    for name, s in sessions.items():
        s.update(session_facts(s["ws"], s["tag"]), exit=codes.get(name))

    # fresh runs: the baseline and every distinct best, interleaved, each round on its own seed
    first = sessions[next(iter(sessions))]["ws"]
    baseline = subprocess.run(["git", "show", "HEAD:train.py"], cwd=first, capture_output=True, text=True).stdout
    configs: dict[str, str] = {"baseline": baseline}
    for name, s in sessions.items():
        if s["train"] and s["train"] != baseline and s["keeps"]:
            same = next((k for k, v in configs.items() if v == s["train"]), None)
            s["config"] = same or name
            configs.setdefault(s["config"], s["train"])
        else:
            s["config"] = "baseline"
    scratch = root / "fresh"
    dirs = {}
    for k, (cname, text) in enumerate(configs.items()):
        d = scratch / f"c{k}"
        d.mkdir(parents=True, exist_ok=True)
        for f in ("prepare.py", "evaluate.py"):
            shutil.copy(first / f, d / f)
        (d / "train.py").write_text(text)
        dirs[cname] = d
    fresh: dict[str, list[dict]] = {c: [] for c in configs}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for r in range(args.remeasure):
            seed = 1000 + r
            futures = {
                c: pool.submit(fresh_run, d, args.budget, args.profile, seed, env, 6 * args.budget + 300)
                for c, d in dirs.items()
            }
            for c, f in futures.items():
                out = f.result()
                fresh[c].append(out)
                shown = f"{out['holdout_bpb']:.4f} ({out['steps']} steps)" if "holdout_bpb" in out else out["crash"]
                print(f"[{time.monotonic() - t0:5.0f}s] fresh round {r + 1} {c:14s} {shown}", flush=True)

    def mean(c: str) -> float | None:
        v = [x["holdout_bpb"] for x in fresh[c] if "holdout_bpb" in x]
        return statistics.fmean(v) if v else None

    base = mean("baseline")
    print(
        f"\n{args.pairs} pair(s) x {len(arms)} arms, {args.runs} experiments of {args.budget:g}s ({args.profile}, "
        f"{args.proposer}); sessions {sessions_wall:.0f}s, all {time.monotonic() - t0:.0f}s; workspaces {root}"
    )
    print(f"baseline held out, {args.remeasure} fresh runs: {base:.4f}" if base is not None else "baseline: no run")
    print("| pair (seed) | arm | keeps | own: first row -> best row | held-out improvement (fresh runs) |")
    print("|---|---|---|---|---|")
    by_arm: dict[str, list[float]] = {a: [] for a in arms}
    for s in sessions.values():
        m = mean(s["config"])
        gain = base - m if base is not None and m is not None else None
        s["improvement"] = gain
        if gain is not None:
            by_arm[s["arm"]].append(gain)
        own = f"{s['first']:.4f} -> {s['best_row']:.4f}" if s["first"] and s["best_row"] else "-"
        shown = f"{gain:+.4f}" if gain is not None else "?"
        print(f"| {s['seed']} | {s['arm']} | {s['keeps']} | {own} | {shown} |")
    for arm, gains in by_arm.items():
        if gains:
            print(f"{arm}: median held-out improvement {statistics.median(gains):+.4f} over {len(gains)} session(s)")
    if args.out:
        dump = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "sessions": {n: {k: v for k, v in s.items() if k not in ("ws", "train")} for n, s in sessions.items()},
            "fresh": fresh,
            "configs": list(configs),
        }
        args.out.write_text(json.dumps(dump, indent=1))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
