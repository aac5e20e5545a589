"""Near misses are not wasted (core/bundle.py): ideas measured better but not proven are parked, and once three
are, the loop tries them together as one idea, judged on its own runs; its record names the ideas it holds, and
parked ideas survive a resume (they are read back from the run records). A real session on a fake train.py
whose three small gains are each inside the noise on one run and clear together."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.core.bundle import near_miss, parked
from orchestrator.core.noise import Gate
from orchestrator.core.state import load_state
from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import Evidence, read_record
from orchestrator.store.session import Paths

SUMMARY = 'print("---")\nprint(f"val_bpb:          {BPB:.6f}")\nprint("training_seconds: 0.1")\n'


def train(counter: Path, p: int = 0, q: int = 0, r: int = 0) -> str:
    """val_bpb = 2 - 0.015 (P + Q + R), the baseline's three runs 0.01 apart (sd 0.01), every later run exact:
    each idea alone is 1.3 standard errors better (a near miss on its one look), the three together 3.9."""
    return (
        f"P = {p}\nQ = {q}\nR = {r}\n\nfrom pathlib import Path\ncounter = Path({str(counter)!r})\n"
        "k = int(counter.read_text()) if counter.exists() else 0\ncounter.write_text(str(k + 1))\n"
        "noise = [0.0, 0.01, -0.01][k] if k < 3 else 0.0\n"
        "BPB = 2.0 - 0.015 * (P + Q + R) + noise\n" + SUMMARY
    )


IDEAS = [("P on", {"p": 1}), ("Q on", {"q": 1}), ("R on", {"r": 1}), ("nothing new", {})]


def settings(repo: Path, most: int, **gate) -> Settings:
    return Settings(
        repo=repo,
        tag="b",
        tag_given=True,
        budget=1.0,
        timeout=30.0,
        proposer="fakes:Scripted",
        baseline_repeats=2,
        max_experiments=most,
        gate=Gate(mode="noise", max_repeats=1, **gate),
    )


def test_three_near_misses_are_tried_as_one_bundle_that_names_them_across_a_resume(fake_repo, plan, tmp_path):
    counter = tmp_path / "counter"
    repo = fake_repo(train(counter))
    plan([{"description": d, "train": train(counter, **v)} for d, v in IDEAS])
    paths = Paths(repo, "b")

    run_loop(settings(repo, 5), echo=lambda _: None)  # the baseline's 3 runs, P and Q: parked
    state = load_state(paths)
    assert [r.status for r in state.records[3:]] == ["discard", "discard"]
    assert parked(state) == [4, 5]

    run_loop(settings(repo, 8), echo=lambda _: None)  # resumed: R parked, then the bundle of all three
    records = [read_record(paths.run_dir(n)) for n in range(1, 8)]
    assert all(r is not None for r in records)
    bundle = records[6]
    assert bundle is not None and bundle.info["bundle"] == [4, 5, 6]
    assert bundle.description.startswith("bundle of #4, #5, #6: P on; Q on; R on")
    assert "P = 1" in bundle_train(repo, bundle.commit) and "R = 1" in bundle_train(repo, bundle.commit)
    assert bundle.status == "keep" and bundle.val_bpb == pytest.approx(2.0 - 0.045)
    assert parked(load_state(paths)) == []  # bundled: parked no more
    rows = paths.ledger.read_text().splitlines()
    assert "[near miss: parked]" in rows[4] and rows[7].split("\t")[4] == "keep"


def bundle_train(repo: Path, commit: str) -> str:
    import git

    return git.Repo(repo).git.show(f"{commit}:train.py")


def test_bundles_off_the_near_misses_wait(fake_repo, plan, tmp_path):
    counter = tmp_path / "counter"
    repo = fake_repo(train(counter))
    plan([{"description": d, "train": train(counter, **v)} for d, v in IDEAS])
    run_loop(settings(repo, 7, bundle=0), echo=lambda _: None)
    state = load_state(Paths(repo, "b"))
    assert [r.description for r in state.records[3:]] == ["P on", "Q on", "R on", "nothing new"]
    assert not any("bundle" in r.info or r.gate.stats.get("parked") for r in state.records)
    assert "parked" not in (repo / "results.tsv").read_text()


@pytest.mark.parametrize(
    "evidence, mode, parks",
    [
        (Evidence("discard", delta=0.01, stats={"se": 0.01}), "noise", True),  # 1 se better
        (Evidence("discard", delta=0.004, stats={"se": 0.01}), "noise", False),  # 0.4 se: no
        (Evidence("discard", delta=-0.01, stats={"se": 0.01}), "noise", False),  # worse
        (Evidence("keep", delta=0.05, stats={"se": 0.01}), "noise", False),  # kept, not missed
        (Evidence("discard", delta=0.01, stats={"se": 0.01}), "strict", False),  # upstream's rule parks nothing
        (Evidence("discard", delta=0.01, stats={"gain": 0.002}), "value", True),  # posterior mean gain > 0
        (Evidence("discard", delta=0.01, stats={"gain": -0.001}), "value", False),  # the prior says a lucky run
        (Evidence("discard", delta=0.03, selection=True, stats={"se": 0.01}), "noise", False),  # a best-of-k pick
    ],
)
def test_which_discards_are_near_misses(evidence, mode, parks):
    assert near_miss(evidence, mode) is parks
