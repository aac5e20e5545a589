"""The decision logic as tables: `decide` (the judge) and the planner's slot refill, on states replayed from
records. No git, no processes: each row is a state, what finished, and what must be decided."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from orchestrator.core.judge import Finished, decide
from orchestrator.core.noise import Gate
from orchestrator.core.plan import REFILL_BEFORE, refill
from orchestrator.core.state import Kind, replay
from orchestrator.store.ledger import Evidence, Record

BASELINE = Record(
    n=1,
    status="keep",
    description="baseline",
    commit="c1",
    val_bpb=1.0,
    gate=Evidence("keep", runs=1, why="baseline"),
    device="cpu",
    metrics={"num_steps": 100, "total_tokens_M": 100.0, "training_seconds": 10.0, "num_params_M": 1.0},
)


def run(
    n: int, bpb: float | None, kind: Kind = Kind.CANDIDATE, steps: int = 100, group: int = 0, outside: float = 1.0
) -> Finished:
    """A run of a session on a machine other users kept busy (`outside` CPUs: a slow run's printed steps are
    believed only then, state.busy_outside)."""
    record = Record(
        n=n,
        status="",
        description=f"idea {n}",
        commit=f"c{n}",
        val_bpb=bpb,
        device="cpu",
        group=group,
        metrics={
            "num_steps": steps,
            "total_tokens_M": float(steps),
            "training_seconds": 10.0,
            "num_params_M": 1.0,
            "cpu_outside": outside,
        },
    )
    return Finished(record, kind, crashed=bpb is None)


# state's records, the finished runs, the gate -> (status, gate decision, a word of the note) of each
TABLE = [
    ("first baseline", [], [run(1, 1.0, Kind.BASELINE)], "strict", [("keep", "keep", "")]),
    (
        "baseline on two slots: the second is a repeat",
        [],
        [run(1, 1.0, Kind.BASELINE), run(2, 1.01, Kind.BASELINE, group=1)],
        "strict",
        [("keep", "keep", ""), ("discard", "repeat", "")],
    ),
    ("a crashed baseline", [], [run(1, None, Kind.BASELINE)], "strict", [("crash", "", "")]),
    ("lower is kept", [BASELINE], [run(2, 0.9)], "strict", [("keep", "keep", "")]),
    ("higher is discarded", [BASELINE], [run(2, 1.1)], "strict", [("discard", "discard", "")]),
    ("equal is discarded", [BASELINE], [run(2, 1.0)], "strict", [("discard", "discard", "")]),
    (
        "of two better candidates the best is confirmed, none kept now",
        [BASELINE],
        [run(2, 0.95), run(3, 0.9), run(4, None)],
        "strict",
        [("discard", "discard", "not the best"), ("discard", "rerun", "best of 2"), ("crash", "", "")],
    ),
    (
        "a candidate slowed from outside is run again, not judged",
        [BASELINE],
        [run(2, 0.5, steps=20), run(3, 1.1)],
        "noise",
        [("discard", "rerun", "disturbed"), ("discard", "discard", "")],
    ),
    (
        "a candidate that prints few steps on a quiet machine is judged on its value",
        [BASELINE],
        [run(2, 1.1, steps=20, outside=0.1)],
        "noise",
        [("discard", "discard", "")],
    ),
]


@pytest.mark.parametrize("name, records, runs, mode, expected", TABLE, ids=[row[0] for row in TABLE])
def test_decide(name, records, runs, mode, expected):
    state = replay(list(records), "c0")
    before = [asdict(r.record) for r in runs]
    judged = decide(state, runs, Gate(mode))
    got = [(str(j.status), str(j.gate.decision), j.gate.note) for j in judged]
    assert [(s, d) for s, d, _ in got] == [(s, d) for s, d, _ in expected], got
    for (_, _, note), (_, _, word) in zip(got, expected):
        assert word in note, (note, word)
    assert [asdict(r.record) for r in runs] == before  # decide is pure: the records are left as they were


def test_a_crashed_confirmation_run_ends_the_candidate_as_with_one_slot():
    """Two slots confirm a best-of-2 pick at once: one run crashes (the idea's doing: a train.py that exits after
    seeing an unlucky value), the other is lucky. Judged on the lucky one alone it would be kept; it is discarded,
    as a crashed run again ends a pending candidate on one slot. A crash put down to the machine changes nothing."""
    pick = replace(
        BASELINE,
        n=2,
        status="discard",
        description="idea 2",
        commit="c2",
        val_bpb=0.95,
        gate=Evidence("rerun", runs=1, selection=True),
    )
    state = replay([BASELINE, pick], "c0")
    for cause, expected in (("idea", ("discard", "discard")), ("environment", ("keep", "keep"))):
        lucky, crashed = run(3, 0.9, Kind.CONFIRM, group=2), run(4, None, Kind.CONFIRM, group=2)
        crashed.record.cause = cause
        judged = decide(state, [lucky, crashed], Gate("strict"))
        assert (str(judged[0].status), str(judged[0].gate.decision)) == expected, (cause, judged[0].gate)
        assert str(judged[1].status) == "crash"
        if cause == "idea":
            assert judged[0].gate.note == "discarded: run 4 of it crashed"


def test_a_second_slow_run_of_a_configuration_is_its_own_speed():
    """A configuration gets the benefit of the doubt once: run again, a slow run counts."""
    slow = run(2, 0.5, steps=20)
    first = decide(replay([BASELINE], "c0"), [slow], Gate("noise"))[0]
    assert first.gate.disturbed
    slow.record.status, slow.record.gate = str(first.status), first.gate
    again = decide(replay([BASELINE, slow.record], "c0"), [run(3, 0.5, Kind.RERUN, steps=20, group=2)], Gate("noise"))
    assert not again[0].gate.disturbed and again[0].gate.decision in ("keep", "rerun")


BUDGET = 60.0
# free slots, busy runs, age of the generation, --max-experiments room -> a repeat of the best or nothing
REFILLS = [
    (1, 1, 0.0, None, True),
    (1, 3, REFILL_BEFORE * BUDGET - 1, 5, True),
    (0, 1, 0.0, None, False),  # no free slot
    (1, 0, 0.0, None, False),  # nothing else trains: the generation is over anyway
    (1, 1, REFILL_BEFORE * BUDGET + 1, None, False),  # too late: it would hold up the next generation
    (1, 1, 0.0, 0, False),  # --max-experiments reached
]


@pytest.mark.parametrize("free, busy, age, room, wanted", REFILLS)
def test_refill(free, busy, age, room, wanted):
    state = replay([BASELINE], "c0")
    planned = refill(state, free, busy, age, BUDGET, room)
    assert (planned is not None) == wanted
    if planned is not None:
        assert planned.kind == Kind.PARENT and planned.base == "c1" and planned.group == 1
        assert planned.info == {"repeat": "slot freed early"}
    assert refill(replay([], "c0"), free, busy, age, BUDGET, room) is None  # no best yet: nothing to repeat


def record(n: int, bpb: float, steps: int, group: int = 1, status: str = "discard", outside: float = 1.0) -> Record:
    return Record(
        n=n,
        status=status,
        description="baseline" if n == group else f"baseline (repeat {n})",
        commit=f"c{n}",
        val_bpb=bpb,
        device="cpu",
        group=group,
        gate=Evidence("keep" if n == group else "repeat", runs=1),
        metrics={"num_steps": steps, "training_seconds": 30.0, "cpu_outside": outside},
    )


# (val_bpb, steps) of one configuration's runs in order -> the runs set aside as slowed from outside
# ... and the run whose saved model stands for the configuration (the held-out check's): the run being
# recorded when the first was set aside (the repeats' models are not kept)
SLOWED = [
    ([(2.77, 100), (2.17, 213), (2.17, 209)], {1}, 3),  # a first run slowed (nothing to compare it with then)
    ([(2.77, 100), (2.17, 213)], set(), 1),  # one other run is not enough to tell which one was slowed
    ([(2.17, 213), (2.77, 100), (2.18, 209)], {2}, 1),
    ([(2.17, 213), (2.20, 180), (2.18, 209)], set(), 1),  # 0.85x: within a run's own variation
    ([(2.77, 100), (2.17, 213), (2.80, 98), (2.17, 209), (2.16, 211)], {1, 3}, 4),
]


@pytest.mark.parametrize("runs, aside, stands", SLOWED)
def test_a_slowed_run_leaves_the_mean_once_its_configuration_shows_its_speed(runs, aside, stands):
    records = [record(i + 1, bpb, steps, status="keep" if i == 0 else "discard") for i, (bpb, steps) in enumerate(runs)]
    state = replay(records, "c0")
    assert state.set_aside == aside
    assert state.runs(1) == [bpb for i, (bpb, _) in enumerate(runs) if i + 1 not in aside]
    assert state.best_group == 1 and state.baseline_group == 1  # the baseline stays the baseline
    assert state.baseline_run == state.best_run == stands


def test_few_steps_printed_on_a_quiet_machine_set_no_run_aside():
    """The steps are train.py's word: on a machine nobody else kept busy, a run that printed few is counted."""
    runs = [(2.17, 213), (2.77, 100), (2.18, 209)]
    records = [
        record(i + 1, bpb, steps, status="keep" if i == 0 else "discard", outside=0.2)
        for i, (bpb, steps) in enumerate(runs)
    ]
    state = replay(records, "c0")
    assert not state.set_aside and state.runs(1) == [2.17, 2.77, 2.18]


def test_a_keep_that_its_fresh_runs_contradict_is_reported():
    """A change kept on lucky runs: the kept code's fresh runs (unbiased) are clearly worse than the best it
    replaced; the fresh run says so, and the session's state lists the keep as contradicted. Fresh runs that
    agree with the keep say nothing."""

    def rec(n, bpb, status, gate, group=0):
        return Record(
            n=n,
            status=status,
            description=f"r{n}",
            commit=f"c{n}",
            val_bpb=bpb,
            device="cpu",
            group=group,
            gate=gate,
            metrics=dict(BASELINE.metrics),
        )

    base = [
        rec(1, 1.0, "keep", Evidence("keep", runs=1, why="baseline")),
        rec(2, 1.01, "discard", Evidence("repeat"), group=1),
        rec(3, 0.99, "discard", Evidence("repeat"), group=1),
    ]
    stats = {"ref_sd": 0.01, "best_sd": 0.01, "best_runs": 3, "se": 0.0115}
    keep = rec(4, 0.96, "keep", Evidence("keep", runs=1, mean=0.96, best_mean=1.0, delta=0.04, stats=stats))
    for fresh, contradicted in ((1.03, True), (0.97, False)):
        state = replay([*base, keep], "c0")
        judged = decide(state, [run(5, fresh, Kind.PARENT, group=4)], Gate("value"))[0]
        assert ("contradicts keep #4" in judged.gate.note) is contradicted, judged.gate
        done = Record(**{**asdict(run(5, fresh, Kind.PARENT, group=4).record), "status": "discard"})
        done.gate = judged.gate  # as the loop writes it into the record
        assert [n for n, _ in replay([*base, keep, done], "c0").contradicted()] == ([4] if contradicted else [])
    # a later run of the kept code that no longer contradicts it clears the warning
    bad = Record(**{**asdict(run(5, 1.03, Kind.PARENT, group=4).record), "status": "discard"})
    bad.gate = decide(replay([*base, keep], "c0"), [run(5, 1.03, Kind.PARENT, group=4)], Gate("value"))[0].gate
    assert replay([*base, keep, bad], "c0").contradicted()[0][0] == 4
    later = decide(replay([*base, keep, bad], "c0"), [run(6, 0.94, Kind.PARENT, group=4)], Gate("value"))[0]
    after = Record(**{**asdict(run(6, 0.94, Kind.PARENT, group=4).record), "status": "discard"})
    after.gate = later.gate
    assert "contradicts" not in later.gate.note and replay([*base, keep, bad, after], "c0").contradicted() == []
