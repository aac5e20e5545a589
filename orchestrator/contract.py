"""A reusable contract test for proposers: `check_proposer("name-or-module:Class", tmp_dir)`.

It runs a real loop (a real git repo, a real subprocess per experiment) over a small fake train.py whose
val_bpb is a smooth function of its constants, and asserts what every proposer must guarantee. Third-party
proposers call it from their own test suite.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

from .ledger import read_record, read_rows
from .loop import Settings, run_loop
from .session import Paths

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
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "baseline"]):
        subprocess.run(cmd, cwd=path, check=True)
    return path


def make_fake_repo(path: Path, train: str = FAKE_TRAIN) -> Path:
    return make_git_repo(path, {"train.py": train})


def train_sources(repo: Path, tag: str, n: int) -> list[str]:
    """train.py as each experiment ran it (from its tried ref)."""
    return [subprocess.run(["git", "show", f"refs/autoloop/{tag}/tried/{i}:train.py"], cwd=repo, check=True,
                           capture_output=True, text=True).stdout for i in range(1, n + 1)]


def check_proposer(proposer: str, tmp_dir: Path, experiments: int = 8, distinct: bool = True,
                   setup: Callable[[Path], None] | None = None) -> list:
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
        run_loop(Settings(repo=repo, tag="contract", budget=1, timeout=30, proposer=proposer, max_experiments=limit,
                          baseline_repeats=0), echo=lambda line: None)
    rows = read_rows(repo / "results.tsv")
    assert len(rows) > 1, f"{proposer} proposed nothing"
    for n, row in enumerate(rows, start=1):
        record = read_record(Paths(repo, "contract").run_dir(n))
        assert record is not None and "\n" not in record.description and record.description
        assert "proposer error" not in row.description, row.description
        assert "edited files other than train.py" not in row.description, row.description
        assert "does not compile" not in row.description, row.description
    if distinct:
        sources = train_sources(repo, "contract", len(rows))[1:]
        assert len(set(sources)) == len(sources), f"{proposer} repeated a configuration"
    return rows
