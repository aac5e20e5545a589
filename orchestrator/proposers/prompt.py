"""The prompt every LLM proposer gets: program.md, the session's journal (proposers/memory.py), the history, the
last crash's log and the best train.py."""

from __future__ import annotations

from pathlib import Path

import click

from ..store.ledger import Record
from ..store.session import Paths
from ..trust import redaction
from ..trust.summary import read_tail
from .memory import JOURNAL_CHARS, journal

DEFAULT_PROMPT_CHARS = 48_000  # ~12k tokens: fits any model's context with room for the reply

# The command-line options of the proposers that build this prompt (declared by them: orchestrator/plugins.py).
PROMPT_OPTIONS = (
    click.Option(
        ["--program"],
        help="The research brief handed to LLM proposers.  [default: program.md in the repo]",
    ),
    click.Option(
        ["--prompt-chars"],
        type=click.IntRange(min=2000),
        help="Upper bound on the prompt's size in characters.  [default: 48000]",
    ),
)
FALLBACK_BRIEF = (
    "Lower val_bpb within the fixed training budget by editing only train.py: one idea per "
    "experiment, no new packages, simpler is better when results tie. The model is exported "
    "(torch.export) and scored by the harness: forward(idx) takes a (rows, MAX_SEQ_LEN) batch of "
    "token ids and returns logits (rows, MAX_SEQ_LEN, vocab); plain PyTorch operations only in "
    "evaluation (no custom kernels, no dropout, nothing in-place on buffers); causal, each row on its "
    "own, no state between batches."
)
LOG_TAIL_LINES = 40


def read_program(repo: Path, path: str | None = None) -> str:
    """program.md from the user's checkout (read fresh each time, so edits steer a running loop)."""
    program = Path(path) if path else repo / "program.md"
    if not program.is_absolute():
        program = repo / program
    try:
        return program.read_text()
    except OSError:
        return FALLBACK_BRIEF


def _row(r: Record) -> str:
    bpb = f"{r.val_bpb:.6f}" if r.val_bpb is not None else "-"
    text = r.description + (f" [{redaction.clean(r.reason)}]" if r.reason else "")  # a record of an older version
    return f"#{r.n:<4} {r.status:8} {bpb:>9}  {text[:160]}"


def history_lines(history: list[Record], max_rows: int) -> list[str]:
    """The best results and the most recent ones (no duplicates), in experiment order."""
    finished = [r for r in history if r.status in ("keep", "discard", "crash")]
    scored = sorted((r for r in finished if r.val_bpb is not None), key=lambda r: r.val_bpb)
    keep_n = max_rows // 3
    chosen = {r.n: r for r in scored[:keep_n]}
    for r in reversed(finished):
        if len(chosen) >= max_rows:
            break
        chosen.setdefault(r.n, r)
    return [_row(chosen[n]) for n in sorted(chosen)]


def crash_tail(history: list[Record], paths: Paths) -> str:
    """The last lines of the latest experiment's log when it crashed after starting to train: the run's own
    words, so without secrets or long random tokens (redaction.clean), cleaned before they are cut."""
    finished = [r for r in history if r.status in ("keep", "discard", "crash")]
    if not finished or finished[-1].status != "crash":
        return ""
    last = finished[-1]
    reason = redaction.clean(last.reason)
    log = paths.run_dir(last.n) / "run.log"
    if not log.exists():
        return f"Experiment #{last.n} ({last.description}) crashed before training: {reason}"
    lines = read_tail(log, 64 * 1024).replace("\r", "\n").splitlines()
    tail = redaction.clean("\n".join(lines[-LOG_TAIL_LINES:]))[-4000:]
    return f"Experiment #{last.n} ({last.description}) crashed: {reason}\nEnd of its log:\n{tail}"


def build_prompt(
    program: str,
    train_source: str,
    history: list[Record],
    paths: Paths,
    task: str,
    max_chars: int = DEFAULT_PROMPT_CHARS,
) -> str:
    """The whole prompt, never longer than max_chars: history rows and then the brief give way first."""
    crash = crash_tail(history, paths)
    counts = {s: sum(r.status == s for r in history) for s in ("keep", "discard", "crash")}
    baseline = next((r.val_bpb for r in history if r.status == "keep"), None)
    best = min((r.val_bpb for r in history if r.status == "keep" and r.val_bpb is not None), default=None)
    summary = (
        f"{len(history)} experiments so far ({counts['keep']} keep, {counts['discard']} discard, "
        f"{counts['crash']} crash)"
        + (f"; baseline val_bpb {baseline:.6f}, best {best:.6f}." if baseline is not None and best is not None else ".")
    )

    def assemble(brief: str, rows: list[str]) -> str:
        parts = [
            f"# Research brief (program.md)\n\n{brief.strip()}",
            f"# What this session has learned (journal)\n\n{learned}",
            f"# Results so far\n\n{summary}\nBest and most recent experiments "
            f"(#n, status, val_bpb, description):\n" + ("\n".join(rows) or "(none yet)"),
        ]
        if crash:
            parts.append(f"# The last experiment crashed\n\n{crash}\n\nIf the bug was trivial, fix it in this try.")
        parts.append(f"# Current best train.py\n\n```python\n{train_source}\n```")
        parts.append(f"# Your task\n\n{task.strip()}")
        return "\n\n".join(parts) + "\n"

    learned = journal(history, min(JOURNAL_CHARS, max_chars // 6))
    rows = history_lines(history, 60)
    prompt = assemble(program, rows)
    while len(prompt) > max_chars and rows:
        rows = history_lines(history, len(rows) // 2) if len(rows) > 1 else []
        prompt = assemble(program, rows)
    if len(prompt) > max_chars:  # the brief gives way last; train.py itself is never cut
        spare = max(0, len(program) - (len(prompt) - max_chars) - 20)
        prompt = assemble(program[:spare] + "\n[... brief truncated]", rows)
    return redaction.redact(prompt)  # a brief or train.py may hold a key of ours: it never reaches an LLM
