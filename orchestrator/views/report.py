"""`autoloop report` and `autoloop results`: what a session found, for a person (plot, markdown) and an agent (JSON).

Reads only the ledger and the run records, so it works on any past session and on a copied .autoloop/ folder.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from ..core.holdout import disagreement
from ..core.state import Decision, State, Status, group_of, load_state, replay
from ..core.verify import later_text
from ..store.ledger import Record, read_record
from ..store.session import Paths
from ..store.spend import Spend
from ..trust.evaluation import holdout_noise, holdout_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Annotation
    from matplotlib.transforms import Bbox


def load(paths: Paths) -> pd.DataFrame:
    """results.tsv as a DataFrame (by column name, as upstream's analysis.ipynb reads it), with n added."""
    df = pd.read_csv(paths.ledger, sep="\t", dtype={"commit": str})
    df.insert(0, "n", range(1, len(df) + 1))
    return df


def facts(paths: Paths) -> dict:
    df = load(paths)
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
    crash_reasons: Counter[str] = Counter()
    for r in state.records:
        if r.status == Status.CRASH:
            crash_reasons[(r.reason or "unknown").split(":")[0]] += 1
    spend = Spend(paths.spend)  # every request, whether its idea ran or not
    tokens, cost = spend.tokens, spend.cost
    if not paths.spend.exists():  # a session from before the spend ledger: what its records carry
        tokens, cost = state.usage()
    holdout = read_holdout(paths)
    sigma = state.spread().sd  # the session's run-to-run spread: the held-out check's noise is judged against it
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
        **value(state, holdout, sigma),
        "llm_tokens": tokens,
        "llm_cost": cost,
        "holdout": holdout,
        "holdout_disagrees": disagreement(holdout, sigma),  # '' when it agrees (or no check)
        "contradicted": [{"n": n, "why": why} for n, why in state.contradicted()],
        "sigma": sigma,
        "verify": read_verify(paths),
    }


def read_verify(paths: Paths) -> dict | None:
    """verify.json (`autoloop verify`: core/verify.py), or None before a verification."""
    try:
        data = json.loads(paths.verify_json.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("changes"), list) else None


def read_holdout(paths: Paths) -> dict | None:
    """holdout.json (the held-out check: core/holdout.py), or None before a check was made."""
    path = paths.state / "holdout.json"
    return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------------------------------------------------------
# The night's value against its compute


def value(state: State, holdout: dict | None, sigma: float | None) -> dict:
    """What the session bought with its compute. An improvement is the baseline's val_bpb minus the best's (bits
    per byte; positive when the best is better), per training hour (GPU-hours on GPUs: each run trains on one);
    the held-out one once the held-out check was made. The pace: candidate ideas the gate decided per hour."""
    hours = sum(r.ended - r.started for r in state.records if r.ended) / 3600
    training = sum(training_seconds(r) for r in state.records) / 3600
    on_validation = (
        state.baseline_bpb - state.best_bpb if state.baseline_bpb is not None and state.best_bpb is not None else None
    )
    held_out = holdout_improvement(holdout)
    se, verdict = holdout_noise(holdout, sigma) if holdout else (None, "")
    judged = ideas_judged(state)
    return {
        "hours": hours,
        "training_hours": training,
        "training_on_gpu": any(r.device not in ("", "cpu") for r in state.records),
        "val_improvement_per_training_hour": per_hour(on_validation, training),
        "holdout_improvement": held_out,
        "holdout_improvement_se": se if held_out is not None else None,  # one model each: σ√2
        "holdout_verdict": verdict if held_out is not None else "",
        "holdout_improvement_per_training_hour": per_hour(held_out, training),
        "ideas_judged": judged,
        "ideas_judged_per_hour": per_hour(judged, hours),
    }


def training_seconds(record: Record) -> float:
    """The run's training time (its whole time for a record from before the phases were timed)."""
    if not record.timings:
        return record.ended - record.started if record.ended else 0.0
    return float(record.timings.get("train", 0.0))


def holdout_improvement(holdout: dict | None) -> float | None:
    """The baseline's held-out bits per byte minus the best's, or None without a complete check."""
    if not holdout or holdout.get("error"):
        return None
    return holdout["baseline"]["holdout_bpb"] - holdout["best"]["holdout_bpb"]


def ideas_judged(state: State) -> int:
    """Candidate configurations the gate decided, kept or discarded: not the baseline, a crash, one still being
    run again, nor one left unjudged because another process slowed its run."""
    decided = {
        group_of(r)
        for r in state.records
        if (r.gate.decision or r.status) in (Decision.KEEP, Decision.DISCARD) and not r.gate.disturbed
    }
    return len(decided - {state.baseline_group})


def per_hour(amount: float | None, hours: float) -> float | None:
    return amount / hours if amount is not None and hours > 0 else None


# ---------------------------------------------------------------------------------------------------------------
# progress.png: the session as the gate saw it

KEPT, DISCARDED, AGAIN = "kept", "discarded idea", "repeat, rerun, confirmation"
STYLE = {  # how each kind of run is drawn
    KEPT: {"s": 40, "color": "#1f77b4", "zorder": 4},
    DISCARDED: {"s": 14, "color": "#b0b0b0", "zorder": 2},
    AGAIN: {"s": 22, "marker": "D", "facecolors": "none", "edgecolors": "#ff7f0e", "zorder": 3},
}
LABEL_CHARS = 36  # a kept idea's label: its description cut to this many characters
DPI = 120


def plot(paths: Paths, out: Path) -> Path:
    """progress.png: figure(), saved."""
    import matplotlib.pyplot as plt

    fig = figure(paths)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def figure(paths: Paths) -> Figure:
    """Every non-crash run as a point (kept, a discarded idea, or a run again of a configuration: a repeat of the
    best, a rerun or confirmation of a candidate), kept ideas labelled, the best's mean over its counted runs after
    each run with ± its standard error (what the gate compared ideas with), and the baseline's mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    state = load_state(paths)
    runs = [r for r in state.records if r.status != Status.CRASH and r.val_bpb is not None]
    verified = read_verify(paths)
    measured = [c for c in (verified or {}).get("changes", []) if c.get("contribution") is not None]
    if measured:
        fig, axes = plt.subplot_mosaic(
            [["top", "top"], ["waterfall", "transfer"]],
            figsize=(12, 9),
            dpi=DPI,
            gridspec_kw={"height_ratios": [2, 1], "width_ratios": [2.2, 1]},
        )
        ax = axes["top"]
        draw_contributions(axes["waterfall"], measured, verified)
        draw_transfer(axes["transfer"], verified)
    else:
        fig, ax = plt.subplots(figsize=(12, 6), dpi=DPI)
    for kind, style in STYLE.items():
        mine = [r for r in runs if kind_of(r) == kind]
        if mine:
            ax.scatter([r.n for r in mine], [r.bpb for r in mine], label=kind, **style)  # type: ignore[arg-type]
    best = running_best(state.records, state.start_commit)
    if best:
        draw_best(ax, best)
    if state.baseline_bpb is not None:
        ax.axhline(state.baseline_bpb, color="#d62728", linestyle="--", linewidth=1, label="baseline (mean)")
    if runs:
        set_ylim(ax, runs, best)
    ax.set_xlabel("experiment")
    ax.set_ylabel("val_bpb (lower is better)")
    kept, crashes = (
        sum(r.status == Status.KEEP for r in state.records),
        sum(r.status == Status.CRASH for r in state.records),
    )
    stopped = sum(r.status != Status.CRASH and r.val_bpb is None for r in state.records)  # --early-stop: no val_bpb
    ax.set_title(
        f"autoloop {paths.tag}: {state.done} experiments, {kept} kept, {crashes} crashed"
        + (f", {stopped} stopped early (not drawn)" if stopped else "")
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    labels = label_kept(ax, state, runs)
    fig.tight_layout()
    place_labels(fig, ax, labels)
    return fig


VERDICT_COLOUR = {"matters": "#2ca02c", "no measurable contribution": "#b0b0b0"}


def draw_contributions(ax: Axes, changes: list[dict], verified: dict) -> None:
    """`autoloop verify`'s waterfall: each kept change's leave-one-out contribution (its ablation's val_bpb
    minus the best's: how much worse the best is without it), stacked in the order they were kept, ± its
    standard error, coloured by verdict."""
    level = 0.0
    for i, c in enumerate(changes):
        d, se = c["contribution"], c.get("se") or 0.0
        colour = VERDICT_COLOUR.get(c["verdict"], "#ff7f0e")
        ax.bar(i, d, bottom=level, color=colour, width=0.6)
        ax.errorbar(i, level + d, yerr=se, color="black", capsize=3, linewidth=1)
        level += d
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(changes)))
    ax.set_xticklabels([f"#{c['n']} {shorten(c['description'], 22)}" for c in changes], fontsize=7)
    ax.set_ylabel("contribution (val_bpb)")
    done = "" if verified.get("complete") else " (in progress)"
    ax.set_title(
        f"autoloop verify{done}: leave-one-out contribution of each kept change (green: matters, grey: none "
        "measurable), ± standard error",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="y")


def draw_transfer(ax: Axes, verified: dict) -> None:
    """`autoloop verify`'s transfer table beside the waterfall: each stack's improvement on the baseline at the
    session's budget and the longer one, and the verdicts."""
    ax.axis("off")
    transfer = verified.get("transfer") or {}
    if "skipped" in transfer or not transfer.get("rows"):
        ax.text(0, 0.9, shorten(transfer.get("skipped", "transfer: not measured"), 60), fontsize=8, va="top")
        return
    stacks = [s for s in ("best", "minimal") if any(row.get(s) for row in transfer["rows"])]
    cells = [
        [f"{row['budget']:g}s"]
        + [f"{row[s]['improvement']:+.4f}" if row.get(s) and row[s]["improvement"] is not None else "-" for s in stacks]
        for row in transfer["rows"]
    ]
    cells.append(["verdict"] + [(transfer.get("verdicts") or {}).get(s, "-") for s in stacks])
    table = ax.table(cellText=cells, colLabels=["budget", *stacks], loc="upper center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.scale(1, 1.4)
    ax.set_title(f"transfer: {transfer['metric']} improvement on the baseline", fontsize=9)


def kind_of(record: Record) -> str:
    """A run again of a configuration counts towards its mean: it is no idea of its own."""
    if record.status == Status.KEEP:
        return KEPT
    again = (Decision.REPEAT, Decision.RERUN, Decision.CONFIRMING)
    return AGAIN if group_of(record) != record.n or record.gate.decision in again else DISCARDED


def running_best(records: list[Record], start: str) -> list[tuple[int, float, float]]:
    """(n, the best's mean, its standard error) after each run, from the state the loop rebuilt then: the mean the
    gate compared candidates with, not the lowest run (one lucky run is not what later ideas had to beat)."""
    state, points = replay([], start), []
    for record in records:
        state.add(record)
        if state.best_bpb is not None:
            values = state.comparator() or state.runs(state.best_group)  # as best_bpb: fresh runs once any
            se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
            points.append((record.n, state.best_bpb, se))
    return points


def draw_best(ax: Axes, best: list[tuple[int, float, float]]) -> None:
    """The best's mean as a step line (held until the next run), its standard error as a band; the last step is
    drawn half a run on, so that a best kept by the last run shows."""
    steps = best + best[-1:]
    xs: list[float] = [n for n, _, _ in steps]
    xs[-1] += 0.5
    means, low, high = [m for _, m, _ in steps], [m - se for _, m, se in steps], [m + se for _, m, se in steps]
    colour = STYLE[KEPT]["color"]
    ax.step(xs, means, where="post", color=colour, linewidth=1.5, label="best: mean of its runs")
    if any(se for _, _, se in best):
        ax.fill_between(xs, low, high, step="post", color=colour, alpha=0.15, linewidth=0, label="± standard error")


def set_ylim(ax: Axes, runs: list[Record], best: list[tuple[int, float, float]]) -> None:
    """From the lowest run (or band) to the 95th percentile of the runs (a diverged idea would flatten the rest),
    every kept run included."""
    values = pd.Series([r.bpb for r in runs])
    kept = [r.bpb for r in runs if r.status == Status.KEEP]
    low = min([values.min()] + [m - se for _, m, se in best])
    high = max([values.quantile(0.95)] + kept)
    pad = 0.1 * (high - low) or 0.01
    ax.set_ylim(low - pad, high + pad)


def label_kept(ax: Axes, state: State, runs: list[Record]) -> list[Annotation]:
    """Each kept idea's description (its first run's), cut to LABEL_CHARS, below and right of its point."""
    by_n = {r.n: r for r in state.records}
    labels = []
    for r in runs:
        if r.status == Status.KEEP and group_of(r) != state.baseline_group:
            label = ax.annotate(
                shorten(by_n[group_of(r)].description, LABEL_CHARS),
                (r.n, r.bpb),
                textcoords="offset points",
                xytext=(6, -4),
                va="top",
                fontsize=7,
                color="#1f4f7f",
            )
            label.set_in_layout(False)  # placed after the layout (place_labels): it must not shrink the axes
            labels.append(label)
    return labels


def shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def place_labels(fig: Figure, ax: Axes, labels: list[Annotation]) -> None:
    """Move each label below the earlier ones it would cover, then into the axes if it pokes out of them."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    box = ax.get_window_extent(renderer).padded(-3)
    placed: list[Bbox] = []
    for label in labels:
        for other in placed:
            text = label.get_window_extent(renderer)
            if text.overlaps(other):
                move(label, fig, 0, other.y0 - text.y1 - 2)
        text = label.get_window_extent(renderer)
        dx = max(box.x0 - text.x0, 0) + min(box.x1 - text.x1, 0)
        dy = max(box.y0 - text.y0, 0) + min(box.y1 - text.y1, 0)
        move(label, fig, dx, dy)
        placed.append(label.get_window_extent(renderer))


def move(label: Annotation, fig: Figure, dx: float, dy: float) -> None:
    """Shift a label by (dx, dy) pixels (its offset is in points)."""
    x, y = label.xyann
    label.xyann = (x + dx * 72 / fig.dpi, y + dy * 72 / fig.dpi)


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
    if (lead := night_value_line(f)) is not None:
        lines += [lead, ""]
    if f["best_bpb"] is not None:
        lines += [
            f"**val_bpb {f['baseline_bpb']:.6f} -> {f['best_bpb']:.6f}** "
            f"({f['delta']:+.6f}, {f['delta_percent']:+.2f}%) at `{f['best_commit']}`",
            "",
        ]
    if f.get("holdout_disagrees"):
        lines += [f"> **Warning:** {f['holdout_disagrees']}", ""]
    for c in f.get("contradicted") or []:
        lines += [f"> **Keep #{c['n']} contradicted by later runs:** {c['why']}", ""]
    lines += [
        f"- experiments: {f['experiments']} ({f['keep']} keep, {f['discard']} discard, {f['crash']} crash); "
        f"keep rate {100 * f['keep_rate']:.1f}%",
        f"- time: {f['hours']:.2f} h, of which training {f['training_hours']:.2f} h",
        *value_lines(f),
    ]
    if f["llm_tokens"]:
        lines.append(f"- LLM: {f['llm_tokens']} tokens, ${f['llm_cost']:.2f}")
    if f["holdout"]:
        lines.append(f"- held-out split: {holdout_text(f['holdout'], f.get('sigma'))}")
    if image:
        lines += ["", f"![progress]({image})"]
    lines += ["", "## Top improvements", "", "| # | commit | val_bpb | delta | description |", "|---|---|---|---|---|"]
    lines += [
        f"| {i['n']} | `{i['commit']}` | {i['val_bpb']:.6f} | {i['delta']:+.6f} | {i['description']} |"
        for i in f["top_improvements"]
    ] or ["| - | - | - | - | no improvement was kept |"]
    if f.get("verify"):
        lines += ["", *verify_lines(f["verify"])]
    lines += ["", "## Crashes by reason", ""]
    lines += [f"- {reason}: {count}" for reason, count in f["crash_reasons"].items()] or ["- none"]
    if diff:
        lines += ["", "## Baseline -> best (train.py)", "", "```diff", diff.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def verify_lines(v: dict) -> list[str]:
    """report.md's verification section: contributions, the minimal stack, the transfer table."""
    hours = v.get("train_seconds", 0.0) / 3600
    lines = [
        "## Verification" + ("" if v.get("complete") else " (in progress: `autoloop verify` resumes it)"),
        "",
        f"{v['runs']} runs ({v.get('crashes', 0)} crashed), {hours:.2f} training hours, of the best "
        f"`{v['best_commit']}` at {v['budget']:g}s. Contribution: the val_bpb of the best without the change "
        "minus the best's (positive: the change helps).",
        "",
        "| # | change | contribution | runs | verdict |",
        "|---|---|---|---|---|",
    ]
    for c in v["changes"]:
        d = c.get("contribution")
        fig = f"{d:+.6f} ± {c['se']:.6f}" if d is not None and c.get("se") is not None else "-"
        note = f" ({c['note']})" if c.get("note") else ""
        if (late := c.get("latest")) and late.get("se") is not None:  # the figures are the deciding look's
            note += f" (decided on these runs; {later_text(late)})"
        lines.append(f"| {c['n']} | {c['description']} | {fig} | {c['runs']} | {c['verdict']}{note} |")
    m = v.get("minimal")
    if m:
        dropped = ", ".join(f"#{n}" for n in m["dropped"]) or "nothing"
        lines += [
            "",
            f"Minimal stack (dropping {dropped}): {m['verdict']}"
            + (f", branch `{m['branch']}`" if m.get("branch") else ""),
        ]
    t = v.get("transfer")
    if t and "skipped" in t:
        lines += ["", f"Transfer: {t['skipped']}"]
    elif t:
        lines += [
            "",
            f"Transfer ({t['metric']}, improvement = baseline minus stack, mean ± standard error):",
            "",
            "| budget | baseline | best | improvement | minimal | improvement |",
            "|---|---|---|---|---|---|",
        ]
        for row in t["rows"]:
            cells = [f"{row['budget']:g}s", _num(row.get("baseline"))]
            for stack in ("best", "minimal"):
                r = row.get(stack)
                cells += (
                    [_num(r["mean"]), _num(r["improvement"], signed=True) + (f" ± {r['se']:.6f}" if r["se"] else "")]
                    if r
                    else ["-", "-"]
                )
            lines.append("| " + " | ".join(cells) + " |")
        if t.get("verdicts"):
            lines += ["", "Verdict: " + "; ".join(f"the {k} {v_}" for k, v_ in t["verdicts"].items())]
    return lines


def _num(x: float | None, signed: bool = False) -> str:
    return "-" if x is None else f"{x:+.6f}" if signed else f"{x:.6f}"


def night_value_line(f: dict) -> str | None:
    """The report's first line: what the night bought on data no decision used, per training hour, and whether
    it is beyond the noise (one model each: ± σ√2); None before a held-out check."""
    gain = f.get("holdout_improvement")
    if gain is None:
        return None
    unit = "GPU-hour" if f["training_on_gpu"] else "training hour (CPU)"
    se = f.get("holdout_improvement_se")
    noise = f" ± {se:.6f} ({f['holdout_verdict']})" if se is not None else " (its noise unknown: nothing run twice)"
    rate = f["holdout_improvement_per_training_hour"]
    per = f", {rate:.6f} per {unit}" if rate is not None else ""
    return f"**Held-out improvement {gain:+.6f} bpb{noise}{per}** (baseline minus best, on the held-out split)"


def value_lines(f: dict) -> list[str]:
    """The report's lines on what the night bought: the improvement per training hour, the ideas judged."""
    unit = "GPU-hour" if f["training_on_gpu"] else "training hour (CPU)"
    lines = []
    if f["val_improvement_per_training_hour"] is not None:
        held_out = (
            f"{f['holdout_improvement_per_training_hour']:.6f} bpb on the held-out split, "
            if f["holdout_improvement_per_training_hour"] is not None
            else ""
        )
        on_validation = f"{f['val_improvement_per_training_hour']:.6f}{' bpb' if not held_out else ''} on validation"
        lines.append(f"- improvement per {unit}: {held_out}{on_validation} (baseline minus best)")
    pace = f" ({f['ideas_judged_per_hour']:.1f} per hour)" if f["ideas_judged_per_hour"] is not None else ""
    lines.append(f"- ideas judged: {f['ideas_judged']}{pace}")
    return lines


def write_report(paths: Paths, repo: Path, out_dir: Path) -> dict:
    f = facts(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(paths, out_dir / "progress.png")
    (out_dir / "report.md").write_text(markdown(f, cumulative_diff(paths, repo, f), png.name))
    return f


def verify_table(paths: Paths, limit: int | None = None) -> str:
    """`autoloop results --verify`: the verification's runs (they are not rows of results.tsv)."""
    root = paths.verify / "runs"
    records = [r for d in (root.iterdir() if root.is_dir() else []) if (r := read_record(d)) is not None]
    records.sort(key=lambda r: r.n)
    if limit:
        records = records[-limit:]
    if not records:
        return "no verification runs (run `autoloop verify`)"
    df = pd.DataFrame(
        {
            "n": [r.n for r in records],
            "commit": [r.commit[:7] for r in records],
            "budget": [r.info.get("budget") for r in records],
            "val_bpb": [r.val_bpb for r in records],
            "held_out": [r.metrics.get("holdout_bpb") for r in records],
            "status": [r.status for r in records],
            "description": [(r.description + (f" [{r.reason}]" if r.reason else ""))[:70] for r in records],
        }
    )
    return df.to_string(index=False)


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
