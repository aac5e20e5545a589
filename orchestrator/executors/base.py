"""The executor contract: where and how one experiment's commands run.

The controller hands an executor a Job (commands, environment, hard timeout, the files they work on) and a
slot; the executor runs the steps somewhere (a local GPU, a Ray worker on another machine) and reports what it
observed: each step's exit code, whether it timed out, its wall time and log, the files the steps wrote, the
device it ran on. `infra_error` set means the executor failed, not the experiment: the controller runs the job
again elsewhere and never records it as the idea's crash.

`run_steps` is the part every executor shares: it runs on the machine that does the work.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..trust.confine import (
    gpu_devices,
    hidden_paths,
    home_cache,
    private_places,
    readable_paths,
    sandbox_problem,
    sandboxed,
)
from ..trust.curve import CurveWatch, StopRule
from .gpu import smi
from .runner import LOG_CAP_BYTES, LineWatch, RunResult, run_command

OUT = "{out}"  # in a step's arguments and environment: the directory the steps write logs and outputs to
PYTHON = "{python}"  # the Python interpreter of the machine the step runs on
SCRATCH_DIRS = ("HOME", "TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME")  # made if in {out}
# A step's memory limit unless the job sets one: this share of the machine's memory (or of the container's limit)
MEMORY_SHARE = 0.75
# Without a GPU, a step's address space is limited too, to this many times its memory limit: an allocation far
# past it (a weight declared [2**36]) fails at once, however the kernel overcommits. Not with a GPU: CUDA reserves
# address space by the terabyte.
ADDRESS_FACTOR = 2
CGROUP_LIMIT = "/sys/fs/cgroup/memory.max"
PYTHONS = re.compile(r"^(python|pypy)[0-9.]*$")  # a step run by one of these is asked where its packages are
# What the controller writes in a run's directory before its job (trial.py, holdout.py) and after it: with the
# job's logs, inputs and outputs, all a run's directory ever holds
CONTROLLER_FILES = ("proposer.log", "diff.patch", "record.json")


@dataclass
class Job:
    steps: list[list[str]]  # commands run in order; a step runs only if the one before exited 0 and left
    logs: list[str]  #        the watched files alone. One log file name per step.
    env: dict[str, str]
    timeout_s: float  # hard limit for each step; the whole process tree is killed when it is reached
    workdir: Path  # the code on the controller's machine (a git worktree)
    out_dir: Path  # where logs and outputs end up on the controller's machine
    watch: tuple[str, ...] = ()  # files of workdir no step may change (checked after every step)
    inputs: dict[str, Path] = field(default_factory=dict)  # files put into the output directory first
    step_env: list[dict[str, str | None]] = field(default_factory=list)  # per step: set (or None: unset)
    on_start: Callable[[int], None] | None = None  # the pid of each step's process (executors on this machine)
    log_cap: int = LOG_CAP_BYTES  # bytes a step's log keeps at most (its head and its tail)
    step_stdin: list[str | None] = field(default_factory=list)  # per step: what it reads on stdin (None: nothing)
    sandbox: dict | None = None  # {"net": bool, "required": bool}: steps confined by bubblewrap (confine.py)
    local_only: tuple[str, ...] = ()  # env values true of this machine only (another node resolves its own)
    pass_env: tuple[str, ...] = ()  # --pass-env: names of env that travel to another machine too (remote.py)
    # sandboxed: every GPU's device node, not only CUDA_VISIBLE_DEVICES' (a Slurm job's numbers its GPUs from 0
    # where the cluster constrains devices by cgroup, which then guards the others itself)
    every_gpu: bool = False
    # Per step: a line the step before prints after which this one may start (sandboxed only, where the two
    # cannot reach each other): it gets ready (imports, data) and waits for its stdin, which it gets once the
    # step before has ended and passed its checks. The evaluation's start-up then overlaps the model's export.
    step_start_after: list[str | None] = field(default_factory=list)
    # In the sandbox ({out} substituted): per step, files and directories it may not read at all (the training
    # step: the validation and held-out data), which it sees empty; paths within the writable ones that stay
    # read-only (relative ones: in the worktree, whose .git is read-only always); paths it reads that may lie
    # under /tmp or /run, which the sandbox empties (our Python, AUTOLOOP_CACHE and PYTHONPATH are added by
    # run_steps).
    step_hidden: list[tuple[str, ...]] = field(default_factory=list)
    read_only: tuple[str, ...] = ()
    readable: tuple[str, ...] = ()
    # --early-stop: the first step (training) is stopped when its curve is clearly behind the best's
    # (trust/curve.py: StopRule.to_dict); the job then ends there, `stopped` saying why
    stop_rule: dict | None = None
    # Bytes of memory each step's processes may hold (runner.tree_memory) before they are killed: None for
    # default_memory_limit(), 0 for none
    memory_limit: int | None = None
    # The files the steps may leave in out_dir besides their logs and inputs: after each step anything else there
    # is removed (a checkpoint for a later run, a link, a directory), so a run's directory holds only what the
    # controller expects. None: the names the steps and their environment give as {out}/NAME (the model, the
    # result); a job that gives them the directory itself ({out} alone) keeps whatever they write.
    outputs: tuple[str, ...] | None = None


@dataclass
class StepResult:
    exit_code: int | None
    timed_out: bool
    wall_s: float
    log: Path
    killed: str = ""  # stopped at its memory limit: the crash reason (runner.memory_note), else ''
    cpu_share: float | None = None  # how much of the CPU it got while ready to run (runner.CpuShare), if known
    cpu_outside: float | None = None  # CPUs other processes kept busy meanwhile (runner.CpuShare), if known


@dataclass
class JobResult:
    steps: list[StepResult] = field(default_factory=list)
    modified: list[str] = field(default_factory=list)  # watched files a step changed (later steps did not run)
    ages: dict[str, float] = field(default_factory=dict)  # output file -> seconds from the start of step 1
    device: str = ""  # e.g. "NVIDIA H100 80GB HBM3" or "cpu"
    node: str = ""  # the host the job ran on
    slot: int = 0
    infra_error: str = ""  # the executor failed (node lost, worker died): run the job again elsewhere
    interrupted: bool = False
    stopped: str = ""  # why --early-stop stopped the training step (the later steps did not run)
    audited: str = ""  # an audited run (StopRule.audit) trained to the end: why the rule would have stopped it

    @property
    def ok(self) -> bool:
        return (
            bool(self.steps) and not self.interrupted and all(s.exit_code == 0 and not s.timed_out for s in self.steps)
        )


@dataclass
class Slot:
    index: int
    env: dict[str, str]  # e.g. CUDA_VISIBLE_DEVICES for the slot's GPU
    label: str  # what the console shows: "gpu 3", "cpu", "ray"


class Handle:
    """A submitted job: poll `done()`, wait with `result()`, stop it with `cancel()`."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float) -> bool:
        """Wait up to timeout seconds for the job to end; True if it has."""
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return True

    def result(self, timeout: float | None = None) -> JobResult:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError


class Ended(Handle):
    """A job that has ended by the time submit() returns (run in the caller's thread, or refused before it
    started): done, with its result; nothing left to cancel."""

    def __init__(self, result: JobResult):
        self._result = result

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> JobResult:
        return self._result

    def cancel(self) -> None:
        pass


class Executor:
    """Runs jobs on its slots. Registered in the entry-point group `autoloop.executors` (orchestrator/plugins.py);
    `options` are the click.Option objects `autoloop run` offers for it, handed to `create` by name."""

    name = "base"
    slots: list[Slot]
    options: tuple = ()

    @classmethod
    def create(cls, workers: int | None, options: dict) -> Executor:
        """The executor for `--workers` (None: its own default) and the values of its options."""
        return cls(workers=workers, **{k: v for k, v in options.items() if v is not None})

    def submit(self, job: Job, slot: Slot) -> Handle:
        raise NotImplementedError

    def close(self) -> None:
        pass


def sha256_of(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def substitute(value: str, out: Path, python: str) -> str:
    return value.replace(OUT, str(out)).replace(PYTHON, python)


def substitute_all(values, out: Path) -> list[str]:
    return [substitute(v, out, sys.executable) for v in values]


def gpu_name(visible: str | None) -> str:
    """The model of the first GPU in CUDA_VISIBLE_DEVICES (nvidia-smi), or 'cpu' where there is none."""
    if visible is not None and not visible.strip():
        return "cpu"
    first = (visible or "0").split(",")[0].strip()
    out = (smi(["--query-gpu=name", "--format=csv,noheader", "-i", first], timeout=20) or "").strip()
    return out.splitlines()[0] if out else "cpu"


def git_link(workdir: Path) -> list[str]:
    """The worktree's .git (a file pointing at the repository's gitdir for it, or a repository): a step that
    rewrote it could point the controller's next git command anywhere."""
    return [str(workdir.resolve() / ".git")] if (workdir / ".git").exists() else []


def default_memory_limit() -> int:
    """MEMORY_SHARE of this machine's memory, or of the container's where its cgroup allows less."""
    import psutil

    total = psutil.virtual_memory().total
    try:
        limit = Path(CGROUP_LIMIT).read_text().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return int(total * MEMORY_SHARE)


def run_steps(
    job: Job, workdir: Path, out: Path, slot_env: dict[str, str], cancel: threading.Event | None = None
) -> JobResult:
    """Run the job's steps in workdir, logs and outputs to out; on the machine that does the work."""
    out.mkdir(parents=True, exist_ok=True)
    for name, src in job.inputs.items():
        dest = out / name
        if Path(src).resolve() != dest.resolve():
            dest.unlink(missing_ok=True)
            try:
                os.link(src, dest)  # same filesystem: no copy of a large model
            except OSError:
                shutil.copy2(src, dest)
    env = {k: substitute(v, out, sys.executable) for k, v in {**job.env, **slot_env}.items()}
    scratch = [Path(env[k]) for k in SCRATCH_DIRS if k in env and str(OUT) in job.env.get(k, "")]
    for path in scratch:
        path.mkdir(parents=True, exist_ok=True)
    keep = _outputs(job, scratch, out)
    if keep is not None:  # what an interrupted attempt left goes before this one starts
        keep_only(out, keep, _scratch_names(scratch, out))
    given = [p.name for p in out.iterdir() if p.name in (*CONTROLLER_FILES, *job.inputs) and _regular(p)]
    memory = default_memory_limit() if job.memory_limit is None else job.memory_limit
    confined = None
    if job.sandbox is not None:
        if problem := sandbox_problem():
            if job.sandbox.get("required"):
                return JobResult(
                    device=gpu_name(env.get("CUDA_VISIBLE_DEVICES")),
                    node=socket.gethostname(),
                    infra_error=f"the sandbox is required (--sandbox on; on another machine, auto too), but "
                    f"{problem} on {socket.gethostname()}: install it there, or run unconfined with --sandbox off",
                )
        else:  # only the run's own directory, its worktree and the session's compile cache are writable
            writable = {out.resolve(), Path(workdir).resolve(), *(p.resolve() for p in scratch)}
            confined = {
                "writable": [str(p) for p in writable],
                "net": bool(job.sandbox.get("net")),
                "read_only": [  # (what the controller put in the run's directory stays as it put it)
                    *(str(Path(workdir).resolve() / p) for p in substitute_all(job.read_only, out)),
                    *git_link(Path(workdir)),
                    *(str(out.resolve() / name) for name in given),
                ],
                "private": private_places(Path(workdir), out),
                "shm_bytes": memory,
            }
    result = JobResult(device=gpu_name(env.get("CUDA_VISIBLE_DEVICES")), node=socket.gethostname())
    before = {name: sha256_of(workdir / name) for name in job.watch}

    # Each step after the first gets scratch directories of its own (HOME, TMPDIR, kernel caches), made afresh
    # outside the run directory: a step before it could plant files for it in a scratch they shared (a CUDA JIT
    # cache under ~/.nv read by the evaluation's kernels). Sandboxed, the earlier step cannot see them at all.
    fresh = {i: Path(tempfile.mkdtemp(prefix="autoloop-step-")) for i in range(1, len(job.steps))} if scratch else {}

    def step(i: int, **extra) -> RunResult:
        step_env = dict(env)
        writable: list[str] = []
        if i in fresh:
            for key in SCRATCH_DIRS:
                if key in env and str(OUT) in job.env.get(key, ""):
                    (fresh[i] / key.lower()).mkdir(exist_ok=True)
                    step_env[key] = str(fresh[i] / key.lower())
            writable.append(str(fresh[i]))
        for key, value in (job.step_env[i] if i < len(job.step_env) else {}).items():
            if value is None:
                step_env.pop(key, None)
            else:
                step_env[key] = substitute(value, out, sys.executable)
        argv = [substitute(a, out, sys.executable) for a in job.steps[i]]
        devices = gpu_devices(None if job.every_gpu else step_env.get("CUDA_VISIBLE_DEVICES"))
        if confined is not None:
            python = argv[0] if PYTHONS.match(os.path.basename(argv[0])) else ""
            readable = [*readable_paths(step_env, python), *substitute_all(job.readable, out)]
            hidden = [*substitute_all(job.step_hidden[i] if i < len(job.step_hidden) else (), out)]
            if "HOME" in step_env and not _under(Path(step_env["HOME"]), out):  # the user's (no manifest)
                cache, tokens = home_cache(step_env["HOME"])
                readable, hidden = [*readable, *cache], [*hidden, *tokens]
            argv = sandboxed(
                argv,
                **{**confined, "writable": [*confined["writable"], *writable]},
                hidden=[*hidden, *hidden_paths(readable, step_env, python)],
                readable=readable,
                devices=devices,
            )
        gpu = any(os.path.exists(d) for d in devices if d != "/dev/dri")  # (a render node: any graphics)
        return run_command(
            argv,
            workdir,
            step_env,
            out / job.logs[i],
            job.timeout_s,
            on_start=job.on_start,
            log_cap=job.log_cap,
            stdin_text=job.step_stdin[i] if i < len(job.step_stdin) else None,
            memory_limit=memory,
            address_limit=0 if gpu or not memory else memory * ADDRESS_FACTOR,
            **extra,
        )

    first_start = time.time()
    early: _Early | None = None  # the next step, started already (sandboxed: each step has its own namespaces)
    try:
        for i in range(len(job.steps)):
            if early is not None:  # the step before has ended and passed its checks: this one may go on
                run, early = early.result(), None
            else:
                watches: list[Callable[[bytes], None]] = []
                if confined is not None and (line := _early_start(job, i + 1, workdir)):
                    early = _Early(lambda gate, stop, n=i + 1: step(n, stdin_gate=gate, cancel=stop), cancel)
                    watches.append(LineWatch(line, early.start))
                curve = CurveWatch(rule) if i == 0 and (rule := StopRule.from_dict(job.stop_rule)) else None
                if curve is not None:
                    watches.append(curve)
                stop = cancel if curve is None else _Either(curve.fired, cancel)
                run = step(i, cancel=stop, on_output=_all(watches))
            result.steps.append(
                StepResult(
                    run.exit_code,
                    run.timed_out,
                    run.wall_s,
                    out / job.logs[i],
                    run.killed,
                    run.cpu_share,
                    run.cpu_outside,
                )
            )
            if keep is not None:  # (its processes are gone; one started early writes its own outputs only)
                keep_only(out, keep, _scratch_names(scratch, out))
            by_rule = run.interrupted and curve is not None and curve.why and not (cancel and cancel.is_set())
            if run.interrupted and not by_rule:
                result.interrupted = True
                break
            result.modified = [name for name, digest in before.items() if sha256_of(workdir / name) != digest]
            if by_rule:  # stopped by the rule, not by the user: a result, judged as such (its edits too)
                result.stopped = curve.why
                break
            if curve is not None and curve.rule.audit:
                result.audited = curve.why
            if run.timed_out or run.exit_code != 0 or result.modified:
                break
    finally:
        if early is not None:  # never told to go (a failed step, a Ctrl-C): it ends unevaluated
            early.call_off()
        if keep is not None:  # (after a Ctrl-C too; what a step started early and called off left too)
            keep_only(out, keep)
        for path in fresh.values():
            shutil.rmtree(path, ignore_errors=True)
    for path in out.iterdir():
        if _regular(path):
            result.ages[path.name] = path.stat().st_mtime - first_start
    for name in {"home", "tmp", *_scratch_names(scratch, out)}:  # the run's own HOME and TMPDIR: scratch
        _remove(out / name)
    return result


def _outputs(job: Job, scratch: list[Path], out: Path) -> set[str] | None:
    """The names of files a step may leave in out (Job.outputs), or None where the job gives its steps the whole
    of it."""
    values = [*(a for s in job.steps for a in s), *job.env.values()]
    values += [v for e in job.step_env for v in e.values() if v is not None]
    if job.outputs is None and any(re.search(re.escape(OUT) + r"(?!/[^/])", v) for v in values):
        return None
    named = job.outputs
    if named is None:
        named = tuple(m for v in values for m in re.findall(re.escape(OUT) + r"/([^/\s]+)", v))
    return {*job.logs, *job.inputs, *CONTROLLER_FILES, *named} - set(_scratch_names(scratch, out))


def _scratch_names(scratch: list[Path], out: Path) -> list[str]:
    """The directories of out that are the steps' scratch (HOME, TMPDIR): theirs until the job ends."""
    return [p.relative_to(out).parts[0] for p in scratch if _under(p, out) and p != out]


def keep_only(out: Path, files: set[str], dirs: Iterable[str] = ()) -> None:
    """Remove from out every entry but the regular files named in `files` and the directories named in `dirs`,
    never following a link: a link, a directory or a FIFO where a model or a log should be goes too."""
    try:
        entries = list(os.scandir(out))
    except OSError:
        return
    for entry in entries:
        if entry.name in files and entry.is_file(follow_symlinks=False):
            continue
        if entry.name in dirs and entry.is_dir(follow_symlinks=False):
            continue
        _remove(Path(entry.path))


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _remove(path: Path) -> None:
    """Remove a file, link or directory tree, never following a link."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def _under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def _all(watches: list[Callable[[bytes], None]]) -> Callable[[bytes], None] | None:
    """One on_output that feeds each watch (None for none)."""
    if not watches:
        return None

    def feed(data: bytes) -> None:
        for watch in watches:
            watch(data)

    return feed


def _early_start(job: Job, i: int, workdir: Path) -> str:
    """The line after which step i may start while the step before still runs ('' for none). Only a step that
    reads stdin can wait for it (its stdin is written once the step before has ended and passed its checks), and
    only one whose code in the worktree the step before cannot change (each such file named read-only): it may
    still be reading it."""
    if i >= len(job.steps) or i >= len(job.step_start_after) or i >= len(job.step_stdin):
        return ""
    if job.step_stdin[i] is None or not job.step_start_after[i]:
        return ""
    code = [a for a in job.steps[i][1:] if not a.startswith("-") and OUT not in a and (Path(workdir) / a).is_file()]
    return "" if not code or any(a not in job.read_only for a in code) else job.step_start_after[i] or ""


class _Either:
    """Set when either of two events is (run_command only asks is_set)."""

    def __init__(self, a: threading.Event, b: threading.Event | None):
        self.a, self.b = a, b

    def is_set(self) -> bool:
        return self.a.is_set() or (self.b is not None and self.b.is_set())


class _Early:
    """A step started before the one it follows has ended (in a thread of its own), held at its stdin."""

    def __init__(self, run: Callable[..., RunResult], cancel: threading.Event | None):
        self.run = run
        self.gate, self.stop = threading.Event(), threading.Event()
        self.cancel = _Either(self.stop, cancel)
        self.thread: threading.Thread | None = None
        self.outcome: RunResult | BaseException | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        def target() -> None:
            try:
                self.outcome = self.run(self.gate, self.cancel)
            except BaseException as e:  # noqa: BLE001 - handed to the thread that waits for it
                self.outcome = e

        with self._lock:
            if self.thread is None and not self.stop.is_set():
                self.thread = threading.Thread(target=target, daemon=True, name="early step")
                self.thread.start()

    def result(self) -> RunResult:
        """The step's result, once it has run to its end (started now if the line never came)."""
        self.gate.set()
        self.start()
        assert self.thread is not None
        self.thread.join()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        assert self.outcome is not None
        return self.outcome

    def call_off(self) -> None:
        """The step before failed or was stopped: this one never gets its stdin, and its processes end."""
        with self._lock:
            self.stop.set()
        if self.thread is not None:
            self.thread.join()


def wait_any(handles: list[Handle], poll_s: float = 0.5, until: float | None = None) -> list[Handle]:
    """The handles that are done, waiting until at least one is (or the monotonic deadline `until` passes)."""
    while True:
        done = [h for h in handles if h.done()]
        if done or not handles or (until is not None and time.monotonic() >= until):
            return done
        time.sleep(poll_s)
