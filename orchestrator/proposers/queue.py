"""The user's idea queue (.autoloop/queue.jsonl): ideas queued with `autoloop queue add` run first, in order.

The file is an append-only log of `add`, `rm`, `claim` and `done` entries, so `autoloop queue add` can write to
it while a loop reads it. An idea counts as done once its experiment is recorded (its record carries the id).
A session claims an idea when it takes it: while that session runs, no other session of the repo takes it.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..store.hparams import read_constants, set_constant
from ..store.ledger import Record
from ..store.session import is_locked
from .base import Proposal, ProposalFailed


@dataclass
class Idea:
    id: int
    description: str
    set: dict = field(default_factory=dict)  # NAME -> value source text
    patch: str = ""
    added: float = 0.0


def parse_assignment(text: str) -> tuple[str, str]:
    """'NAME=VALUE' -> (NAME, VALUE source text); the value must be a Python literal or a bare word."""
    name, sep, value = text.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not name.isidentifier() or not value:
        raise ValueError(f"expected NAME=VALUE, got {text!r}")
    try:
        ast.literal_eval(value)
    except (ValueError, SyntaxError):
        value = repr(value)  # a bare word such as SSSL becomes the string 'SSSL'
    return name, value


class Queue:
    def __init__(self, path: Path):
        self.path = path

    def _append(self, entry: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(entry) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def entries(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a crash
        return out

    @contextlib.contextmanager
    def _locked(self):
        """The queue's lock: ids stay unique when two terminals add at once, and a claim is one session's."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def add(self, description: str, assignments: dict[str, str] | None = None, patch: str = "") -> Idea:
        with self._locked():
            next_id = 1 + max((e["id"] for e in self.entries() if e.get("op") == "add"), default=0)
            idea = Idea(next_id, " ".join(description.split()), dict(assignments or {}), patch, time.time())
            self._append({"op": "add", **idea.__dict__})
        return idea

    def remove(self, idea_id: int) -> bool:
        if idea_id not in {i.id for i in self.pending()}:
            return False
        self._append({"op": "rm", "id": idea_id})
        return True

    def mark_done(self, idea_id: int, tag: str, n: int) -> None:
        self._append({"op": "done", "id": idea_id, "tag": tag, "n": n})

    def pending(self, also_done: set[int] = frozenset()) -> list[Idea]:
        ideas, gone = {}, set(also_done)
        for e in self.entries():
            if e.get("op") == "add":
                ideas[e["id"]] = Idea(
                    e["id"], e["description"], e.get("set", {}), e.get("patch", ""), e.get("added", 0)
                )
            elif e.get("op") in ("rm", "done"):
                gone.add(e["id"])
        return [idea for i, idea in sorted(ideas.items()) if i not in gone]

    def next(self, history: list[Record], tag: str | None = None) -> Idea | None:
        """The first waiting idea this session has not run, claimed for session `tag` (an idea claimed by
        another session that is still running is left to it)."""
        recorded = {r.info.get("queue_id") for r in history if r.info.get("queue_id") is not None}
        with self._locked():
            entries = self.entries()
            owners = {e["id"]: e["tag"] for e in entries if e.get("op") == "claim"}
            for idea in self.pending(recorded):
                owner = owners.get(idea.id)
                if owner is not None and owner != tag and is_locked(self.path.parent / owner / "lock"):
                    continue
                if tag is not None and owner != tag:
                    self._append({"op": "claim", "id": idea.id, "tag": tag})
                return idea
        return None


def apply_idea(idea: Idea, workdir: Path, profile: str | None) -> Proposal:
    """Edit train.py in workdir as the idea says; ProposalFailed (a crash row) if it no longer applies."""
    info = {"queue_id": idea.id}
    if idea.patch:
        proc = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", "-"], cwd=workdir, input=idea.patch, capture_output=True, text=True
        )
        if proc.returncode != 0:
            err = " ".join(proc.stderr.split())[:200]
            raise ProposalFailed(idea.description, f"queued patch no longer applies: {err}", info)
        return Proposal(idea.description, info)
    path = workdir / "train.py"
    source = path.read_text()
    for name, value_text in idea.set.items():
        consts = {c.name: c for c in read_constants(source, profile)}
        if name not in consts:
            raise ProposalFailed(idea.description, f"queued idea sets {name}, which train.py does not define", info)
        source = set_constant(source, consts[name], None, text=value_text)
    path.write_text(source)
    return Proposal(idea.description, info)
