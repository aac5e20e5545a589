"""Run one experiment command in its own process group under a hard timeout; kill the whole tree after.

On Linux the command runs under a reaper (this file run as a script, `reap()`): a child subreaper, so every
process the command starts stays its descendant however it detaches (setsid, a double fork), and it ends them all
when the command exits, when it is told to stop, or when the controller dies (even by SIGKILL). Nothing a run
starts outlives it. This file is run by path with `python -I -S`: it imports nothing of the package.
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # the reaper, started without site (`python -I -S`: half the start-up time):
    sys.path.append(sys.argv.pop(1))  # psutil from where the controller found it (after the standard library)
import psutil  # noqa: E402

KILL_GRACE_S = 5.0  # SIGTERM, then this long, then SIGKILL
REAP_S = 10.0  # after SIGKILL: how long to wait for the exit before reporting the process as stuck
LOG_CAP_BYTES = 64 << 20  # a run's log keeps its first and last half of this much (a print in the step loop
#                           could otherwise fill the disk)
FLUSH_S = 0.5  # how often a capped log's tail is written out while the run goes on
CANCEL_TICK_S = 0.05  # how often a command that may be stopped looks whether it was
GATE_TICK_S = 0.02  # how often a command started early checks whether it may have its stdin
MEMORY_TICK_S = 0.25  # how often the memory a command's processes hold is measured (under a memory limit)
SHARE_TICK_S = 1.0  # how often the CPU time of a command's threads, and their wait for a CPU, is read
GIB = 1 << 30
# What a process prints when an allocation fails (Python, torch's CPU allocator, C++, glibc): under an address
# space limit, the limit's doing
ALLOCATION_FAILED = (b"MemoryError", b"can't allocate memory", b"Cannot allocate memory", b"std::bad_alloc")


class CappedLog:
    """A log file that keeps the first and the last `cap / 2` bytes of what is written to it, with a line
    saying how much was cut between them. Memory and disk stay under `cap` whatever the process prints.

    It lies in the run's directory, which the run can write: it is created anew (whatever the run left at
    that path, a link to a file of the host's included, is removed, never followed), and if the run replaces it
    while it is written, the controller's own copy is put back when it closes."""

    def __init__(self, path: Path, cap: int):
        self.path = path
        self.fd = _create(path)  # what the run prints is in the file at once (progress, status)
        self.ino = os.fstat(self.fd).st_ino
        self.cap, self.head = cap, cap // 2
        self.size = 0  # bytes on disk while nothing is cut
        self.tail: bytearray | None = None  # once cut: the last cap - head bytes, in memory
        self.cut = 0
        self.flushed = time.monotonic()

    def write(self, data: bytes) -> None:
        if self.tail is None and self.size + len(data) <= self.cap:
            _write_all(self.fd, data, self.size)
            self.size += len(data)
            return
        if self.tail is None:  # the cap is reached: what is past the head becomes the start of the tail
            self.tail = bytearray(os.pread(self.fd, self.size - self.head, self.head))
        self.tail += data
        excess = len(self.tail) - (self.cap - self.head)
        if excess > 0:
            del self.tail[:excess]
            self.cut += excess
        if time.monotonic() - self.flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.tail is not None:
            note = (
                f"\n[autoloop: {self.cut} bytes of this log cut here; it keeps its first and last "
                f"{self.head >> 20} MiB]\n".encode()
            )
            _write_all(self.fd, note + bytes(self.tail), self.head)
            os.ftruncate(self.fd, self.head + len(note) + len(self.tail))
        self.flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        try:
            if os.lstat(self.path).st_ino == self.ino:
                return
        except OSError:
            pass
        try:  # replaced or removed by the run: our copy goes back
            fd = _create(self.path)
            try:
                size, offset = os.fstat(self.fd).st_size, 0
                while offset < size:
                    chunk = os.pread(self.fd, min(1 << 20, size - offset), offset)
                    if not chunk:
                        break
                    _write_all(fd, chunk, offset)
                    offset += len(chunk)
            finally:
                os.close(fd)
        except OSError:
            pass
        finally:
            os.close(self.fd)


def _create(path: Path) -> int:
    """A new regular file at path, opened read-write; whatever was there (a link, a FIFO) is removed first, and
    one put back in between makes it try again (O_EXCL: never opened, never followed)."""
    for _ in range(100):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(path, ignore_errors=True)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue
    raise OSError(f"cannot create {path}: something keeps putting a file there")


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


class LineWatch:
    """Calls `then` once, the first time `line` is printed as a line of its own (fed the output in any chunks)."""

    def __init__(self, line: str, then: Callable[[], None]):
        self.line, self.then = line.encode(), then
        self.pending = b""  # the output since the last newline
        self.seen = False

    def __call__(self, data: bytes) -> None:
        if self.seen:
            return
        *lines, self.pending = (self.pending + data).split(b"\n")
        self.pending = self.pending[-len(self.line) - 2 :]  # a longer line cannot be it (nor can this, cut)
        if any(ln.rstrip(b"\r") == self.line for ln in lines):
            self.seen = True
            self.then()


def _pump(fd: int, log: CappedLog, on_output: Callable[[bytes], None] | None = None) -> None:
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
                if on_output is not None:
                    try:
                        on_output(data)
                    except Exception:  # noqa: BLE001 - a watcher's failure must not stop the log (and the run)
                        on_output = None
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
    killed: str = ""  # why it ended at a limit of ours other than the timeout ("memory limit: ..."), else ''
    cpu_share: float | None = None  # CpuShare.share(): how much of the CPU its busiest thread got; None: unknown
    cpu_outside: float | None = None  # CpuShare.outside(): CPUs other processes kept busy meanwhile; None: unknown


class CpuShare:
    """What the machine left the command: how much of the CPU it got while it was ready to run, and how busy
    other users' processes kept the CPUs meanwhile, from the kernel's accounts (Linux `/proc`), read every
    SHARE_TICK_S. On a machine other processes keep busy a run waits for the CPU and, under a wall-clock budget,
    reaches fewer steps; an edit that makes training slower spends as long ready to run, so its share stays
    (judge.disturbance sets aside a run that waited while others were busy).

    - share(): of the thread that spent the most time on a CPU (the training loop's), on-CPU / (on-CPU + waiting)
      (`/proc/PID/task/TID/schedstat`). A run can lower it itself (threads pinned beside each other), so it is
      only ever read with the next figure, which a run cannot raise.
    - outside(): CPUs kept busy on average by the processes of the machine that are neither this process nor
      its descendants (the run, other slots' runs, the proposer's tools) nor kernel threads, each one's own CPU
      time (`/proc/PID/stat`) between readings. What the run starts stays its descendant (the reaper is a child
      subreaper), however it ends, and a process's own CPU time is the scheduler's exact count. Nor do the
      processes the kernel starts (its threads and the user-space helpers it spawns under kthreadd: a core-dump
      helper such as apport for each crash, modprobe for a socket of an unknown family, which a run could ask for
      at will), nor the runs of any autoloop (under a reaper: another slot's on a Ray or Slurm node).

    Each None where the kernel keeps no such account (not Linux) or the run ended before the second reading."""

    def __init__(self) -> None:
        self.threads: dict[int, tuple[int, int]] = {}  # thread id -> (ns on a CPU, ns ready but waiting), last read
        self.others: dict[int, tuple[int, int]] = {}  # pid -> (start time, CPU ticks) of the others, last read
        self.since: float | None = None  # seconds since boot at the first reading
        self.busy = 0  # CPU ticks the others spent since then
        self.span = 0.0  # seconds from the first reading to the last

    def sample(self, pid: int) -> None:
        for proc in [pid, *(p.pid for p in _descendants(pid))]:
            try:
                tids = os.listdir(f"/proc/{proc}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{proc}/task/{tid}/schedstat", "rb") as f:
                        on, wait = (int(v) for v in f.read().split()[:2])
                except (OSError, ValueError):
                    continue
                self.threads[int(tid)] = (on, wait)
        try:
            with open("/proc/uptime", "rb") as f:
                now = float(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return
        tick = os.sysconf("SC_CLK_TCK")
        first = self.since is None
        self.since = now if self.since is None else self.since
        seen = others_now(os.getpid())
        for other, (started, ticks) in seen.items():
            before = self.others.get(other)
            if before is not None and before[0] == started:
                self.busy += ticks - before[1]
            elif not first and started >= self.since * tick:  # started since the first reading: all of it
                self.busy += ticks
        self.others = seen
        self.span = now - self.since

    def share(self) -> float | None:
        if not self.threads:
            return None
        on, wait = max(self.threads.values())
        return on / (on + wait) if on > 0 else None

    def outside(self) -> float | None:
        if self.span < SHARE_TICK_S / 2:
            return None
        return self.busy / os.sysconf("SC_CLK_TCK") / self.span


PF_KTHREAD = 0x00200000  # /proc/PID/stat flags: a kernel thread


def others_now(controller: int) -> dict[int, tuple[int, int]]:
    """pid -> (start time, CPU ticks of its own threads) of every process that is not the controller's, the
    kernel's or an autoloop run's (`theirs`; one pass over /proc: each process's parent, flags, start and CPU
    time, and the command line of those that may be a reaper)."""
    seen: dict[int, tuple[int, int, int, int]] = {}  # pid -> (parent, flags, start time, CPU ticks)
    reapers: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                comm, rest = f.read().rsplit(b")", 1)
                fields = rest.split()
            seen[int(name)] = (int(fields[1]), int(fields[6]), int(fields[19]), int(fields[11]) + int(fields[12]))
            if comm.startswith(b"python", comm.find(b"(") + 1) and is_reaper(int(name)):
                reapers.add(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return theirs(seen, controller, reapers)


def is_reaper(pid: int) -> bool:
    """Is this process an autoloop reaper (`under_reaper`: python -I -S .../executors/runner.py ...)?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return len(argv) > 3 and argv[1:3] == [b"-I", b"-S"] and argv[3].endswith(b"/executors/runner.py")


def theirs(
    seen: dict[int, tuple[int, int, int, int]], controller: int, reapers: Collection[int] = ()
) -> dict[int, tuple[int, int]]:
    """Of `seen` (pid -> (parent, flags, start time, CPU ticks)), the other users' processes: pid -> (start
    time, CPU ticks), leaving out the trees of the controller, of kthreadd (the kernel's threads and the helpers
    it spawns on a run's behalf) and of every autoloop reaper (autoloop runs, this session's on other nodes' slots
    or another session's: a run of ours may look like another user's to a slot beside it), and kernel threads."""
    children: dict[int, list[int]] = {}
    for pid, (parent, *_) in seen.items():
        children.setdefault(parent, []).append(pid)
    # kthreadd: the kernel thread with no parent (pid 2 where the PID namespace is the machine's; out of sight in a
    # container's, as is what it spawns)
    kthreadd = [pid for pid, (parent, flags, *_) in seen.items() if parent == 0 and flags & PF_KTHREAD]
    ours, todo = set(), [controller, *kthreadd, *reapers]
    while todo:
        pid = todo.pop()
        if pid not in ours:
            ours.add(pid)
            todo.extend(children.get(pid, ()))
    return {
        pid: (start, ticks)
        for pid, (_, flags, start, ticks) in seen.items()
        if pid not in ours and not flags & PF_KTHREAD
    }


def cpu_accounts() -> tuple[int, int] | None:
    """(CPU ticks the machine spent in user and system mode since boot, from /proc/stat; CPU ticks of every
    process in sight, kernel threads included, each with those of the children it reaped), or None where the
    kernel keeps no such accounts (not Linux). Between two readings the first grows by what every process on the
    machine spent, the second by what the processes in sight spent, including those that ended meanwhile (their
    time moves to the parent that reaps them); what is left is the load out of sight (`hidden_load`)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        machine = sum(int(v) for v in fields[1:4])  # user, nice, system (interrupts: nobody's process's)
    except (OSError, ValueError):
        return None
    seen = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    seen += sum(int(v) for v in f.read().rsplit(b")", 1)[1].split()[11:15])
            except (OSError, ValueError):
                continue
    return machine, seen


def hidden_load(seconds: float = 1.0, tries: int = 2, confirm: float = 0.0) -> float | None:
    """CPUs kept busy on average over `seconds` by processes out of sight here (another container's, other
    users' under /proc's hidepid): CpuShare cannot count them, so a run they slow looks like the idea's own.
    The least of `tries` samples, taken again only while at least `confirm`: a process that ends during a reading
    of /proc after its parent was read is in neither, and its whole CPU time would read as out of sight
    (out-of-sight load stays). None where the kernel keeps no accounts."""
    least = None
    for _ in range(tries):
        before, t0 = cpu_accounts(), time.monotonic()
        time.sleep(seconds)
        after, t1 = cpu_accounts(), time.monotonic()
        if before is None or after is None:
            return None
        hidden = max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / os.sysconf("SC_CLK_TCK") / (t1 - t0))
        least = hidden if least is None else min(least, hidden)
        if least < confirm:  # nothing to confirm
            break
    return least


def tree_memory(pid: int, limit: int | None = None) -> int:
    """Bytes of memory the process tree under pid holds that only it can give back: anonymous and shared memory,
    each page shared between its processes (forked workers) counted once (PSS); file pages the kernel may drop
    (a memory-mapped dataset) are not counted. With a limit, first the cheap upper bound (each process's resident
    anonymous and shared memory, /proc/PID/status), and PSS only where that passes the limit: smaps_rollup walks
    the page tables under the process's memory lock (8.5 ms for a 1.6 GB torch process, four times a second)."""
    tree = [pid, *(p.pid for p in _descendants(pid))]
    if limit is not None and (bound := sum(_resident(proc) for proc in tree)) <= limit:
        return bound
    return sum(_held(proc) for proc in tree)


def _resident(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return sum(int(fields.get(k, b"0 kB").split()[0]) for k in (b"RssAnon", b"RssShmem")) << 10
    except (OSError, ValueError):
        return _held(pid)


def _held(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines()[1:] if b":" in line)
        if b"Pss_Anon" in fields:
            return sum(int(fields.get(k, b"0 kB").split()[0]) for k in (b"Pss_Anon", b"Pss_Shmem")) << 10
        return int(fields[b"Pss"].split()[0]) << 10
    except (OSError, KeyError, ValueError):
        pass
    try:  # an older kernel, or a process we may not inspect: resident less file-backed pages
        with open(f"/proc/{pid}/statm", "rb") as f:
            _, resident, shared = (int(v) for v in f.read().split()[:3])
        return max(0, resident - shared) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def memory_note(limit: int, used: int | None = None) -> str:
    """The crash reason of a command stopped at its memory limit (a line of its log, a run's crash reason)."""
    if used is None:  # under an address space limit (no GPU)
        return f"autoloop: out of memory: the step reached its memory limit of {size(limit)} of address space"
    return f"autoloop: out of memory: the step reached its memory limit of {size(limit)}: its processes held " + (
        f"{size(used)} and were killed"
    )


def size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n >> 20} MiB"


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


def _write_stdin(proc: subprocess.Popen, text: str | None) -> None:
    try:
        proc.stdin.write((text or "").encode())
        proc.stdin.close()
    except OSError:
        pass


def _reap(proc: subprocess.Popen) -> None:
    """Wait for a killed process, boundedly: one stuck in the kernel after SIGKILL is reported, not waited on."""
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        print(
            f"autoloop: warning: process {proc.pid} did not exit {REAP_S:.0f}s after SIGKILL (stuck in the "
            "kernel, e.g. on a GPU driver); not waiting for it",
            flush=True,
        )


# ---------------------------------------------------------------------------
# The reaper: the process run_command starts in place of the command (Linux)
# ---------------------------------------------------------------------------

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # <linux/prctl.h>
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}  # SIGTERM is also what the controller's death sends
LEFTOVER_GRACE_S = 0.5  # after the command exited: SIGTERM its leftovers, this long, then SIGKILL
REAPER = sys.platform.startswith("linux")  # prctl: elsewhere the command runs directly (its group is killed)


def under_reaper(cmd: list[str], address_limit: int = 0) -> list[str]:
    """cmd run under the reaper (which knows the controller's pid: it ends the tree if the controller is gone),
    its address space limited to address_limit bytes (0: not)."""
    if not REAPER:
        return cmd
    site = os.path.dirname(os.path.dirname(psutil.__file__))
    return [
        *(sys.executable, "-I", "-S", os.path.abspath(__file__), site),
        *(str(os.getpid()), str(address_limit), "--", *cmd),
    ]


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


def _end_descendants(grace_s: float, statuses: dict[int, int]) -> None:
    """SIGTERM every descendant (orphans are ours: we are their subreaper), wait, SIGKILL the rest; until none
    is left (one may fork while it dies). Exit codes of our children go to statuses."""
    for _ in range(10):
        procs = psutil.Process().children(recursive=True)
        if not procs:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
            for proc in procs:
                try:
                    proc.send_signal(sig)
                except psutil.Error:
                    pass
            gone, procs = psutil.wait_procs(procs, timeout=wait_s)
            statuses.update((p.pid, p.returncode) for p in gone if p.returncode is not None)
            if not procs:
                break
        _reap_children(statuses)


def _reap_children(statuses: dict[int, int]) -> None:
    """Collect every child that has exited (orphans that died are ours to wait for)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = os.waitstatus_to_exitcode(status)


def _exit_as(code: int | None) -> None:
    """Exit the way the command did: its exit code, or killed by its signal (the caller sees -signal)."""
    if code is not None and code < 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashed command's signal, not our core dump
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.kill(os.getpid(), -code)
    os._exit(1 if code is None or code < 0 else code)


def _limit_memory(address_limit: int) -> None:
    """What the command inherits: an address space limit (an allocation past it fails at once, in the process
    that asked), and the first place in the kernel's choice of what to kill when the machine runs out of memory
    (never the controller)."""
    if address_limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (address_limit, address_limit))
    try:  # no core dumps, a hard limit a run cannot raise: 1 (not 0) stops a pipe's helper too (core_pattern
        # "|apport ...": the kernel ignores the limit for pipes but for 1), which would burn CPU outside the run
        resource.setrlimit(resource.RLIMIT_CORE, (1, 1))
    except (OSError, ValueError):  # (a hard limit of 0 already: no core file; a pipe's helper still runs)
        pass
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def reap(argv: list[str]) -> None:
    """The reaper's main: `CONTROLLER_PID ADDRESS_LIMIT -- COMMAND...`. Signals are taken synchronously
    (sigwaitinfo), so none can land between starting the command and knowing its pid."""
    parent, address_limit, cmd = int(argv[0]), int(argv[1]), argv[3:]
    signal.pthread_sigmask(signal.SIG_BLOCK, {*STOP_SIGNALS, signal.SIGCHLD})
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the controller died before PDEATHSIG was armed
        os._exit(1)
    _limit_memory(address_limit)
    try:  # the command gets our stdin (a nonce), output and environment; default signal mask and SIGPIPE
        pid = os.posix_spawnp(
            cmd[0], cmd, os.environ, setsigmask=(), setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, *STOP_SIGNALS)
        )
    except OSError as e:
        print(f"autoloop: cannot run {cmd[0]}: {e}", file=sys.stderr, flush=True)
        os._exit(127)
    statuses: dict[int, int] = {}
    grace = LEFTOVER_GRACE_S
    while pid not in statuses:
        info = signal.sigwaitinfo({*STOP_SIGNALS, signal.SIGCHLD})
        if info.si_signo in STOP_SIGNALS:  # a timeout, a cancel, the controller's end: all of it, now
            grace = KILL_GRACE_S
            break
        _reap_children(statuses)
    _end_descendants(grace, statuses)
    _reap_children(statuses)
    _exit_as(statuses.get(pid))


def run_command(
    cmd: list[str],
    cwd: Path,
    env: dict[str, str],
    log_path: Path,
    timeout_s: float,
    on_start: Callable[[int], None] | None = None,
    on_tick: Callable[[float], None] | None = None,
    tick_s: float = 1.0,
    cancel: threading.Event | None = None,
    log_cap: int = LOG_CAP_BYTES,
    stdin_text: str | None = None,
    on_output: Callable[[bytes], None] | None = None,
    stdin_gate: threading.Event | None = None,
    memory_limit: int = 0,
    address_limit: int = 0,
) -> RunResult:
    """Run cmd with stdout+stderr to log_path (capped: CappedLog) in a new session, under the reaper; never
    raises for the command's failures. The pid on_start gets is the reaper's (its tree is the run's).

    On timeout or KeyboardInterrupt the whole tree is killed (SIGTERM, grace, SIGKILL); after a normal
    exit the reaper ends whatever the command left (its group is killed too), so nothing outlives an experiment.
    on_output sees the output as it comes. With stdin_gate, stdin_text is written only once the gate opens, and
    the timeout counts from then (the command may get ready before it is told to go); a cancel before that
    closes stdin unwritten. Under a memory_limit (bytes; 0: none) the tree is killed once its processes hold more
    (tree_memory); under an address_limit (Linux) its allocations past that fail. Either way `killed` says so, and
    so does the log's last line.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            under_reaper(cmd, address_limit),
            cwd=cwd,
            env=env,
            stdout=write_end,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL if stdin_text is None else subprocess.PIPE,
            start_new_session=True,
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    pump = threading.Thread(
        target=_pump,
        args=(read_end, CappedLog(log_path, log_cap), on_output),
        daemon=True,
        name=f"log {log_path.name}",
    )
    pump.start()
    pgid = proc.pid  # start_new_session makes the child a session and group leader
    if on_start is not None:
        on_start(proc.pid)
    written = stdin_text is None
    timed_out = interrupted = False
    killed = ""
    reaped: dict[int, int | None] = {}
    ticked = measured = shared = time.monotonic()
    share = CpuShare()
    try:
        while True:
            if not written and (stdin_gate is None or stdin_gate.is_set()):
                written = True  # a line or two (a nonce): fits the pipe, so this never blocks
                start = time.monotonic() if stdin_gate is not None else start
                _write_stdin(proc, stdin_text)
            elapsed = time.monotonic() - start
            try:
                tick = tick_s if written else min(tick_s, GATE_TICK_S)  # held at the gate: look often
                if cancel is not None:  # a stop (early stopping's, the user's) lands within CANCEL_TICK_S
                    tick = min(tick, CANCEL_TICK_S)
                if memory_limit:
                    tick = min(tick, MEMORY_TICK_S)
                proc.wait(timeout=max(0.01, min(tick, timeout_s - elapsed)))
                break
            except subprocess.TimeoutExpired:
                if cancel is not None and cancel.is_set():
                    interrupted = True
                    if not written:  # told nothing: it may end on its own (no nonce, no evaluation)
                        written = True
                        _write_stdin(proc, "")
                    reaped = kill_tree(proc.pid, pgid)
                    _reap(proc)
                    break
                if written and time.monotonic() - start >= timeout_s:  # (held: the step before has its own)
                    timed_out = True
                    reaped = kill_tree(proc.pid, pgid)
                    _reap(proc)
                    break
                if memory_limit and time.monotonic() - measured >= MEMORY_TICK_S:
                    measured = time.monotonic()
                    if (used := tree_memory(proc.pid, memory_limit)) > memory_limit:
                        killed = memory_note(memory_limit, used)
                        reaped = kill_tree(proc.pid, pgid, grace_s=0.5)  # it may grow on while it dies
                        _reap(proc)
                        break
                if time.monotonic() - shared >= SHARE_TICK_S:
                    shared = time.monotonic()
                    share.sample(proc.pid)
                if on_tick is not None and time.monotonic() - ticked >= tick_s:
                    ticked = time.monotonic()
                    on_tick(ticked - start)
    except BaseException:  # Ctrl-C, SIGTERM, or an error in a callback: nothing may outlive us
        interrupted = True
        kill_tree(proc.pid, pgid)
        _reap(proc)
        raise
    finally:
        if not interrupted and not timed_out:
            kill_tree(proc.pid, pgid, grace_s=0.5)  # leftovers of a finished run
        pump.join(REAP_S)  # the tree is gone: the pipe is at its end (a process stuck in the kernel aside)
    code = reaped.get(proc.pid, proc.returncode) if (timed_out or interrupted or killed) else proc.returncode
    if not killed and address_limit and REAPER and code != 0 and _allocation_failed(log_path):
        killed = memory_note(address_limit)
    if killed and not pump.is_alive():  # every process of the run is gone: nothing can swap the log any more
        _append(log_path, f"\n{killed}\n")
    return RunResult(
        exit_code=code,
        timed_out=timed_out,
        wall_s=time.monotonic() - start,
        log_path=log_path,
        interrupted=interrupted,
        killed=killed,
        cpu_share=share.share(),
        cpu_outside=share.outside(),
    )


def _allocation_failed(log_path: Path, tail: int = 1 << 16) -> bool:
    """The end of the log says an allocation failed."""
    try:
        fd = os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, tail, max(0, size - tail))
    except OSError:
        return False
    finally:
        os.close(fd)
    return any(sign in data for sign in ALLOCATION_FAILED)


def _append(log_path: Path, text: str) -> None:
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    try:
        _write_all(fd, text.encode(), os.fstat(fd).st_size)
    except OSError:
        pass
    finally:
        os.close(fd)


if __name__ == "__main__":
    reap(sys.argv[1:])
