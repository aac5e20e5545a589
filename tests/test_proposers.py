"""Proposers: the constant parser, the contract for every built-in, and what `search` learns."""

from __future__ import annotations

import textwrap

import pytest
from conftest import ROOT

from orchestrator.contract import check_proposer, make_fake_repo, train_sources
from orchestrator.loop import Settings, run_loop
from orchestrator.proposers import available
from orchestrator.proposers.queue import Queue
from orchestrator.proposers.space import config_of
from orchestrator.store.hparams import read_constants, set_constant
from orchestrator.store.ledger import read_rows
from orchestrator.store.session import Paths

BUILTINS = ["search", "random", "tpe", "cmaes", "perturb", "queue"]


def test_every_builtin_is_registered():
    assert set(BUILTINS) <= set(available())


@pytest.mark.parametrize("name", BUILTINS)
def test_contract(name, tmp_path):
    if name in ("tpe", "cmaes"):
        pytest.importorskip("optuna")
        pytest.importorskip("cmaes")
    rows = check_proposer(name, tmp_path, experiments=6, setup=queue_three_ideas if name == "queue" else None)
    if name == "queue":  # the queue runs dry after three ideas: the loop ends there
        assert [r.description for r in rows] == ["baseline", "lower lr", "mode b", "deeper via patch"]
        assert [r.status for r in rows[1:]] == ["keep", "keep", "keep"]
    else:
        assert len(rows) == 6


def queue_three_ideas(repo):
    q = Queue(Paths(repo, "_").queue)
    q.add("lower lr", {"LR": "0.02"})
    q.add("mode b", {"MODE": "'b'"})
    q.add(
        "deeper via patch",
        patch="""--- a/train.py
+++ b/train.py
@@ -9,3 +9,3 @@
 WIDTH = 128  # channels  [16, 1024]
-DEPTH = 4  # layers  [1, 12]
+DEPTH = 5  # layers  [1, 12]
 WARMUP = 0.0  # share of the budget  [0.0, 0.5]
""",
    )


def test_parser_on_the_shipped_train_py():
    source = (ROOT / "train.py").read_text()
    cpu = {c.name: c for c in read_constants(source, "cpu")}
    assert cpu["DEPTH"].value == 4 and cpu["DEPTH"].profile == "cpu" and (cpu["DEPTH"].low, cpu["DEPTH"].high) == (1, 8)
    gpu = {c.name: c for c in read_constants(source, "gpu")}
    assert gpu["DEPTH"].value == 8 and (gpu["DEPTH"].low, gpu["DEPTH"].high) == (2, 24)  # bounds per profile
    assert (cpu["TOTAL_BATCH_SIZE"].low, cpu["TOTAL_BATCH_SIZE"].high) == (2**10, 2**15)
    assert cpu["TOTAL_BATCH_SIZE"].value == 2**12 and cpu["HEAD_DIM"].choices == (32, 64, 128)
    assert cpu["WINDOW_PATTERN"].choices == ("auto", "L", "SL", "SSL", "SSSL")
    assert "FINAL_EVAL_BATCH_SIZE" not in cpu  # [fixed]
    edited = set_constant(source, cpu["TOTAL_BATCH_SIZE"], 2**13)
    assert "cpu=2**13, tiny=2**9)  # tokens per optimizer step, about" in edited
    assert sum(a != b for a, b in zip(source.splitlines(), edited.splitlines())) == 1


def test_constants_beside_non_ascii_text_keep_their_exact_source():
    """Columns are UTF-8 byte offsets: a value after non-ASCII text (a comment, a string) is read and
    replaced exactly."""
    source = "# Hyperparameters\nNAME = 'café'; LR = 0.04  # débit [0.001, 1.0]\n"
    consts = {c.name: c for c in read_constants(source)}
    assert consts["LR"].text == "0.04" and consts["LR"].high == 1.0 and consts["NAME"].text == "'café'"
    assert set_constant(source, consts["LR"], 0.05).splitlines()[1] == "NAME = 'café'; LR = 0.05  # débit [0.001, 1.0]"


def test_parser_on_odd_layouts():
    source = textwrap.dedent("""\
        X = 1  # before the section: ignored
        # ---------------------------------------------------------------------------
        # Hyperparameters
        # ---------------------------------------------------------------------------
        NEG = -3  # offset  [-10, 10]
        SCI = 1e-4  # tiny rate [1e-6, 1e-2]
        POW = 2**8
        BETAS = (0.9, 0.95)  # a tuple
        NAME = 'x'  # {x, y, z}
        lower = 5
        MULTI = (
            1, 2)
        EXPR = some_function(3)
        A, B = 1, 2
        HASH = 3  # a comment with # inside and [brackets] mid-text
        # ---------------------------------------------------------------------------
        # Model
        # ---------------------------------------------------------------------------
        AFTER = 7
        """)
    consts = {c.name: c for c in read_constants(source)}
    assert list(consts) == ["NEG", "SCI", "POW", "BETAS", "NAME", "HASH"]
    assert consts["NEG"].value == -3 and (consts["NEG"].low, consts["NEG"].high) == (-10, 10)
    assert consts["SCI"].value == 1e-4 and consts["SCI"].high == 1e-2
    assert consts["POW"].value == 256 and consts["BETAS"].value == (0.9, 0.95)
    assert consts["NAME"].choices == ("x", "y", "z") and consts["HASH"].low is None
    out = set_constant(source, consts["NEG"], -4)
    assert "NEG = -4  # offset  [-10, 10]" in out
    out = set_constant(out, consts["SCI"], 3e-5)
    assert "SCI = 3e-05  # tiny rate [1e-6, 1e-2]" in out
    assert "POW = 2**9" in set_constant(source, consts["POW"], 512)
    assert config_of(source, None)["BETAS[1]"] == 0.95


def run_search(repo, n, seed=0, tag="s"):
    return run_loop(
        Settings(
            repo=repo,
            tag=tag,
            budget=1,
            timeout=30,
            proposer="search",
            max_experiments=n,
            seed=seed,
            baseline_repeats=0,
        ),
        echo=lambda line: None,
    )


@pytest.fixture(scope="module")
def search_session(tmp_path_factory):
    """One 40-experiment session of `search` on the fake bowl, for the tests that only read one. Its randomness is
    seeded by the history, so its first 30 runs are those a 30-experiment session makes."""
    repo = make_fake_repo(tmp_path_factory.mktemp("search") / "r")
    run_loop(
        Settings(
            repo=repo,
            tag="s",
            budget=1,
            timeout=30,
            proposer="search",
            max_experiments=40,
            seed=0,
            baseline_repeats=0,
            sandbox="off",
        ),
        echo=lambda line: None,
    )  # (before conftest's `unconfined`)
    return repo


def test_search_improves_never_repeats_and_avoids_the_crash_region(search_session):
    repo = search_session
    rows = read_rows(repo / "results.tsv")[:30]
    sources = train_sources(repo, "s", len(rows))
    configs = [config_of(s, None) for s in sources]
    assert len({tuple(sorted((k, repr(v)) for k, v in c.items())) for c in configs}) == len(configs)
    best = min(r.val_bpb for r in rows if r.status == "keep")
    assert best < rows[0].val_bpb - 0.05  # it finds real improvements on the bowl
    ooms = [i for i, r in enumerate(rows) if r.status == "crash"]
    assert 1 <= len(ooms) <= 3  # the fake runs out of memory at WIDTH >= 512, whatever its depth
    for i in ooms:  # each crash closes what is at least as wide and as deep (memory grows with both)
        assert not any(
            c["WIDTH"] >= configs[i]["WIDTH"] and c["DEPTH"] >= configs[i]["DEPTH"] for c in configs[i + 1 :]
        )
    for row in rows[1:]:
        assert " -> " in row.description  # e.g. "LR 0.04 -> 0.0567"


def test_search_closes_what_a_crash_of_a_bigger_model_covers_in_every_size_at_once():
    """Old: a crash after growing DEPTH closed every deeper model, whatever its micro-batch, so a deeper model
    that fits with fewer sequences per micro-batch was out of reach. Now the sizes that memory grows with are
    closed together; the total batch (more accumulated micro-steps when bigger) is not one of them; a region the
    best ran in is void."""
    from orchestrator.proposers.search import Regions
    from orchestrator.proposers.space import read_space

    space, best = read_space((ROOT / "train.py").read_text(), "tiny")
    regions = Regions(space)
    assert regions.names == ["DEPTH", "ASPECT_RATIO", "HEAD_DIM", "DEVICE_BATCH_SIZE"]
    deeper = {**best, "DEPTH": best["DEPTH"] * 2, "HEAD_DIM": 64}
    assert regions.grew(deeper, best) and not regions.grew({**best, "TOTAL_BATCH_SIZE": 4096}, best)
    regions.add(deeper)
    assert regions.closes(deeper, best)
    assert regions.closes({**deeper, "ASPECT_RATIO": 96, "TOTAL_BATCH_SIZE": 128}, best)  # as big, or bigger
    assert not regions.closes({**deeper, "DEVICE_BATCH_SIZE": best["DEVICE_BATCH_SIZE"] // 2}, best)
    assert not regions.closes({**deeper, "HEAD_DIM": 32}, best)
    assert not regions.closes({**best, "DEPTH": best["DEPTH"] + 1}, best)
    assert not regions.closes(deeper, deeper)  # the best ran there: that crash was not about memory
    assert not regions.closes({**deeper, "HEAD_DIM": "auto"}, best)  # a value edited by hand: not compared


def test_search_survives_a_restart(tmp_path):
    straight = make_fake_repo(tmp_path / "a")
    run_search(straight, 10)
    resumed = make_fake_repo(tmp_path / "b")
    run_search(resumed, 4)
    run_search(resumed, 10)  # a new proposer instance, rebuilt from results.tsv + records + git
    assert [r.description for r in read_rows(straight / "results.tsv")] == [
        r.description for r in read_rows(resumed / "results.tsv")
    ]


def test_search_learns_each_idea_once_from_its_decided_outcome():
    """A promising idea's first run reads `discard` in results.tsv while the gate runs it again: search must not
    learn 'discarded' from it (nor count its repeats as more tries); it learns the final decision."""
    from orchestrator.proposers.search import outcomes
    from orchestrator.store.ledger import Evidence, Record

    def rec(n, status, decision, group=None):
        return Record(n=n, status=status, description="x", commit="c", gate=Evidence(decision), group=group)

    pending = [rec(1, "keep", "keep"), rec(2, "discard", "rerun")]
    assert outcomes(pending) == {1: "keep", 2: None}
    assert outcomes(pending + [rec(3, "keep", "keep", group=2)])[2] == "keep"
    assert outcomes(pending + [rec(3, "discard", "discard", group=2)])[2] == "discard"
    assert outcomes([rec(1, "crash", "")])[1] == "crash"


def test_search_screens_first_then_jumps(search_session):
    """The first 10 ideas are local moves around the default (the screen); after it every idea is a jump of the
    model (TPE over every constant), except a push of a kept local move further the same way. Every idea's
    record names its move."""
    from orchestrator.store.ledger import read_record

    repo = search_session
    records = [read_record(Paths(repo, "s").run_dir(n)) for n in range(2, 41)]
    ideas = [r for r in records if r is not None and (r.group or r.n) == r.n]
    moves = [r.info.get("move") for r in ideas]
    assert moves[:10] == ["local"] * 10
    assert moves.count("model") >= 10
    kept = {r.group or r.n for r in records if r is not None and r.status == "keep"}
    pushes = [idea for idea in ideas[10:] if idea.info["move"] == "local" and idea.info.get("push")]
    # a local move past the screen that is not a push is the fallback for when TPE has nothing new: rare here
    assert len([i for i in ideas[10:] if i.info["move"] == "local"]) - len(pushes) <= 2
    for before, idea in zip(ideas, ideas[1:]):
        if idea.info.get("push"):  # the idea before it was a kept local move: the same constants, moved further
            assert before.info["move"] == "local" and before.n in kept, (before.description, idea.description)
            assert set(idea.info["changes"]) == set(before.info["changes"]), idea.description
    assert all(r.description.count(" -> ") <= 2 for r in ideas if r.info["move"] == "local")
    jumps = [r for r in ideas if r.info["move"] == "model"]
    assert all(r.description.startswith("jump: ") and r.description.count(" -> ") <= 4 for r in jumps)
    wide = next(r for r in jumps if len(r.info["changes"]) > 4)  # described in part, recorded in full
    assert wide.description.endswith(f", +{len(wide.info['changes']) - 4} more")


def test_search_starts_with_a_screen_of_one_constant_one_way_sizes_first(tmp_path):
    """The start-up ideas each move one constant one way from the best, never a (constant, direction) already
    tried from that best, and the sizes (WIDTH, DEPTH: both ways each, unless that configuration was tried or
    crashed) before anything else; a keep makes a new best, screened afresh."""
    repo = make_fake_repo(tmp_path / "r")
    run_search(repo, 11)
    rows = read_rows(repo / "results.tsv")
    configs = [config_of(s, None) for s in train_sources(repo, "s", len(rows))]
    best, seen, closed = configs[0], set(), set()
    for i, (row, config) in enumerate(zip(rows[1:], configs[1:]), 1):
        changed = {k: v for k, v in config.items() if v != best[k]}
        assert len(changed) == 1, row.description
        ((name, value),) = changed.items()
        move = (name, value if name == "MODE" else (1 if value > best[name] else -1))
        assert move not in seen, row.description
        sizes = (
            {
                (n, d)
                for n in ("WIDTH", "DEPTH")
                for d in (1, -1)  # both powers of two: one doubling
                if {**best, n: best[n] * 2**d} not in configs[:i]
            }
            - closed
        )
        assert name in ("WIDTH", "DEPTH") or sizes <= seen, row.description
        seen.add(move)
        if row.status == "crash" and move == ("WIDTH", 1):
            closed.add(move)  # out of memory at this width: wider is closed
        if row.status == "keep":
            best, seen = config, set()
    assert any(row.description.startswith("LR ") for row in rows)  # past the sizes, the rates


def test_search_proposes_the_same_idea_after_a_restart_past_its_start_up(search_session, tmp_path):
    """Two fresh instances on the same history (past the screen: local moves and TPE both in play) propose the same
    edit: the state is rebuilt from the history, the randomness seeded by it."""
    import shutil

    from orchestrator.proposers.base import Context
    from orchestrator.proposers.search import SearchProposer
    from orchestrator.store.ledger import read_record

    repo = search_session
    history = [r for r in (read_record(Paths(repo, "s").run_dir(n)) for n in range(1, 31)) if r is not None]
    assert {"model", "local"} <= {r.info.get("move") for r in history}
    proposals = []
    for k in range(2):
        work = tmp_path / f"w{k}"
        work.mkdir()
        shutil.copy(repo / "train.py", work / "train.py")
        proposal = SearchProposer(Context(repo=repo, tag="s", profile=None)).propose(work, history)
        proposals.append((proposal.description, proposal.info["move"], (work / "train.py").read_text()))
    assert proposals[0] == proposals[1]


def test_trials_keep_powers_of_two_and_survive_undeclared_values():
    """Jumps hold a power-of-two constant to powers of two within its bounds; a value the space no longer
    declares (a queued idea's choice, a value past today's range) is left out of its trial, not an error."""
    import optuna

    from orchestrator.proposers.space import Param
    from orchestrator.proposers.tpe import as_declared, finished_trials
    from orchestrator.store.ledger import Record

    batch = Param("B", "pow2", 2, 24)
    assert [as_declared(batch, v) for v in (1, 3, 5, 11, 23, 100)] == [2, 4, 4, 8, 16, 16]
    space = {"W": Param("W", "choice", choices=("a", "b")), "LR": Param("LR", "log", 1e-3, 1.0)}
    runs = [
        (Record(n=1, status="keep", description="base", val_bpb=1.0), {"W": "a", "LR": 0.01}),
        (Record(n=2, status="discard", description="x", val_bpb=1.2), {"W": "zzz", "LR": 0.02}),
        (Record(n=3, status="discard", description="x", val_bpb=1.4), {"W": "zzz", "LR": 0.02}),
        (Record(n=4, status="crash", description="x", cause="environment"), {"W": "b", "LR": 0.5}),
    ]
    trials = finished_trials(optuna, space, runs)
    assert [t.params for t in trials] == [{"W": "a", "LR": 0.01}, {"LR": 0.02}]  # the machine's crash: no trial
    assert [t.value for t in trials] == [1.0, pytest.approx(1.3)]  # one trial per configuration, its mean
