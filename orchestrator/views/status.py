"""`autoloop status`: a read-only view of a session, from its status file, lock and ledger."""

from __future__ import annotations

import time
from pathlib import Path

from .. import LoopError
from ..core.holdout import disagreement
from ..core.progress import last_step
from ..core.state import load_state
from ..store.ledger import read_rows
from ..store.session import Paths, is_locked, latest_tag, read_status
from ..trust.evaluation import holdout_text


def collect(repo: Path, tag: str | None) -> dict:
    tag = tag or latest_tag(repo)
    if tag is None:
        raise LoopError(f"no autoloop session in {repo}; start one with `autoloop run`")
    paths = Paths(repo, tag)
    if not paths.state.is_dir():
        raise LoopError(f"no session with tag {tag!r} in {repo}")
    status = read_status(paths)
    rows = read_rows(paths.ledger)
    state = load_state(paths)  # the same derivation as the loop's, the report's and the console's
    running = is_locked(paths.lock)
    spread = state.spread()
    info = {
        "tag": tag,
        "running": running,
        "phase": status.get("phase") if running else (status.get("phase") or "idle"),
        "experiments": len(rows),
        "keeps": sum(r.status == "keep" for r in rows),
        "crashes": sum(r.status == "crash" for r in rows),
        "baseline_bpb": state.baseline_bpb,
        "best_bpb": state.best_bpb,
        "best_commit": state.best_commit[:7] if state.best_group else None,
        "sigma": spread.sd,
        "sigma_dof": spread.dof,
        "current": None,
        "slots": [],
        "recent": [r.__dict__ for r in rows[-5:]],
        "verify": verify_status(paths),
        "holdout": holdout_status(paths, spread.sd),
        "contradicted": [{"n": n, "why": why} for n, why in state.contradicted()],
    }
    busy = status.get("running") or []
    if running and len(busy) == 1:  # one run: the current experiment
        item = busy[0]
        step = last_step(Path(item["log"]) if item.get("log") else paths.run_dir(item["n"]) / "run.log")
        info["current"] = {
            "n": item["n"],
            "phase": status.get("phase"),
            "description": item["description"],
            "elapsed_s": round(time.time() - item["started"], 1),
            "budget_s": status.get("budget"),
            "step": step[0] if step else None,
            "loss": step[2] if step else None,
        }
    elif running and busy:  # parallel runs: one entry per busy slot
        for item in busy:
            step = last_step(Path(item["log"]) if item.get("log") else paths.run_dir(item["n"]) / "run.log")
            info["slots"].append(
                {
                    "n": item["n"],
                    "slot": item["slot"],
                    "description": item["description"],
                    "elapsed_s": round(time.time() - item["started"], 1),
                    "step": step[0] if step else None,
                    "loss": step[2] if step else None,
                }
            )
    elif running and status.get("n"):
        step = last_step(paths.run_dir(status["n"]) / "run.log")
        info["current"] = {
            "n": status["n"],
            "phase": status.get("phase"),
            "description": status.get("description"),
            "elapsed_s": round(time.time() - status.get("experiment_started", time.time()), 1),
            "budget_s": status.get("budget"),
            "step": step[0] if step else None,
            "loss": step[2] if step else None,
        }
    return info


def verify_status(paths: Paths) -> dict | None:
    """The verification's state for `status`: complete or not, runs, each change's verdict, the minimal stack's
    branch and the transfer verdicts (None before `autoloop verify`)."""
    import json

    try:
        v = json.loads(paths.verify_json.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(v, dict) or not isinstance(v.get("changes"), list):
        return None
    return {
        "complete": bool(v.get("complete")),
        "runs": v.get("runs", 0),
        "changes": {f"#{c.get('n')}": c.get("verdict") for c in v["changes"]},
        "minimal_branch": (v.get("minimal") or {}).get("branch"),
        "transfer": (v.get("transfer") or {}).get("verdicts") or (v.get("transfer") or {}).get("skipped"),
    }


def holdout_status(paths: Paths, sigma: float | None) -> dict | None:
    """The held-out check for `status` (None before one was made): its line, and `disagrees`, the warning when
    the best is much better on validation than held out (core/holdout.py: disagreement; '' when it agrees)."""
    import json

    try:
        result = json.loads((paths.state / "holdout.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict):
        return None
    return {"text": holdout_text(result, sigma), "disagrees": disagreement(result, sigma)}


def transfer_text(transfer: dict | str) -> str:
    """{"best": "shrinks", "minimal": "holds"} -> "the best shrinks, the minimal holds" (or why it was skipped)."""
    if isinstance(transfer, dict):
        return ", ".join(f"the {stack} {verdict}" for stack, verdict in transfer.items())
    return str(transfer)


def render(info: dict) -> str:
    state = "running" if info["running"] else "not running"
    lines = [
        f"session {info['tag']}: {state} ({info['phase']})",
        f"experiments: {info['experiments']} ({info['keeps']} keep, {info['crashes']} crash)",
    ]
    if info["best_bpb"] is not None:
        lines.append(
            f"best val_bpb: {info['best_bpb']:.6f} at {info['best_commit']} (baseline {info['baseline_bpb']:.6f})"
        )
    if info["sigma"] is not None:
        lines.append(
            f"noise: typical σ = {info['sigma']:.5f} val_bpb between runs of one configuration "
            f"(worth {info['sigma_dof']} runs; each configuration's own repeats refine its own)"
        )
    elif info["experiments"]:
        lines.append("noise: σ not measured yet (no repeated runs)")
    if info.get("holdout"):
        lines.append(f"held-out check: {info['holdout']['text']}")
        if info["holdout"]["disagrees"]:
            lines.append(f"WARNING: {info['holdout']['disagrees']}")
    for c in info.get("contradicted") or []:
        lines.append(f"WARNING: keep #{c['n']} is contradicted by later runs: {c['why']}")
    if info["current"]:
        c = info["current"]
        progress = f", step {c['step']} loss {c['loss']:.4f}" if c.get("step") is not None else ""
        lines.append(
            f"current: #{c['n']} {c['phase']} {c['elapsed_s']:.0f}s elapsed (budget {c['budget_s']:g}s"
            f"{progress}): {c['description'] or '(proposing)'}"
        )
    for c in info["slots"]:
        progress = f", step {c['step']} loss {c['loss']:.4f}" if c.get("step") is not None else ""
        lines.append(f"slot {c['slot']}: #{c['n']} {c['elapsed_s']:.0f}s elapsed{progress}: {c['description']}")
    if info.get("verify"):
        v = info["verify"]
        verdicts = ", ".join(f"{n} {d}" for n, d in v["changes"].items())
        lines.append(
            f"verify: {'complete' if v['complete'] else 'in progress'} ({v['runs']} runs): {verdicts or '-'}"
            + (f"; minimal stack on {v['minimal_branch']}" if v["minimal_branch"] else "")
            + (f"; transfer: {transfer_text(v['transfer'])}" if v["transfer"] else "")
        )
    if info["recent"]:
        lines.append("last results:")
        for r in info["recent"]:
            lines.append(f"  {r['commit']}  {r['val_bpb']:.6f}  {r['status']:7}  {r['description'][:70]}")
    return "\n".join(lines)
