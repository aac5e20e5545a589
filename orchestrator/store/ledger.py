"""The ledger: results.tsv (one row per experiment, append-only, fsync'd) and per-run record.json files."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import LoopError

COLUMNS = ("commit", "val_bpb", "memory_gb", "mfu_percent", "status", "description")
STATUSES = ("keep", "discard", "crash")


@dataclass
class Row:
    commit: str
    val_bpb: float
    memory_gb: float
    mfu_percent: float
    status: str
    description: str

    def to_line(self) -> str:
        desc = " ".join(self.description.replace("\t", " ").split())  # no tabs or newlines, ever
        return (
            f"{self.commit[:7]}\t{self.val_bpb:.6f}\t{self.memory_gb:.1f}\t{self.mfu_percent:.2f}\t"
            f"{self.status}\t{desc}\n"
        )


@dataclass
class Evidence:
    """What the noise gate decided of one run and on what (record.json "gate", one flat object): the decision,
    the runs it counted, both means, the margin the candidate had to clear and its delta, why, the note the row
    shows, and the statistical test's own figures (`stats`: test, t, threshold, dof, ...; core/noise.py)."""

    decision: str = ""  # keep | discard | rerun | confirming | repeat (core/state.py: Decision)
    runs: int = 0
    mean: float | None = None
    best_mean: float | None = None
    margin: float | None = None
    delta: float | None = None
    why: str = ""
    note: str = ""
    selection: bool = False  # the best of a generation's candidates, to be confirmed
    confirmation: bool = False  # decided by confirmation runs
    disturbed: str = ""  # why the run was not counted (another process slowed it)
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The flat object record.json holds: the fields that are set, then the test's figures."""
        out = {
            k: v
            for k, v in ((f, getattr(self, f)) for f in EVIDENCE_FIELDS)
            if v is not None and v != "" and v is not False and not (k == "runs" and v == 0)
        }
        return {**out, **self.stats}

    @classmethod
    def from_dict(cls, data: dict | None) -> Evidence:
        data = dict(data or {})
        known = {k: data.pop(k) for k in EVIDENCE_FIELDS if k in data}
        return cls(**known, stats=data)


EVIDENCE_FIELDS = tuple(f for f in Evidence.__dataclass_fields__ if f != "stats")


@dataclass
class Record:
    """Everything about one experiment that does not fit in a row (record.json)."""

    n: int
    status: str
    description: str
    commit: str = ""
    parent: str = ""
    reason: str = ""
    val_bpb: float | None = None
    metrics: dict = field(default_factory=dict)
    # training loss at fractions of the planned steps ({"0.1": 4.2, ..., "1.0": 3.1}; core/progress.py:
    # parse_curve), from the run's own output: only ever a reason to stop or discard a run, never to keep one
    curve: dict = field(default_factory=dict)
    proposer: str = ""
    started: float = 0.0
    ended: float = 0.0
    timings: dict = field(default_factory=dict)  # seconds: propose, check, git, train, record
    exit_code: int | None = None
    timed_out: bool = False
    best_before: float | None = None
    info: dict = field(default_factory=dict)  # what the proposer attached (e.g. the queue item id)
    group: int = 0  # the first run of this candidate (repeats share it); 0 means n
    gate: Evidence = field(default_factory=Evidence)  # the noise gate's decision and its evidence
    device: str = ""  # what it ran on, as the executor saw it (e.g. "NVIDIA H100 80GB HBM3", "cpu")
    slot: int | None = None  # the executor slot (parallel runs)
    phase: str = ""  # where a crash happened: propose, check, train, evaluate, audit
    cause: str = ""  # a crash's cause: idea | environment (the search learns nothing from the environment's)

    @property
    def bpb(self) -> float:
        """val_bpb of a run that measured one (asked only of runs that did: a crash has none)."""
        if self.val_bpb is None:
            raise ValueError(f"experiment {self.n} ({self.status}) has no val_bpb")
        return self.val_bpb


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def repair_tail(path: Path) -> None:
    """Drop a partial last line (a write cut short by a kill), so the next append starts on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
            os.fsync(f.fileno())


def ensure_header(path: Path) -> None:
    repair_tail(path)
    if not path.exists() or path.stat().st_size == 0:
        append_line(path, "\t".join(COLUMNS) + "\n")


def append_line(path: Path, line: str) -> None:
    """One write of a whole line with O_APPEND, then fsync: a row is either there or not."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)


def append_row(path: Path, row: Row) -> None:
    ensure_header(path)
    append_line(path, row.to_line())


def read_rows(path: Path) -> list[Row]:
    """The rows of results.tsv; a malformed one is a LoopError naming its line (a last line still being written
    is left out)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")[1:]
    if not data.endswith(b"\n"):
        lines = lines[:-1]
    rows = []
    for number, raw in enumerate(lines, start=2):
        if not raw.strip():
            continue
        try:
            commit, bpb, mem, mfu, status, desc = raw.decode("utf-8").split("\t", 5)
            rows.append(Row(commit, float(bpb), float(mem), float(mfu), status, desc))
            if status not in STATUSES or not commit.strip():
                raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
        except (UnicodeDecodeError, ValueError) as e:
            why = (
                "it is not UTF-8"
                if isinstance(e, UnicodeDecodeError)
                else "it does not have 6 tab-separated columns"
                if "unpack" in str(e)
                else str(e)
            )
            raise LoopError(
                f"{path} line {number} cannot be read ({why}): {raw[:80].decode(errors='replace')!r}. "
                "Repair the line by hand (each row's record is runs/<n>/record.json, n its row number), "
                "or restore the file"
            ) from None
    return rows


def write_json_atomic(path: Path, data: dict) -> None:
    """path written whole or not at all. The temporary file has a name no one can guess and is created anew
    (O_EXCL): a run's directory is the run's to write, and a link it left at a predictable name would have had
    the controller write through it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # (mkstemp's is 0600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def record_dict(record: Record) -> dict:
    """The record as record.json holds it."""
    return {**asdict(record), "gate": record.gate.to_dict()}


def write_record(run_dir: Path, record: Record) -> None:
    write_json_atomic(run_dir / "record.json", record_dict(record))


def read_record(run_dir: Path) -> Record | None:
    try:
        data = json.loads((run_dir / "record.json").read_text())
        if not isinstance(data, dict):
            return None
        gate = data.get("gate")
        data["gate"] = Evidence.from_dict(gate if isinstance(gate, dict) else {})
        return Record(**data)
    except (OSError, ValueError, TypeError):
        return None
