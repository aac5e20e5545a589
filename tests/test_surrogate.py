"""The surrogate benchmark: the model fits and ranks, the fake train.py is deterministic for a seed and crashes
as often as it should, and search_quality.py drives the real proposers through the real loop."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks" / "surrogate"), str(ROOT / "benchmarks")]

pytest.importorskip("sklearn")

from fake import fake_train  # noqa: E402
from model import Encoding, Forest, Surrogate, fidelity, fit  # noqa: E402

from orchestrator.proposers.random_search import sample  # noqa: E402
from orchestrator.proposers.space import read_space, rounded  # noqa: E402

SOURCE = (ROOT / "train.py").read_text()


def synthetic(n: int, seed: int = 0, noise: float = 0.01):
    """Configurations of the tiny profile's space and a smooth made-up val_bpb with noise."""
    space, default = read_space(SOURCE, "tiny")
    enc = Encoding.from_space(space)
    centre = enc.row(default)
    rng = random.Random(seed)
    configs = [default] + [{n_: rounded(sample(p, rng), p.kind) for n_, p in space.items()} for _ in range(n - 1)]
    configs += [default] * 3  # repeats of the default: its spread
    values = [2.0 + sum((a - b) ** 2 for a, b in zip(enc.row(c), centre)) + rng.gauss(0, noise) for c in configs]
    return space, enc, configs, values


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    space, enc, configs, values = synthetic(60)
    path = tmp_path_factory.mktemp("surrogate") / "model.npz"
    fit(configs, values, enc).save(path)
    return path


@pytest.mark.slow
def test_the_model_ranks_held_out_configurations():
    space, enc, configs, values = synthetic(60)
    f = fidelity(configs, values, enc)
    assert f["spearman"] >= 0.8 and f["configs"] == 60
    trees = fidelity(configs, values, enc, fitter=lambda c, v, e: Forest("extra trees", c, v, e))  # --compare
    assert 0.5 <= trees["spearman"] < 1.0
    loaded = fit(configs, values, enc)
    mean, sd, crash = loaded.predict(configs[:2])
    assert mean[0] < mean[1] and 0.001 < sd[0] < 0.1 and crash.tolist() == [0.0, 0.0]  # no crash seen: none


def run_fake(workdir: Path, seed: int) -> str:
    proc = subprocess.run(
        [sys.executable, "train.py"],
        cwd=workdir,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "AUTOLOOP_SEED": str(seed)},
        timeout=60,
    )
    if proc.returncode:
        assert "surrogate: this configuration crashed" in proc.stderr, proc.stderr
        return "crash"
    return next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("val_bpb:"))


@pytest.mark.slow
def test_the_fake_train_py_is_deterministic_for_a_seed_and_crashes_as_often_as_predicted(model, tmp_path):
    def session(name: str, seed: int, runs: int, path: Path = model, noise_scale: float = 1.0) -> list[str]:
        d = tmp_path / name
        d.mkdir()
        (d / "train.py").write_text(fake_train(SOURCE, "tiny", path, d / "seen.json", noise_scale))
        return [run_fake(d, seed) for _ in range(runs)]

    a, b, c = session("a", 1, 3), session("b", 1, 3), session("c", 2, 3)
    assert a == b and a != c  # one sequence per seed
    assert len(set(a)) == 3  # repeats of one configuration differ (its noise)
    # --noise-scale: the same draws, each one's distance from the true value scaled
    _, default = read_space(SOURCE, "tiny")
    true = float(Surrogate.load(model).predict([default])[0][0])
    noiseless, tripled = session("quiet", 1, 2, noise_scale=0.0), session("loud", 1, 3, noise_scale=3.0)
    assert [float(v) for v in noiseless] == pytest.approx([true] * 2, abs=2e-6)
    for plain, loud in zip(a, tripled):
        assert float(loud) - true == pytest.approx(3 * (float(plain) - true), abs=1e-5)
    # a surrogate whose crash model says 30%: 40 runs crash between 4 and 22 times (binomial, p < 1e-3 outside)
    z = dict(Surrogate.load(model).a)
    z.update(crash_coef=z["crash_coef"] * 0, crash_intercept=math.log(0.3 / 0.7), crash_seen=True)
    crashy = tmp_path / "crashy.npz"
    Surrogate(z, Surrogate.load(model).encoding.dims).save(crashy)
    outcomes = session("d", 3, 40, crashy)
    assert 4 <= outcomes.count("crash") <= 22, outcomes.count("crash")


@pytest.mark.slow
def test_the_benchmark_drives_the_real_proposers_through_the_real_loop(model, tmp_path):
    from search_quality import NOOP, surrogate_session

    from orchestrator.store.ledger import read_record, read_rows
    from orchestrator.store.session import Paths

    for method in ("search", "tpe", NOOP):
        result = surrogate_session((str(model), "tiny", method, "noise", 0, 12, str(tmp_path)))
        repo = tmp_path / f"{method.replace(':', '.')}-noise-0" / "repo"
        rows = read_rows(repo / "results.tsv")
        assert len(rows) == len(result["best_true"]) == 12  # the real ledger, one row per experiment
        record = read_record(Paths(repo, "bench").run_dir(4))
        assert record.gate.decision and record.metrics.get("true_bpb") is not None  # the real gate
        assert result["best_true"][0] is not None
        if method == NOOP:  # every edit is a comment: the true value never moves
            assert len(set(result["best_true"])) == 1 and all(gain == 0 for gain, _ in result["candidates"])
        else:  # the proposer's edits change the configuration
            assert any(r.description.count("->") for r in rows[3:]), [r.description for r in rows]


def test_remeasure_runs_each_distinct_train_py_again_with_fresh_seeds(tmp_path):
    """Real-run comparisons score each session's best by fresh runs: each round on one new seed for all (paired),
    a best that is the default runs once for both, and a crash is None (its mean: infinitely bad)."""
    import git
    from search_quality import best_source, fresh_repo, mean_of, remeasure

    seed = "import os\nprint('val_bpb: ' + str(float(os.environ['AUTOLOOP_SEED'])))\n"
    sources = {"default": seed, "same": seed, "other": seed + "# another\n", "oom": "raise SystemExit('oom')\n"}
    scores = remeasure(sources, 3, 1.0, "tiny", 60, 1)
    assert scores["default"] is scores["same"]  # one train.py, run once
    assert scores["default"] == scores["other"] == [20000.0, 20001.0, 20002.0]  # a fresh seed per round, shared
    assert scores["oom"] == [None] * 3 and mean_of(scores["oom"]) == math.inf and mean_of([2.0, 3.0]) == 2.5
    repo = fresh_repo(tmp_path / "session")  # a session that kept nothing: its best is the default, byte for byte
    git.Repo(repo).git.branch("autoloop/bench")
    assert best_source(repo) == (ROOT / "train.py").read_text()


def test_a_memory_limit_makes_configurations_too_big_for_it_run_out_of_memory(model, tmp_path):
    """--oom-share: a crash region set by hand (the CPU collections have none), so crashes can be compared."""
    from fake import activations, memory_limit

    from orchestrator.proposers.space import apply_changes

    space, default = read_space(SOURCE, "tiny")
    limit, share = memory_limit(space, 0.3)
    assert activations(default) <= limit and 0.05 < share <= 0.3
    assert memory_limit(space, 0.1)[0] > limit  # a smaller share: a higher limit
    bigger = {"DEPTH": default["DEPTH"] * 2, "DEVICE_BATCH_SIZE": default["DEVICE_BATCH_SIZE"] * 4}
    assert activations({**default, **bigger}) > limit
    d = tmp_path / "oom"
    d.mkdir()
    fake = fake_train(SOURCE, "tiny", model, d / "seen.json", memory_limit=limit)
    (d / "train.py").write_text(fake)
    assert run_fake(d, 0) != "crash"  # the default fits
    (d / "train.py").write_text(apply_changes(fake, "tiny", bigger))
    for seed in (0, 1):  # every run of it, whatever the seed
        proc = subprocess.run(
            [sys.executable, "train.py"],
            cwd=d,
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "AUTOLOOP_SEED": str(seed)},
            timeout=60,
        )
        assert proc.returncode and "surrogate: out of memory" in proc.stderr, proc.stderr
