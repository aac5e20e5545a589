"""Near misses are not wasted: candidates measured better than the best but not proven better are parked, and
once `--bundle` of them are, the loop tries them together as one idea.

A small true gain (half a run's sd, as late in a real night) takes a dozen runs to prove on its own; three of
them applied together make a gain that a run or two can show. The bundle is judged like any other idea, on its
own runs against the best, so a bundle of no-ops or of ideas that hurt is discarded as one; its record names
the ideas it holds (`info.bundle`), and those are parked no more (kept or not). A bundle that is itself a near
miss is parked like any idea, and may join a later bundle.

Which discards are near misses (`near_miss`, marked `parked` in their decision's evidence):
- `--gate value`: its posterior mean gain is positive (value.py: the prior already discounts a lucky run);
- `--gate noise`: better by at least PARK_T standard errors.
Never under `--gate strict` (upstream's rule has no near misses: lower is kept). Parked ideas are read back from
the run records (`parked`): a resumed session has the same ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..store import gitops
from ..store.ledger import Evidence
from .pipeline import Prepared
from .state import Cause, Decision, State, Status, group_of

if TYPE_CHECKING:
    from .workspace import Workspace

PARK_T = 0.5  # the noise gate: a discard measured better by this many standard errors is a near miss
MOST = 6  # parked ideas in one bundle at most (the latest)


def near_miss(evidence: Evidence, mode: str) -> bool:
    """Is this final discard measured better than the best, though not proven (a bundle may use it)?"""
    delta, stats = evidence.delta, evidence.stats
    if evidence.decision != Decision.DISCARD or delta is None or delta <= 0 or evidence.selection:
        return False
    if mode == "value":
        return isinstance(stats.get("gain"), (int, float)) and stats["gain"] > 0
    se = stats.get("se")
    return mode == "noise" and isinstance(se, (int, float)) and se > 0 and delta / se >= PARK_T


def parked(state: State) -> list[int]:
    """The parked near misses not bundled yet (each its first run's number), oldest first."""
    used = {  # a bundle that never ran for the machine's fault (its crash put down to the environment) used none
        n
        for r in state.records
        if not (r.status == Status.CRASH and r.cause == Cause.ENVIRONMENT)
        for n in (*r.info.get("bundle", ()), *r.info.get("bundle_dropped", ()))
    }
    final: dict[int, bool] = {}
    for r in state.records:
        if r.gate.decision in (Decision.KEEP, Decision.DISCARD):
            final[group_of(r)] = bool(r.gate.stats.get("parked"))
    return [g for g, p in final.items() if p and g not in used]


def bundle(ws: Workspace, state: State, parts: list[int]) -> Prepared | None:
    """One idea of these parked ideas applied together on the best (each three-way, as its run's change from
    the best it was made on); None when fewer than two of them apply together. A part that no longer applies to
    the best alone, or changes nothing there (it is in the best already), is named in `info.bundle_dropped`
    and parked no more; one that clashes only with an earlier part stays parked for a later bundle."""
    best = state.best_commit
    wt = ws.proposal_worktree(best)
    first = {r.n: r for r in state.records}

    def apply(n: int) -> bool:  # on the worktree's HEAD: committed if it applies and changes something
        record, head = first[n], wt.head.commit.hexsha
        patch, patch_u0 = (gitops.diff(wt, record.parent, record.commit, c) for c in (3, 0))
        if gitops.carry_over(wt, patch, patch_u0) or not gitops.diff_all(wt, head).strip():
            gitops.checkout_clean(wt, head)
            return False
        gitops.commit_all(wt, f"autoloop bundle: #{n} {record.description[:60]}")
        return True

    alone: list[int] = []
    dropped: list[int] = []
    for n in parts:  # each alone on the best
        (alone if apply(n) else dropped).append(n)
        gitops.checkout_clean(wt, best)
    held = [n for n in alone if apply(n)]
    if len(held) < 2:
        gitops.checkout_clean(wt, best)
        return None
    names = ", ".join(f"#{n}" for n in held)
    ideas = "; ".join(first[n].description for n in held)
    return Prepared(
        base=best,
        description=f"bundle of {names}: {ideas}"[:300],
        info={"bundle": held, "move": "bundle", **({"bundle_dropped": dropped} if dropped else {})},
        patch=gitops.diff(wt, best, wt.head.commit.hexsha),
        patch_u0=gitops.diff(wt, best, wt.head.commit.hexsha, 0),
        planned=wt.head.commit.hexsha,
    )


def due(ws: Workspace, state: State) -> Prepared | None:
    """The bundle to run next, if `--bundle` parked near misses are waiting (the latest MOST of them)."""
    want = ws.settings.gate.bundle
    waiting = parked(state)
    if not want or ws.settings.gate.mode == "strict" or len(waiting) < want:
        return None
    return bundle(ws, state, waiting[-MOST:])
