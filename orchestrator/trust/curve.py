"""A run's training curve, from its own progress lines, and the rule that stops a run clearly behind the best.

train.py prints `step N (p%) | loss: L` about once a second and at each 5% of its planned steps (after its
calibration line, `schedule: N steps`). The curve is the loss at fixed fractions of the planned steps. It is the
run's own output, as untrusted as anything the run printed: it may only ever stop or discard a run, never keep
one (what keeps a run is the harness's measurement). Here, below the executors, so that the rule runs where the
run does (a Ray worker too).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .summary import read_run_file

STEP_LINE = re.compile(r"step (\d+) \(([\d.]+)%\) \| loss: ([\d.]+)")  # train.py's progress line
_SCHEDULE = re.compile(r"schedule: \d+ steps\b")  # train.py's calibration: the percentages after it are of steps

CURVE_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(1, 11))  # of the planned steps: 0.1, 0.2, ..., 1.0
CURVE_KEYS = tuple(f"{f:.1f}" for f in CURVE_FRACTIONS)  # record.json's curve is {"0.1": loss, ...} (JSON keys)
CURVE_TOLERANCE = 2.5  # percentage points: the last progress line at most this far before a fraction stands for it
CURVE_BYTES = 4 << 20  # what is read of a log, from its start: ~30000 progress lines (a night-long budget)


def read_curve(log: Path) -> dict[str, float]:
    """parse_curve() of a run's log, read as last_step's is (a regular file at that very path, bounded: a FIFO, a
    link or /dev/zero in its place gives {}), from its start, where the calibration line is."""
    data = read_run_file(log, CURVE_BYTES, tail=False)
    return {} if data is None else parse_curve(data.decode(errors="replace"))


def parse_curve(text: str) -> dict[str, float]:
    """The training loss at each of CURVE_FRACTIONS of the planned steps ({"0.1": 4.21, ..., "1.0": 3.05}): the
    loss of the last progress line at or before the fraction, when one is within CURVE_TOLERANCE of it (else the
    fraction is absent). Only the lines after train.py's calibration line ("schedule: N steps") count: before
    it their percentage is of the time budget, not of the steps. Lines with a loss that is not finite, or that
    do not parse, are ignored; a crashed run has the points it reached.

    The curve is the run's own output, as untrusted as anything the run printed: it may only ever be used to
    stop or discard a run early, never to keep one (what keeps a run is the harness's measurement)."""
    points: list[tuple[float, float]] | None = None  # (percent, loss), once the schedule is known
    for line in text.splitlines():
        points = read_line(line, points)
    return curve_of(points or [])


def read_line(line: str, points: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
    """The (percent, loss) points after one more line of output: a calibration line starts them afresh (the
    later schedule counts), a progress line after it adds one."""
    if _SCHEDULE.match(line):
        return []
    if points is not None and (match := STEP_LINE.match(line)):
        try:
            pct, loss = float(match.group(2)), float(match.group(3))
        except ValueError:  # "1.2.3"
            return points
        if math.isfinite(loss):
            points.append((pct, loss))
    return points


def curve_of(points: list[tuple[float, float]]) -> dict[str, float]:
    """The curve of (percent, loss) points in the order printed (parse_curve)."""
    curve: dict[str, float] = {}
    for key, fraction in zip(CURVE_KEYS, CURVE_FRACTIONS):
        target = round(100 * fraction, 6)  # percent, as printed (100 * 0.3 is 30.000000000000004)
        near = [loss for pct, loss in points if target - CURVE_TOLERANCE <= pct <= target]
        if near:
            curve[key] = near[-1]
    return curve


@dataclass(frozen=True)
class StopRule:
    """When a run still training is clearly behind the best (`--early-stop on`), judged on curves at equal
    fractions of planned steps (a deeper model makes fewer steps, at the same fractions of its schedule):

    - only at the fractions from `first` up to, not including, `last`: the learning rate's warm-down starts at
      `last` (train.py's 1 - WARMDOWN_RATIO), and during it every curve drops; the first steps say little;
    - behind at a fraction: the run's loss above the mean of the best's runs there by more than `z` times their
      spread (its sd, for a new run: sqrt(1 + 1/n)) and more than `floor` of that mean. The spread is
      `spread[key]` (a relative sd pooled over every configuration run more than once: many runs' worth, so one
      lucky pair of the best's runs cannot make the band narrow) times the best's mean, else the sd of the best's
      own runs there;
    - stopped when behind at two fractions in a row without closing the gap: a slow starter (a larger batch, a
      deeper model) that is behind early but catching up is left to run.

    A fraction is judged where the best has 2 runs there, or 1 and a pooled spread. `best` maps a fraction key
    ("0.3") to the best's runs' losses there."""

    best: dict[str, list[float]]
    first: float = 0.2
    last: float = 0.5
    z: float = 3.0
    floor: float = 0.01
    spread: dict[str, float] = field(default_factory=dict)  # fraction key -> relative sd pooled over configurations
    audit: bool = False  # applied, never obeyed: the run trains to the end and its record says whether it would stop

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> StopRule | None:
        return None if not data else cls(**data)


def behind(rule: StopRule, curve: dict[str, float]) -> str:
    """Why the run with this curve (so far) should stop now, or '' to let it run."""
    import statistics

    previous: tuple[float, float] | None = None  # (gap, band) at the fraction judged before
    for key in CURVE_KEYS:
        values = rule.best.get(key, [])
        pooled = rule.spread.get(key)
        if not rule.first <= float(key) < rule.last or key not in curve or len(values) < (1 if pooled else 2):
            continue
        mean = statistics.fmean(values)
        sd = pooled * abs(mean) if pooled else statistics.stdev(values)
        band = max(rule.z * sd * math.sqrt(1 + 1 / len(values)), rule.floor * abs(mean))
        gap = curve[key] - mean
        if gap > band and previous is not None and previous[0] > previous[1] and gap >= previous[0]:
            return (
                f"stopped at {100 * float(key):.0f}% of its steps: loss {curve[key]:.4f} vs the best's "
                f"{mean:.4f} ± {sd:.4f} ({len(values)} runs), behind since the last look and not closing"
            )
        previous = (gap, band)
    return ""


LINE_BYTES = 200  # a progress or calibration line is shorter: what is longer is cut before it is matched


@dataclass
class CurveWatch:
    """Fed a training step's output as it comes (run_command's on_output): applies the rule each time the run
    passes one of the curve's fractions, and sets `fired` (with `why`) when it says stop. It keeps only the curve
    itself (the last loss within each fraction's window, as curve_of does), each line cut to LINE_BYTES, and
    stops reading once the run is past the rule's last look: a run printing junk at full speed costs it little."""

    rule: StopRule
    why: str = ""
    fired: threading.Event = field(default_factory=threading.Event)
    curve: dict[str, float] | None = None  # after the calibration line
    pending: bytes = b""
    judged: int = 0  # curve fractions passed so far
    done: bool = False

    def __call__(self, data: bytes) -> None:
        if self.done:
            return
        *lines, self.pending = (self.pending + data).split(b"\n")
        self.pending = self.pending[:LINE_BYTES]  # the rest of an over-long line is not a progress line
        passed = self.judged
        for raw in lines:
            if not raw.startswith((b"step ", b"schedule: ")):
                continue
            line = raw[:LINE_BYTES].decode(errors="replace").rstrip("\r")
            if _SCHEDULE.match(line):  # the calibration: the percentages from here on are of steps
                self.curve = {}
            elif self.curve is not None and (points := read_line(line, [])):
                self.curve.update(curve_of(points))
                passed = max(passed, sum(points[0][0] >= 100 * f for f in CURVE_FRACTIONS))
        if passed > self.judged:
            self.judged = passed
            self.why = behind(self.rule, self.curve or {})
            if self.why and not self.rule.audit:
                self.fired.set()
            past = CURVE_FRACTIONS[self.judged - 1] >= self.rule.last
            self.done = bool(self.why) or past
