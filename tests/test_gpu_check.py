"""Fail loudly on an unusable GPU: nvidia-smi lists GPUs but torch (in the run's Python) cannot use CUDA.

The one fake is an executable `nvidia-smi` put first on PATH; torch, the harness query and the CLI run for real.
These tests need a torch without usable CUDA (the CI and dev machines here): on a CUDA machine they are skipped.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import fakes
import pytest
import torch
from conftest import ROOT, make_repo, subprocess_env

from orchestrator.executors.gpu import Driver, driver_problem, nvidia_smi, parse_header, parse_list, wheel_index
from orchestrator.store.ledger import read_rows
from orchestrator.store.session import Paths
from orchestrator.trust import harness

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
TORCH = torch.__version__.split("+")[0]
TORCH_STATE = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"

H100 = "NVIDIA H100 80GB HBM3"
HEADER = """Mon Nov 30 12:00:00 2025
+---------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver}             Driver Version: {driver}   CUDA Version: {cuda}     |
|-----------------------------------------+----------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |         Memory-Usage | GPU-Util  Compute M. |
|=========================================+======================+======================|
|   0  NVIDIA H100 80GB HBM3          On  | 00000000:18:00.0 Off |                    0 |
| N/A   31C    P0              71W / 700W |      4MiB / 81559MiB |      0%      Default |
+-----------------------------------------+----------------------+----------------------+
"""


def fake_nvidia_smi(bin_dir: Path, gpus=(H100,), driver="535.104.05", cuda="12.2", fail=False) -> Path:
    """An executable nvidia-smi answering `-L` and the plain call like the real one, or failing like a bad driver."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    listing = "".join(
        f"GPU {i}: {name} (UUID: GPU-{i:08x}-1b2c-3d4e-5f60-718293a4b5c6)\n" for i, name in enumerate(gpus)
    )
    broken = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    body = (
        f'echo "{broken}"\nexit 9\n'
        if fail
        else f'if [ "$1" = "-L" ]; then\ncat <<"EOF"\n{listing}EOF\nexit 0\nfi\n'
        f'cat <<"EOF"\n{HEADER.format(driver=driver, cuda=cuda)}EOF\n'
    )
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


def env_with(bin_dir: Path, **extra: str) -> dict[str, str]:
    env = subprocess_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **extra)
    for key in ("AUTOLOOP_DEVICE", "AUTOLOOP_PROFILE", "CUDA_VISIBLE_DEVICES", "RAY_ADDRESS", "AUTOLOOP_GPUS"):
        if key not in extra:
            env.pop(key, None)
    return env


def autoloop(repo: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "run",
            "--repo",
            str(repo),
            "--tag",
            "g",
            "--max-experiments",
            "1",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def trained_rows(repo: Path) -> list:
    ledger = Paths(repo, "g").ledger
    return read_rows(ledger) if ledger.exists() else []


@pytest.mark.parametrize(
    "cuda, index",
    [
        ((11, 4), None),
        ((11, 8), "cu118"),
        ((12, 0), "cu118"),
        ((12, 1), "cu121"),
        ((12, 2), "cu121"),
        ((12, 4), "cu124"),
        ((12, 5), "cu124"),
        ((12, 6), "cu126"),
        ((12, 7), "cu126"),
        ((12, 8), "cu128"),
        ((12, 9), "cu129"),
        ((13, 0), "cu130"),
        ((13, 2), "cu130"),
    ],
)
def test_wheel_index_is_the_newest_the_driver_runs(cuda, index):
    assert wheel_index(cuda) == index


def test_parse_real_nvidia_smi_output():
    listing = (
        f"GPU 0: {H100} (UUID: GPU-0e4f1c2a-aaaa-bbbb-cccc-0123456789ab)\n"
        "  MIG 3g.40gb     Device  0: (UUID: MIG-11111111-2222-3333-4444-555555555555)\n"
        "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-1e4f1c2a-aaaa-bbbb-cccc-0123456789ab)\n"
    )
    assert parse_list(listing) == [H100, "NVIDIA A100-SXM4-80GB"]
    assert parse_header(HEADER.format(driver="580.65.06", cuda="13.0")) == ("580.65.06", (13, 0))
    assert parse_header("garbage") == (None, None)


def test_nvidia_smi_present_absent_and_failing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'ok', gpus=(H100, H100))}{os.pathsep}{os.environ['PATH']}")
    assert nvidia_smi() == Driver((H100, H100), "535.104.05", (12, 2))
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'broken', fail=True)}{os.pathsep}{os.environ['PATH']}")
    assert nvidia_smi() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert nvidia_smi() is None


def test_message_for_a_cuda_build_newer_than_the_driver_and_for_a_fitting_one():
    driver = Driver(("NVIDIA A100-SXM4-80GB",) * 4, "535.104.05", (12, 2))
    too_new = driver_problem(driver, {"version": "2.13.0+cu128", "cuda": "12.8", "available": False}, "python", {})
    assert "4 x NVIDIA A100-SXM4-80GB" in too_new and "built for CUDA 12.8" in too_new
    assert "needs CUDA 12.8" in too_new and "CUDA up to 12.2" in too_new
    assert "python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu121" in too_new
    fitting = driver_problem(
        driver, {"version": "2.5.1+cu121", "cuda": "12.1", "available": False}, "python", {"CUDA_VISIBLE_DEVICES": "7"}
    )
    assert "pip install" not in fitting and "CUDA_VISIBLE_DEVICES='7'" in fitting
    missing = driver_problem(driver, {"error": "ModuleNotFoundError: No module named 'torch'"}, "python", {})
    assert "cannot be imported" in missing and "pip install torch --index-url" in missing


def test_query_reports_torch_without_a_torch_importing_prepare(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "prepare.py").write_text("TIME_BUDGET = 300\n")
    assert harness.query(plain, dict(os.environ)).torch is None  # not asked, prepare.py does not import torch
    asked = harness.query(plain, dict(os.environ), torch=True)
    assert asked.time_budget == 300 and asked.torch["version"] == torch.__version__
    assert asked.torch["cuda"] == torch.version.cuda and asked.torch["available"] == torch.cuda.is_available()
    bare = tmp_path / "bare"
    bare.mkdir()
    info = harness.query(bare, dict(os.environ), torch=True)  # no prepare.py at all
    assert info.manifest is None and info.profile is None and info.torch["version"] == torch.__version__


@no_cuda
@pytest.mark.parametrize(
    "driver, cuda, expect",
    [
        ("535.104.05", "12.2", f"pip install torch=={TORCH} --index-url https://download.pytorch.org/whl/cu121"),
        ("550.54.14", "12.4", f"pip install torch=={TORCH} --index-url https://download.pytorch.org/whl/cu124"),
        ("470.82.01", "11.4", "update the driver"),
    ],
)
def test_run_fails_loudly_on_a_gpu_torch_cannot_use(fake_repo, tmp_path, driver, cuda, expect):
    repo = fake_repo(fakes.ok(1.0))
    env = env_with(fake_nvidia_smi(tmp_path / "bin", driver=driver, cuda=cuda))
    proc = autoloop(repo, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert H100 in proc.stderr and f"driver: {driver}, which supports CUDA up to {cuda}" in proc.stderr
    assert f"torch:  {torch.__version__}, {TORCH_STATE}" in proc.stderr
    assert expect in proc.stderr and "AUTOLOOP_DEVICE=cpu" in proc.stderr
    if expect == "update the driver":
        assert "pip install" not in proc.stderr
    assert trained_rows(repo) == [] and not any(Paths(repo, "g").runs.iterdir())


@no_cuda
def test_the_check_runs_before_preparation_with_the_real_harness(tmp_path):
    """The project's prepare.py (which imports torch itself) on an 8-GPU box: no data prepared, no 8 workers."""
    repo = tmp_path / "proj"
    make_repo(
        repo, {name: (ROOT / name).read_text() for name in ("prepare.py", "evaluate.py", "train.py", ".gitignore")}
    )
    cache = tmp_path / "cache"
    env = env_with(fake_nvidia_smi(tmp_path / "bin", gpus=(H100,) * 8), AUTOLOOP_CACHE=str(cache))
    proc = autoloop(repo, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"8 x {H100}" in proc.stderr and "whl/cu121" in proc.stderr
    assert "preparing data" not in proc.stdout and not cache.exists() and trained_rows(repo) == []


@no_cuda
@pytest.mark.parametrize("how", ["option", "env"])
def test_gpu_profile_without_cuda_is_a_clear_error(fake_repo, tmp_path, how):
    repo = fake_repo(fakes.ok(1.0))
    bin_dir = fake_nvidia_smi(tmp_path / "bin", fail=True)  # no usable GPU listed, whatever this machine has
    env = env_with(bin_dir, **({"AUTOLOOP_PROFILE": "gpu"} if how == "env" else {}))
    proc = autoloop(repo, *(["--profile", "gpu"] if how == "option" else []), env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "gpu profile" in proc.stderr and "needs CUDA" in proc.stderr
    assert f"torch {torch.__version__}, {TORCH_STATE}" in proc.stderr
    assert "AUTOLOOP_DEVICE=cpu" in proc.stderr and trained_rows(repo) == []


@no_cuda
@pytest.mark.parametrize(
    "args, extra",
    [
        (["--profile", "gpu"], {"AUTOLOOP_DEVICE": "cpu"}),  # the gpu profile's harness on the CPU, on purpose
        ([], {"CUDA_VISIBLE_DEVICES": ""}),  # GPUs hidden: CPU slots on purpose
        (["--gpus", ""], {}),
    ],
)
def test_cpu_on_purpose_skips_the_check(fake_repo, tmp_path, args, extra):
    repo = fake_repo(fakes.ok(1.0))
    env = env_with(fake_nvidia_smi(tmp_path / "bin", driver="470.82.01", cuda="11.4"), **extra)
    proc = autoloop(repo, *args, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r.status for r in trained_rows(repo)] == ["keep"]
