"""How often does the keep gate accept an edit that does nothing? And does it still accept a real gain?

A proposer that makes only no-op edits (a comment or whitespace) runs N experiments of the real train.py on
this machine. With the default noise-aware gate (almost) none may be kept; for comparison the script replays
upstream's strict rule ("lower is kept") over the same first-run measurements. Then a short second session
starts from a hobbled train.py (Muon LR / 10) whose one proposal restores it: a real gain that must be kept.

    python benchmarks/false_keeps.py --experiments 30 --budget 10 --profile cpu
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from orchestrator.contract import make_git_repo
from orchestrator.loop import Settings, run_loop
from orchestrator.proposers import Proposal, Proposer
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths

ROOT = Path(__file__).resolve().parent.parent
HOBBLE = ("MATRIX_LR = 0.04", "MATRIX_LR = 0.004")


class NoOpProposer(Proposer):
    """Edits that change nothing the training notices: an unused assignment (a comment or whitespace alone is
    the same code to the idea memory, which skips it as a duplicate of the first: proposers/memory.py)."""

    name = "noop"

    def propose(self, workdir, history):
        path = workdir / "train.py"
        k = len(history)
        path.write_text(path.read_text() + f"\n_no_op_{k} = {k}  # no-op edit {k}\n")
        return Proposal(f"no-op edit {k} (an unused assignment)")


class FixProposer(Proposer):
    """One real improvement: undo the hobbled learning rate."""

    name = "fix"

    def propose(self, workdir, history):
        if any(r.description.startswith("restore") for r in history):
            return None
        path = workdir / "train.py"
        path.write_text(path.read_text().replace(HOBBLE[1], HOBBLE[0]))
        return "restore MATRIX_LR 0.004 -> 0.04"


def fresh_repo(where: Path, hobble: bool = False) -> Path:
    files = {name: (ROOT / name).read_text() for name in ("prepare.py", "evaluate.py", "train.py", ".gitignore")}
    if hobble:
        files["train.py"] = files["train.py"].replace(*HOBBLE)
    return make_git_repo(where, files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiments", type=int, default=30, help="no-op experiments after the baseline runs")
    ap.add_argument("--budget", type=float, default=10.0)
    ap.add_argument("--profile", default="cpu", choices=["gpu", "cpu", "tiny"])
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        repo = fresh_repo(Path(tmp) / "noop")
        total = 3 + args.experiments
        settings = Settings(
            repo=repo,
            tag="noop",
            budget=args.budget,
            profile=args.profile,
            proposer="__main__:NoOpProposer",
            max_experiments=None,
        )

        def enough(line: str) -> None:
            print(line, flush=True)

        # stop after N no-op candidates have been decided (repeats add runs, not candidates)
        while True:
            state = run_loop(Settings(**{**settings.__dict__, "max_experiments": total}), echo=enough)
            records = [read_record(Paths(repo, "noop").run_dir(n)) for n in range(1, state.done + 1)]
            candidates = {r.group for r in records if r.description.startswith("no-op")}
            finished = {
                r.group
                for r in records
                if r.description.startswith("no-op") and (r.status == "crash" or r.gate.decision in ("keep", "discard"))
            }
            if len(finished) >= args.experiments or state.done >= 4 * total:
                break
            total = state.done + (args.experiments - len(finished))
        rows = read_rows(repo / "results.tsv")
        noise_keeps = sum(r.status == "keep" and r.description.startswith("no-op") for r in rows)
        firsts = [r for r in records if r.description.startswith("no-op") and r.n == r.group and r.val_bpb]

        def replay_strict(start: float) -> int:
            best, keeps = start, 0
            for r in firsts:
                if r.val_bpb < best:
                    keeps, best = keeps + 1, r.val_bpb
            return keeps

        strict_keeps = replay_strict(records[0].val_bpb)  # upstream: against the one baseline run
        strict_mean_keeps = replay_strict(state.baseline_bpb)  # against the mean of the baseline runs
        spread = state.spread()

        fix_repo = fresh_repo(Path(tmp) / "fix", hobble=True)
        run_loop(
            Settings(
                repo=fix_repo, tag="fix", budget=args.budget, profile=args.profile, proposer="__main__:FixProposer"
            ),
            echo=enough,
        )
        fix_rows = read_rows(fix_repo / "results.tsv")
    print()
    print(
        f"no-op candidates decided: {len(finished)} ({len(candidates)} proposed, {state.done} runs incl. "
        f"baseline repeats and re-runs), budget {args.budget:g}s, profile {args.profile}"
    )
    print(f"typical sigma of val_bpb: {spread.sd or 0:.5f} (worth {spread.dof} runs)")
    print(
        f"kept, noise gate:         {noise_keeps} of {len(finished)} ({100 * noise_keeps / max(1, len(finished)):.1f}%)"
    )
    print(
        f"kept, strict (replayed):  {strict_keeps} of {len(firsts)} first runs "
        f"({100 * strict_keeps / max(1, len(firsts)):.1f}%) against the first baseline run "
        f"{records[0].val_bpb:.6f}; {strict_mean_keeps} against the baseline mean {state.baseline_bpb:.6f}"
    )
    restore = [r for r in fix_rows if r.description.startswith("restore")]
    print(
        f"real improvement:         {'KEPT' if any(r.status == 'keep' for r in restore) else 'NOT kept'}: "
        + "; ".join(f"{r.status} {r.val_bpb:.4f} {r.description}" for r in restore)
        + f" (baseline {fix_rows[0].val_bpb:.4f})"
    )
    print(f"wall time:                {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
