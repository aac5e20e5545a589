"""What the loop knows, as data: statuses, decisions, the phase a crash happened in, and the session state.

The run records on disk are the truth. `replay` rebuilds the state from them alone, and everything that shows
a session reads it: resume, `autoloop status`, `autoloop report`, the console summary and the held-out check.
So the branch tip, the report's best and the console's best are one commit by construction.

Runs of one candidate form a group (numbered by its first run); the baseline and its repeats are group 1.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from .. import LoopError
from ..store.ledger import Record, read_record, read_rows
from ..store.session import Paths
from .noise import Spread, reference_spread


class Kind(str, Enum):
    """Why a run is in a generation; the judge reads each kind its own way."""

    BASELINE = "baseline"  # the starting train.py (its first runs measure the noise)
    PARENT = "parent"  # the best again: sharpens its mean, measures sigma
    CANDIDATE = "candidate"  # a new idea
    RERUN = "rerun"  # a pending candidate again (inside the margin)
    CONFIRM = "confirm"  # a best-of-k pick run again before it is kept


class _Word(str, Enum):
    """An enum whose members are the words written to disk (and print as them)."""

    def __str__(self) -> str:
        return self.value


class Status(_Word):
    """A row's status in results.tsv (upstream's words)."""

    KEEP = "keep"
    DISCARD = "discard"
    CRASH = "crash"


class Decision(_Word):
    """What the gate decided for one run (record.json `gate.decision`)."""

    KEEP = "keep"  # the branch advances to this run's commit
    DISCARD = "discard"
    REPEAT = "repeat"  # a run of the best itself: it measures σ and sharpens the best's mean
    RERUN = "rerun"  # promising: run the candidate again before deciding (a best-of-k pick: to confirm it)
    CONFIRMING = "confirming"  # one of several confirmation runs; the last one carries the decision
    DUPLICATE = "duplicate"  # an exact repeat of an idea already judged from the same parent: not run, no cost


class Phase(_Word):
    """Where an experiment crashed (record.json `phase`)."""

    PROPOSE = "propose"
    CHECK = "check"
    TRAIN = "train"
    EVALUATE = "evaluate"
    AUDIT = "audit"


class Cause(_Word):
    """Who a crash is put down to (record.json `cause`): proposers learn only from the idea's crashes."""

    IDEA = "idea"  # a shape error, the OOM of a bigger model, NaN, a timeout, an edit that may not run
    ENVIRONMENT = "environment"  # the device lost, a driver error, a full disk, a broken install


@dataclass(frozen=True)
class Crash:
    reason: str
    phase: Phase
    cause: Cause = Cause.IDEA


def group_of(record: Record) -> int:
    return record.group or record.n


def counts(record: Record) -> bool:
    """Does this run's value count in its configuration's mean? Crashes do not, nor a best-of-k pick (biased
    low: the winner's curse), nor a run slowed from outside (disturbed)."""
    return (
        record.status != Status.CRASH
        and record.val_bpb is not None
        and not record.gate.selection
        and not record.gate.disturbed
    )


DISTURBED = 0.7  # a run below this share of its twins' median throughput was slowed from outside
LOADED = 0.85  # a run whose CPU share fell below this share of the median waited on a busy machine ...
BUSY = 0.5  # ... if other processes kept at least this many CPUs busy on average meanwhile
WAIT_MIN_S = 10.0  # ... in a training step this long at least (a shorter one's share is mostly its start-up's)
CPU_SHARE = "cpu_share"  # the record's metrics measured by the controller (runner.CpuShare), never by train.py
CPU_OUTSIDE = "cpu_outside"


def cpu_share(record: Record) -> float | None:
    """How much of the CPU the run's busiest thread got while it was ready to run (runner.CpuShare), if known."""
    share = record.metrics.get(CPU_SHARE)
    return float(share) if isinstance(share, (int, float)) and 0 < share <= 1 else None


def busy_outside(record: Record) -> bool:
    """Did other users' processes keep at least BUSY CPUs busy while the run trained (the runner's measure,
    `cpu_outside`)? Only then is a run believed slowed from outside: a train.py can lower its own share of the
    CPU, or print a low step count on the runs it wants left out, but never raise the others' load."""
    outside = record.metrics.get(CPU_OUTSIDE)
    return isinstance(outside, (int, float)) and outside >= BUSY


def waited(record: Record, usual: float) -> bool:
    """Did the run wait on a machine other processes kept busy: its CPU share below LOADED of `usual` while
    others kept BUSY CPUs busy (a run can lower its own share, never raise the others' load), over a training
    step of WAIT_MIN_S at least?"""
    share, train = cpu_share(record), record.timings.get("train")
    if not isinstance(train, (int, float)) or train < WAIT_MIN_S:
        return False
    return bool(share and busy_outside(record) and share < LOADED * usual)


def throughput(record: Record, unit: str) -> float | None:
    """Work per training second from the run's summary: optimizer steps (exact; comparable between runs of one
    configuration) or tokens (comparable across configurations, but printed in 0.1 M steps: only used when that
    rounding is under 1%)."""
    m = record.metrics
    work, seconds = m.get("num_steps" if unit == "steps" else "total_tokens_M"), m.get("training_seconds")
    if not isinstance(work, (int, float)) or work <= 0 or unit == "tokens" and work < 10:
        return None
    return work / seconds if isinstance(seconds, (int, float)) and seconds > 0 else float(work)


@dataclass
class State:
    records: list[Record] = field(default_factory=list)
    start_commit: str = ""
    best_commit: str = ""
    best_group: int = 0
    best_run: int = 0  # the run whose saved model stands for the best (its last run)
    # the run that kept the best: its runs up to here were selected by the gate (their mean is biased low: the
    # winner's curse), so only later runs compare it with candidates (`comparator`); 0 for the baseline
    kept_at: int = 0
    baseline_group: int = 0  # the baseline's runs (1, unless a crashed baseline was run again)
    baseline_run: int = 0  # the run whose saved model stands for the baseline
    pending: int | None = None  # a candidate group to run again before it is decided
    # counted runs found slowed from outside once later runs of their configuration showed its speed (a first
    # run has no twins to be judged against when it is decided): their values leave the means
    set_aside: set[int] = field(default_factory=set)

    @property
    def done(self) -> int:
        return len(self.records)

    def counted(self, record: Record) -> bool:
        """Does this run's value count (counts()), and was it not found slowed afterwards (set_aside)?"""
        return counts(record) and record.n not in self.set_aside

    def kept_code(self, record: Record) -> bool:
        """Did this run run code kept before it (a repeat of the baseline, a run of the best)? The clock audit
        learns the machine's start-up from such runs only (trial.learned_startup)."""
        group = group_of(record)
        return any(
            group_of(r) == group and r.n < record.n and (r.gate.decision or r.status) == Decision.KEEP
            for r in self.records
        )

    def runs(self, group: int, device: str | None = None, after: int = 0) -> list[float]:
        """val_bpb of the counted runs of `group` (on `device` only, if given; numbered above `after` only)."""
        return [
            r.bpb
            for r in self.records
            if group_of(r) == group and r.n > after and self.counted(r) and (device is None or r.device == device)
        ]

    def comparator(self, device: str | None = None, fresh: bool = True) -> list[float]:
        """val_bpb of the best's fresh runs (on `device` only, if given): those made after the run that kept it.
        The runs that won its keep are a selected sample (a sequential test stops when they look good), so a
        candidate is compared with fresh runs only, as the best's runs measured afterwards are unbiased.
        `fresh=False`: all its counted runs (upstream's rule, --gate strict, compares with the kept run)."""
        return self.runs(self.best_group, device, after=self.kept_at if fresh else 0)

    def fresh(self, mode: str, device: str) -> bool:
        """Is the best compared with its fresh runs only (`comparator`)? When the gate weighs run-to-run noise:
        the noise gate, once some configuration was measured twice on `device`. Before that (--baseline-repeats 0)
        and under --gate strict it is upstream's rule: lower than the kept run is kept."""
        return mode != "strict" and any(len(v) >= 2 for (_, d), v in self.groups().items() if d == device)

    def contradicted(self) -> list[tuple[int, str]]:
        """Keeps that later, unbiased runs of the kept code say were worse than what they replaced (the judge's
        `contradiction`): (the keep's run, why), each keep as its latest run of the kept code has it (a later
        run that no longer contradicts it clears it)."""
        kept = {group_of(r): r.n for r in self.records if r.status == Status.KEEP}
        found: dict[int, str] = {}
        for r in self.records:
            keep = kept.get(group_of(r))
            if r.gate.decision != Decision.REPEAT or keep is None or r.n <= keep or group_of(r) == self.baseline_group:
                continue
            if r.gate.stats.get("contradicts") == keep:
                found[keep] = r.gate.note
            else:
                found.pop(keep, None)
        return sorted(found.items())

    @property
    def best_bpb(self) -> float | None:
        """The best's mean as the gate sees it: of its fresh runs once it has some, else of the runs that kept it."""
        runs = self.comparator() or self.runs(self.best_group)
        return statistics.fmean(runs) if runs else None

    @property
    def baseline_bpb(self) -> float | None:
        runs = self.runs(self.baseline_group) if self.baseline_group else []
        return statistics.fmean(runs) if runs else None

    def groups(self, extra: Sequence[Record] = ()) -> dict[tuple[int, str], list[float]]:
        """The counted runs of every (configuration, device type)."""
        groups: dict[tuple[int, str], list[float]] = {}
        for r in [*self.records, *extra]:
            if self.counted(r):
                groups.setdefault((group_of(r), r.device), []).append(r.bpb)
        return groups

    def others(self, device: str, *exclude: int, extra: Sequence[Record] = ()) -> list[list[float]]:
        """The runs of every configuration on `device` but those excluded (they give the reference spread)."""
        return [v for (g, d), v in self.groups(extra).items() if d == device and g not in exclude]

    def spread(self) -> Spread:
        """The typical spread between runs of one configuration, over the whole session (shown by status)."""
        return reference_spread(list(self.groups().values()))

    def usage(self) -> tuple[int, float]:
        """Tokens and dollars the proposer reported over the session (record.json info.usage)."""
        tokens = sum(int(r.info.get("usage", {}).get("total_tokens", 0)) for r in self.records)
        cost = sum(float(r.info.get("usage", {}).get("cost", 0.0)) for r in self.records)
        return tokens, cost

    def add(self, record: Record) -> None:
        self.records.append(record)
        self._set_aside_slowed(group_of(record), record.device)
        group, decision = group_of(record), record.gate.decision or record.status
        if decision == Decision.KEEP:
            self.best_commit, self.best_group, self.best_run, self.pending = record.commit, group, record.n, None
            self.kept_at = record.n
            if not self.baseline_group:  # the first run: nothing selected it
                self.baseline_group, self.baseline_run, self.kept_at = group, record.n, 0
        elif decision == Decision.RERUN:
            self.pending = group
        elif decision != Decision.CONFIRMING and self.pending == group:  # decided (or crashed on its own)
            self.pending = None
        if self.counted(record):  # a saved model found slowed no longer stands for its configuration: this one
            if group == self.baseline_group and self.baseline_run in self.set_aside:
                self.baseline_run = record.n
            if group == self.best_group and self.best_run in self.set_aside:
                self.best_run = record.n

    def _set_aside_slowed(self, group: int, device: str) -> None:
        """Of the counted runs of one configuration on one device, those whose steps per second fall below
        DISTURBED of the median of at least two others' while other users kept the machine busy (`busy_outside`:
        the steps are train.py's word), or that `waited` with a CPU share below LOADED of theirs (a first run
        slowed by another process: nothing to compare it with when it was judged)."""
        runs = [r for r in self.records if group_of(r) == group and r.device == device and counts(r)]
        slowed: set[int] = set()
        speeds = {r.n: v for r in runs if (v := throughput(r, "steps"))}
        shares = {r.n: v for r in runs if (v := cpu_share(r))}
        for r in runs:
            fast = [v for m, v in speeds.items() if m != r.n]
            if (
                r.n in speeds
                and len(fast) >= 2
                and speeds[r.n] < DISTURBED * statistics.median(fast)
                and busy_outside(r)
            ):
                slowed.add(r.n)
            usual = [v for m, v in shares.items() if m != r.n]
            if len(usual) >= 2 and waited(r, statistics.median(usual)):
                slowed.add(r.n)
        self.set_aside -= {r.n for r in runs} - slowed
        self.set_aside |= slowed


def replay(records: list[Record], start_commit: str) -> State:
    """The session state after these records, in order (a pure function of them)."""
    state = State(start_commit=start_commit, best_commit=start_commit)
    for record in records:
        state.add(record)
    return state


def load_records(paths: Paths) -> list[Record]:
    """Each row's record.json (a row whose record is missing stands for itself), by row number, each row and
    record checked to be the same run (a row deleted or edited by hand is a LoopError naming the line and
    what belongs there, never a shifted state)."""
    records = []
    for n, row in enumerate(read_rows(paths.ledger), start=1):
        record = read_record(paths.run_dir(n))
        if record is None:
            record = Record(
                n=n,
                status=row.status,
                description=row.description,
                commit=row.commit,
                val_bpb=row.val_bpb if row.status != "crash" else None,
            )
        elif record.n != n or not record.commit.startswith(row.commit) or record.status != row.status:
            raise LoopError(
                f"{paths.ledger} line {n + 1} ({row.commit} {row.status} {row.description[:40]!r}) is not "
                f"run {n} (commit {record.commit[:7]}, {record.status}, {record.description[:40]!r}, "
                f"from runs/{n}/record.json): a row was deleted or edited by hand. Restore the rows in "
                "order, then run the same command to resume"
            )
        records.append(record)
    return records


def load_state(paths: Paths) -> State:
    """The state of a session on disk, as a resume would rebuild it."""
    try:
        start = json.loads(paths.session.read_text())["start_commit"]
    except (OSError, ValueError, KeyError):
        start = ""
    return replay(load_records(paths), start)
