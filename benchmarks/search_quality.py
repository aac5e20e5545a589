"""Compare proposers at equal budget: `search` vs random search vs optuna's TPE (and CMA-ES, perturb).

Real runs (the default): each (method, seed) runs a fresh session of the real train.py from the same baseline
commit. Methods are interleaved per seed, so machine noise hits them alike. Then the default train.py and each
session's best run --remeasure more times, interleaved, with seeds no session used; a method's improvement is the
default's mean minus its best's mean. (A session's own figures are noisier: its baseline's first run against
its best's runs, which the gate saw and kept, so they lean optimistic.)

    python benchmarks/search_quality.py --budget 8 --experiments 16 --seeds 3 --profile tiny

On a surrogate (`--surrogate MODEL.npz`, fitted by benchmarks/surrogate/model.py on real runs): the same real
controller (real proposer, real gate, real ledger) drives a fake train.py that answers from the surrogate in
milliseconds with its per-configuration noise and crashes, and prints the noise-free value too. Per method:
the best *true* val_bpb (of the session's kept best) after --checkpoints experiments, crashes, and how many
experiments it needs to reach TPE's final median; per gate: false keeps (a kept change whose true value is not
better) and power (the share of candidates truly better by 2 baseline σ or more that were kept).

    python benchmarks/search_quality.py --surrogate benchmarks/surrogate/tiny-10s.npz --profile tiny \
        --seeds 20 --experiments 100 --methods search,random,tpe,cmaes,perturb --jobs 2
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import git

from orchestrator.contract import make_git_repo
from orchestrator.core.noise import Gate
from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths

ROOT = Path(__file__).resolve().parent.parent


def fresh_repo(where: Path) -> Path:
    names = ("prepare.py", "evaluate.py", "train.py", ".gitignore")
    return make_git_repo(where, {name: (ROOT / name).read_text() for name in names})


NOOP = "false_keeps:NoOpProposer"  # edits that change nothing (comments): every keep of one is a false keep


def true_value(source: str, profile: str, model: str) -> float:
    """The surrogate's noise-free val_bpb of the configuration a (fake) train.py sets, as the fake computes it."""
    from orchestrator.proposers.space import read_space

    _, config = read_space(source, profile)
    return float(_load(model).predict([config])[0][0])


@functools.lru_cache(maxsize=4)
def _load(model: str):
    """A fitted surrogate, read once per process (true_value is asked for every stopped run)."""
    from model import Surrogate

    return Surrogate.load(Path(model))


def run_cost(record) -> float:
    """A run's compute in runs' worth: 1, or for a run stopped early the share of its steps it ran; 0 for a row
    that never trained (an exact repeat caught by the idea memory, an edit that did not compile)."""
    if record.gate.decision == "duplicate" or (record.status == "crash" and not record.timings.get("train")):
        return 0.0
    stopped = re.search(r"stopped at (\d+)%", record.gate.note or "") if record.gate.why == "stopped early" else None
    return int(stopped.group(1)) / 100 if stopped else 1.0


def surrogate_session(job: tuple) -> dict:
    """One (method, gate, seed) session on the surrogate, in a fresh repo: what it kept, when, and how true."""
    model, profile, method, gate, seed, experiments, where, *rest = job
    noise_scale = rest[0] if rest else 1.0
    limit = rest[1] if len(rest) > 1 else None  # activations above which a run is out of memory (--oom-share)
    drift, period = rest[2] if len(rest) > 2 else (0.0, 40)  # night_value.py --drift: val_bpb amplitude, runs
    early_stop = rest[3] if len(rest) > 3 else "off"  # night_value.py's arms: --early-stop
    compute = rest[4] if len(rest) > 4 else None  # runs' worth to spend (stopped runs count their share), at most
    options = rest[5] if len(rest) > 5 else {}  # the proposer's options (hybrid_value.py: --hybrid-llm)
    overrides = (
        rest[6] if len(rest) > 6 else {}
    )  # the gate's other settings (night_value.py, hybrid_value.py: --bundle)
    # `experiments` runs
    os.environ.setdefault("AUTOLOOP_PROGRESS_SECONDS", "1e9")  # one result per session, not the loop's live line
    sys.path[:0] = [str(ROOT / "benchmarks" / "surrogate"), str(ROOT / "benchmarks")]
    from fake import fake_train

    from orchestrator.core.state import Status, group_of, replay

    base = Path(where) / f"{method.replace(':', '.')}-{gate}-{seed}"
    base.mkdir(parents=True)
    pause = None if early_stop == "on" else 0.0  # the curve paced only where a stop must land (fake.PAUSE)
    train = fake_train(
        (ROOT / "train.py").read_text(),
        profile,
        Path(model),
        base / "seen.json",
        noise_scale,
        limit,
        drift,
        period,
        **({} if pause is None else {"pause": pause}),
    )
    repo = make_git_repo(base / "repo", {"train.py": train})
    settings = Settings(
        repo=repo,
        tag="bench",
        budget=1.0,
        max_experiments=experiments,
        proposer=method,
        profile=profile,
        seed=seed,
        timeout=60,
        gate=Gate(mode=gate, early_stop=early_stop, **overrides),
        sandbox="off",
        baseline_repeats=0 if gate == "strict" else 2,
        max_crashes=experiments + 1,
        options=dict(options),
    )  # a streak of crashes is data here, not a broken setup
    done, spent = 0, 0.0
    while True:  # with a compute budget: the session resumed with more runs until it is spent
        if compute is not None:
            settings.max_experiments = min(experiments, done + math.ceil(compute - spent))  # < 1 run beyond
        run_loop(settings, echo=lambda line: None)
        records = [read_record(Paths(repo, "bench").run_dir(n)) for n in range(1, experiments + 1)]
        records = [r for r in records if r is not None]
        done, spent = len(records), sum(map(run_cost, records))
        if compute is None or spent >= compute or done >= experiments or done < settings.max_experiments:
            break
    true = {group_of(r): r.metrics.get("true_bpb") for r in records if r.metrics.get("true_bpb") is not None}
    for r in records:  # a run stopped early printed no summary: its configuration's true value from the model
        if r.gate.why == "stopped early" and group_of(r) not in true:
            true[group_of(r)] = true_value(git.Repo(repo).git.show(f"{r.commit}:train.py"), profile, model)
    best_true, parent_true, keeps, candidates, cost = [], {}, [], [], []
    state = replay([], records[0].commit if records else "")
    for r in records:
        before = true.get(state.best_group) if state.best_group else None
        if (
            r.gate.decision
            and group_of(r) == r.n
            and state.best_group
            and r.status != Status.CRASH
            and r.info.get("repeat") is None
            and r.info.get("confirm") is None
            and group_of(r) in true
        ):
            parent_true[group_of(r)] = before
        state.add(r)
        best_true.append(true.get(state.best_group))
        cost.append(run_cost(r))
        if r.status == Status.KEEP and group_of(r) in parent_true:
            keeps.append((group_of(r), parent_true[group_of(r)], true[group_of(r)]))
    kept = {g for g, _, _ in keeps}
    source_of = {r.n: r.info.get("source") for r in records if group_of(r) == r.n}
    stopped = {group_of(r) for r in records if r.gate.why == "stopped early"}
    for g, before in parent_true.items():
        if before is not None:
            candidates.append((before - true[g], g in kept, g in stopped))
    return {
        "method": method,
        "gate": gate,
        "seed": seed,
        "best_true": best_true,
        "cost": cost,
        "crashes": sum(r.status == Status.CRASH for r in records),
        "duplicates": sum(r.gate.decision == "duplicate" for r in records),  # repeats caught, never run
        "sources": [r.info.get("source") for r in records if group_of(r) == r.n and r.info.get("source")],
        "keeps": [(before, after) for _, before, after in keeps],
        "keep_sources": [  # (the kept idea's source, its true gain): hybrid_value.py's share of the gain
            (source_of.get(g) or "-", before - after) for g, before, after in keeps if before is not None
        ],
        "candidates": candidates,
    }


def surrogate_main(args) -> None:
    from concurrent.futures import ProcessPoolExecutor

    sys.path.insert(0, str(ROOT / "benchmarks" / "surrogate"))
    from model import Surrogate

    from orchestrator.proposers.space import read_space

    methods = args.methods.split(",")
    gates = args.gates.split(",")
    space, default = read_space((ROOT / "train.py").read_text(), args.profile)
    limit = None
    if args.oom_share:
        from fake import activations, memory_limit

        limit, share = memory_limit(space, args.oom_share)
        if share == 0:
            sys.exit(
                f"search_quality: --oom-share {args.oom_share:g} leaves no configuration out of memory (sizes "
                "are powers of two, so the largest alone is about 2% of the space): use a larger share"
            )
        if activations(default) > limit:
            sys.exit(
                f"search_quality: with --oom-share {args.oom_share:g} the default itself runs out of memory: "
                "use a smaller share"
            )
        print(
            f"out of memory above {limit} activations: {share:.1%} of the space (the default: {activations(default)})",
            flush=True,
        )
    baseline_sd = float(Surrogate.load(args.surrogate).predict([default])[1][0]) * args.noise_scale
    jobs = [
        (str(args.surrogate.resolve()), args.profile, m, g, seed, args.experiments)
        for seed in range(args.first_seed, args.first_seed + args.seeds)
        for g in gates
        for m in (methods if g == gates[0] else ["search"]) + ([NOOP] if args.noop else [])
    ]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs, initializer=die_with_parent) as pool:
        results = list(pool.map(surrogate_session, [(*j, tmp, args.noise_scale, limit) for j in jobs]))
    report_surrogate(args, results, methods, gates, baseline_sd, time.monotonic() - t0)


def die_with_parent() -> None:
    """A pool worker ends with the benchmark (killed or failed), never left running a session alone."""
    import ctypes
    import signal

    try:
        # PR_SET_PDEATHSIG (Linux). Not SIGTERM: the loop turns it into an exception that the pool's worker
        # catches, and the orphan would go on to its next session.
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{statistics.median(values):.4f} [{q[0]:.4f}, {q[2]:.4f}]"


def report_surrogate(
    args, results: list[dict], methods: list[str], gates: list[str], baseline_sd: float, wall: float
) -> None:
    from scipy.stats import wilcoxon

    main_gate = gates[0]
    checkpoints = [int(c) for c in args.checkpoints.split(",") if int(c) <= args.experiments]
    by = {
        m: sorted([r for r in results if r["method"] == m and r["gate"] == main_gate], key=lambda r: r["seed"])
        for m in methods
    }

    def best_at(r: dict, k: int) -> float:
        values = [v for v in r["best_true"][:k] if v is not None]
        return values[-1] if values else float("nan")

    print(
        f"\n{args.seeds} seeds x {args.experiments} experiments per method, surrogate {args.surrogate}, "
        f"gate {main_gate}, baseline sd {baseline_sd:.4f}"
        + (f" (runs' noise x{args.noise_scale:g})" if args.noise_scale != 1 else "")
        + f"; {wall:.0f}s"
    )
    print("best TRUE val_bpb of the kept best: median [quartiles]")
    print(
        f"{'method':8s} "
        + " ".join(f"{'after ' + str(k):>26s}" for k in checkpoints)
        + f" {'crashes':>8s}"
        + f" {'to reach tpe':>13s}"
    )
    target = statistics.median(best_at(r, args.experiments) for r in by["tpe"]) if "tpe" in by else None
    for m in methods:
        runs = by[m]
        cells = " ".join(f"{quartiles([best_at(r, k) for r in runs]):>26s}" for k in checkpoints)
        crashes = sum(r["crashes"] for r in runs)
        reach = "-"
        if target is not None:
            needed = [
                next((k + 1 for k, v in enumerate(r["best_true"]) if v is not None and v <= target), None) for r in runs
            ]
            got = sorted(n for n in needed if n is not None)
            reach = f"{statistics.median(got):.0f} ({len(got)}/{len(runs)})" if got else f"never (0/{len(runs)})"
        print(f"{m:8s} {cells} {crashes:8d} {reach:>13s}")
    if "search" in by:
        for other in (m for m in methods if m != "search"):
            for k in checkpoints:
                a = [best_at(r, k) for r in by["search"]]
                b = [best_at(r, k) for r in by[other]]
                diff = [x - y for x, y in zip(a, b)]
                wins = sum(d < 0 for d in diff)
                p = wilcoxon(a, b, alternative="less").pvalue if any(diff) else 1.0
                print(
                    f"search vs {other:7s} after {k:3d}: search better on {wins}/{len(diff)} seeds, "
                    f"median difference {statistics.median(diff):+.4f}, Wilcoxon one-sided p = {p:.3g}"
                )
            a, b = [r["crashes"] for r in by["search"]], [r["crashes"] for r in by[other]]
            if any(a) or any(b):
                fewer = sum(x < y for x, y in zip(a, b))
                p = wilcoxon(a, b, alternative="less").pvalue if any(x != y for x, y in zip(a, b)) else 1.0
                print(
                    f"search vs {other:7s} crashes: {sum(a)} vs {sum(b)}, fewer on {fewer}/{len(a)} seeds "
                    f"(more on {sum(x > y for x, y in zip(a, b))}), Wilcoxon one-sided p = {p:.3g}"
                )
    print(
        f"\ngates (method search): a keep whose true value is not better is a false keep; power: candidates "
        f"truly better by >= 2 baseline sd ({2 * baseline_sd:.4f}) that were kept"
    )
    for g in gates:
        rs = [r for r in results if r["method"] == "search" and r["gate"] == g]
        keeps = [k for r in rs for k in r["keeps"] if k[0] is not None]
        false = sum(after >= before for before, after in keeps)
        noop = [kept for r in results if r["method"] == NOOP and r["gate"] == g for _, kept, *_ in r["candidates"]]
        strong = [kept for r in rs for gain, kept, *_ in r["candidates"] if gain >= 2 * baseline_sd]
        print(
            f"{g:7s} keeps {len(keeps):4d}, false keeps {false:3d} ({100 * false / max(1, len(keeps)):.1f}% of "
            f"keeps), no-op candidates kept {sum(noop)}/{len(noop)}, power {sum(strong)}/{len(strong)} "
            f"({100 * sum(strong) / max(1, len(strong)):.0f}%)"
        )
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=8.0, help="training seconds per experiment")
    ap.add_argument("--experiments", type=int, default=16, help="experiments per session (baseline included)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds run from this one (more seeds in another run)")
    ap.add_argument("--profile", default="tiny", choices=["gpu", "cpu", "tiny"])
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="hard limit per run (default 3 x budget + 30 s): huge sampled models time out alike",
    )
    ap.add_argument(
        "--methods",
        default=None,
        help="comma-separated proposers [default: search,random,tpe; with --surrogate also cmaes,perturb]",
    )
    ap.add_argument("--surrogate", type=Path, default=None, help="a fitted surrogate (.npz): no real training")
    ap.add_argument(
        "--gates",
        default="noise,strict",
        help="with --surrogate: the gates to compare (the first is used for every method, the others for search)",
    )
    ap.add_argument("--checkpoints", default="30,100", help="with --surrogate: report the best after these counts")
    ap.add_argument(
        "--noise-scale",
        type=float,
        default=1.0,
        help="with --surrogate: multiply every run's noise (a stress test: same landscape, noisier runs)",
    )
    ap.add_argument(
        "--oom-share",
        type=float,
        default=0.0,
        help="with --surrogate: configurations too big for a memory limit crash (out of memory), the "
        "limit set so at most this share of the space does (the collections have no crashes)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="with --surrogate: sessions at once")
    ap.add_argument(
        "--no-noop",
        dest="noop",
        action="store_false",
        help="with --surrogate: skip the no-op sessions that measure the gates' false keeps (faster)",
    )
    ap.add_argument(
        "--gate",
        default="strict",
        choices=["noise", "strict"],
        help="keep rule for every method (strict: short sessions keep something to compare)",
    )
    ap.add_argument(
        "--remeasure",
        type=int,
        default=3,
        help="real runs: after each seed, run the default and every method's best this many more times "
        "(interleaved, fresh seeds) and compare those means (0: the sessions' own figures)",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON here")
    args = ap.parse_args()
    if not (math.isfinite(args.noise_scale) and args.noise_scale > 0):
        ap.error(f"--noise-scale must be a positive number (1: the runs' noise as measured), not {args.noise_scale}")
    if not 0 <= args.oom_share < 1:
        ap.error(f"--oom-share must be a share of the space in [0, 1), not {args.oom_share}")
    if args.seeds < 1 or args.first_seed < 0:
        ap.error(f"--seeds must be 1 or more and --first-seed 0 or more, not {args.seeds} and {args.first_seed}")
    if args.remeasure < 0:
        ap.error(f"--remeasure must be 0 or more runs, not {args.remeasure}")
    if args.oom_share and not args.surrogate:
        ap.error("--oom-share needs --surrogate (real runs crash only where they really do)")
    if args.surrogate:
        args.methods = args.methods or "search,random,tpe,cmaes,perturb"
        return surrogate_main(args)
    from orchestrator.core.state import group_of

    methods = (args.methods or "search,random,tpe").split(",")
    per_seed: list[dict] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("AUTOLOOP_CACHE", str(Path(tmp) / "cache"))
        os.environ.setdefault("AUTOLOOP_PROGRESS_SECONDS", "1e9")  # one line per session, not the loop's live line
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            bests = {"default": (ROOT / "train.py").read_text()}
            seen: dict[str, dict] = {}
            for method in methods:
                repo = fresh_repo(Path(tmp) / f"{method}-{seed}")
                settings = Settings(
                    repo=repo,
                    tag="bench",
                    budget=args.budget,
                    max_experiments=args.experiments,
                    proposer=method,
                    profile=args.profile,
                    seed=seed,
                    timeout=args.timeout or 3 * args.budget + 30,
                    gate=Gate(mode=args.gate),
                    baseline_repeats=0 if args.gate == "strict" else 2,
                    max_crashes=args.experiments + 1,
                )  # a streak of crashes is data here
                run_loop(settings, echo=lambda line: None)
                rows = read_rows(repo / "results.tsv")
                kept = [r.val_bpb for r in rows if r.status == "keep"]
                records = [read_record(Paths(repo, "bench").run_dir(n)) for n in range(1, len(rows) + 1)]
                ideas = len({group_of(r) for r in records if r is not None} - {1})  # run 1: the baseline
                seen[method] = {
                    "session": kept[0] - min(kept),
                    "keeps": len(kept) - 1,
                    "ideas": ideas,
                    "crashes": sum(r.status == "crash" for r in rows),
                }
                bests[method] = best_source(repo)
                print(
                    f"[{time.monotonic() - t0:6.0f}s] seed {seed} {method:7s} baseline {kept[0]:.4f} best "
                    f"{min(kept):.4f} ({len(kept) - 1} keeps of {ideas} ideas, "
                    f"{seen[method]['crashes']} crashes)",
                    flush=True,
                )
                for r in records:
                    if r is not None and r.status == "crash":  # the run directories are temporary: say why here
                        print(f"    crash #{r.n} {r.description[:70]}: {r.reason[:120]}", flush=True)
            if args.remeasure:
                scores = remeasure(
                    bests, args.remeasure, args.budget, args.profile, args.timeout or 3 * args.budget + 30, seed
                )
                base = mean_of(scores["default"])
                for method in methods:  # a best that crashed again is infinitely worse; a default that did: void
                    seen[method]["improvement"] = base - mean_of(scores[method]) if base < math.inf else None
                print(
                    f"[{time.monotonic() - t0:6.0f}s] seed {seed} re-measured, {args.remeasure} runs each: "
                    + ", ".join(f"{k} {mean_of(v):.4f}" for k, v in scores.items())
                    + ("" if base < math.inf else " (the default crashed: this seed is left out)"),
                    flush=True,
                )
                seen["scores"] = scores
            per_seed.append(seen)
    key = "improvement" if args.remeasure else "session"
    print(
        f"\n{args.seeds} seeds x {args.experiments} experiments x {args.budget:g}s, profile {args.profile}; "
        + (
            f"improvement: the default's mean minus the session's best's mean, {args.remeasure} fresh runs each"
            if args.remeasure
            else "improvement: the session's baseline minus its best, as its ledger says"
        )
    )
    print(f"{'method':8s} {'median':>8s} {'min':>8s} {'max':>8s} {'keeps':>6s} {'ideas':>6s} {'crashes':>8s}  per seed")
    for m in methods:
        v = [s[m][key] for s in per_seed if s[m][key] is not None]
        if not v:
            print(f"{m:8s} no seed measured (the default crashed on every re-measure)")
            continue
        print(
            f"{m:8s} {statistics.median(v):8.4f} {min(v):8.4f} {max(v):8.4f} "
            f"{sum(s[m]['keeps'] for s in per_seed):6d} {sum(s[m]['ideas'] for s in per_seed):6d} "
            f"{sum(s[m]['crashes'] for s in per_seed):8d}  " + " ".join(f"{x:.4f}" for x in v)
        )
    if args.out:
        finite = json.loads(json.dumps(per_seed), parse_constant=lambda c: None)  # -inf (a crashed best): null
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "seeds": finite}, indent=1))


def best_source(repo: Path) -> str:
    """A session's best train.py, byte for byte: one that kept nothing is the default's and shares its runs."""
    return git.Repo(repo).git.show("autoloop/bench:train.py", strip_newline_in_stdout=False)


def mean_of(values: list[float | None]) -> float:
    """The mean of a configuration's re-measured runs; a crash in any counts as infinitely bad."""
    return math.inf if not values or None in values else statistics.fmean(values)


def remeasure(
    sources: dict[str, str], rounds: int, budget: float, profile: str, timeout: float, seed: int
) -> dict[str, list[float | None]]:
    """Each distinct train.py run `rounds` more times outside any session, interleaved in a shuffled order per
    round (drift in the machine's speed hits them alike), with seeds no session used: what each best is worth,
    free of the noise of the runs a gate saw. {name: [val_bpb, or None for a crash]}."""
    import random
    import shutil

    sys.path.insert(0, str(ROOT / "benchmarks" / "surrogate"))
    from collect import run_once

    distinct = list(dict.fromkeys(sources.values()))  # a best that is the default (or another's) runs once
    runs: list[list[float | None]] = [[] for _ in distinct]
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        for i, source in enumerate(distinct):
            (Path(tmp) / str(i)).mkdir()
            shutil.copy(ROOT / "prepare.py", Path(tmp) / str(i) / "prepare.py")
            shutil.copy(ROOT / "evaluate.py", Path(tmp) / str(i) / "evaluate.py")
            (Path(tmp) / str(i) / "train.py").write_text(source)
        for r in range(rounds):
            order = list(range(len(distinct)))
            rng.shuffle(order)
            for i in order:
                result = run_once(
                    Path(tmp) / str(i), budget, profile, timeout, {"AUTOLOOP_SEED": str(10_000 * (seed + 1) + r)}
                )
                runs[i].append(float(result["val_bpb"]) if result["val_bpb"] else None)
                if not result["val_bpb"]:
                    names = ", ".join(n for n, src in sources.items() if src == distinct[i])
                    print(f"    re-measure crash ({names}, round {r + 1}): {result['crash'][:120]}", flush=True)
    return {name: runs[distinct.index(source)] for name, source in sources.items()}


if __name__ == "__main__":
    sys.exit(main())
