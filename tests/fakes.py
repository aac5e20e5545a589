"""Small fake train.py variants that print the summary block, and a scripted proposer, for loop tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.proposers import Proposer

SUMMARY = """
print("---")
print(f"val_bpb:          {BPB:.6f}")
print("training_seconds: 0.1")
print("total_seconds:    0.2")
print("peak_vram_mb:     2048.0")
print("mfu_percent:      1.50")
print("total_tokens_M:   0.1")
print("num_steps:        3")
print("num_params_M:     0.1")
print("depth:            2")
"""


def orphan(code: str, *args: str) -> int:
    """A Python process that is not ours (another user's job): in a session of its own, its parent gone at once,
    so that it is no descendant of the controller (runner.others_now counts it as others' load); its pid."""
    started = subprocess.run(
        ["sh", "-c", 'setsid "$@" >/dev/null 2>&1 & echo $!', "sh", sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(started.stdout)


def ok(bpb: float = 1.0, sleep: float = 0.0) -> str:
    return (
        f'"""fake train.py"""\nimport time\n\n# Hyperparameters\nBPB = {bpb!r}  # [0.1, 10.0]\n'
        f'SLEEP = {sleep!r}  # [fixed]\n\ntime.sleep(SLEEP)\nprint("step 00001 | loss: 1.0")\n' + SUMMARY
    )


def crash() -> str:
    return 'print("step 1")\nraise RuntimeError("CUDA out of memory (fake)")\n'


def hang() -> str:
    return 'import time\nprint("hanging", flush=True)\ntime.sleep(3600)\n'


def nan() -> str:
    return 'BPB = float("nan")\n' + SUMMARY


def no_summary() -> str:
    return 'print("training finished but forgot the summary")\n'


def fake_then_real(bpb: float) -> str:
    """An early fake block that claims 0.1, then the real final block."""
    return 'print("---")\nprint("val_bpb: 0.100000")\nprint("step 2")\n' + f"BPB = {bpb!r}\n" + SUMMARY


def grandchild(pidfile: Path, then: str = "hang", ignore_term: bool = True) -> str:
    """Spawns a grandchild that ignores SIGTERM (or not), leaves the process group (its own session, as a server
    or a DataLoader worker that calls setsid) and writes its pid; then hangs or exits normally."""
    tail = "time.sleep(3600)" if then == "hang" else "BPB = 1.5\n" + SUMMARY
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_term else ""
    return f"""import subprocess, sys, time
code = "import signal, time; {ignore}time.sleep(3600)"
p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
open({str(pidfile)!r}, "w").write(str(p.pid))
time.sleep(0.3)
{tail}
"""


def modifies_prepare() -> str:
    return 'open("prepare.py", "a").write("\\nTAMPERED = True\\n")\nBPB = 0.5\n' + SUMMARY


def additive(counter: Path, a: int = 1, b: int = 1, c: int = 1, sleep: float = 0.0) -> str:
    """val_bpb = 2 + 0.3 A + 0 B + 0.2 C + noise: normal, sd 0.004, drawn from the run's number k (a counter in
    the file `counter`; seeded k + 200: run 3's draw is below run 2's), so a session and its verification replay
    alike. B does nothing. At a budget of 2 s or more A's effect is -0.1 and C's -0.4: a stack that turns A and C
    off helps at 1 s and hurts at 3 s."""
    return (
        f'"""fake train.py: additive effects"""\nimport os\nimport random\nimport time\nfrom pathlib import Path\n\n'
        f"A = {a}\nB = {b}\nC = {c}\n\ncounter = Path({str(counter)!r})\n"
        "k = int(counter.read_text()) if counter.exists() else 0\ncounter.write_text(str(k + 1))\n"
        'long = float(os.environ.get("AUTOLOOP_TIME_BUDGET", "1")) >= 2\n'
        f"time.sleep({sleep!r})\n"
        "noise = random.Random(k + 200).gauss(0, 0.004)\n"
        "BPB = 2.0 + (-0.1 if long else 0.3) * A + 0.0 * B + (-0.4 if long else 0.2) * C + noise\n"
        'print("step 00001 | loss: 1.0")\n' + SUMMARY
    )


class Scripted(Proposer):
    """Follows the plan in $AUTOLOOP_TEST_PLAN: a JSON list of steps {description, train, files, sleep}.

    The step is chosen by the number of finished experiments, so the plan replays identically on resume.
    """

    name = "scripted"

    def propose(self, workdir: Path, history: list) -> str | None:
        plan = json.loads(Path(os.environ["AUTOLOOP_TEST_PLAN"]).read_text())
        # one step per idea: baseline runs and re-runs of an earlier idea do not count
        index = sum(1 for r in history if (r.group or r.n) == r.n and not r.description.startswith("baseline"))
        if index >= len(plan):
            return None
        step = plan[index]
        if step.get("sleep"):
            time.sleep(step["sleep"])
        if step.get("raise"):
            raise ValueError(step["raise"])
        if "train" in step:
            (workdir / "train.py").write_text(step["train"])
        for rel, content in step.get("files", {}).items():
            (workdir / rel).write_text(content)
        return step["description"]


def write_plan(path: Path, steps: list[dict]) -> Path:
    path.write_text(json.dumps(steps))
    return path
