"""The real train.py: a CPU smoke run with the tiny profile, the summary contract, and a CUDA-only check."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT
from orchestrator.summary import SUMMARY_KEYS, parse_summary, val_bpb_of


def run_train(env: dict, budget: str = "2", timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(env, AUTOLOOP_TIME_BUDGET=budget)
    return subprocess.run([sys.executable, "train.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tiny_env):
    return run_train(tiny_env)


def test_smoke_run_prints_the_summary_contract(smoke):
    assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-2000:]
    block = smoke.stdout[smoke.stdout.rindex("\n---\n") + 5:].splitlines()
    keys = [line.split(":", 1)[0] for line in block]
    assert tuple(keys[:len(SUMMARY_KEYS)]) == SUMMARY_KEYS  # upstream's keys, spelling and order
    assert keys[len(SUMMARY_KEYS):][:2] == ["device", "memory_kind"]
    for line in block:  # `key:` padded to the value column at 18 characters, as upstream prints it
        assert re.match(r"^[a-zA-Z_]+: +", line).end() == 18, line
    metrics = parse_summary(smoke.stdout)
    assert re.search(r"^val_bpb:          \d+\.\d{6}$", smoke.stdout, re.M)
    assert 0.5 < val_bpb_of(metrics) < 10
    assert metrics["device"] == "cpu" and metrics["memory_kind"] == "rss"
    assert metrics["mfu_percent"] == 0.0  # unknown peak FLOPs on a CPU: 0.00, not a made-up number
    assert metrics["num_steps"] > 1 and metrics["depth"] == 2
    assert 2.0 <= metrics["training_seconds"] < 10


def test_smoke_run_reports_progress(smoke):
    assert re.search(r"^step \d{5} \(\d+\.\d%\) \| loss: \d+\.\d+", smoke.stdout, re.M)


def test_budget_and_seed_come_from_the_environment(tiny_env):
    out = subprocess.run([sys.executable, "-c", "import prepare; print(prepare.TIME_BUDGET, prepare.SEED)"],
                         cwd=ROOT, env=dict(tiny_env, AUTOLOOP_TIME_BUDGET="7", AUTOLOOP_SEED="3"),
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["7.0", "3"]


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_run_uses_bf16_and_reports_vram(tiny_env):
    env = dict(tiny_env)
    env.pop("AUTOLOOP_DEVICE")
    proc = run_train(env, budget="5", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    metrics = parse_summary(proc.stdout)
    assert metrics["device"] == "cuda" and metrics["memory_kind"] == "vram"
    assert metrics["peak_vram_mb"] > 0 and val_bpb_of(metrics) is not None
