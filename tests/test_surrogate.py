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
            assert len(set(result["best_true"])) == 1 and all(gain == 0 for gain, *_ in result["candidates"])
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


def synthetic_curves(configs: list[dict], values: list[float], seed: int = 0) -> list[dict]:
    """Training curves for synthetic(): loss at fraction f is val_bpb x (1 + slope (1 - f)), with a slope that
    grows with DEPTH (deeper: a slower start) and 2% run-to-run noise, correlated with nothing."""
    rng = random.Random(seed)
    return [
        {
            f"{0.1 * i:.1f}": v * (1 + 0.2 * c["DEPTH"] * (1 - 0.1 * i)) * math.exp(rng.gauss(0, 0.02))
            for i in range(1, 11)
        }
        for c, v in zip(configs, values)
    ]


@pytest.fixture(scope="module")
def curve_model(tmp_path_factory):
    space, enc, configs, values = synthetic(60)
    configs += [configs[5]] * 4  # a second configuration measured more than once
    values += [values[5] + random.Random(1).gauss(0, 0.01) for _ in range(4)]
    path = tmp_path_factory.mktemp("surrogate") / "curves.npz"
    fit(configs, values, enc, synthetic_curves(configs, values)).save(path)
    return path


@pytest.mark.slow
def test_the_surrogate_answers_with_a_curve_its_noise_and_a_slow_start(curve_model):
    s = Surrogate.load(curve_model)
    _, default = read_space(SOURCE, "tiny")
    offsets, sd, rho = s.predict_curve([{**default, "DEPTH": 1}, {**default, "DEPTH": 4}])
    assert s.has_curve and offsets.shape == (2, 10)
    # above the final value early, less so later; the deeper model further above (its slower start)
    assert offsets[1, 1] > offsets[0, 1] > offsets[0, 8] > -0.05
    assert offsets[1, 1] == pytest.approx(math.log(1 + 0.8 * 0.8), abs=0.15)
    assert float(sd.mean()) == pytest.approx(0.02, abs=0.005) and all(abs(r) < 0.8 for r in rho)  # 7 dof each
    space, enc, configs, values = synthetic(20)
    assert not fit(configs, values, enc).has_curve  # one fitted without curves has none (the fake prints none)


@pytest.mark.slow
def test_the_fake_prints_a_training_curve_the_controller_reads(curve_model, tmp_path):
    from orchestrator.trust.curve import parse_curve

    (tmp_path / "train.py").write_text(fake_train(SOURCE, "tiny", curve_model, tmp_path / "seen.json", pause=0.0))
    proc = subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "AUTOLOOP_SEED": "1"},
    )
    curve = parse_curve(proc.stdout)
    val = float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("val_bpb:")))
    assert list(curve) == [f"{0.1 * i:.1f}" for i in range(1, 11)]
    # the default (DEPTH 2) starts about 1.36x its final value and ends near it
    assert curve["0.2"] / val == pytest.approx(1 + 0.4 * 0.8, rel=0.12)
    assert curve["1.0"] / val == pytest.approx(1.0, rel=0.08)


@pytest.mark.slow
def test_the_benchmark_stops_losing_runs_of_the_real_loop_and_counts_their_compute(curve_model, tmp_path):
    import git
    from night_value import improvement, within
    from search_quality import surrogate_session, true_value

    from orchestrator.store.ledger import read_record
    from orchestrator.store.session import Paths

    result = surrogate_session(
        (str(curve_model), "tiny", "search", "noise", 0, 60, str(tmp_path), 1.0, None, (0.0, 40), "on", 20)
    )
    cost = result["cost"]
    stopped = [c for c in cost if c < 1]
    assert stopped and all(0.2 < c < 0.8 for c in stopped)  # losers stopped before the warm-down, after 20%
    assert 20 <= sum(cost) < 21 and len(cost) > 20  # resumed with more runs until 20 runs' worth is spent
    assert within(result, 20) == len(cost) - (sum(cost) > 20)
    assert improvement(result, 20) >= improvement(result, 10) >= 0
    repo = tmp_path / "search-noise-0" / "repo"  # a stopped run's true value is the model's, as the fake's is
    finished = next(
        r for r in map(read_record, map(Paths(repo, "bench").run_dir, range(4, 40))) if r and r.metrics.get("true_bpb")
    )
    source = git.Repo(repo).git.show(f"{finished.commit}:train.py")
    assert true_value(source, "tiny", str(curve_model)) == pytest.approx(finished.metrics["true_bpb"], abs=2e-6)
    stopped_ideas = [gain for gain, _, stop in result["candidates"] if stop]
    assert stopped_ideas and min(stopped_ideas) < -1.0  # stopped ideas count, with their true gain: losers mostly


def test_the_ceiling_is_a_configuration_no_single_move_improves():
    """night_value.ceiling, the best configuration a fitted model knows (the ceiling of any arm's improvement):
    below the baseline and below every random configuration it started from, and a local optimum: no value of
    any one dimension (on its grid) is better."""
    from night_value import ceiling, grid

    from orchestrator.proposers.random_search import sample
    from orchestrator.proposers.space import read_space

    model = ROOT / "benchmarks" / "surrogate" / "tiny-5s.npz"
    base, top, best = ceiling(model, "tiny", draws=500, starts=2)
    space, _ = read_space((ROOT / "train.py").read_text(), "tiny")
    surrogate = Surrogate.load(model)
    assert top < base and surrogate.predict([best])[0][0] == pytest.approx(top)
    rng = random.Random(0)
    drawn = [{n: sample(p, rng) for n, p in space.items()} for _ in range(200)]
    assert top <= surrogate.predict(drawn)[0].min()
    for name, p in space.items():
        assert surrogate.predict([{**best, name: v} for v in grid(p)])[0].min() >= top - 1e-9, name
