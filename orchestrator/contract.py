"""Reusable contract tests for plugins, for their authors' own test suites:

- `check_proposer("name-or-module:Class", tmp_dir)` runs a real loop (a real git repo, a real subprocess per
  experiment) over a small fake train.py whose val_bpb is a smooth function of its constants, and asserts what
  every proposer must guarantee;
- `check_executor(executor, tmp_dir)` submits real jobs (steps, logs, outputs, a watched file, a hard timeout,
  cancel) and asserts what every executor must guarantee, process trees killed included.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from .executors import Executor, Job, wait_any
from .loop import Settings, run_loop
from .store.ledger import read_record, read_rows
from .store.session import Paths

FAKE_TRAIN = '''"""A fake train.py: val_bpb is a bowl over the constants; WIDTH >= 512 runs out of memory."""
import math

# ---------------------------------------------------------------------------
# Hyperparameters
# ---------------------------------------------------------------------------

LR = 0.04  # learning rate  [0.001, 1.0]
WIDTH = 128  # channels  [16, 1024]
DEPTH = 4  # layers  [1, 12]
WARMUP = 0.0  # share of the budget  [0.0, 0.5]
BETAS = (0.8, 0.95)
MODE = "a"  # {a, b, c}

# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------

if WIDTH >= 512:
    raise RuntimeError("CUDA out of memory (fake)")
bpb = (1.0 + 0.1 * math.log(LR / 0.01) ** 2 + 0.05 * math.log2(WIDTH / 256) ** 2 + 0.01 * (DEPTH - 6) ** 2
       + 0.2 * (WARMUP - 0.1) ** 2 + 0.3 * (BETAS[1] - 0.99) ** 2 + {"a": 0.02, "b": 0.0, "c": 0.05}[MODE])
print("---")
print(f"val_bpb:          {bpb:.6f}")
print("peak_vram_mb:     1024.0")
print("mfu_percent:      0.00")
'''


def make_git_repo(path: Path, files: dict[str, str]) -> Path:
    """A fresh git repository at path with `files` (relative name -> text) committed as the baseline."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "baseline"],
    ):
        subprocess.run(cmd, cwd=path, check=True)
    return path


def make_fake_repo(path: Path, train: str = FAKE_TRAIN) -> Path:
    return make_git_repo(path, {"train.py": train})


def train_sources(repo: Path, tag: str, n: int) -> list[str]:
    """train.py as each experiment ran it (from its tried ref)."""
    return [
        subprocess.run(
            ["git", "show", f"refs/autoloop/{tag}/tried/{i}:train.py"],
            cwd=repo,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for i in range(1, n + 1)
    ]


def check_proposer(
    proposer: str,
    tmp_dir: Path,
    experiments: int = 8,
    distinct: bool = True,
    setup: Callable[[Path], None] | None = None,
) -> list:
    """Run `experiments` experiments with the proposer; assert the contract; return the rows.

    - it proposes (the loop runs past the baseline) with one-line descriptions and no proposer errors;
    - it edits only train.py, and train.py still compiles (no crash row blames the edit);
    - with distinct=True, no two experiments ran the same train.py;
    - a fresh instance rebuilt from the same history (a resume) continues without repeating itself.
    """
    repo = make_fake_repo(tmp_dir / "contract-repo")
    if setup is not None:
        setup(repo)  # e.g. queue ideas for the queue proposer
    half = max(2, experiments // 2)
    for limit in (half, experiments):  # a restart half-way: a fresh proposer instance rebuilt from the history
        run_loop(
            Settings(
                repo=repo,
                tag="contract",
                budget=1,
                timeout=30,
                proposer=proposer,
                max_experiments=limit,
                baseline_repeats=0,
            ),
            echo=lambda line: None,
        )
    rows = read_rows(repo / "results.tsv")
    assert len(rows) > 1, f"{proposer} proposed nothing"
    for n, row in enumerate(rows, start=1):
        record = read_record(Paths(repo, "contract").run_dir(n))
        assert record is not None and "\n" not in record.description and record.description
        assert "proposer error" not in row.description, row.description
        assert "edited files other than train.py" not in row.description, row.description
        assert "does not compile" not in row.description, row.description
    if distinct:  # runs the gate asked for again (a candidate's repeats, the best's) are not the proposer's
        records = [read_record(Paths(repo, "contract").run_dir(n)) for n in range(1, len(rows) + 1)]
        sources = [
            s
            for s, r in zip(train_sources(repo, "contract", len(rows)), records)
            if r.n > 1 and (r.group or r.n) == r.n
        ]
        assert len(set(sources)) == len(sources), f"{proposer} repeated a configuration"
    return rows


# ---------------------------------------------------------------------------
# Executors
# ---------------------------------------------------------------------------

# A step that starts a grandchild (in its own process group, like a dataloader that called setsid would not;
# here plain), records its pid, prints what GPU it sees, then hangs.
HANG = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["AUTOLOOP_PIDS"], "w").write(f"{os.getpid()} {child.pid}")
print("visible", repr(os.environ.get("CUDA_VISIBLE_DEVICES")), flush=True)
time.sleep(600)
"""

SHOW = """
import os, time
print("visible", repr(os.environ.get("CUDA_VISIBLE_DEVICES")), flush=True)
open(os.path.join(os.environ["AUTOLOOP_OUT"], "artifact.bin"), "wb").write(b"x" * 1000)
time.sleep(float(os.environ.get("AUTOLOOP_SLEEP", "0")))
"""


def code_repo(path: Path) -> Path:
    return make_git_repo(
        path,
        {
            "hang.py": HANG,
            "show.py": SHOW,
            "prepare.py": "X = 1\n",
            "tamper.py": "open('prepare.py', 'a').write('# changed\\n')\n",
        },
    )


def job(repo: Path, out: Path, steps: list[list[str]], timeout: float = 60.0, **env: str) -> Job:
    return Job(
        steps=steps,
        logs=[f"step{i}.log" for i in range(len(steps))],
        env={**os.environ, "AUTOLOOP_OUT": "{out}", "AUTOLOOP_PIDS": str(out.parent / f"{out.name}.pids"), **env},
        timeout_s=timeout,
        workdir=repo,
        out_dir=out,
        watch=("prepare.py",),
    )


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def check_steps_logs_outputs(ex: Executor, repo: Path, tmp: Path) -> None:
    """Steps run in order in the code's directory; logs and outputs come back; a failing step stops the rest."""
    out = tmp / "ok"
    result = ex.submit(
        job(repo, out, [["{python}", "show.py"], ["{python}", "-c", "print('second')"]]), ex.slots[0]
    ).result(timeout=120)
    assert result.ok and not result.infra_error and [s.exit_code for s in result.steps] == [0, 0]
    assert "visible" in (out / "step0.log").read_text() and (out / "step1.log").read_text() == "second\n"
    assert (out / "artifact.bin").read_bytes() == b"x" * 1000 and 0 <= result.ages["artifact.bin"] < 60
    assert result.device and result.node

    out = tmp / "fail"
    result = ex.submit(
        job(repo, out, [["{python}", "-c", "raise SystemExit(3)"], ["{python}", "show.py"]]), ex.slots[0]
    ).result(timeout=120)
    assert [s.exit_code for s in result.steps] == [3] and not result.ok and not result.infra_error


def check_watched_files(ex: Executor, repo: Path, tmp: Path) -> None:
    """A step that changes a watched file stops the job there, and says which file."""
    out = tmp / "tamper"
    result = ex.submit(job(repo, out, [["{python}", "tamper.py"], ["{python}", "show.py"]]), ex.slots[0]).result(
        timeout=120
    )
    assert result.modified == ["prepare.py"] and len(result.steps) == 1


def check_own_gpus(ex: Executor, repo: Path, tmp: Path) -> list[str]:
    """Jobs running at once each see their own CUDA_VISIBLE_DEVICES; returns what they saw."""
    handles = [
        ex.submit(job(repo, tmp / f"gpu{s.index}", [["{python}", "show.py"]], AUTOLOOP_SLEEP="3"), s) for s in ex.slots
    ]
    results = [h.result(timeout=120) for h in handles]
    assert all(r.ok for r in results), results
    seen = [(tmp / f"gpu{s.index}" / "step0.log").read_text().split(" ", 1)[1].strip() for s in ex.slots]
    assert len(set(seen)) == len(seen), seen
    return seen


def check_timeout_kills_tree(ex: Executor, repo: Path, tmp: Path) -> None:
    """A hung step is killed at the hard timeout, with its grandchildren; the job says it timed out."""
    out = tmp / "hang"
    t = time.monotonic()
    result = ex.submit(
        job(repo, out, [["{python}", "hang.py"], ["{python}", "show.py"]], timeout=4.0), ex.slots[0]
    ).result(timeout=120)
    assert result.steps[0].timed_out and len(result.steps) == 1 and not result.infra_error
    assert time.monotonic() - t < 60
    assert_dead(tmp / "hang.pids")


def assert_dead(pid_file: Path) -> None:
    pids = [int(p) for p in pid_file.read_text().split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), pids


def check_cancel(ex: Executor, repo: Path, tmp: Path) -> None:
    """cancel() stops a running job and its whole tree; the result says interrupted."""
    handle = ex.submit(job(repo, tmp / "cancel", [["{python}", "hang.py"]], timeout=300.0), ex.slots[0])
    deadline = time.monotonic() + 60
    while not (tmp / "cancel.pids").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    handle.cancel()
    assert wait_any([handle], until=time.monotonic() + 60)
    result = handle.result(timeout=60)
    assert result.interrupted and not result.infra_error and not result.ok, result
    assert_dead(tmp / "cancel.pids")


def check_executor(ex: Executor, tmp: Path) -> None:
    """Every check an executor must pass (cancel only where a job can still be running after submit())."""
    tmp.mkdir(parents=True, exist_ok=True)
    repo = code_repo(tmp / "code")
    for check in (check_steps_logs_outputs, check_watched_files, check_timeout_kills_tree):
        check(ex, repo, tmp / check.__name__)
    if getattr(ex, "cancellable", True):
        check_cancel(ex, repo, tmp / "check_cancel")
