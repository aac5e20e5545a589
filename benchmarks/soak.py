"""Soak test: a night of misbehaving runs and a controller killed with SIGKILL, then resumed, along the way.

N experiments (default 100) of a fake train.py that misbehaves at random: it crashes, hangs past --timeout
(with a worker that ignores SIGTERM), prints val_bpb nan, prints a 1 GiB log, leaves stray files in its
working directory (a 16 MiB checkpoint, a .gitignore of '*', a results.tsv, a .autoloop/ of its own), or
exits early without a summary (leaving a worker behind); most runs are ok. `autoloop run` runs as a
subprocess and is SIGKILLed --kills times (once about 20%, 45% and 70% of the rows exist, at a random moment
up to --kill-window seconds later: proposing, committing, training, killing a hung run, recording), then
started again with the same command until the session holds N experiments. Then, from disk:

    rows lost          experiments 1..N without a results.tsv row whose runs/<n>/record.json has its commit
    rows duplicated    rows past N, a commit recorded twice, or one idea recorded twice
    processes left     anything still alive that the runs started (every pid seen in a controller's tree,
                       every process carrying this soak's marker variable, every orphan this script adopted)
    misjudged          a misbehaving run not recorded as a crash, or an ok run recorded as one
    disk / RSS         du of .autoloop and the controller's resident memory, at the start and at the end

It exits non-zero when rows are lost or duplicated, processes are left, a run is misjudged, the branch is
not at the best, or a controller exits on its own with an error or prints a traceback. The modes follow a
seeded RNG keyed on the number of recorded experiments, so a resumed controller proposes the same idea
again and a given --seed replays the same night (the kill moments vary with timing).

This script makes itself a child subreaper (Linux), so a run orphaned by a killed controller is re-parented
here (and reaped, as init does on a real machine) instead of escaping to a PID 1 that may not reap.

    python benchmarks/soak.py [--experiments 100] [--seed 0] [--kills 3] [--timeout 5] [--flood-mb 1024]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:  # this checkout's controller, installed or not
    sys.path.insert(0, str(ROOT))

from orchestrator.proposers import Proposal, Proposer  # noqa: E402

TAG = "soak"
PREPARE = 'import os\nTIME_BUDGET = float(os.environ.get("AUTOLOOP_TIME_BUDGET", "300"))\n'
# Set in the controller's environment, so every process of the runs inherits it (an AUTOLOOP_ name without a
# secret-looking word: the runs' allow-listed environment keeps it).
MARKER = "AUTOLOOP_SOAK_MARKER"

# mode: weight. Most runs are ok (the baseline always is); --max-crashes is raised anyway, because a run of bad
# luck must not end the soak early. The CRASHING modes must be recorded as crashes, the others must not.
MODES = {"ok": 52, "crash": 8, "hang": 6, "nan": 7, "flood": 7, "stray": 12, "early": 8}
CRASHING = {"crash", "hang", "nan", "early"}
KILL_DRIFT_ROWS = 3  # a kill due after r rows comes at the latest once r + 3 exist

FAKE_TRAIN = '''"""fake train.py of the soak benchmark: it misbehaves as MODE says"""
import os
import subprocess
import sys
import time

# Hyperparameters
IDEA = @IDEA@  # [fixed]
MODE = "@MODE@"  # [fixed]
BPB = @BPB@  # [fixed]
FLOOD_MB = @FLOOD_MB@  # [fixed]

WORKER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"


def summary(bpb):
    print("---")
    print(f"val_bpb:          {bpb:.6f}")
    print("training_seconds: 0.1")
    print("total_seconds:    0.2")
    print("peak_vram_mb:     512.0")
    print("mfu_percent:      1.50")
    print("num_steps:        3")
    print("depth:            2")


print(f"soak idea {IDEA}: {MODE}", flush=True)
print("step 00001 | loss: 1.0", flush=True)
if MODE == "crash":
    raise RuntimeError("soak: a deliberate crash")
if MODE == "hang":  # past --timeout, with a worker that ignores SIGTERM
    subprocess.Popen([sys.executable, "-c", WORKER])
    time.sleep(3600)
if MODE == "early":  # exits 0 without a summary, leaving a worker behind
    subprocess.Popen([sys.executable, "-c", WORKER])
    time.sleep(0.2)
    sys.exit(0)
if MODE == "flood":  # FLOOD_MB MiB of output as fast as the pipe takes it, then the summary
    chunk = (("x" * 127 + "\\n") * 512).encode()
    for _ in range(FLOOD_MB * 16):
        sys.stdout.buffer.write(chunk)
    sys.stdout.flush()
if MODE == "stray":  # files the run leaves behind, some under names git ignores or that look like autoloop's
    os.makedirs("ckpt", exist_ok=True)
    with open("ckpt/model.bin", "wb") as f:
        f.write(os.urandom(1 << 20) * 16)
    os.makedirs(".autoloop/soak", exist_ok=True)
    os.makedirs("__pycache__", exist_ok=True)
    for name, text in ((".gitignore", "*\\n"), ("results.tsv", "commit\\tval_bpb\\nabcdef0\\t0.1\\n"),
                       (".autoloop/soak/results.tsv", "stray\\n"), ("__pycache__/train.cpython-311.pyc", "junk"),
                       ("stray.txt", "left here\\n"), ("train.py.orig", "# stray\\n"), (".hidden", "x")):
        with open(name, "w") as f:
            f.write(text)
summary(float("nan") if MODE == "nan" else BPB)
'''


def fake_train(idea: int, mode: str, bpb: float, flood_mb: int) -> str:
    return (
        FAKE_TRAIN.replace("@IDEA@", str(idea))
        .replace("@MODE@", mode)
        .replace("@BPB@", repr(bpb))
        .replace("@FLOOD_MB@", str(flood_mb))
    )


def idea_for(seed: int, k: int) -> tuple[str, float]:
    """The mode and val_bpb of the idea proposed after k recorded experiments (the same on every resume)."""
    rng = random.Random(f"soak-{seed}-{k}")
    mode = rng.choices(list(MODES), weights=list(MODES.values()))[0]
    return mode, round(rng.uniform(0.9, 1.2), 6)


class SoakProposer(Proposer):
    """Writes the fake train.py with the mode drawn for len(history) (seeded by $AUTOLOOP_SOAK_SEED)."""

    name = "soak"

    def propose(self, workdir: Path, history: list) -> Proposal:
        k = len(history)
        mode, bpb = idea_for(int(os.environ.get("AUTOLOOP_SOAK_SEED", "0")), k)
        (workdir / "train.py").write_text(
            fake_train(k, mode, bpb, int(os.environ.get("AUTOLOOP_SOAK_FLOOD_MB", "1024")))
        )
        return Proposal(f"idea {k}: {mode}", info={"soak_idea": k, "soak_mode": mode})


# ---------------------------------------------------------------------------------------------- the harness


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "train.py").write_text(fake_train(0, "ok", 1.0, 0))
    (path / "prepare.py").write_text(PREPARE)
    for cmd in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "config", "user.name", "soak"],
        ["git", "config", "user.email", "soak@example.com"],
        ["git", "add", "-A"],
        ["git", "commit", "-qm", "init"],
    ):
        subprocess.run(cmd, cwd=path, check=True)
    return path


def become_subreaper() -> bool:
    """Orphans of a killed controller are re-parented to this process (Linux prctl PR_SET_CHILD_SUBREAPER)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def disk_usage(path: Path) -> int:
    """Bytes on disk under path (du: allocated blocks, each inode once)."""
    seen, total = set(), 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def count_rows(ledger: Path) -> int:
    try:
        return max(0, ledger.read_bytes().count(b"\n") - 1)
    except OSError:
        return 0


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass
class Controller:
    """One `autoloop run` process and what was seen of it."""

    index: int
    pid: int
    rows_start: int
    rows_end: int = 0
    rss_first: int = 0  # resident memory once it recorded its first row
    rss_last: int = 0
    rss_peak: int = 0
    ended: str = ""  # "SIGKILL at row r, while <phase>" or "exit <code>"
    wall: float = 0.0
    log: Path | None = None
    orphaned: list[str] = field(default_factory=list)  # processes of its runs alive when it was SIGKILLed


class Soak:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.repo = make_repo(work / "repo")
        self.state = self.repo / ".autoloop" / TAG
        self.ledger = self.state / "results.tsv"
        self.marker = uuid.uuid4().hex
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (create time, command) of every process of the runs
        self.controllers: list[Controller] = []
        self.disk_start = 0
        self.rng = random.Random(f"kills-{args.seed}")
        self.ours = psutil.Process()
        self.left: list[int] = []  # processes of the runs found alive at the end (killed after the report)

    def command(self) -> list[str]:
        a = self.args
        return [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--repo",
            str(self.repo),
            "--tag",
            TAG,
            "--budget",
            "1",
            "--timeout",
            f"{a.timeout:g}",
            "--baseline-repeats",
            "0",
            "--max-experiments",
            str(a.experiments),
            "--max-crashes",
            "1000",
            "--max-log-mb",
            f"{a.max_log_mb:g}",
            "--proposer",
            "soak:SoakProposer",
            "--workers",
            str(a.workers),
            "--gpus",
            "",
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ, AUTOLOOP_SOAK_SEED=str(self.args.seed), AUTOLOOP_SOAK_FLOOD_MB=str(self.args.flood_mb))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env[MARKER] = self.marker
        for key in [
            k
            for k in env
            if k.startswith("AUTOLOOP_") and k not in (MARKER, "AUTOLOOP_SOAK_SEED", "AUTOLOOP_SOAK_FLOOD_MB")
        ]:
            del env[key]  # the command line alone says how the loop runs
        return env

    def status(self) -> dict:
        try:
            return json.loads((self.state / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def note(self, proc: psutil.Process) -> None:
        try:
            self.seen.setdefault(proc.pid, (proc.create_time(), " ".join(proc.cmdline())[:120]))
        except psutil.Error:
            pass

    def sample(self, ctl: Controller, handle: psutil.Process | None) -> None:
        """RSS of the controller, every process in its tree, and the orphans re-parented here (reaped)."""
        if handle is not None:
            try:
                rss = handle.memory_info().rss  # 0 once it has exited (a zombie until waited for)
                if rss:
                    ctl.rss_last, ctl.rss_peak = rss, max(ctl.rss_peak, rss)
                if rss and not ctl.rss_first and count_rows(self.ledger) > ctl.rows_start:
                    ctl.rss_first = rss
                for child in handle.children(recursive=True):
                    self.note(child)
            except psutil.Error:
                pass
        for child in self.ours.children(recursive=True):
            if child.pid == ctl.pid:
                continue
            self.note(child)
            try:
                if child.ppid() == self.ours.pid and child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)  # an orphan re-parented here: reap it, as init would
            except (psutil.Error, ChildProcessError):
                pass

    def marked(self) -> dict[int, str]:
        """Live processes (not zombies) that carry this soak's marker, or work inside its repository."""
        found = {}
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.pid == self.ours.pid:
                continue
            try:
                if (
                    p.environ().get(MARKER) == self.marker or str(self.repo) in (p.cwd() or "")
                ) and p.status() != psutil.STATUS_ZOMBIE:
                    self.note(p)
                    found[p.pid] = " ".join(p.info["cmdline"] or [])[:100]
            except psutil.Error:
                pass
        return found

    def run_controller(self, kill_at: int | None) -> Controller:
        """Start `autoloop run`; SIGKILL it at a random moment once `kill_at` rows exist (None: let it finish)."""
        index = len(self.controllers) + 1
        log = self.work / f"controller-{index}.log"
        t0 = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.command(),
                cwd=ROOT,
                env=self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        ctl = Controller(index, proc.pid, count_rows(self.ledger), log=log)
        self.controllers.append(ctl)
        try:
            handle = psutil.Process(proc.pid)
        except psutil.Error:
            handle = None
        fire_at = None
        deadline = time.monotonic() + self.args.max_minutes * 60
        while proc.poll() is None:
            self.sample(ctl, handle)
            rows = count_rows(self.ledger)
            if not self.disk_start and rows >= 1:
                self.disk_start = disk_usage(self.repo / ".autoloop")
            if kill_at is not None and fire_at is None and rows >= kill_at:
                fire_at = time.monotonic() + self.rng.uniform(0.0, self.args.kill_window)
            if fire_at is not None and (time.monotonic() >= fire_at or rows >= kill_at + KILL_DRIFT_ROWS):
                phase = self.status().get("phase", "?")
                self.sample(ctl, handle)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                ctl.orphaned = [f"{pid} {cmd}" for pid, cmd in self.marked().items()]  # the resume must end them
                ctl.ended = f"SIGKILL at row {count_rows(self.ledger)}, while {phase}"
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                ctl.ended = f"killed: still running after --max-minutes {self.args.max_minutes:g}"
                break
            time.sleep(0.03)
        else:
            ctl.ended = f"exit {proc.returncode}"
        ctl.rows_end, ctl.wall = count_rows(self.ledger), time.monotonic() - t0
        self.sample(ctl, None)
        return ctl

    def run(self) -> None:
        n, kills = self.args.experiments, self.args.kills
        points = (
            sorted(
                {
                    min(n - 1, max(1, round(n * f) + self.rng.randint(-2, 2)))
                    for f in [0.2 + 0.5 * i / max(1, kills - 1) for i in range(kills)]
                }
            )
            if n > 1
            else []
        )
        for point in points[:kills]:
            ctl = self.run_controller(point)
            if not ctl.ended.startswith("SIGKILL"):
                return
        for _ in range(3):  # the last one runs to the end (an unexpected exit is resumed, and reported)
            ctl = self.run_controller(None)
            if ctl.ended == "exit 0" or ctl.ended.startswith("killed") or count_rows(self.ledger) >= n:
                return

    # ------------------------------------------------------------------------------------------ the verdict

    def leftovers(self) -> tuple[list[str], int]:
        """Processes of the runs still alive (and zombies, counted apart), after a short grace."""
        deadline = time.monotonic() + 5.0
        while True:
            for child in self.ours.children():
                try:
                    if child.status() == psutil.STATUS_ZOMBIE:
                        os.waitpid(child.pid, os.WNOHANG)
                except (psutil.Error, ChildProcessError):
                    pass
            alive, zombies = {}, 0
            for pid, (created, cmd) in self.seen.items():
                try:
                    p = psutil.Process(pid)
                    if abs(p.create_time() - created) < 0.01:
                        if p.status() == psutil.STATUS_ZOMBIE:
                            zombies += 1
                        else:
                            alive[pid] = cmd
                except psutil.Error:
                    pass
            for pid, cmd in self.marked().items():
                alive.setdefault(pid, cmd)
            for child in self.ours.children(recursive=True):
                try:
                    if child.status() != psutil.STATUS_ZOMBIE:
                        alive.setdefault(child.pid, " ".join(child.cmdline())[:120])
                except psutil.Error:
                    pass
            if not alive or time.monotonic() > deadline:
                self.left = sorted(alive)
                return [f"{pid} {cmd}" for pid, cmd in sorted(alive.items())], zombies
            time.sleep(0.2)

    def verdict(self) -> dict:
        from orchestrator.core.state import load_state
        from orchestrator.store.ledger import read_record
        from orchestrator.store.session import Paths

        n = self.args.experiments
        paths = Paths(self.repo, TAG)
        lines = self.ledger.read_text(errors="replace").splitlines()[1:] if self.ledger.exists() else []
        rows = [line.split("\t") for line in lines if line.strip()]
        problems: list[str] = []
        lost = 0
        for i in range(1, n + 1):
            record = read_record(paths.run_dir(i))
            row = rows[i - 1] if i <= len(rows) else None
            if (
                row is None
                or record is None
                or record.n != i
                or not record.commit.startswith(row[0])
                or record.status != row[4]
            ):
                lost += 1
                problems.append(
                    f"experiment {i}: row {row[:1] + row[4:5] if row else None}, record "
                    f"{(record.n, record.commit[:7], record.status) if record else None}"
                )
        records = [r for r in (read_record(paths.run_dir(i)) for i in range(1, len(rows) + 1)) if r]
        commits = [row[0] for row in rows]
        ideas = [r.info.get("soak_idea") for r in records if "soak_idea" in r.info and r.n == (r.group or r.n)]
        duplicated = max(0, len(rows) - n) + (len(commits) - len(set(commits))) + (len(ideas) - len(set(ideas)))
        if duplicated:
            problems.append(
                f"{len(rows)} rows for {n} experiments; {len(commits) - len(set(commits))} repeated "
                f"commits; {len(ideas) - len(set(ideas))} ideas recorded twice"
            )
        misjudged = []
        by_mode: dict[str, dict[str, int]] = {}
        for r in records:
            mode = r.info.get("soak_mode", "ok")  # the baseline is the unmodified (ok) train.py
            by_mode.setdefault(mode, {}).setdefault(r.status, 0)
            by_mode[mode][r.status] += 1
            crashed = r.status == "crash"
            # printing 1 GiB takes seconds: past the hard timeout, or past the budget by the controller's clock
            slow = crashed and r.reason.startswith(("timeout", "budget exceeded"))
            if crashed != (mode in CRASHING) and not (mode == "flood" and slow):
                misjudged.append(f"#{r.n} {mode} -> {r.status} {r.reason}")
        state = load_state(paths)
        tip = subprocess.run(
            ["git", "rev-parse", f"autoloop/{TAG}"], cwd=self.repo, capture_output=True, text=True
        ).stdout.strip()
        refs_bad = 0
        for r in records:
            ref = subprocess.run(
                ["git", "rev-parse", "-q", "--verify", f"refs/autoloop/{TAG}/tried/{r.n}"],
                cwd=self.repo,
                capture_output=True,
                text=True,
            ).stdout.strip()
            refs_bad += ref != r.commit
        status = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "status", "--repo", str(self.repo), "--tag", TAG, "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        logs = [p for p in self.state.rglob("*.log")]
        biggest = max((p.stat().st_size for p in logs), default=0)
        tracebacks = [c.index for c in self.controllers if c.log and b"Traceback" in c.log.read_bytes()]
        unexpected = [
            f"controller {c.index}: {c.ended}"
            for c in self.controllers
            if not c.ended.startswith("SIGKILL") and c.ended != "exit 0"
        ]
        left, zombies = self.leftovers()
        return dict(
            rows=len(rows),
            lost=lost,
            duplicated=duplicated,
            left=left,
            zombies=zombies,
            misjudged=misjudged,
            by_mode=by_mode,
            problems=problems,
            branch_ok=tip == state.best_commit,
            best=state.best_commit,
            tip=tip,
            refs_bad=refs_bad,
            status_rc=status.returncode,
            status_err=status.stderr.strip()[-300:],
            biggest_log=biggest,
            logs=len(logs),
            tracebacks=tracebacks,
            unexpected=unexpected,
            incomplete=len(list((self.state / "incomplete").iterdir())) if (self.state / "incomplete").is_dir() else 0,
            disk_end=disk_usage(self.repo / ".autoloop"),
            git=disk_usage(self.repo / ".git"),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiments", type=int, default=100, help="experiments in the session (baseline included)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the modes and the kill moments")
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs of the controller along the way")
    ap.add_argument("--timeout", type=float, default=5.0, help="the loop's --timeout: a hang costs this (+5 s grace)")
    ap.add_argument("--flood-mb", type=int, default=1024, help="MiB a flooding run prints")
    ap.add_argument("--max-log-mb", type=float, default=8.0, help="the loop's --max-log-mb")
    ap.add_argument("--workers", type=int, default=1, help="the loop's --workers (CPU slots)")
    ap.add_argument(
        "--kill-window",
        type=float,
        default=12.0,
        help="a kill comes at a random moment up to this many seconds after its row count is reached "
        "(longer than a hang's timeout and kill grace, so any moment of any run can be hit)",
    )
    ap.add_argument("--max-minutes", type=float, default=30.0, help="give up on a controller running this long")
    ap.add_argument("--keep", action="store_true", help="keep the temporary repository (kept anyway on failure)")
    args = ap.parse_args()

    t0 = time.monotonic()
    subreaper = become_subreaper()
    work = Path(tempfile.mkdtemp(prefix="autoloop-soak-"))
    soak = Soak(args, work)
    try:
        soak.run()
    finally:
        for ctl in soak.controllers:  # never leave a controller of ours running (Ctrl-C on this script)
            try:
                psutil.Process(ctl.pid).kill()
            except psutil.Error:
                pass
    v = soak.verdict()
    wall = time.monotonic() - t0
    first, last = soak.controllers[0], soak.controllers[-1]
    failed = bool(
        v["lost"]
        or v["duplicated"]
        or v["left"]
        or v["misjudged"]
        or not v["branch_ok"]
        or v["tracebacks"]
        or v["unexpected"]
        or v["rows"] < args.experiments
    )

    print(
        f"soak: {args.experiments} experiments, seed {args.seed}, {len(soak.controllers)} controller "
        f"processes ({sum(c.ended.startswith('SIGKILL') for c in soak.controllers)} SIGKILLed), --timeout "
        f"{args.timeout:g}, flood {args.flood_mb} MiB, --max-log-mb {args.max_log_mb:g}, "
        f"subreaper {'on' if subreaper else 'off'}"
    )
    print(
        f"{'#':>3}  {'pid':>7}  {'rows':>9}  {'wall':>7}  {'RSS first':>10}  {'RSS peak':>10}  {'RSS last':>10}  "
        f"{'orphaned':>8}  ended"
    )
    for c in soak.controllers:
        print(
            f"{c.index:>3}  {c.pid:>7}  {c.rows_start:>3} -> {c.rows_end:<3}  {c.wall:>6.1f}s  "
            f"{mib(c.rss_first):>10}  {mib(c.rss_peak):>10}  {mib(c.rss_last):>10}  {len(c.orphaned):>8}  {c.ended}"
            + "".join(f"\n{'':>10}orphaned: {o}" for o in c.orphaned)
        )
    print(
        "modes -> statuses:  "
        + "; ".join(
            f"{mode} {', '.join(f'{s} {k}' for s, k in sorted(st.items()))}"
            for mode, st in sorted(v["by_mode"].items())
        )
    )
    figures = [
        ("rows", f"{v['rows']} of {args.experiments}"),
        ("rows lost", v["lost"]),
        ("rows duplicated", v["duplicated"]),
        ("processes left", f"{len(v['left'])} ({v['zombies']} zombies of the runs not yet reaped)"),
        ("misjudged runs", len(v["misjudged"])),
        ("branch at the best", "yes" if v["branch_ok"] else f"NO: tip {v['tip'][:7]}, best {v['best'][:7]}"),
        ("tried refs wrong", v["refs_bad"]),
        ("killed runs set aside", f"{v['incomplete']} (incomplete/)"),
        ("autoloop status", "ok" if v["status_rc"] == 0 else f"exit {v['status_rc']}: {v['status_err']}"),
        ("tracebacks", ", ".join(f"controller {i}" for i in v["tracebacks"]) or "none"),
        ("largest run log", f"{mib(v['biggest_log'])} of {v['logs']} logs (cap {args.max_log_mb:g} MiB)"),
        (
            "disk .autoloop",
            f"start {mib(soak.disk_start)} (after the baseline), end {mib(v['disk_end'])}; .git {mib(v['git'])}",
        ),
        (
            "controller RSS",
            f"start {mib(first.rss_first)} (first controller, first row), peak {mib(first.rss_peak)}; "
            f"end {mib(last.rss_last)} (last controller, last sample), peak {mib(last.rss_peak)}; "
            f"max {mib(max(c.rss_peak for c in soak.controllers))}",
        ),
        ("wall time", f"{wall:.0f}s"),
    ]
    for name, value in figures:
        print(f"{name + ':':<24}{value}")
    for line in v["problems"][:10] + v["misjudged"][:10] + v["left"][:10] + v["unexpected"]:
        print(f"  ! {line}")
    for pid in soak.left:  # counted and reported: now end them (they are this soak's)
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    if failed or args.keep:
        print(f"repository and controller logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
