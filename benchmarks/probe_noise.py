"""The evaluation's probes on honest models, and their power against a cheat (evaluate.py; docs/trust.md).

Part 1, honest models: train.py with other shapes (depth, width, head size, attention window, logit cap) in fp32
and bf16, on the cpu and tiny profiles, each trained for a few seconds, exported as under the controller, and
scored by `python -I -S evaluate.py` (--repeats times): the probes' figures for each (rows probed, largest move of
a log-probability, its root mean square, the true token's mean gain at the cuts and its z) against the bounds, and
whether any was refused. `--load N` starts N CPU-bound processes beside it (a loaded machine).

Part 2, detection: one honest exported model with a cheat added to its logits at a share G of positions (the
next token's logit raised by --delta where a hash of position and token falls under G), probed --trials times
with fresh random rows: the share of trials it passes, against (1 - G)^n for n probed rows.

    python benchmarks/probe_noise.py --budget 4 --repeats 2 --load 2
    python benchmarks/probe_noise.py --skip-honest --trials 100 --shares 0.01,0.02,0.05
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (profile, dtype, {train.py constant: value}): 24 honest models of different sizes and shapes
MODELS = [
    (profile, dtype, shape)
    for profile, shapes in (
        (
            "tiny",
            [
                {},
                {"DEPTH": 1},
                {"DEPTH": 4},
                {"ASPECT_RATIO": 16},
                {"ASPECT_RATIO": 96, "HEAD_DIM": 64},
                {"WINDOW_PATTERN": '"SL"'},
                {"LOGIT_CAP": 50.0},
                {"DEPTH": 3, "HEAD_DIM": 64},
            ],
        ),
        (
            "cpu",
            [
                {},
                {"DEPTH": 2},
                {"DEPTH": 6, "ASPECT_RATIO": 16},
                {"WINDOW_PATTERN": '"SSL"', "HEAD_DIM": 32},
            ],
        ),
    )
    for shape in shapes
    for dtype in ("fp32", "bf16")
]


def burn() -> None:
    while True:
        pass


def with_constants(source: str, shape: dict) -> str:
    for name, value in shape.items():
        source, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", source, count=1, flags=re.M)
        assert n == 1, name
    return source


def export(work: Path, env: dict, budget: float) -> str:
    """Train and export (as under the controller); '' or why it failed."""
    env = dict(env, AUTOLOOP_TIME_BUDGET=str(budget), AUTOLOOP_EVAL_ARTIFACT=str(work / "model.pt"))
    proc = subprocess.run([sys.executable, "train.py"], cwd=work, env=env, capture_output=True, text=True)
    return "" if proc.returncode == 0 else (proc.stdout + proc.stderr).strip().splitlines()[-1][:200]


def evaluate(work: Path, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "evaluate.py", "model.pt"], cwd=work, env=env, capture_output=True, text=True
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("AUTOLOOP_EVAL ")), None)
    return json.loads(line.split(" ", 1)[1]) if line else {"error": (proc.stdout + proc.stderr)[-300:]}


def honest(args) -> int:
    refused, rows = 0, []
    print(
        f"{'profile':7} {'dtype':5} {'shape':38} {'val_bpb':>8} {'rows':>5} {'max_abs':>9} {'rms':>9} "
        f"{'gain':>10} {'z':>6} {'eval_s':>6} {'probe_s':>7}  verdict"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for i, (profile, dtype, shape) in enumerate(MODELS):
            work = Path(tmp) / str(i)
            work.mkdir()
            for name in ("prepare.py", "evaluate.py"):
                shutil.copy(ROOT / name, work / name)
            (work / "train.py").write_text(with_constants((ROOT / "train.py").read_text(), shape))
            env = dict(os.environ, AUTOLOOP_PROFILE=profile, AUTOLOOP_DEVICE="cpu", AUTOLOOP_DTYPE=dtype)
            if args.cache:
                env["AUTOLOOP_CACHE"] = args.cache
            subprocess.run([sys.executable, "prepare.py"], cwd=work, env=env, capture_output=True, check=True)
            if why := export(work, env, args.budget):
                print(f"{profile:7} {dtype:5} {json.dumps(shape):38} training failed: {why}")
                continue
            for _ in range(args.repeats):
                r = evaluate(work, env)
                p = r.get("probe") or {}
                verdict = "refused: " + r["error"][:80] if "error" in r else "ok"
                refused += "error" in r
                rows.append(p)
                print(
                    f"{profile:7} {dtype:5} {json.dumps(shape)[:38]:38} {r.get('val_bpb', float('nan')):8.4f} "
                    f"{p.get('rows', 0):5d} {p.get('max_abs', 0):9.3g} {p.get('rms', 0):9.3g} "
                    f"{p.get('mean_gain_at_cut', 0):10.3g} {p.get('z', 0):6.2f} {r.get('seconds', 0):6.2f} "
                    f"{r.get('probe_seconds', 0):7.2f}  {verdict}",
                    flush=True,
                )
    worst = max((p.get("max_abs", 0) for p in rows), default=0)
    rms = max((p.get("rms", 0) for p in rows), default=0)
    zs = [p.get("z", 0) for p in rows if p]
    print(
        f"\n{len(rows)} evaluations of {len(MODELS)} models: {refused} refused; largest move {worst:.3g} nats, "
        f"largest rms {rms:.3g}, z from {min(zs, default=0):.2f} to {max(zs, default=0):.2f}"
    )
    return 1 if refused else 0


def detection(args) -> int:
    """In this process: an exported honest model (tiny profile), cheating at a share G of positions."""
    os.environ.update(AUTOLOOP_PROFILE=args.profile, AUTOLOOP_DEVICE="cpu")
    if args.cache:
        os.environ["AUTOLOOP_CACHE"] = args.cache
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ("prepare.py", "evaluate.py", "train.py"):
            shutil.copy(ROOT / name, work / name)
        subprocess.run([sys.executable, "prepare.py"], cwd=work, env=os.environ, capture_output=True, check=True)
        if why := export(work, dict(os.environ), args.budget):
            sys.exit(f"training failed: {why}")
        sys.path.insert(0, str(work))
        import evaluate as ev

        token_bytes, rows, wanted, problem = ev._evaluation_data("val")
        assert not problem, problem
        graph, _, _ = ev.load_exported(str(work / "model.pt"), torch.device("cpu"))
        vocab, T = len(token_bytes), ev.MAX_SEQ_LEN
        bound = ev.EVAL_MAX_ELEMENTS_SHARE * ev.EVAL_ROWS * T * vocab
        print(
            f"profile {args.profile}: {len(rows)} evaluation rows, {len(ev.probe_rows(len(rows), torch.Generator()))}"
            f" probed, cheat +{args.delta} on the next token's logit"
        )
        for share in (float(s) for s in args.shares.split(",")):

            def cheats(x, share=share):
                return (x * 7919 + torch.arange(T)[None, :] * 104729) % 10007 < share * 10007

            def forward(x, cheats=cheats):
                nxt = torch.nn.functional.one_hot(torch.roll(x, -1, 1), vocab)
                return graph(x, bound) + args.delta * nxt * cheats(x)[..., None]

            real = cheats(rows[:, :-1])[:, :-1].float().mean().item()  # of the positions a probe can cut at

            passed, n = 0, 0
            t0 = time.time()
            for trial in range(args.trials):
                gen = torch.Generator().manual_seed(1000 + trial)
                picks = ev.probe_rows(len(rows), gen)
                _, _, kept = ev.score(forward, rows, wanted, vocab, token_bytes, torch.device("cpu"), picks)
                cheat, _ = ev.probe(forward, rows, kept, picks, gen, vocab, torch.device("cpu"), "cpu")
                passed += not cheat
                n = len(picks)
            print(
                f"G = {share:.3f} (on the evaluation's text {real:.4f}): passed {passed}/{args.trials} "
                f"({passed / args.trials:.3f}); (1 - G)^{n} = {(1 - real) ** n:.3f}  ({time.time() - t0:.0f}s)",
                flush=True,
            )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=4.0, help="training seconds per model")
    ap.add_argument("--repeats", type=int, default=2, help="evaluations per honest model")
    ap.add_argument("--load", type=int, default=0, help="CPU-bound processes started beside the measurement")
    ap.add_argument("--cache", default=None, help="AUTOLOOP_CACHE (default: prepare.py's)")
    ap.add_argument("--skip-honest", action="store_true")
    ap.add_argument("--trials", type=int, default=0, help="detection: probings per cheat share (0: skip)")
    ap.add_argument("--shares", default="0.01,0.02,0.05", help="detection: shares G of positions cheated on")
    ap.add_argument("--delta", type=float, default=5.0, help="detection: what the cheat adds to a logit")
    ap.add_argument("--profile", default="tiny", choices=["tiny", "cpu"], help="detection's profile")
    args = ap.parse_args()
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    try:
        status = 0 if args.skip_honest else honest(args)
        if args.trials:
            detection(args)
        return status
    finally:
        for b in burners:
            b.terminate()


if __name__ == "__main__":
    sys.exit(main())
