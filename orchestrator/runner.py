"""Run one experiment command in its own process group under a hard timeout; kill the whole tree after."""

from __future__ import annotations

import os
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
                tick_s: float = 1.0, cancel: threading.Event | None = None) -> RunResult:
    """Run cmd with stdout+stderr to log_path in a new session; never raises for the command's failures.

    On timeout or KeyboardInterrupt the whole tree is killed (SIGTERM, grace, SIGKILL); after a normal
    exit any process left in the group is killed too, so nothing outlives an experiment.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    pgid = proc.pid  # start_new_session makes the child a session and group leader
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
    code = reaped.get(proc.pid, proc.returncode) if (timed_out or interrupted) else proc.returncode
    return RunResult(exit_code=code, timed_out=timed_out, wall_s=time.monotonic() - start,
                     log_path=log_path, interrupted=interrupted)
