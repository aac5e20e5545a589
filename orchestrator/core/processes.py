"""The processes of a session's runs: which one each slot runs now (status.json, so that a resume after a
SIGKILL of the controller can end them), and the ending of what a dead controller left."""

from __future__ import annotations

import os
import threading

import psutil

from ..executors.runner import kill_tree
from ..store.session import Paths, write_status


class Processes:
    """slot -> [pid, create time] of the process tree it runs here, mirrored into status.json."""

    def __init__(self, paths: Paths):
        self.paths = paths
        self.pids: dict[str, list[float]] = {}
        self._lock = threading.Lock()  # slot threads report pids while the loop records

    def started(self, slot: int | str, pid: int, created: float) -> None:
        with self._lock:
            key = str(slot)
            if key in self.pids and _alive(*self.pids[key]):  # a step that starts while the one before ends
                key += "+"  # (the evaluation, sandboxed): both are the slot's until the run is over
            self.pids[key] = [pid, created]
            first = {"train_pid": pid, "train_started": created} if key == str(slot) else {}  # training's
            write_status(self.paths, **first, train_pids=dict(self.pids))

    def ended(self, slot: int | str, **status) -> None:
        """The slot's run is over (recorded); `status` goes to status.json with it."""
        with self._lock:
            self.pids.pop(str(slot), None)
            self.pids.pop(f"{slot}+", None)
            write_status(self.paths, train_pid=None, train_pids=dict(self.pids), **status)

    def kill_all(self) -> None:
        """The last line of defence on the way out: end every run this controller started that still lives."""
        with self._lock:
            running, self.pids = dict(self.pids), {}
        kill_orphan({"train_pids": running})


def _alive(pid: float, created: float) -> bool:
    try:
        proc = psutil.Process(int(pid))
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - created) < 2.0
    except psutil.Error:
        return False


def kill_orphan(status: dict) -> None:
    """A controller killed with SIGKILL leaves its training processes running: end them before resuming."""
    running = [tuple(v) for v in (status.get("train_pids") or {}).values()]
    if status.get("train_pid"):
        running.append((status["train_pid"], status.get("train_started", 0)))
    for pid, created in set(running):
        pid = int(pid)
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                if abs(proc.create_time() - created) < 2.0:
                    kill_tree(pid, pid)
                continue  # alive, or the pid is another process's now: a session with its id is not ours
        except psutil.Error:
            pass
        # the run's first process is gone, but its session may still hold one (e.g. a worker that ignored the
        # SIGTERM of a timeout when the controller was killed): each run is a session whose id is that pid
        for proc in psutil.process_iter(["create_time"]):
            try:
                if os.getsid(proc.pid) == pid and proc.info["create_time"] >= created - 2.0:
                    kill_tree(proc.pid, pid)
            except (OSError, psutil.Error):
                pass
