"""The gpu profile's path end to end on the CPU: the controller, the real train.py and prepare.py at sequence
2048 and vocabulary 8192, the gpu profile's evaluation sizing and the held-out check, with a shrunken model on
a small corpus made here. What differs on a GPU is the device, not the path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import CLOCK_SLACK, ROOT, make_repo

SHRINK = {
    "DEPTH": 1,
    "ASPECT_RATIO": 32,
    "HEAD_DIM": 32,
    "DEVICE_BATCH_SIZE": 1,
    "TOTAL_BATCH_SIZE": 2048,
    "FINAL_EVAL_BATCH_SIZE": 4,
}
# A hobbled baseline (learning rates / 100) that the queued idea restores: a sure improvement to keep.
HOBBLED = {"MATRIX_LR": ("0.04", "0.0004"), "EMBEDDING_LR": ("0.6", "0.006"), "UNEMBEDDING_LR": ("0.004", "0.00004")}


def small_train_py() -> str:
    source = (ROOT / "train.py").read_text()
    for name, value in SHRINK.items():
        source, n = re.subn(rf"^({name} = per_profile\(gpu=)[^,]+,", rf"\g<1>{value},", source, flags=re.M)
        assert n == 1, name
    for name, (normal, low) in HOBBLED.items():
        source, n = re.subn(rf"^{name} = {re.escape(normal)}(?=  #)", f"{name} = {low}", source, flags=re.M)
        assert n == 1, name
    return source


def make_corpus(path: Path, total_bytes: int = 3_000_000) -> None:
    """~3 MB of Python source cut into ~1.5 kB documents (many documents keep the split shares steady)."""
    path.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    size, i = 0, 0
    for source in sorted(stdlib.glob("*.py")):
        text = source.read_text(encoding="utf-8", errors="replace")
        for start in range(0, len(text), 1500):
            (path / f"doc{i:05d}.txt").write_text(text[start : start + 1500])
            size, i = size + len(text[start : start + 1500]), i + 1
        if size >= total_bytes:
            return


@pytest.mark.slow
def test_gpu_profile_path_end_to_end_on_cpu(tmp_path):
    corpus = tmp_path / "corpus"
    make_corpus(corpus)
    repo = tmp_path / "repo"
    make_repo(
        repo,
        {
            "train.py": small_train_py(),
            "prepare.py": (ROOT / "prepare.py").read_text(),
            "evaluate.py": (ROOT / "evaluate.py").read_text(),
            ".gitignore": "results.tsv\n",
        },
    )
    env = dict(os.environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_DEVICE="cpu", **CLOCK_SLACK)  # honest runs
    for key in ("AUTOLOOP_PROFILE", "AUTOLOOP_DATASET", "AUTOLOOP_BASELINE_REPEATS"):
        env.pop(key, None)

    def autoloop(*args):
        return subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args, "--repo", str(repo)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )

    sets = [arg for name, (normal, _) in HOBBLED.items() for arg in ("--set", f"{name}={normal}")]
    queued = autoloop("queue", "add", "restore the learning rates", *sets)
    assert queued.returncode == 0, queued.stdout + queued.stderr
    proc = autoloop(
        "run",
        "--profile",
        "gpu",
        "--dataset",
        str(corpus),
        "--budget",
        "4",
        "--tag",
        "gpu",
        "--proposer",
        "queue",
        "--gate",
        "strict",
        "--baseline-repeats",
        "0",
        "--max-experiments",
        "2",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out

    manifest = json.loads(next((tmp_path / "cache").glob("local-corpus-*/manifest-gpu.json")).read_text())
    constants = manifest["constants"]
    assert constants["MAX_SEQ_LEN"] == 2048 and constants["VOCAB_SIZE"] == 8192
    assert 2**15 <= constants["HOLDOUT_TOKENS"] <= constants["EVAL_TOKENS"] < 40 * 524288  # sized to the corpus

    rows = (repo / "results.tsv").read_text().splitlines()[1:]
    assert [row.split("\t")[4] for row in rows] == ["keep", "keep"], out  # baseline, then the restored LRs
    runs = repo / ".autoloop" / "gpu" / "runs"
    for n in (1, 2):
        record = json.loads((runs / str(n) / "record.json").read_text())
        metrics = record["metrics"]
        assert metrics["profile"] == "gpu" and metrics["device"] == "cpu"
        assert metrics["eval_tokens"] == constants["EVAL_TOKENS"]  # the harness scored the whole evaluation
        assert record["val_bpb"] == metrics["harness_val_bpb"] > 0
        log = (runs / str(n) / "run.log").read_text()
        assert "model exported for the autoloop harness" in log  # train.py did not evaluate a second time
        assert "eval_vram_mb" not in log

    holdout = json.loads((repo / ".autoloop" / "gpu" / "holdout.json").read_text())
    assert "error" not in holdout, holdout
    assert holdout["best"]["n"] == 2 and 0 < holdout["best"]["holdout_bpb"] < holdout["baseline"]["holdout_bpb"]
    assert "held-out check: baseline" in out
