"""Run one experiment command in its own process group under a hard timeout; kill the whole tree after."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

KILL_GRACE_S = 5.0  # SIGTERM, then this long, then SIGKILL
REAP_S = 10.0  # after SIGKILL: how long to wait for the exit before reporting the process as stuck
LOG_CAP_BYTES = 64 << 20  # a run's log keeps its first and last half of this much (a print in the step loop
#                           could otherwise fill the disk)
FLUSH_S = 0.5  # how often a capped log's tail is written out while the run goes on


class CappedLog:
    """A log file that keeps the first and the last `cap / 2` bytes of what is written to it, with a line
    saying how much was cut between them. Memory and disk stay under `cap` whatever the process prints."""

    def __init__(self, path: Path, cap: int):
        self.f = open(path, "wb", buffering=0)  # what the run prints is in the file at once (progress, status)
        self.cap, self.head = cap, cap // 2
        self.size = 0  # bytes on disk while nothing is cut
        self.tail: bytearray | None = None  # once cut: the last cap - head bytes, in memory
        self.cut = 0
        self.flushed = time.monotonic()

    def write(self, data: bytes) -> None:
        if self.tail is None and self.size + len(data) <= self.cap:
            self.f.write(data)
            self.size += len(data)
            return
        if self.tail is None:  # the cap is reached: what is past the head becomes the start of the tail
            self.f.flush()
            with open(self.f.name, "rb") as r:
                r.seek(self.head)
                self.tail = bytearray(r.read())
        self.tail += data
        excess = len(self.tail) - (self.cap - self.head)
        if excess > 0:
            del self.tail[:excess]
            self.cut += excess
        if time.monotonic() - self.flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.tail is not None:
            self.f.seek(self.head)
            self.f.write(f"\n[autoloop: {self.cut} bytes of this log cut here; it keeps its first and last "
                         f"{self.head >> 20} MiB]\n".encode() + bytes(self.tail))
            self.f.truncate()
        self.f.flush()
        self.flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        self.f.close()


def _pump(fd: int, log: CappedLog) -> None:
    """Copy the process's output into its log until every writer has closed the pipe."""
    poller = select.poll()  # not select(): a descriptor above 1024 is fine
    poller.register(fd, select.POLLIN | select.POLLHUP)
    try:
        while True:
            if poller.poll(FLUSH_S * 1000):
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                log.write(data)
            elif log.tail is not None:
                log.flush()
    finally:
        os.close(fd)
        log.close()


@dataclass
class RunResult:
    exit_code: int | None
    timed_out: bool
    wall_s: float
    log_path: Path
    interrupted: bool = False


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_tree(pid: int, pgid: int, grace_s: float = KILL_GRACE_S) -> dict[int, int | None]:
    """SIGTERM the process group and every descendant (even those that left the group), wait, then SIGKILL.

    Returns the exit status of each process it reaped (psutil reaps our own children while it waits)."""
    codes: dict[int, int | None] = {}
    procs = _descendants(pid)
    try:
        procs.insert(0, psutil.Process(pid))
    except psutil.Error:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        gone, alive = psutil.wait_procs(procs, timeout=grace_s if sig == signal.SIGTERM else 2.0)
        codes.update((p.pid, None if p.returncode is None else int(p.returncode)) for p in gone)
        procs = alive
        if not procs and sig == signal.SIGTERM:
            # The group may still hold processes we could not see (reparented); finish them off.
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return codes
    return codes


def _reap(proc: subprocess.Popen) -> None:
    """Wait for a killed process, boundedly: one stuck in the kernel after SIGKILL is reported, not waited on."""
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        print(f"autoloop: warning: process {proc.pid} did not exit {REAP_S:.0f}s after SIGKILL (stuck in the "
              "kernel, e.g. on a GPU driver); not waiting for it", flush=True)


def run_command(cmd: list[str], cwd: Path, env: dict[str, str], log_path: Path, timeout_s: float,
                on_start: Callable[[int], None] | None = None, on_tick: Callable[[float], None] | None = None,
                tick_s: float = 1.0, cancel: threading.Event | None = None,
                log_cap: int = LOG_CAP_BYTES, stdin_text: str | None = None) -> RunResult:
    """Run cmd with stdout+stderr to log_path (capped: CappedLog) in a new session; never raises for the
    command's failures.

    On timeout or KeyboardInterrupt the whole tree is killed (SIGTERM, grace, SIGKILL); after a normal
    exit any process left in the group is killed too, so nothing outlives an experiment.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=write_end, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
                                start_new_session=True)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    pump = threading.Thread(target=_pump, args=(read_end, CappedLog(log_path, log_cap)), daemon=True,
                            name=f"log {log_path.name}")
    pump.start()
    pgid = proc.pid  # start_new_session makes the child a session and group leader
    if stdin_text is not None:  # a line or two (a nonce): fits the pipe, so this never blocks
        try:
            proc.stdin.write(stdin_text.encode())
            proc.stdin.close()
        except OSError:
            pass
    if on_start is not None:
        on_start(proc.pid)
    timed_out = interrupted = False
    reaped: dict[int, int | None] = {}
    try:
        while True:
            elapsed = time.monotonic() - start
            try:
                proc.wait(timeout=max(0.01, min(tick_s, timeout_s - elapsed)))
                break
            except subprocess.TimeoutExpired:
                if cancel is not None and cancel.is_set():
                    interrupted = True
                    reaped = kill_tree(proc.pid, pgid)
                    _reap(proc)
                    break
                if time.monotonic() - start >= timeout_s:
                    timed_out = True
                    reaped = kill_tree(proc.pid, pgid)
                    _reap(proc)
                    break
                if on_tick is not None:
                    on_tick(time.monotonic() - start)
    except BaseException:  # Ctrl-C, SIGTERM, or an error in a callback: nothing may outlive us
        interrupted = True
        kill_tree(proc.pid, pgid)
        _reap(proc)
        raise
    finally:
        if not interrupted and not timed_out:
            kill_tree(proc.pid, pgid, grace_s=0.5)  # leftovers of a finished run
        pump.join(REAP_S)  # the tree is gone: the pipe is at its end (a process stuck in the kernel aside)
    code = reaped.get(proc.pid, proc.returncode) if (timed_out or interrupted) else proc.returncode
    return RunResult(exit_code=code, timed_out=timed_out, wall_s=time.monotonic() - start,
                     log_path=log_path, interrupted=interrupted)
