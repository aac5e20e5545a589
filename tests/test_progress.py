"""The live progress line: in place under a pseudo-terminal, plain lines when output is a pipe."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

from conftest import make_repo, subprocess_env

SLOW_TRAIN = """import time
for step in range(1, 8):
    print(f"step {step:05d} ({100 * step / 7:.1f}%) | loss: {5.0 - step / 10:.6f} | dt: 300ms", flush=True)
    time.sleep(0.4)
print("---")
print("val_bpb:          1.000000")
"""


def cmd(repo):
    return [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "run",
        "--repo",
        str(repo),
        "--tag",
        "p",
        "--budget",
        "3",
        "--max-experiments",
        "2",
        "--proposer",
        "perturb",
    ]


def test_progress_line_updates_in_place_on_a_terminal(tmp_path):
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": "# Hyperparameters\nLR = 0.1  # [0.01, 1.0]\n" + SLOW_TRAIN})
    leader, follower = os.openpty()
    proc = subprocess.Popen(cmd(repo), stdout=follower, stderr=follower, env=subprocess_env(), close_fds=True)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(leader)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "\r\x1b[K#1 training" in text  # rewritten in place
    assert re.search(r"#1 training \ds/3s \| step \d+ \(\d+%\) loss 4\.\d{4}", text)
    assert "| ETA " in text  # the session is bounded by --max-experiments
    assert "\r\x1b[K   1  " in text  # the live line is wiped before the experiment's row


def test_plain_progress_lines_without_a_terminal(tmp_path):
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": "# Hyperparameters\nLR = 0.1  # [0.01, 1.0]\n" + SLOW_TRAIN})
    proc = subprocess.run(
        cmd(repo), capture_output=True, text=True, timeout=120, env=subprocess_env(AUTOLOOP_PROGRESS_SECONDS="1")
    )
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout and "\x1b[" not in proc.stdout
    progress = [line for line in proc.stdout.splitlines() if line.startswith("#1 training")]
    assert progress and all("step" in line or "training 0s" in line or "training 1s" in line for line in progress)
