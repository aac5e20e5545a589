"""Where a session's state lives (.autoloop/<tag>/), its lock, and the status file `autoloop status` reads."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import LoopError
from .ledger import write_json_atomic


@dataclass(frozen=True)
class Paths:
    repo: Path
    tag: str

    @property
    def state(self) -> Path:
        return self.repo / ".autoloop" / self.tag

    @property
    def worktree(self) -> Path:
        return self.state / "worktree"

    @property
    def proposal(self) -> Path:
        return self.state / "proposal"

    def slot(self, index: int) -> Path:
        """The worktree of executor slot `index` (parallel runs)."""
        return self.state / "slots" / str(index)

    @property
    def ledger(self) -> Path:
        return self.state / "results.tsv"

    @property
    def runs(self) -> Path:
        return self.state / "runs"

    def run_dir(self, n: int) -> Path:
        return self.runs / str(n)

    @property
    def status(self) -> Path:
        return self.state / "status.json"

    @property
    def session(self) -> Path:
        return self.state / "session.json"

    @property
    def spend(self) -> Path:
        return self.state / "spend.jsonl"

    @property
    def verify(self) -> Path:
        """`autoloop verify`'s runs (runs/<n>/record.json, their own numbering) and plan."""
        return self.state / "verify"

    def verify_run_dir(self, n: int) -> Path:
        return self.verify / "runs" / str(n)

    @property
    def verify_json(self) -> Path:
        return self.state / "verify.json"

    @property
    def lock(self) -> Path:
        return self.state / "lock"

    @property
    def queue(self) -> Path:
        return self.repo / ".autoloop" / "queue.jsonl"


class Lock:
    """An exclusive flock on .autoloop/<tag>/lock: held while a loop runs, released by the kernel if it dies."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise LoopError(
                f"another `autoloop run` is already running on tag {self.path.parent.name!r} "
                f"(pid {holder}); stop it first (Ctrl-C or kill {holder}) or use another --tag"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Lock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def is_locked(path: Path) -> bool:
    """True while some process holds the lock (i.e. a loop is running)."""
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


_STATUS_LOCK = threading.Lock()
_STATUS: dict[Path, dict] = {}  # what this process wrote: the file is rewritten from it, not read back (what a
#                                 run writes into status.json is gone at the next write)


def write_status(paths: Paths, **fields) -> None:
    """Record where the loop stands (phase, experiment, pids) for `autoloop status` and for resume."""
    with _STATUS_LOCK:  # executor threads report pids while the loop writes its phase
        if paths.status not in _STATUS:  # this process's first write: carry on from what is there
            _STATUS[paths.status] = read_status(paths)
        data = _STATUS[paths.status]
        data.update(fields, updated=time.time())
        write_json_atomic(paths.status, data)


def read_status(paths: Paths) -> dict:
    try:
        return json.loads(paths.status.read_text())
    except (OSError, ValueError):
        return {}


def latest_tag(repo: Path) -> str | None:
    """The tag whose session was active most recently."""
    root = repo / ".autoloop"
    tags = [p for p in root.iterdir() if (p / "status.json").exists()] if root.is_dir() else []
    return max(tags, key=lambda p: (p / "status.json").stat().st_mtime).name if tags else None
