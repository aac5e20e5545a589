"""The controller's view of the fixed harness (prepare.py): environment, preparation, integrity checks."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import LoopError
from .confine import allowed_env

_QUERY = """
import json, os, sys
info = {}
if os.path.exists("prepare.py"):
    import prepare
    info.update(manifest=str(getattr(prepare, "MANIFEST_PATH", "") or ""), profile=getattr(prepare, "PROFILE", None),
                time_budget=getattr(prepare, "TIME_BUDGET", None), artifacts=hasattr(prepare, "save_eval_artifact"),
                dataset=getattr(prepare, "DATASET", None), smoke_warning=getattr(prepare, "SMOKE_TEST_WARNING", None),
                vocab=getattr(prepare, "VOCAB_SIZE", None),
                cache=str(getattr(prepare, "CACHE_DIR", "") or ""), result_file=hasattr(prepare, "_write_result"),
                exported=hasattr(prepare, "load_exported") or os.path.exists("evaluate.py"),
                evaluator="evaluate.py" if os.path.exists("evaluate.py") and hasattr(prepare, "EVAL_ROWS")
                else "prepare.py" if hasattr(prepare, "load_exported") else "",
                export_line=getattr(prepare, "EXPORT_LINE", None))
    info["result_file"] = info["result_file"] or info["evaluator"] == "evaluate.py"
if "torch" in sys.argv[1:] or "torch" in sys.modules:  # torch's view of CUDA (free when prepare imported it)
    try:
        import torch
        info["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                         "hip": getattr(torch.version, "hip", None), "available": bool(torch.cuda.is_available()),
                         "devices": int(torch.cuda.device_count())}
    except Exception as e:
        info["torch"] = {"error": f"{type(e).__name__}: {e}"}
print("AUTOLOOP_HARNESS " + json.dumps(info))
"""


@dataclass
class HarnessInfo:
    manifest: Path | None  # None for harnesses without one (e.g. upstream autoresearch)
    profile: str | None
    time_budget: float | None
    artifacts: bool = False  # prepare.py saves the model for the controller's own evaluation
    torch: dict | None = None  # the run's torch: version, cuda, hip, available, devices (or error); None: not asked
    dataset: str | None = None  # the data prepare.py uses (its default depends on the profile)
    smoke_warning: str | None = None  # what prepare.py says of a corpus too small for the profile
    cache: str = ""  # where prepare.py keeps its data (CACHE_DIR), as resolved with the controller's HOME
    result_file: bool = False  # `prepare.py --evaluate --result FILE` (older ones print the result instead)
    vocab: int | None = None  # the tokenizer's vocabulary (VOCAB_SIZE), for size estimates
    exported: bool = False  # the evaluation scores an exported graph and never runs train.py's code (protected)
    export_line: str | None = None  # what train.py prints as the export begins: the evaluation may start then
    evaluator: str = ""  # the file that scores the exported graph: evaluate.py, or (older harnesses) prepare.py


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run_env(
    budget: float,
    seed: int,
    profile: str | None,
    dataset: str | None,
    cache: str | None,
    pass_env: tuple[str, ...] = (),
) -> dict[str, str]:
    """The environment every harness and training process gets: the allow-listed part of ours (no secrets;
    confine.py) and `pass_env`, then budget, seed, cache, data, profile."""
    env = allowed_env(pass_env=pass_env)
    env.update(AUTOLOOP_TIME_BUDGET=f"{budget:g}", AUTOLOOP_SEED=str(seed), PYTHONUNBUFFERED="1")
    for key, value in (("AUTOLOOP_PROFILE", profile), ("AUTOLOOP_DATASET", dataset), ("AUTOLOOP_CACHE", cache)):
        if value:
            env[key] = value
    return env


def query(workdir: Path, env: dict[str, str], torch: bool = False) -> HarnessInfo:
    """Ask prepare.py (in a subprocess, as train.py will see it) where its manifest lives; torch: also torch's view
    of CUDA (reported anyway when prepare.py imports torch)."""
    if not (workdir / "prepare.py").exists() and not torch:
        return HarnessInfo(None, None, None, False)
    proc = subprocess.run(
        [sys.executable, "-c", _QUERY, *(["torch"] if torch else [])],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("AUTOLOOP_HARNESS ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise LoopError(
            "prepare.py could not be imported with this Python "
            f"({sys.executable}): {' | '.join(tail)}. Install the project (pip install -e .) "
            "or fix prepare.py"
        )
    data = json.loads(line.split(" ", 1)[1])
    return HarnessInfo(
        Path(data["manifest"]) if data.get("manifest") else None,
        data.get("profile"),
        data.get("time_budget"),
        bool(data.get("artifacts")),
        data.get("torch"),
        data.get("dataset"),
        data.get("smoke_warning"),
        data.get("cache") or "",
        bool(data.get("result_file")),
        data.get("vocab") if isinstance(data.get("vocab"), int) else None,
        bool(data.get("exported")),
        data.get("export_line") if isinstance(data.get("export_line"), str) else None,
        data.get("evaluator") if data.get("evaluator") in ("evaluate.py", "prepare.py") else "",
    )


def manifest_digest(manifest_path: Path) -> str:
    """prepare.py's manifest_digest: everything in the manifest but when it was written ('' without one)."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return ""
    return hashlib.sha256(
        json.dumps({k: v for k, v in manifest.items() if k != "created"}, sort_keys=True).encode()
    ).hexdigest()


def scored_on_readable_sources(manifest_path: Path) -> bool:
    """An offline corpus (the machine's own Python files) prepared without test suites to score on: the run can
    read the sources of its validation split (prepare.py: held_out_of_reach)."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("dataset") in ("pystdlib", "pypackages") and not manifest.get("hidden_sources")


def verify(manifest_path: Path, prepare_py: Path | None = None) -> list[str]:
    """Problems of the prepared files against the manifest (controller-side hashing); [] when all match.
    With prepare_py: also whether that prepare.py is the one that prepared them (an older one sized the data
    differently)."""
    if not manifest_path.exists():
        return [f"no manifest at {manifest_path}"]
    try:
        manifest = json.loads(manifest_path.read_text())
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return [f"unreadable manifest {manifest_path}"]
    root = manifest_path.parent
    problems = []
    if prepare_py is not None and prepare_py.exists() and manifest.get("prepare_sha256") != sha256_file(prepare_py):
        problems.append("the data was prepared by another prepare.py")
    for rel, digest in sorted(files.items()):
        path = root / rel
        if not path.exists():
            problems.append(f"missing prepared file {rel}")
        elif sha256_file(path) != digest:
            problems.append(f"prepared file {rel} changed")
    return problems


def prepare(workdir: Path, env: dict[str, str], echo=print, force: bool = False) -> None:
    """Run `python prepare.py` (`--force`: from scratch), streaming its progress to the console."""
    echo(
        "autoloop: preparing data again (a run changed it) ..."
        if force
        else "autoloop: preparing data (first run only) ..."
    )
    proc = subprocess.Popen(
        [sys.executable, "prepare.py", *(["--force"] if force else [])],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tail: list[str] = []
    try:
        for line in proc.stdout or ():
            echo("  " + line.rstrip())
            tail = (tail + [line.rstrip()])[-5:]
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the downloads too (they resume on the next run)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        raise
    if proc.wait() != 0:
        raise LoopError(f"prepare.py failed (exit {proc.returncode}): {' | '.join(tail)}")


def evaluation_data(manifest: Path | None) -> tuple[str, ...]:
    """The validation and held-out files of the prepared data, and the directories of an offline corpus's sources
    they were made from (the sandbox hides them from the training step)."""
    if manifest is None:
        return ()  # a harness without a manifest (upstream's): nothing known to hide
    try:
        recorded = json.loads(manifest.read_text())
        splits = recorded["splits"]
        files = tuple(str(manifest.parent / "data" / rel) for key in ("val", "holdout") for rel in splits[key])
        return files + tuple(str(path) for path in recorded.get("hidden_sources", ()) if os.path.isabs(str(path)))
    except (AttributeError, OSError, ValueError, KeyError, TypeError):
        return ()  # a harness without a manifest (upstream's): nothing known to hide
