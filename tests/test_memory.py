"""Idea memory: an exact repeat of an idea already judged from the same parent is a row at no cost, never a run
(for every proposer: the LLM's repeats through a real openai client and a local server, two slots' equal ideas);
the journal reaches the prompt, survives a resume and prints with `autoloop journal`."""

from __future__ import annotations

import fakes
import pytest
from conftest import cli
from fake_openai import FakeOpenAI, edit

from orchestrator.core.noise import Gate
from orchestrator.loop import Settings, run_loop
from orchestrator.proposers.memory import fingerprint, journal
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths

OLD = "BPB = 1.0  # [0.1, 10.0]"


def bpb(value: float) -> str:
    return f"BPB = {value!r}  # [0.1, 10.0]"


def quiet(_line: str) -> None:
    pass


def test_an_llm_s_repeats_are_rows_at_no_cost_and_the_prompt_carries_the_journal(fake_repo):
    pytest.importorskip("openai")
    repo = fake_repo(fakes.ok(1.0))
    replies = [
        edit(OLD, bpb(1.2), "BPB up"),  # 2 discard
        edit(OLD, bpb(1.2), "BPB up, again"),  # 3 duplicate of 2 (same parent)
        edit(OLD, bpb(0.9), "BPB down"),  # 4 keep
        edit(bpb(0.9), bpb(1.1), "BPB up from the new best"),  # 5 discard: the same edit, another parent
        edit(bpb(0.9), bpb(1.1) + "   ", "BPB up, reformatted"),  # 6 duplicate of 5 (layout is no idea)
        edit(bpb(0.9), bpb(1.3), "BPB up more"),  # 7 discard
        edit(bpb(0.9), bpb(1.1), "BPB up, third time"),  # 8 duplicate of 5
        edit(bpb(0.9), bpb(0.8), "BPB down more"),  # 9 keep
        edit(bpb(0.8), bpb(0.85), "a little up"),  # 10 discard
    ]
    with FakeOpenAI(replies) as server:
        settings = Settings(
            repo=repo,
            tag="m",
            budget=1.0,
            timeout=20.0,
            proposer="llm",
            baseline_repeats=0,
            max_experiments=10,
            pipeline=False,
            options={"llm_base_url": server.base_url, "llm_model": "fake-model"},
        )
        lines: list[str] = []
        run_loop(settings, echo=lines.append)
        prompts = server.prompts()
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows] == ["keep", "discard", "discard", "keep"] + ["discard"] * 4 + ["keep", "discard"]
    duplicates = {3: 2, 6: 5, 8: 5}
    shown = [line for line in lines if "duplicate of #" in line]
    assert len(shown) == 3 and all(line.count("duplicate of #") == 1 for line in shown), shown  # said once each
    paths = Paths(repo, "m")
    for n, earlier in duplicates.items():
        assert f"duplicate of #{earlier} (discard at " in rows[n - 1].description, rows[n - 1].description
        assert rows[n - 1].val_bpb == rows[earlier - 1].val_bpb  # the earlier result, not 0
        record = read_record(paths.run_dir(n))
        assert record.gate.decision == "duplicate" and "train" not in record.timings  # never trained
        assert not (paths.run_dir(n) / "run.log").exists()
    trained = [n for n in range(1, 11) if (paths.run_dir(n) / "run.log").exists()]
    assert trained == [1, 2, 4, 5, 7, 9, 10]  # 3 of the 9 ideas repeated: 0 runs spent on them
    # the prompts: the journal from the first; the repeat told once, in the next prompt
    assert all("# What this session has learned (journal)" in p for p in prompts)
    assert "Repeats caught and not run: 1" in prompts[3] and "#3 BPB up, again" in prompts[3]
    assert "duplicate of #2" in prompts[3]  # its row, with the earlier result
    assert "Kept changes" in prompts[-1] and "#4 BPB down" in prompts[-1] and "#9 BPB down more" in prompts[-1]
    # it survives a resume (the records are the memory) and prints on its own
    out = cli("journal", "--repo", str(repo), "--tag", "m")
    assert out.returncode == 0 and "Repeats caught and not run: 3" in out.stdout, out.stdout + out.stderr
    assert "Tried and not kept, by theme" in out.stdout and "- other constants: 4 tried" in out.stdout


def test_an_idea_made_ahead_that_the_best_already_holds_is_not_run(fake_repo):
    """Pipelined: the LLM's next idea is made on the old best while the current one trains; here it is the same
    change, which is kept. Carried over to the new best it changes nothing: it is asked again, never run (a
    real night ran one such empty change for a full run: benchmarks/scripted_llm.py)."""
    pytest.importorskip("openai")
    repo = fake_repo(fakes.ok(1.0))
    replies = [
        edit(OLD, bpb(0.9), "BPB down"),  # 2 keep
        edit(OLD, bpb(0.9), "BPB down (made ahead on the baseline)"),  # in the best once 2 is kept: asked again
        edit(bpb(0.9), bpb(0.8), "BPB down more"),  # 3 keep
    ]
    with FakeOpenAI(replies) as server:
        settings = Settings(
            repo=repo,
            tag="p",
            budget=1.0,
            timeout=20.0,
            proposer="llm",
            gate=Gate(mode="strict"),
            baseline_repeats=0,
            max_experiments=3,
            pipeline=True,
            options={"llm_base_url": server.base_url, "llm_model": "fake-model"},
        )
        run_loop(settings, echo=quiet)
        asked = len(server.requests)
    rows = read_rows(repo / "results.tsv")
    assert [(r.status, r.description) for r in rows[1:]] == [("keep", "BPB down"), ("keep", "BPB down more")]
    paths = Paths(repo, "p")
    assert all((paths.run_dir(n) / "diff.patch").read_text().strip() for n in (2, 3))  # no empty change ran
    assert asked >= 3  # the idea already in the best was made, and another asked for instead


def test_two_slots_never_run_the_same_idea_at_once(fake_repo, plan):
    repo = fake_repo(fakes.ok(1.0, sleep=0.3))
    same = fakes.ok(0.9, sleep=0.3)
    plan(
        [
            {"description": "idea A", "train": same},
            {"description": "idea A, made by the other slot", "train": same},
            {"description": "idea B", "train": fakes.ok(0.95, sleep=0.3)},
        ]
    )
    settings = Settings(
        repo=repo,
        tag="p",
        budget=1.0,
        timeout=20.0,
        proposer="fakes:Scripted",
        baseline_repeats=0,
        workers=2,
        executor_options={"gpus": ""},
        max_experiments=5,
    )
    run_loop(settings, echo=quiet)
    paths = Paths(repo, "p")
    records = [read_record(paths.run_dir(n)) for n in range(1, len(read_rows(paths.ledger)) + 1)]
    by_generation: dict[str, list] = {}
    for r in records:
        if r.info.get("fingerprint") and r.gate.decision != "duplicate":
            assert r.info["fingerprint"] not in by_generation.get(r.parent, []), r
            by_generation.setdefault(r.parent, []).append(r.info["fingerprint"])
    dup = next(r for r in records if r.description == "idea A, made by the other slot")
    assert dup.gate.decision == "duplicate" and "train" not in dup.timings, dup
    assert "running in this generation" in dup.reason or "duplicate of #" in dup.reason


def test_fingerprints_ignore_layout_and_comments_but_not_the_parent():
    a = "X = 1  # a comment\nprint(X)\n"
    b = "X = 1\n\n\nprint( X )  # other words\n"
    assert fingerprint(a, "p1") == fingerprint(b, "p1")
    assert fingerprint(a, "p1") != fingerprint(a, "p2")
    assert fingerprint(a, "p1") != fingerprint("X = 2\nprint(X)\n", "p1")
    assert journal([]).startswith("Kept changes")
    from orchestrator.proposers.memory import theme
    from orchestrator.store.ledger import Record

    older = Record(n=5, status="discard", description="jump: MATRIX_LR 0.04 -> 0.05, DEPTH 2 -> 1")  # no info.moved
    assert theme(older) == "learning rates"
    assert theme(Record(n=6, status="discard", description="swap in GELU")) == "architecture / code"


def test_hybrid_tunes_the_constant_a_kept_llm_idea_introduced_and_follows_the_better_source(fake_repo):
    """--proposer hybrid against a local OpenAI-compatible server: the LLM's first idea adds a constant GAIN
    (structural: the search could not have made it) and is kept; the search then tunes GAIN; afterwards the
    LLM only adds unused imports while the search keeps finding gains, and the bandit gives the search most ideas.
    Every idea's source is in its record."""
    pytest.importorskip("openai")
    repo = fake_repo(fakes.ok(1.0))
    structural = edit(OLD, OLD + "\nGAIN = 0.2  # [0.1, 0.9]\nBPB = BPB - GAIN", "subtract a new GAIN")
    useless = [edit("import time", f"import time\nimport os as _os{i}", f"import os ({i})") for i in range(30)]
    with FakeOpenAI([structural, *useless]) as server:
        settings = Settings(
            repo=repo,
            tag="h",
            budget=1.0,
            timeout=20.0,
            proposer="hybrid",
            baseline_repeats=0,
            max_experiments=24,
            pipeline=False,
            seed=3,
            options={"llm_base_url": server.base_url, "llm_model": "fake-model", "hybrid_tune": 3},
        )
        run_loop(settings, echo=quiet)
    paths = Paths(repo, "h")
    records = [read_record(paths.run_dir(n)) for n in range(1, len(read_rows(paths.ledger)) + 1)]
    ideas = [r for r in records[1:] if (r.group or r.n) == r.n]
    assert all(r.info.get("source") in ("llm", "search", "search-tune") for r in ideas), [r.info for r in ideas]
    first = ideas[0]
    assert first.info["source"] == "llm" and first.status == "keep" and "GAIN = 0.2" in git_show(repo, first.commit)
    tune = [r for r in ideas if r.info.get("source") == "search-tune"]
    assert len(tune) == 3 and all(r.info["tuning"] == first.n for r in tune), [r.info for r in ideas]
    assert all([m[0] for m in r.info["moved"]] == ["GAIN"] for r in tune)  # only the new constant
    later = [r.info["source"] for r in ideas if r.n > tune[-1].n]
    assert later.count("search") > later.count("llm"), later  # the source that keeps finding gains gets more


def test_a_failed_llm_idea_is_charged_to_the_llm_and_the_search_gets_its_turn(fake_repo):
    """Before anything is kept the sources take turns by their ideas; an LLM reply that does not apply is a
    crash row of the LLM's (it used to carry no source, so the LLM kept the turn and failed again)."""
    pytest.importorskip("openai")
    repo = fake_repo(fakes.ok(1.0))
    with FakeOpenAI([edit("NOT IN TRAIN.PY", "x = 1", "an edit that does not apply")]) as server:
        settings = Settings(
            repo=repo,
            tag="f",
            budget=1.0,
            timeout=20.0,
            proposer="hybrid",
            baseline_repeats=0,
            max_experiments=3,
            pipeline=False,
            seed=3,
            options={"llm_base_url": server.base_url, "llm_model": "fake-model"},
        )
        run_loop(settings, echo=quiet)
    paths = Paths(repo, "f")
    records = [read_record(paths.run_dir(n)) for n in (2, 3)]
    assert records[0].status == "crash" and records[0].info.get("source") == "llm", records[0].info
    assert records[1].info.get("source") == "search", records[1].info


def test_the_bandit_follows_the_better_rate_explores_the_uncertain_and_leaves_the_fruitless():
    from orchestrator.proposers.base import Context
    from orchestrator.proposers.hybrid import HybridProposer
    from orchestrator.store.ledger import Evidence, Record

    bandit = HybridProposer.__new__(HybridProposer)
    bandit.price, bandit.context = 2.0, Context(repo=None, tag="t", profile=None, seed=1)

    def idea(n: int, source: str, gain: float = 0.0, cost: float = 0.0) -> Record:
        gate = Evidence("keep", best_mean=1.0, mean=1.0 - gain) if gain else Evidence("discard")
        return Record(
            n=n,
            status="keep" if gain else "discard",
            description="",
            info={"source": source, "usage": {"cost": cost}},
            timings={"train": 10.0},
            gate=gate,
        )

    def share(history: list[Record], source: str) -> float:
        filler = [Record(n=900, status="discard", description="")]  # (the draw's seed: the history's length)
        return [bandit.choose(history + filler * i) for i in range(400)].count(source) / 400

    baseline = [Record(n=1, status="keep", description="baseline")]
    history = [*baseline]
    assert bandit.choose(history) == "llm"  # nothing kept yet: turns, the LLM first
    history += [idea(2, "llm")]
    assert bandit.choose(history) == "search"
    history += [idea(3, "search", gain=0.1), idea(4, "llm", gain=0.1, cost=0.02)]  # the LLM's $0.02 = 36 s
    assert 0.7 < share(history, "search") < 0.95  # the better rate (0.1 / 10 s vs 0.1 / 56 s); the LLM explored
    bandit.price = 1e9  # dollars are free: the LLM's idea cost 10 s too
    history += [idea(5, "llm", gain=0.5)]
    assert share(history, "llm") > 0.5  # the better rate now, on three ideas against one
    llm = [idea(100 + i, "llm", gain=0.05 if i % 3 == 0 else 0.0) for i in range(10)]  # 4 keeps in 10
    one = share([*baseline, idea(2, "search"), *llm], "llm")
    many = share([*baseline, *(idea(2 + i, "search") for i in range(10)), *llm], "llm")
    assert 0.7 < one < 0.97 and many > 0.99, (one, many)  # 1 fruitless idea: still explored; 10: left
    search = [idea(2 + i, "search", gain=0.05 if i % 4 == 0 else 0.0) for i in range(20)]  # 5 keeps in 20
    assert 0.5 < share([*baseline, *search, *llm], "llm") < 0.8  # close rates: both get a real share


def test_the_bandit_learns_from_ideas_measured_better_before_anything_is_kept():
    """Keeps come rarely, and late: an idea the gate measured better than the best (a lead, not kept yet) tells
    which source makes promising ideas; one measured worse counts as nothing found; a kept idea counts its keep,
    not the fresh runs of the best that follow in its group. (Under the keeps-only rule the two sources below
    would still take turns.)"""
    from orchestrator.proposers.base import Context
    from orchestrator.proposers.hybrid import HybridProposer
    from orchestrator.store.ledger import Evidence, Record

    bandit = HybridProposer.__new__(HybridProposer)
    bandit.price, bandit.context = 2.0, Context(repo=None, tag="t", profile=None, seed=1)

    def looked(n: int, source: str, mean: float, status: str = "discard", group: int | None = None) -> Record:
        return Record(
            n=n,
            status=status,
            description="",
            group=group,
            info={"source": source},
            timings={"train": 10.0},
            gate=Evidence(status, best_mean=1.0, mean=mean),
        )

    filler = [Record(n=900, status="discard", description="")]
    history = [Record(n=1, status="keep", description="baseline")]
    history += [looked(2 + 2 * i, "llm", 0.95) for i in range(4)]  # leads: 0.05 better each, none kept yet
    history += [looked(3 + 2 * i, "search", 1.02) for i in range(4)]  # worse than the best
    assert bandit.ideas(history) == {"llm": [(pytest.approx(0.05), 10.0)] * 4, "search": [(0.0, 10.0)] * 4}
    shares = [bandit.choose(history + filler * i) for i in range(200)].count("llm") / 200
    assert shares > 0.9, shares
    kept = [looked(20, "search", 0.9, "keep"), looked(21, "search", 1.0, "discard", group=20)]  # then a fresh run
    assert bandit.ideas(history + kept)["search"][-1] == (pytest.approx(0.1), 20.0)  # its keep's gain, both runs' cost


def test_the_tuning_of_an_idea_kept_on_a_later_run_goes_on_after_its_own_keep(fake_repo):
    """The LLM's idea #2 was kept on its 3rd run (#4, a repeat), the search's tuning #5 of it on its 2nd (#6): the
    tuning goes on from the LLM idea, found through the repeats (this raised StopIteration on every later call,
    a crash row each, before the idea's first run was looked up)."""
    from orchestrator.proposers.base import Context
    from orchestrator.proposers.hybrid import HybridProposer
    from orchestrator.store.ledger import Evidence, Record

    repo = fake_repo(fakes.ok(1.0))
    options = {"llm_model": "m", "llm_base_url": "http://127.0.0.1:9/v1"}  # (never called)
    hybrid = HybridProposer(Context(repo=repo, tag="t", profile="tiny", seed=1, options=options))
    moved = {"moved": [["BPB", "1.0", "0.9"]]}
    llm, tune = {"source": "llm", **moved}, {"source": "search-tune", "tuning": 4, **moved}
    kept = Evidence("keep", best_mean=1.0, mean=0.9)
    history = [
        Record(n=1, status="keep", description="baseline"),
        Record(n=2, status="discard", description="idea", info=llm),
        Record(n=3, status="discard", description="idea", group=2, info={**llm, "repeat": 2}),
        Record(n=4, status="keep", description="idea", group=2, info={**llm, "repeat": 3}, gate=kept),
        Record(n=5, status="discard", description="tune", info=tune),
        Record(n=6, status="keep", description="tune", group=5, info={**tune, "repeat": 2}, gate=kept),
    ]
    assert hybrid.tuning(history, bpb(0.9)) == (4, ["BPB"], 1)  # one tuning idea of 3 so far: it goes on
    # the first tuning idea at once; the rest only on the search's turns (here the LLM's rate is the better one)
    fruitless = [Record(n=100 + i, status="discard", description="s", info={"source": "search"}) for i in range(20)]
    filler = [Record(n=900, status="discard", description="")]  # (the draw's seed: the history's length)
    assert all(hybrid.route(history[:4] + filler * i, bpb(0.9))[0] == "search-tune" for i in range(20))
    later = [
        (hybrid.route(h, bpb(0.9)), hybrid.choose(h)) for h in (history + fruitless + filler * i for i in range(40))
    ]
    assert all(
        route == (("search-tune", (4, ["BPB"], 1)) if arm == "search" else ("llm", None)) for route, arm in later
    )
    assert sum(route[0] == "llm" for route, _ in later) >= 10  # (so the rule above was put to the test)
    history += [Record(n=7 + i, status="discard", description="tune", info=tune) for i in range(2)]
    assert hybrid.tuning(history, bpb(0.9)) is None  # 3 tuning ideas: the bandit's turn
    hybrid.close()


def git_show(repo, commit: str) -> str:
    import git

    return git.Repo(repo).git.show(f"{commit}:train.py")


def test_memory_survives_a_resume(fake_repo):
    """The memory is the records: an idea tried before the loop stopped is caught after it resumed."""
    pytest.importorskip("openai")
    repo = fake_repo(fakes.ok(1.0))
    with FakeOpenAI([edit(OLD, bpb(1.2), "BPB up")]) as server:
        settings = Settings(
            repo=repo,
            tag="r",
            budget=1.0,
            timeout=20.0,
            proposer="llm",
            baseline_repeats=0,
            max_experiments=2,
            pipeline=False,
            options={"llm_base_url": server.base_url, "llm_model": "fake-model"},
        )
        run_loop(settings, echo=quiet)  # baseline, BPB up (discarded); then stopped
        settings.max_experiments = 3
        run_loop(settings, echo=quiet)  # resumed: the same idea again
        prompts = server.prompts()
    rows = read_rows(repo / "results.tsv")
    assert "duplicate of #2 (discard at 1.200000): not run" in rows[2].description, rows[2].description
    assert "#2 BPB up: +0.2000" in prompts[1]  # the journal of the resumed loop knows #2
