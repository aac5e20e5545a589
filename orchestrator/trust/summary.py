"""Parse the `---` summary block that ends a train.py run (the train.py -> controller contract)."""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path

from . import redaction

TAIL_BYTES = 1 << 20  # what is read of a run's log: the summary and the last error are at its end

SUMMARY_KEYS = (
    "val_bpb",
    "training_seconds",
    "total_seconds",
    "peak_vram_mb",
    "mfu_percent",
    "total_tokens_M",
    "num_steps",
    "num_params_M",
    "depth",
)
_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):\s*(\S.*?)\s*$")
# What a crash looks like when the machine, not the idea, failed: the device, the driver, the disk, the install.
_ENVIRONMENT = re.compile(
    r"No space left on device|Disk quota exceeded|Read-only file system|ModuleNotFoundError|ImportError|"
    r"CUDA driver|driver version is insufficient|cudaErrorDevicesUnavailable|busy or unavailable|"
    r"no CUDA-capable device|No CUDA GPUs are available|fallen off the bus|GPU is lost|device lost|"
    r"CUDA error: unknown error|ECC error|uncorrectable|NCCL error|HIP error: no ROCm-capable|"
    r"CUDA error: (?:initialization error|launch failure)"
)
_ERROR = re.compile(r"(Error|Exception|FAIL|Traceback|Killed|error:|out of memory)", re.IGNORECASE)


def _value(text: str) -> float | int | str:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_summary(log_text: str) -> dict[str, float | int | str]:
    """The key: value lines after the LAST line that is exactly `---`; {} if there is no such block.

    Only the final block counts, so anything train.py printed earlier (even a fake block) is ignored.
    """
    lines = log_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "---"]
    if not starts:
        return {}
    metrics: dict[str, float | int | str] = {}
    for line in lines[starts[-1] + 1 :]:
        match = _LINE.match(line.strip())
        if match:
            metrics[match.group(1)] = _value(match.group(2))
    return metrics


def val_bpb_of(metrics: dict) -> float | None:
    """The finite val_bpb of a parsed summary, or None."""
    value = metrics.get("val_bpb")
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def last_error_line(log_text: str, limit: int = 160) -> str:
    """The most telling line of a failed run: the last line that looks like an error, else the last line;
    without secrets or long random tokens (it becomes a crash reason: a row, a record, a prompt)."""
    lines = [line.strip() for line in log_text.replace("\r", "\n").splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR.search(line) and not line.startswith("File "):
            return redaction.line(line, limit)
    return redaction.line(lines[-1], limit) if lines else ""


def environment_error(log_text: str) -> str:
    """The line of a crashed run's log that blames the environment (device, driver, disk, install), or '';
    cleaned as last_error_line's."""
    lines = log_text.replace("\r", "\n").splitlines()[-200:]
    for line in reversed(lines):
        if _ENVIRONMENT.search(line) and not line.strip().startswith("File "):
            return redaction.line(line.strip(), 160)
    return ""


def read_run_file(path: Path, limit: int, tail: bool = True) -> bytes | None:
    """At most `limit` bytes (the last ones, or the first) of a file a run could have replaced, or None: it must
    be a regular file at that very path. The controller reads with our rights what a sandboxed run could not:
    a symlink planted in its place (to a secret of the host) is not followed, a FIFO cannot block us, and
    /dev/zero cannot fill our memory."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        if tail and size > limit:
            os.lseek(fd, size - limit, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_tail(path: Path, limit: int = TAIL_BYTES) -> str:
    """The last `limit` bytes of a log as text ('' if it is missing or not a regular file: read_run_file): a
    run that printed gigabytes cannot fill the controller's memory."""
    data = read_run_file(path, limit)
    return "" if data is None else data.decode(errors="replace")
