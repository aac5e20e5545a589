"""The executor contract, as checks any executor must pass (tests/test_executors.py runs them on each)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from conftest import make_repo
from orchestrator.executors import Executor, Job, wait_any

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
    make_repo(path, {"hang.py": HANG, "show.py": SHOW, "prepare.py": "X = 1\n",
                     "tamper.py": "open('prepare.py', 'a').write('# changed\\n')\n"})
    return path


def job(repo: Path, out: Path, steps: list[list[str]], timeout: float = 60.0, **env: str) -> Job:
    return Job(steps=steps, logs=[f"step{i}.log" for i in range(len(steps))],
               env={**os.environ, "AUTOLOOP_OUT": "{out}", "AUTOLOOP_PIDS": str(out.parent / f"{out.name}.pids"),
                    **env},
               timeout_s=timeout, workdir=repo, out_dir=out, watch=("prepare.py",))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def check_steps_logs_outputs(ex: Executor, repo: Path, tmp: Path) -> None:
    """Steps run in order in the code's directory; logs and outputs come back; a failing step stops the rest."""
    out = tmp / "ok"
    result = ex.submit(job(repo, out, [["{python}", "show.py"], ["{python}", "-c", "print('second')"]]),
                       ex.slots[0]).result(timeout=120)
    assert result.ok and not result.infra_error and [s.exit_code for s in result.steps] == [0, 0]
    assert "visible" in (out / "step0.log").read_text() and (out / "step1.log").read_text() == "second\n"
    assert (out / "artifact.bin").read_bytes() == b"x" * 1000 and 0 <= result.ages["artifact.bin"] < 60
    assert result.device and result.node

    out = tmp / "fail"
    result = ex.submit(job(repo, out, [["{python}", "-c", "raise SystemExit(3)"], ["{python}", "show.py"]]),
                       ex.slots[0]).result(timeout=120)
    assert [s.exit_code for s in result.steps] == [3] and not result.ok and not result.infra_error


def check_watched_files(ex: Executor, repo: Path, tmp: Path) -> None:
    """A step that changes a watched file stops the job there, and says which file."""
    out = tmp / "tamper"
    result = ex.submit(job(repo, out, [["{python}", "tamper.py"], ["{python}", "show.py"]]),
                       ex.slots[0]).result(timeout=120)
    assert result.modified == ["prepare.py"] and len(result.steps) == 1


def check_own_gpus(ex: Executor, repo: Path, tmp: Path) -> list[str]:
    """Jobs running at once each see their own CUDA_VISIBLE_DEVICES; returns what they saw."""
    handles = [ex.submit(job(repo, tmp / f"gpu{s.index}", [["{python}", "show.py"]], AUTOLOOP_SLEEP="3"), s)
               for s in ex.slots]
    results = [h.result(timeout=120) for h in handles]
    assert all(r.ok for r in results), results
    seen = [(tmp / f"gpu{s.index}" / "step0.log").read_text().split(" ", 1)[1].strip() for s in ex.slots]
    assert len(set(seen)) == len(seen), seen
    return seen


def check_timeout_kills_tree(ex: Executor, repo: Path, tmp: Path) -> None:
    """A hung step is killed at the hard timeout, with its grandchildren; the job says it timed out."""
    out = tmp / "hang"
    t = time.monotonic()
    result = ex.submit(job(repo, out, [["{python}", "hang.py"], ["{python}", "show.py"]], timeout=4.0),
                       ex.slots[0]).result(timeout=120)
    assert result.steps[0].timed_out and len(result.steps) == 1 and not result.infra_error
    assert time.monotonic() - t < 60
    assert_dead(tmp / "hang.pids")


def assert_dead(pid_file: Path) -> None:
    pids = [int(p) for p in pid_file.read_text().split()]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), pids


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
