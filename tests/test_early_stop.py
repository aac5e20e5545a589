"""--early-stop: the rule as a decision table (trust/curve.py), the watcher on a run's output in any chunks, and
real loops where a candidate clearly behind the best's curves is stopped, recorded, and resumed after."""

from __future__ import annotations

import json

import fakes
import pytest

from orchestrator.core.noise import Gate
from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths
from orchestrator.trust.curve import CurveWatch, StopRule, behind

# the best's three runs: loss at each fraction of the planned steps (sd about 0.01)
BEST = {k: [v - 0.01, v, v + 0.01] for k, v in {"0.1": 5.0, "0.2": 4.5, "0.3": 4.2, "0.4": 4.0, "0.5": 3.9}.items()}
MEAN = {k: sum(v) / 3 for k, v in BEST.items()}


def SPREAD(relative_sd: float) -> dict[str, float]:  # noqa: N802  (a table's constructor)
    return dict.fromkeys(BEST, relative_sd)


def curve(*gaps: float) -> dict[str, float]:
    """A run's curve: the best's mean plus these gaps at 0.1, 0.2, ..."""
    return {k: MEAN[k] + g for k, g in zip(MEAN, gaps)}


# the run's curve so far, the rule's settings -> stopped?, a word of the reason
TABLE = [
    (curve(0.5, 0.5, 0.5), {}, True, "stopped at 30%"),  # a clear loser: behind at 0.2 and 0.3, not closing
    (curve(0.5, 0.5, 0.3, 0.1), {}, False, ""),  # a slow starter catching up: never stopped
    (curve(0.5, 0.6, 0.2, 0.1), {}, False, ""),  # behind but closing at every look: left to run
    (curve(0.5, 0.6, 0.2, 0.3), {}, True, "stopped at 40%"),  # closing, then falling behind again
    (curve(0.5, 0.6, 0.2, 0.1, 0.4), {"last": 0.6}, True, "stopped at 50%"),  # the same, a later warm-down
    (curve(0.0, 0.0, 0.0, 0.5, 0.6), {}, False, ""),  # behind only from the warm-down on (0.5): never looked at
    (curve(0.0, 0.5, 0.6), {"last": 0.3}, False, ""),  # a warm-down that starts at 0.3 leaves 0.2 alone
    (curve(0.5, 0.5), {}, False, ""),  # behind at one look only (0.1 is never looked at)
    (curve(0.03, 0.03, 0.03), {}, False, ""),  # behind, within the band (3 sd of the best's runs and the 1% floor)
    (curve(0.03, 0.03, 0.03), {"z": 1.0, "floor": 0.0}, True, "stopped"),  # a narrower band stops it
    (curve(0.02, 0.045, 0.05), {"z": 0.1}, False, ""),  # within the floor (1% of the loss)
    (curve(-0.5, -0.5, -0.5), {}, False, ""),  # ahead: never
    # a spread pooled over many configurations' runs (relative sd) stands in for the best's own runs'
    (curve(0.06, 0.06, 0.06), {"z": 8.0}, False, ""),  # 8 sd of the best's own runs: within
    (curve(0.06, 0.06, 0.06), {"z": 8.0, "spread": SPREAD(0.001)}, True, "stopped at 30%"),  # pooled: narrower
    (curve(0.5, 0.5, 0.5), {"spread": SPREAD(0.05)}, False, ""),  # wider (5%: a 0.9 band at 4.5): runs on
]


@pytest.mark.parametrize("run,settings,stopped,word", TABLE)
def test_the_rule(run, settings, stopped, word):
    why = behind(StopRule(BEST, **settings), run)
    assert bool(why) == stopped and word in why, why
    if stopped:
        assert "vs the best's" in why and "± " in why and "(3 runs)" in why


def test_a_fraction_the_best_ran_once_is_judged_only_with_a_pooled_spread():
    once = {k: v[:1] for k, v in BEST.items()}
    assert behind(StopRule(once), curve(1.0, 1.0, 1.0, 1.0)) == ""
    assert "(1 runs)" in behind(StopRule(once, spread=SPREAD(0.01)), curve(1.0, 1.0, 1.0, 1.0))
    rule = StopRule(BEST, last=0.4, spread=SPREAD(0.02))
    assert StopRule.from_dict(json.loads(json.dumps(rule.to_dict()))) == rule  # as a Ray job's spec carries it


def test_the_pooled_spread_is_the_relative_sd_between_runs_of_one_configuration():
    import math
    from types import SimpleNamespace

    from orchestrator.core.trial import curve_spread

    def run(group: int, loss: float) -> SimpleNamespace:
        return SimpleNamespace(n=group, group=group, curve={"0.3": loss, "0.4": loss / 2})

    # two configurations at different levels, each 2% apart between its runs; a third run once (no dof)
    runs = [run(1, 4.0), run(1, 4.0 * math.exp(0.02)), run(2, 2.0), run(2, 2.0 * math.exp(0.02)), run(3, 9.0)]
    assert curve_spread(runs) == {}  # 2 degrees of freedom: too few to stand in for the best's own runs
    runs += [run(1, 4.0 * math.exp(0.01)), run(2, 2.0 * math.exp(0.01)), run(4, 3.0), run(4, 3.0)]
    spread = curve_spread(runs)
    assert set(spread) == {"0.3", "0.4"} and spread["0.3"] == pytest.approx(spread["0.4"])
    assert spread["0.3"] == pytest.approx(math.sqrt(2 * 2 * 0.01**2 / 5), rel=1e-6)  # 2 x SS 2e-4 over 5 dof


def progress(loss: dict[str, float], steps: int = 20) -> bytes:
    """train.py's output: its calibration line, then a progress line at each 5% of its planned steps."""
    lines = ["step 00001 (3.0%) | loss: 9.000000", f"schedule: {steps} steps (10ms per step over the first 2)"]
    for i in range(1, steps + 1):
        key = f"{round(i / steps, 1):.1f}"
        value = loss.get(key, 3.0)
        lines.append(f"step {i:05d} ({100 * i / steps:.1f}%) | loss: {value:.6f} | dt: 10ms")
    return ("\n".join(lines) + "\n").encode()


def test_the_watch_fires_once_the_second_look_is_behind_whatever_the_chunks():
    out = progress(curve(0.5, 0.5, 0.5, 0.5, 0.5))
    for size in (1, 7, 64, len(out)):
        watch = CurveWatch(StopRule(BEST))
        fed = 0
        for i in range(0, len(out), size):
            watch(out[i : i + size])
            fed = fed or (i + size if watch.fired.is_set() else 0)
        assert watch.why.startswith("stopped at 30%"), size
        assert b"(30.0%)" in out[:fed] and (b"(40.0%)" not in out[:fed] or size == len(out)), size  # at once
    calm = CurveWatch(StopRule(BEST))
    calm(progress(curve(0.5, 0.5, 0.2, 0.0)))
    assert not calm.fired.is_set() and calm.why == ""


def trained(
    counter, offsets: dict[str, float], steps: int = 20, pause: float = 0.1, only: tuple[int, ...] = (), bpb=None
) -> str:
    """A fake train.py that trains `steps` steps (pause s each), printing the progress lines train.py prints;
    its loss at fraction f is the best's plus offsets[f] (runs of it differ by +-0.01), or only on the session's
    runs numbered in `only` (counted from 0) if given; it scores `bpb` if given."""
    base = {"0.1": 5.0, "0.2": 4.5, "0.3": 4.2, "0.4": 4.0, "0.5": 3.9, "0.6": 3.8, "0.7": 3.7, "0.8": 3.5}
    base |= {"0.9": 3.3, "1.0": 3.2}
    loss = {k: v + offsets.get(k, 0.0) for k, v in base.items()}
    return (
        f"""import os, time
OFFSET = {sum(offsets.values())!r}  # [0.0, 100.0]
p = {str(counter)!r}
k = int(open(p).read()) if os.path.exists(p) else 0
open(p, "w").write(str(k + 1))
jitter = 0.01 * (k % 3 - 1)
loss = {loss!r} if not {list(only)!r} or k in {list(only)!r} else {base!r}
print("schedule: {steps} steps (10ms per step)", flush=True)
for i in range(1, {steps} + 1):
    time.sleep({pause!r})
    print(f"step {{i:05d}} ({{100 * i / {steps}:.1f}}%) | loss: {{loss[f'{{round(i / {steps}, 1):.1f}}'] + jitter:.6f}}", flush=True)
BPB = ({bpb!r} if {bpb!r} is not None else 1.0 + OFFSET / 100) + jitter
"""
        + fakes.SUMMARY
    )


def run(repo, **kw):
    base = dict(repo=repo, tag="e", budget=1.0, timeout=30.0, proposer="fakes:Scripted", gate=Gate(early_stop="on"))
    return run_loop(Settings(**{**base, **kw}), echo=lambda line: None)


def test_a_clear_loser_is_stopped_recorded_and_the_session_resumes(fake_repo, plan, tmp_path):
    counter = tmp_path / "runs"
    repo = fake_repo(trained(counter, {}))
    plan(
        [
            {"description": "loser", "train": trained(counter, {k: 0.5 for k in ("0.2", "0.3", "0.4", "0.5")})},
            {"description": "slow starter", "train": trained(counter, {"0.2": 0.5, "0.3": 0.2, "0.4": 0.0})},
            {"description": "late", "train": trained(counter, {"0.6": 1.0, "0.7": 1.0})},
        ]
    )
    run(repo, max_experiments=4)  # the baseline 3 times, then the loser
    paths = Paths(repo, "e")
    rows = read_rows(paths.ledger)
    loser = read_record(paths.run_dir(4))
    assert rows[3].status == "discard" and "stopped at 30% of its steps" in rows[3].description, rows[3]
    assert loser.val_bpb is None and loser.gate.decision == "discard" and loser.gate.why == "stopped early"
    assert "vs the best's 4.2000 ± 0.0100 (3 runs)" in loser.gate.note
    assert set(loser.curve) <= {"0.1", "0.2", "0.3", "0.4"} and {"0.2", "0.3"} <= set(loser.curve)
    baseline = read_record(paths.run_dir(1))
    assert loser.timings["train"] < 0.75 * baseline.timings["train"]  # it used a part of a run's time
    assert not (paths.run_dir(4) / "eval.log").exists() and "1.0" in baseline.curve
    raw = json.loads((paths.run_dir(4) / "record.json").read_text())
    assert raw["status"] == "discard" and raw["gate"]["note"].startswith("stopped at 30%")

    state = run(repo, max_experiments=6)  # resumed: the slow starter and the late one run to the end
    rows = read_rows(paths.ledger)
    assert [r.description.split(" [")[0].split(" (")[0] for r in rows[4:]] == ["slow starter", "late"]
    for n in (5, 6):
        record = read_record(paths.run_dir(n))
        assert record.val_bpb is not None and "1.0" in record.curve and "stopped" not in rows[n - 1].description
    assert state.best_group == 1 and state.done == 6


def test_off_by_default_and_never_for_the_best(fake_repo, plan, tmp_path):
    counter = tmp_path / "runs"
    repo = fake_repo(trained(counter, {}, pause=0.05))
    plan([{"description": "loser", "train": trained(counter, {k: 0.5 for k in ("0.2", "0.3", "0.4")}, pause=0.05)}])
    run(repo, max_experiments=4, gate=Gate())
    rows = read_rows(Paths(repo, "e").ledger)
    assert "stopped" not in rows[3].description and read_record(Paths(repo, "e").run_dir(4)).val_bpb is not None


def test_never_the_best_and_a_stopped_run_again_discards_its_candidate(fake_repo, plan, tmp_path):
    """The baseline's third run trails the first two's curves by far: it is the best, never stopped. A candidate
    promising on its first run (better, inside the margin) is stopped on its second: it is discarded."""
    counter = tmp_path / "runs"
    behind = {k: 0.5 for k in ("0.2", "0.3", "0.4")}
    repo = fake_repo(trained(counter, behind, only=(2,), pause=0.05))
    far = {k: 3.0 for k in behind}  # beyond the band the third baseline run widened
    plan([{"description": "promising", "train": trained(counter, far, only=(4,), pause=0.05, bpb=0.99)}])
    run(repo, max_experiments=5, gate=Gate(early_stop="on", max_repeats=3))
    paths = Paths(repo, "e")
    rows = read_rows(paths.ledger)
    third = read_record(paths.run_dir(3))
    assert third.val_bpb is not None and "stopped" not in rows[2].description and "0.4" in third.curve
    first, again = read_record(paths.run_dir(4)), read_record(paths.run_dir(5))
    assert first.gate.decision == "rerun" and again.group == 4, rows
    assert again.gate.decision == "discard" and again.gate.why == "stopped early" and again.val_bpb is None
    from orchestrator.core.state import load_state

    assert load_state(paths).pending is None  # decided: the next idea comes


def test_a_run_printing_junk_at_full_speed_costs_the_watch_little():
    watch = CurveWatch(StopRule(BEST))
    junk = b"schedule: 1 steps " + b"x" * (1 << 20) + b"\n"
    for _ in range(16):  # 16 MiB without a newline, 16 MiB of over-long lines, progress lines by the thousand
        watch(b"y" * (1 << 20))
        assert len(watch.pending) <= 200
    for _ in range(16):
        watch(junk)
    watch(b"schedule: 20 steps\n" + b"step 00001 (10.0%) | loss: 5.0\n" * 20000)
    assert len(watch.pending) <= 200 and watch.curve == {"0.1": 5.0} and not watch.fired.is_set()
    watch(progress(curve(0.0, 0.5, 0.5, 0.5)).split(b"schedule: 20 steps (10ms per step over the first 2)\n")[1])
    assert watch.fired.is_set() and watch.done
    before = dict(watch.curve or {})
    watch(b"step 00020 (100.0%) | loss: 1.0\n")  # past the last look: no longer read
    assert watch.curve == before


def test_an_audit_trains_a_would_be_stopped_run_on_and_one_that_beats_the_best_turns_stopping_off(
    fake_repo, plan, tmp_path
):
    """Seed 6 draws run 4 as an audit (trial.AUDIT_SHARE of the runs) and runs 5-7 as not. The idea's curve is
    far behind the best's, yet it scores better: audited, it trains to the end and says it would have been
    stopped; then nothing more is stopped against this best, its run again included."""
    counter = tmp_path / "runs"
    repo = fake_repo(trained(counter, {}, pause=0.05))
    behind = {k: 0.5 for k in ("0.2", "0.3", "0.4")}
    plan([{"description": "low curve, better score", "train": trained(counter, behind, pause=0.05, bpb=0.9)}])
    run(repo, max_experiments=5, seed=6, gate=Gate(early_stop="on", max_repeats=3))
    paths = Paths(repo, "e")
    audited, again = read_record(paths.run_dir(4)), read_record(paths.run_dir(5))
    assert audited.val_bpb == pytest.approx(0.9, abs=0.011) and "1.0" in audited.curve
    assert audited.info["would_stop"].startswith("stopped at 30% of its steps")
    assert again.group == 4 and again.val_bpb is not None and "would_stop" not in again.info  # not even judged
    assert "stopped" not in read_rows(paths.ledger)[4].description
