"""The session's memory of ideas: what each one changed (its fingerprint and a one-line summary), whether a new
one repeats an idea already judged, and the journal every LLM prompt carries (`autoloop journal` prints it).

Everything here is a pure function of the run records (and train.py's sources), so it survives a resume by
construction: the records are the state.

- A *fingerprint* is the idea's resulting train.py with comments and layout removed (its AST), with the commit
  it was made on: two proposals from one parent that yield the same program are one idea.
- An exact repeat of an idea already judged from the same parent is not run: the loop records it at no cost as
  "duplicate of #n" with the earlier result (trial.py), and the proposer sees that row once.
- A near repeat (the same constants moved the same way, by other amounts) runs; the journal shows the earlier
  attempts under its theme.
"""

from __future__ import annotations

import ast
import hashlib
import math
import re
from collections.abc import Iterable

from ..store.hparams import read_constants
from ..store.ledger import Record
from ..trust import redaction

THEMES = (  # theme -> words in a constant's name (the first that matches); code edits: "architecture / code"
    ("learning rates", ("LR",)),
    ("schedule", ("WARMUP", "WARMDOWN", "FINAL_LR", "SCHEDULE")),
    ("optimiser", ("MOMENTUM", "BETA", "WEIGHT_DECAY", "EPS", "ADAM", "MUON")),
    ("sizes", ("DEPTH", "ASPECT", "HEAD", "DIM", "WIDTH", "BATCH", "SEQ", "VOCAB", "LAYER")),
    ("architecture", ("WINDOW", "PATTERN", "CAP", "ACTIVATION", "NORM")),
)
CODE = "architecture / code"
JOURNAL_CHARS = 6000  # the journal's share of a prompt, at most


def fingerprint(source: str, base: str) -> str:
    """The idea as a program: its train.py without comments or layout, and the commit it was made on."""
    try:
        program = ast.dump(ast.parse(source), include_attributes=False)
    except SyntaxError:
        program = "\n".join(line.rstrip() for line in source.splitlines() if line.strip())
    return hashlib.sha256(f"{base}\0{program}".encode()).hexdigest()[:16]


def changes(old: str, new: str, profile: str | None) -> list[list]:
    """The constants an edit moved: [name, old value, new value] each (values as text); [] for a code edit or
    one that moves none (a train.py that does not parse has none)."""
    try:
        before = {c.name: c.text for c in read_constants(old, profile)}
        after = {c.name: c.text for c in read_constants(new, profile)}
    except (SyntaxError, ValueError):
        return []
    return [[name, before.get(name, "-"), text] for name, text in after.items() if before.get(name) != text]


MOVE = re.compile(r"\b([A-Z][A-Z0-9_]*(?:\[\d+\])?) \S+ -> ")  # "MATRIX_LR 0.04 -> 0.05" in a description


def theme(record: Record) -> str:
    """The theme of an idea: of the first constant it moved that names one, else code. The constants moved are
    the record's (info.moved); a record from before the memory names them in its description, as the search's
    ideas are described."""
    names = [name for name, *_ in record.info.get("moved") or []] or MOVE.findall(record.description)
    for name in names[:1]:
        for title, words in THEMES:
            if any(w in name for w in words):
                return title
        return "other constants"
    return CODE


def duplicate_of(records: Iterable[Record], fp: str) -> Record | None:
    """The earlier idea this fingerprint repeats: a first run of a candidate from the same parent (the parent
    is in the fingerprint), judged or crashed on its own (not for the environment's fault), or still running."""
    for r in records:
        if (
            r.info.get("fingerprint") == fp
            and (r.group or r.n) == r.n
            and r.gate.decision != "duplicate"
            and r.cause != "environment"
        ):
            return r
    return None


def duplicate_note(earlier: Record) -> str:
    """What a duplicate's row and record say: the earlier idea and its result."""
    if earlier.status == "running":
        return f"duplicate of #{earlier.n} (running in this generation): not run"
    if earlier.status == "crash":
        return f"duplicate of #{earlier.n}, which crashed ({redaction.clean(earlier.reason)[:80]}): not run"
    value = earlier.gate.mean if earlier.gate.mean is not None else earlier.val_bpb
    shown = f" at {value:.6f}" if isinstance(value, float) else ""
    return f"duplicate of #{earlier.n} ({earlier.status}{shown}): not run"


# ---------------------------------------------------------------------------------------------------------------
# The journal


def _delta(r: Record) -> str:
    """The idea against the best of its time: its mean (or value) minus the best's mean, in val_bpb."""
    value = r.gate.mean if r.gate.mean is not None else r.val_bpb
    before = r.gate.best_mean if r.gate.best_mean is not None else r.best_before
    if isinstance(value, float) and isinstance(before, float) and math.isfinite(value) and math.isfinite(before):
        return f"{value - before:+.4f}"
    return "?"


def _line(r: Record) -> str:
    runs = f", {r.gate.runs} runs" if r.gate.runs and r.gate.runs > 1 else ""
    return f"#{r.n} {r.description[:90]}: {_delta(r)}{runs}"


def journal(history: list[Record], max_chars: int = JOURNAL_CHARS) -> str:
    """What the night has learned, within max_chars: the kept changes with their measured gains, what was tried
    and failed grouped by theme, the crashes with their causes, the open leads (better than the best but not
    yet beyond the noise), the repeats caught. The oldest detail of each theme is summarised first."""
    ideas = [r for r in history if (r.group or r.n) == r.n and r.status in ("keep", "discard", "crash")]
    baseline = next((r.n for r in ideas if r.status == "keep"), 0)
    kept = [r for r in ideas if r.status == "keep" and r.n != baseline]
    failed = [r for r in ideas if r.status == "discard" and r.gate.decision not in ("duplicate",)]
    crashed = [r for r in ideas if r.status == "crash" and r.gate.decision != "duplicate"]
    repeats = [r for r in history if r.gate.decision == "duplicate"]
    leads = [r for r in failed if isinstance(r.gate.delta, float) and r.gate.delta > 0]
    by_theme: dict[str, list[Record]] = {}
    for r in failed:
        by_theme.setdefault(theme(r), []).append(r)

    def render(per_theme: int) -> str:
        parts = ["Kept changes (in order; the change's mean minus the best's before it, val_bpb; lower is better):"]
        parts += [f"- {_line(r)}" for r in kept] or ["- none yet"]
        parts.append("Tried and not kept, by theme (most recent last):")
        for title, rs in sorted(by_theme.items()):
            older = rs[:-per_theme] if per_theme else rs
            shown = rs[-per_theme:] if per_theme else []
            head = f"- {title}: {len(rs)} tried"
            if older:
                best = min(older, key=lambda r: float(_delta(r)) if _delta(r) != "?" else math.inf)
                head += f" ({len(older)} older summarised: closest was {_line(best)})"
            parts.append(head)
            parts += [f"  - {_line(r)}" for r in shown]
        if crashed:
            parts.append("Crashes (cause):")
            shown = crashed[-max(1, per_theme) :]
            parts += [
                f"- #{r.n} {r.description[:70]}: {redaction.clean(r.reason)[:100]} ({r.cause or 'idea'})" for r in shown
            ]
            if len(crashed) > len(shown):
                parts.append(f"- and {len(crashed) - len(shown)} earlier")
        if leads:
            parts.append("Open leads (better than the best's mean, not beyond the noise; worth a variation):")
            parts += [f"- {_line(r)}" for r in leads[-max(1, per_theme) :]]
        if repeats:
            parts.append(
                f"Repeats caught and not run: {len(repeats)} (e.g. "
                + "; ".join(f"#{r.n} {r.description[:50]}" for r in repeats[-3:])
                + "). Do not propose an idea already tried from the same train.py."
            )
        return "\n".join(parts)

    for per_theme in (8, 5, 3, 2, 1, 0):
        text = render(per_theme)
        if len(text) <= max_chars:
            return text
    return text[: max_chars - 20] + "\n[... journal cut]"
