"""`autoloop report` and `autoloop results`: what a session found, for a person (plot, markdown) and an agent (JSON).

Reads only the ledger and the run records, so it works on any past session and on a copied .autoloop/ folder.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pandas as pd

from ..core.state import load_state
from ..store.ledger import read_record
from ..store.session import Paths
from ..store.spend import Spend
from ..trust.evaluation import holdout_text


def load(paths: Paths) -> pd.DataFrame:
    """results.tsv as a DataFrame (by column name, as upstream's analysis.ipynb reads it), with n added."""
    df = pd.read_csv(paths.ledger, sep="\t", dtype={"commit": str})
    df.insert(0, "n", range(1, len(df) + 1))
    return df


def facts(paths: Paths) -> dict:
    df = load(paths)
    records = {n: read_record(paths.run_dir(n)) for n in df["n"]}
    kept = df[df["status"] == "keep"]
    state = load_state(paths)  # best = the branch tip, as the loop, the console and `autoloop status` have it
    baseline, best = state.baseline_bpb, state.best_bpb
    counts = Counter(df["status"])
    improvements = []
    previous = baseline
    for _, row in kept.iloc[1:].iterrows():
        improvements.append(
            {
                "n": int(row["n"]),
                "commit": row["commit"],
                "val_bpb": float(row["val_bpb"]),
                "delta": float(row["val_bpb"]) - previous,
                "description": row["description"],
            }
        )
        previous = min(previous, float(row["val_bpb"]))
    crash_reasons = Counter()
    for n in df[df["status"] == "crash"]["n"]:
        rec = records.get(n)
        reason = (rec.reason if rec and rec.reason else "unknown").split(":")[0]
        crash_reasons[reason] += 1
    seconds = sum((r.ended - r.started) for r in records.values() if r and r.ended)
    train_s = sum(r.timings.get("train", 0.0) for r in records.values() if r)
    spend = Spend(paths.spend)  # every request, whether its idea ran or not
    tokens, cost = spend.tokens, spend.cost
    if not paths.spend.exists():  # a session from before the spend ledger: what its records carry
        tokens = sum(int(r.info.get("usage", {}).get("total_tokens", 0)) for r in records.values() if r)
        cost = sum(float(r.info.get("usage", {}).get("cost", 0.0)) for r in records.values() if r)
    holdout_path = paths.state / "holdout.json"
    return {
        "tag": paths.tag,
        "experiments": len(df),
        "keep": counts.get("keep", 0),
        "discard": counts.get("discard", 0),
        "crash": counts.get("crash", 0),
        "keep_rate": counts.get("keep", 0) / len(df) if len(df) else 0.0,
        "baseline_bpb": baseline,
        "best_bpb": best,
        "best_commit": state.best_commit[:7] if state.best_group else None,
        "delta": best - baseline if best is not None and baseline is not None else None,
        "delta_percent": 100 * (best - baseline) / baseline if best is not None and baseline else None,
        "top_improvements": sorted(improvements, key=lambda i: i["delta"])[:10],
        "crash_reasons": dict(crash_reasons.most_common()),
        "hours": seconds / 3600,
        "training_hours": train_s / 3600,
        "llm_tokens": tokens,
        "llm_cost": cost,
        "holdout": json.loads(holdout_path.read_text()) if holdout_path.exists() else None,
    }


def plot(paths: Paths, out: Path) -> Path:
    """progress.png: every non-crash run as a point, kept ones labelled, the running best as a step line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = load(paths)
    ok = df[df["status"] != "crash"]
    kept = df[df["status"] == "keep"]
    fig, ax = plt.subplots(figsize=(12, 6))
    ax.scatter(ok["n"], ok["val_bpb"], s=14, color="#b0b0b0", label="discarded", zorder=2)
    ax.scatter(kept["n"], kept["val_bpb"], s=40, color="#1f77b4", label="kept", zorder=3)
    if len(kept):
        best = kept["val_bpb"].cummin()
        ax.step(
            list(kept["n"]) + [df["n"].max()],
            list(best) + [best.iloc[-1]],
            where="post",
            color="#1f77b4",
            linewidth=1.5,
            label="running best",
        )
        ax.axhline(kept["val_bpb"].iloc[0], color="#d62728", linestyle="--", linewidth=1, label="baseline")
        for _, row in kept.iloc[1:].iterrows():
            ax.annotate(
                row["description"][:40],
                (row["n"], row["val_bpb"]),
                textcoords="offset points",
                xytext=(4, -10),
                fontsize=7,
                rotation=-20,
                color="#1f4f7f",
            )
        span = ok["val_bpb"].quantile(0.95) - kept["val_bpb"].min()
        ax.set_ylim(kept["val_bpb"].min() - 0.1 * span, ok["val_bpb"].quantile(0.95) + 0.1 * span)
    ax.set_xlabel("experiment")
    ax.set_ylabel("val_bpb (lower is better)")
    crashes = int((df["status"] == "crash").sum())
    ax.set_title(f"autoloop {paths.tag}: {len(df)} experiments, {len(kept)} kept, {crashes} crashed")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def cumulative_diff(paths: Paths, repo: Path, f: dict) -> str:
    base = read_record(paths.run_dir(1))
    if not base or not f["best_commit"]:
        return ""
    proc = subprocess.run(
        ["git", "diff", base.commit, f["best_commit"], "--", "train.py"], cwd=repo, capture_output=True, text=True
    )
    return proc.stdout if proc.returncode == 0 else ""


def markdown(f: dict, diff: str, image: str | None) -> str:
    lines = [f"# autoloop report: {f['tag']}", ""]
    if f["best_bpb"] is not None:
        lines += [
            f"**val_bpb {f['baseline_bpb']:.6f} -> {f['best_bpb']:.6f}** "
            f"({f['delta']:+.6f}, {f['delta_percent']:+.2f}%) at `{f['best_commit']}`",
            "",
        ]
    lines += [
        f"- experiments: {f['experiments']} ({f['keep']} keep, {f['discard']} discard, {f['crash']} crash); "
        f"keep rate {100 * f['keep_rate']:.1f}%",
        f"- time: {f['hours']:.2f} h, of which training {f['training_hours']:.2f} h",
    ]
    if f["llm_tokens"]:
        lines.append(f"- LLM: {f['llm_tokens']} tokens, ${f['llm_cost']:.2f}")
    if f["holdout"]:
        lines.append(f"- held-out split: {holdout_text(f['holdout'])}")
    if image:
        lines += ["", f"![progress]({image})"]
    lines += ["", "## Top improvements", "", "| # | commit | val_bpb | delta | description |", "|---|---|---|---|---|"]
    lines += [
        f"| {i['n']} | `{i['commit']}` | {i['val_bpb']:.6f} | {i['delta']:+.6f} | {i['description']} |"
        for i in f["top_improvements"]
    ] or ["| - | - | - | - | no improvement was kept |"]
    lines += ["", "## Crashes by reason", ""]
    lines += [f"- {reason}: {count}" for reason, count in f["crash_reasons"].items()] or ["- none"]
    if diff:
        lines += ["", "## Baseline -> best (train.py)", "", "```diff", diff.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write_report(paths: Paths, repo: Path, out_dir: Path) -> dict:
    f = facts(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(paths, out_dir / "progress.png")
    (out_dir / "report.md").write_text(markdown(f, cumulative_diff(paths, repo, f), png.name))
    return f


def table(paths: Paths, status: str | None = None, limit: int | None = None) -> str:
    df = load(paths)
    if status:
        df = df[df["status"] == status]
    if limit:
        df = df.tail(limit)
    if df.empty:
        return "no rows"
    df = df.assign(description=df["description"].str.slice(0, 70))
    return df.to_string(index=False, columns=["n", "commit", "val_bpb", "memory_gb", "status", "description"])
