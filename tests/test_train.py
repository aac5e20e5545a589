"""The real train.py: a CPU smoke run with the tiny profile, the summary contract, peak FLOP/s by device name,
the torch.compile fallback, a run whose evaluation happens elsewhere, and a CUDA-only check."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from orchestrator.core.progress import parse_curve
from orchestrator.trust.summary import SUMMARY_KEYS, parse_summary, val_bpb_of


def run_train(
    env: dict, budget: str = "2", timeout: float = 120, args: tuple = ("train.py",)
) -> subprocess.CompletedProcess:
    env = dict(env, AUTOLOOP_TIME_BUDGET=budget)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def summary_lines(stdout: str) -> list[str]:
    return stdout[stdout.rindex("\n---\n") + 5 :].splitlines()


@pytest.fixture(scope="module")
def smoke(tiny_env):
    return run_train(tiny_env)


@pytest.mark.slow
def test_smoke_run_prints_the_summary_contract(smoke):
    assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-2000:]
    block = summary_lines(smoke.stdout)
    keys = [line.split(":", 1)[0] for line in block]
    assert tuple(keys[: len(SUMMARY_KEYS)]) == SUMMARY_KEYS  # upstream's keys, spelling and order
    assert keys[len(SUMMARY_KEYS) :] == [
        "device",
        "memory_kind",
        "dtype",
        "profile",
        "peak_tflops",
        "peak_source",
        "planned_steps",
        "eval_vram_mb",
    ]
    for line, key in zip(block, keys):  # `key:` padded to the value column at 18 characters, as upstream prints
        assert line.startswith(f"{key}:") and re.match(r"^[a-zA-Z_]+: +", line).end() == 18, line
    metrics = parse_summary(smoke.stdout)
    assert re.search(r"^val_bpb:          \d+\.\d{6}$", smoke.stdout, re.M)
    assert 0.5 < val_bpb_of(metrics) < 10
    assert metrics["device"] == "cpu" and metrics["memory_kind"] == "rss"
    # A CPU has no datasheet row: its peak is measured with matmuls in the run's dtype, so MFU is real.
    assert metrics["peak_source"] == "measured" and metrics["peak_tflops"] > 0
    assert 0 < metrics["mfu_percent"] < 100
    # The training peak is taken before evaluation; the overall peak (rss only grows) after it.
    assert 0 < metrics["peak_vram_mb"] <= metrics["eval_vram_mb"]
    assert metrics["num_steps"] > 1 and metrics["depth"] == 2
    assert 1.5 <= metrics["training_seconds"] < 10  # the planned steps fill the 2 s budget, give or take a step


@pytest.mark.slow
def test_smoke_run_reports_progress(smoke):
    assert re.search(r"^step \d{5} \(\d+\.\d%\) \| loss: \d+\.\d+", smoke.stdout, re.M)


@pytest.mark.slow
def test_smoke_run_prints_progress_at_each_twentieth_of_its_planned_steps(smoke):
    """Besides a line a second, one at (the last step at or before) each 5% of the planned steps: a run of
    seconds has a loss curve in its record too (orchestrator/core/progress.py: parse_curve)."""
    schedule = re.search(r"^schedule: (\d+) steps", smoke.stdout, re.M)
    if schedule is None:  # the 2 s budget ran out within its first 4 steps: nothing was planned
        assert "planned_steps:    0" in smoke.stdout, smoke.stdout[-3000:]
        pytest.skip("the smoke run never planned its steps (a starved machine)")
    planned = int(schedule.group(1))
    after = smoke.stdout[smoke.stdout.index("\nschedule: ") :]
    pcts = [float(p) for p in re.findall(r"^step \d{5} \((\d+\.\d)%\) \| loss: \d+\.\d{6} ", after, re.M)]
    assert pcts and pcts == sorted(pcts), pcts
    # each multiple of 5% the run went past has a line at most a step before it (on a starved machine the 2 s run
    # may plan only a few steps: then there are few multiples to check)
    for point in range(5, 101, 5):
        if pcts[0] <= point <= pcts[-1]:
            assert any(point - 100 / planned - 0.05 <= p <= point for p in pcts), (point, planned, pcts)
    assert parse_curve(smoke.stdout)


def test_the_progress_lines_fall_on_the_last_step_at_or_before_each_twentieth(tiny_env):
    """Which steps print a line besides the one-a-second ones: for any number of planned steps, exactly the last
    step at or before each multiple of 5% of them (a multiple it lands on exactly included)."""
    code = """
import json, train
print(json.dumps({p: [k for k in range(p + 1) if train.last_step_before_point(k, p)] for p in range(1, 400)}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=tiny_env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for planned, steps in json.loads(proc.stdout).items():
        assert steps == sorted({m * int(planned) // 20 for m in range(21)}), planned


SXM, PCIE, NVL = (989e12, 494.7e12, 66.9e12), (756e12, 378e12, 51.2e12), (835e12, 417.5e12, 60e12)
A100 = (312e12, 156e12, 19.5e12)
UNKNOWN = (None, None, None)
PEAKS = {  # device name -> dense peak FLOP/s for (bf16, tf32, fp32), from the vendors' datasheets
    "NVIDIA H100 80GB HBM3": SXM,
    "NVIDIA H200": SXM,
    "NVIDIA H800": SXM,
    "NVIDIA H100 PCIe": PCIE,
    "NVIDIA H800 PCIe": PCIE,
    "NVIDIA H100 NVL": NVL,
    "NVIDIA H200 NVL": NVL,
    "NVIDIA A100-SXM4-80GB": A100,
    "NVIDIA A100-SXM4-40GB": A100,
    "NVIDIA A100 80GB PCIe": A100,
    "NVIDIA A100-PCIE-40GB": A100,
    "NVIDIA A800-SXM4-80GB": A100,
    "NVIDIA A800 80GB PCIe": A100,
    "NVIDIA L40S": (362e12, 183e12, 91.6e12),
    "NVIDIA L40": (181e12, 90.5e12, 90.5e12),
    "NVIDIA L4": (121e12, 60e12, 30.3e12),
    "NVIDIA A10G": (70e12, 35e12, 31.2e12),
    "NVIDIA A10": (125e12, 62.5e12, 31.2e12),
    "NVIDIA GeForce RTX 5090": (209.5e12, 104.8e12, 104.8e12),
    "NVIDIA GeForce RTX 4090": (165.2e12, 82.6e12, 82.6e12),
    "NVIDIA GeForce RTX 3090": (71e12, 35.6e12, 35.6e12),
    "NVIDIA RTX A6000": (154.8e12, 77.4e12, 38.7e12),
    "NVIDIA RTX A5000": (111.1e12, 55.6e12, 27.8e12),
    "NVIDIA RTX 6000 Ada Generation": (364.2e12, 182.1e12, 91.1e12),
    "Tesla V100-SXM2-16GB": (None, 15.7e12, 15.7e12),
    "Tesla T4": (None, 8.1e12, 8.1e12),  # no bf16, no TF32
    "AMD Instinct MI300X": (1307.4e12, 653.7e12, 163.4e12),
    "AMD Instinct MI250X": (191.5e12, 47.9e12, 47.9e12),
    "NVIDIA B200": (2.25e15, 1.125e15, 75e12),
    "NVIDIA GB200": (2.5e15, 1.25e15, 80e12),
    # Near misses get no row (a measured peak instead): substrings of listed names, other variants, MIG slices.
    "NVIDIA RTX A1000": UNKNOWN,
    "NVIDIA H20": UNKNOWN,
    "NVIDIA A100-SXM4-40GB MIG 1g.5gb": UNKNOWN,
    "NVIDIA GeForce RTX 4090 Laptop GPU": UNKNOWN,
    "Quadro RTX 6000": UNKNOWN,
    "NVIDIA RTX A4000": UNKNOWN,
    "NVIDIA GeForce RTX 3090 Ti": UNKNOWN,
    "NVIDIA H100 80GB HBM3 MIG 1g.10gb": UNKNOWN,
    "Apple M2": UNKNOWN,
    "": UNKNOWN,
}


def test_peak_flops_by_exact_device_name_and_precision(tiny_env):
    code = """
import json, sys, torch, train
table = {n: [train.table_peak_flops(n, p) for p in ('bf16', 'tf32', 'fp32')] for n in json.load(sys.stdin)}
torch.cuda.get_device_name = lambda device: 'NVIDIA H100 80GB HBM3'  # a pretend CUDA device: the run's precision
runs = []
for dtype, tf32 in [(torch.bfloat16, True), (torch.float32, True), (torch.float32, False)]:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    runs.append(train.peak_flops(torch.device('cuda'), dtype))
print(json.dumps({'table': table, 'runs': runs}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=tiny_env,
        input=json.dumps(list(PEAKS)),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    wrong = {name: got["table"][name] for name, peaks in PEAKS.items() if tuple(got["table"][name]) != peaks}
    assert not wrong
    assert got["runs"] == [[989e12, "table"], [494.7e12, "table"], [66.9e12, "table"]]  # bf16, TF32, plain fp32


@pytest.mark.slow
def test_compile_failure_falls_back_to_eager(tiny_env, tmp_path):
    # A C++ compiler that does not exist: inductor fails at the first forward, as it would on a machine without
    # one; a fresh inductor cache so no earlier compilation is reused.
    env = dict(
        tiny_env,
        AUTOLOOP_COMPILE="1",
        CXX=str(tmp_path / "no-such-g++"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    proc = run_train(env, budget="1", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| compile: True |" in proc.stdout
    assert re.search(r"^note: torch\.compile failed \(.+\); continuing in eager mode$", proc.stdout, re.M)
    metrics = parse_summary(proc.stdout)
    assert val_bpb_of(metrics) is not None and metrics["num_steps"] > 1


@pytest.mark.slow
def test_summary_without_evaluation_when_the_controller_evaluates(tiny_env):
    # Under the controller evaluate_bpb only saves the model and returns nan; the run still ends with a summary.
    code = (
        "import prepare, runpy; prepare.evaluate_bpb = lambda model, tokenizer, batch_size: float('nan'); "
        "runpy.run_path('train.py', run_name='__main__')"
    )
    proc = run_train(tiny_env, budget="1", args=("-c", code))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"^val_bpb:          nan$", proc.stdout, re.M)
    metrics = parse_summary(proc.stdout)
    assert tuple(metrics)[: len(SUMMARY_KEYS)] == SUMMARY_KEYS and "eval_vram_mb" not in metrics
    assert math.isnan(metrics["val_bpb"]) and metrics["peak_vram_mb"] > 0


def test_budget_and_seed_come_from_the_environment(tiny_env):
    out = subprocess.run(
        [sys.executable, "-c", "import prepare; print(prepare.TIME_BUDGET, prepare.SEED)"],
        cwd=ROOT,
        env=dict(tiny_env, AUTOLOOP_TIME_BUDGET="7", AUTOLOOP_SEED="3"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
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
    assert metrics["dtype"] == "bfloat16" and metrics["eval_vram_mb"] > 0 and 0 < metrics["mfu_percent"] < 100
