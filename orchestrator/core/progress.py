"""The live progress line: updated in place on a terminal, plain lines now and then when output is a file."""

from __future__ import annotations

import math
import os
import re
import sys
import time
from pathlib import Path
from typing import TextIO

_STEP = re.compile(r"step (\d+) \(([\d.]+)%\) \| loss: ([\d.]+)")
_SCHEDULE = re.compile(r"schedule: \d+ steps\b")  # train.py's calibration: the percentages after it are of steps

CURVE_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(1, 11))  # of the planned steps: 0.1, 0.2, ..., 1.0
CURVE_KEYS = tuple(f"{f:.1f}" for f in CURVE_FRACTIONS)  # record.json's curve is {"0.1": loss, ...} (JSON keys)
CURVE_TOLERANCE = 2.5  # percentage points: the last progress line at most this far before a fraction stands for it
CURVE_BYTES = 4 << 20  # what is read of a log, from its start: ~30000 progress lines (a night-long budget)


def last_step(log: Path) -> tuple[int, float, float] | None:
    """(step, percent of the budget, smoothed loss) from the newest progress line train.py printed."""
    from ..trust.summary import read_run_file  # a run may have put a FIFO or a link in its log's place

    data = read_run_file(log, 4096)
    if data is None:
        return None
    matches = _STEP.findall(data.decode(errors="replace"))
    if not matches:
        return None
    step, pct, loss = matches[-1]
    return int(step), float(pct), float(loss)


def read_curve(log: Path) -> dict[str, float]:
    """parse_curve() of a run's log, read as last_step's is (a regular file at that very path, bounded: a FIFO, a
    link or /dev/zero in its place gives {}), from its start, where the calibration line is."""
    from ..trust.summary import read_run_file

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
        if _SCHEDULE.match(line):
            points = []  # a second calibration line (not train.py's) starts over: the later schedule counts
        elif points is not None and (match := _STEP.match(line)):
            try:
                pct, loss = float(match.group(2)), float(match.group(3))
            except ValueError:  # "1.2.3"
                continue
            if math.isfinite(loss):
                points.append((pct, loss))
    curve: dict[str, float] = {}
    for key, fraction in zip(CURVE_KEYS, CURVE_FRACTIONS):
        target = round(100 * fraction, 6)  # percent, as printed (100 * 0.3 is 30.000000000000004)
        near = [loss for pct, loss in points or () if target - CURVE_TOLERANCE <= pct <= target]
        if near:
            curve[key] = near[-1]
    return curve


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, m = divmod(seconds // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{seconds % 60:02d}s"


class Progress:
    def __init__(self, stream: TextIO | None = None, plain_every_s: float | None = None):
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.plain_every_s = plain_every_s or float(os.environ.get("AUTOLOOP_PROGRESS_SECONDS", "30"))
        self.last_plain = 0.0
        self.shown = False

    def update(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
            self.shown = True
        elif time.monotonic() - self.last_plain >= self.plain_every_s:
            self.last_plain = time.monotonic()
            self.stream.write(text + "\n")
            self.stream.flush()

    def clear(self) -> None:
        """Before a permanent line: wipe the live one (on a terminal) and restart the plain-line clock."""
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False
        self.last_plain = time.monotonic()
