"""The live progress line: updated in place on a terminal, plain lines now and then when output is a file."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TextIO

from ..trust.curve import CURVE_BYTES, CURVE_FRACTIONS, CURVE_KEYS, STEP_LINE, parse_curve, read_curve  # noqa: F401


def last_step(log: Path) -> tuple[int, float, float] | None:
    """(step, percent of the budget, smoothed loss) from the newest progress line train.py printed."""
    from ..trust.summary import read_run_file  # a run may have put a FIFO or a link in its log's place

    data = read_run_file(log, 4096)
    if data is None:
        return None
    matches = STEP_LINE.findall(data.decode(errors="replace"))
    if not matches:
        return None
    step, pct, loss = matches[-1]
    return int(step), float(pct), float(loss)


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
