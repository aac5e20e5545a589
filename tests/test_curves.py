"""Each run's loss curve: the training loss at fixed fractions of its planned steps, read from the run's own log
(safely: a run writes it) into record.json, crashed runs' too."""

from __future__ import annotations

import json
import os
import threading

import fakes
from conftest import make_repo

from orchestrator.core.progress import CURVE_BYTES, read_curve
from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import Record, read_record, read_rows, write_record
from orchestrator.store.session import Paths

# A log as train.py writes it, with garbage among the lines. Before the calibration line the percentages are of
# the time budget and do not count; after it, of the planned steps.
LOG = (
    b"""device: cpu | dtype: float32 | attention: sdpa | compile: False | profile: tiny
step 00001 (0.0%) | loss: 6.200000 | dt: 131ms | tok/sec: 3,916 | mfu: 20.8% | epoch: 1 | remaining: 5s
step 00004 (9.0%) | loss: 9.000000 | dt: 75ms | tok/sec: 3,916 | mfu: 20.8% | epoch: 1 | remaining: 5s
schedule: 62 steps (75ms per step over the first 4)
step 00005 (6.5%) | loss: 5.100000 | dt: 61ms
step 00006 (8.1%) | loss: 5.000000 | dt: 61ms
step 00007 (9.7%) | loss: 4.900000 | dt: 61ms
step 00008 (11.3%) | loss: 4.800000 | dt: 61ms
\xff\xfe\x00 binary junk \x00
step 00012 (17.4%) | loss: 4.400000 | dt: 61ms
step 00017 (25.8%) | loss: 4.300000 | dt: 61ms
step 00018 (27.5%) | loss: 4.200000 | dt: 61ms
step 00020 (30.6%) | loss: 4.100000 | dt: 61ms
step 00025 (38.7%) | loss: 4.000000 | dt: 61ms
step 00026 (4.0.3%) | loss: 1.000000 | dt: 61ms
step 00026 (40.0%) | loss: 1.2.3 | dt: 61ms
step 00026 (40.0%) | loss: 1"""
    + b"0" * 400
    + b""" | dt: 61ms
step 00026 (40.0%) | loss: nan | dt: 61ms
warning: step 00026 (40.0%) | loss: 1.000000 | dt: 61ms
step 00032 (48.4%) | loss: 3.900000 | dt: 61ms
step 00033 (50.0%) | loss: 3.800000 | dt: 61ms
step 00037 (57.4%) | loss: 3.700000 | dt: 61ms
step 00057 (88.7%) | loss: 3.500000 | dt: 61ms
step 00063 (100.0%) | loss: 3.400000 | dt: 61ms
---
val_bpb:          3.779949
"""
)
CURVE = {
    "0.1": 4.9,  # the last line at or before 10% (9.7%), not 8.1% before it, not 11.3% after it
    # 0.2: the nearest line before 20% is 17.4%, more than 2.5 points off
    "0.3": 4.2,  # 27.5%: just within the tolerance
    "0.4": 4.0,  # 38.7%: the lines at 40.0% are garbage (a bad percentage or loss, an infinite or nan loss, a prefix)
    "0.5": 3.8,  # exactly 50.0%
    # 0.6: 57.4% is before it, but 2.6 points off; 0.7 and 0.8: nothing near
    "0.9": 3.5,
    "1.0": 3.4,
}


def test_the_curve_is_the_last_line_at_or_before_each_fraction_after_the_schedule(tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(LOG)
    assert read_curve(log) == CURVE
    # calibrated past 10% of its steps: the line at 9.0% of the clock before it does not stand for 0.1
    late = b"".join(
        line
        for line in LOG.splitlines(keepends=True)
        if not line.startswith((b"step 00005", b"step 00006", b"step 00007"))
    )
    log.write_bytes(late)
    assert read_curve(log) == {k: v for k, v in CURVE.items() if k != "0.1"}


def test_without_the_calibration_line_there_is_no_curve(tmp_path):
    """A train.py that never fixed its planned steps (upstream's: the clock is its schedule; or one that crashed
    in its first tenth) has percentages of the time budget only: no curve."""
    log = tmp_path / "run.log"
    log.write_bytes(LOG.replace(b"schedule: 62 steps", b"calibrating: 62 steps"))
    assert read_curve(log) == {}


def test_a_log_over_the_cap_is_read_from_its_start(tmp_path):
    """The calibration line and the early fractions are at a log's start: a run that printed megabytes after them
    keeps its curve up to where the cap cut it."""
    log = tmp_path / "run.log"
    head, _, _ = LOG.partition(b"step 00032")
    log.write_bytes(head + b"noise\n" * (CURVE_BYTES // 6) + b"step 00063 (100.0%) | loss: 3.400000\n")
    assert read_curve(log) == {k: v for k, v in CURVE.items() if float(k) <= 0.4}


def test_a_link_or_fifo_in_the_logs_place_is_not_followed(tmp_path):
    """The run writes its log's directory: a link to a file (a host secret, /dev/zero) or a FIFO in its place
    is read as nothing, and never blocks the controller."""
    target = tmp_path / "elsewhere.log"
    target.write_bytes(LOG)
    link = tmp_path / "run.log"
    link.symlink_to(target)
    assert read_curve(target) == CURVE and read_curve(link) == {}

    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    found: list[dict] = []
    reader = threading.Thread(target=lambda: found.append(read_curve(fifo)), daemon=True)
    reader.start()
    reader.join(5)
    try:
        assert not reader.is_alive() and found == [{}]
    finally:
        if reader.is_alive():  # let a blocked reader go: it meets a writer that closes at once
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_record_from_before_curves_loads_and_a_curve_round_trips(tmp_path):
    write_record(tmp_path, Record(n=1, status="keep", description="baseline", curve={"0.1": 4.5, "1.0": 3.2}))
    assert read_record(tmp_path).curve == {"0.1": 4.5, "1.0": 3.2}
    data = json.loads((tmp_path / "record.json").read_text())
    del data["curve"]
    (tmp_path / "record.json").write_text(json.dumps(data))
    old = read_record(tmp_path)
    assert old is not None and old.curve == {} and old.description == "baseline"


PLANNED = 45  # 2.2% a step: each fraction's point is a line a little before it


def progress_train(bpb: float, crash_at: int | None = None) -> str:
    """A fake train.py that calibrates (a line of the clock first), then prints a progress line each step whose
    loss tells the step: 4 + step / 100. With crash_at, it fails after that many planned steps."""
    steps = crash_at or PLANNED
    return (
        f"BPB = {bpb!r}\n"
        'print("step 00001 (5.0%) | loss: 9.000000 | dt: 10ms", flush=True)\n'
        f'print("schedule: {PLANNED} steps (10ms per step over the first 4)", flush=True)\n'
        f"for k in range(1, {steps} + 1):\n"
        f'    print(f"step {{k + 1:05d}} ({{100 * k / {PLANNED}:.1f}}%) | loss: {{4 + k / 100:.6f}} | dt: 10ms")\n'
        + ('raise RuntimeError("loss exploded (fake)")\n' if crash_at else fakes.SUMMARY)
    )


def test_the_loop_records_each_runs_curve_crashed_runs_too(tmp_path, plan):
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": progress_train(1.0), "prepare.py": "TIME_BUDGET = 1.0\n"})
    plan([{"description": "diverges", "train": progress_train(0.9, crash_at=20)}])
    settings = Settings(repo=repo, tag="c", budget=1.0, timeout=20.0, proposer="fakes:Scripted", baseline_repeats=0)
    run_loop(settings, echo=lambda _: None)

    assert [r.status for r in read_rows(repo / "results.tsv")] == ["keep", "crash"]
    runs = Paths(repo, "c")
    baseline, crashed = (json.loads((runs.run_dir(n) / "record.json").read_text()) for n in (1, 2))
    # the step at or before each tenth of 45: 4 (8.9%), 9 (20.0%), 13 (28.9%), 18, 22 (48.9%), 27, 31, 36, 40, 45
    assert baseline["curve"] == {
        "0.1": 4.04,
        "0.2": 4.09,
        "0.3": 4.13,
        "0.4": 4.18,
        "0.5": 4.22,
        "0.6": 4.27,
        "0.7": 4.31,
        "0.8": 4.36,
        "0.9": 4.40,
        "1.0": 4.45,
    }
    assert crashed["status"] == "crash" and "loss exploded" in crashed["reason"]
    assert crashed["curve"] == {"0.1": 4.04, "0.2": 4.09, "0.3": 4.13, "0.4": 4.18}  # where it got to
