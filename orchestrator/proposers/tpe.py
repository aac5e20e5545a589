"""`tpe` and `cmaes`: optuna's TPE and CMA-ES samplers over the same space as `search` (baselines for it; the
model move of `search` is built from the same pieces)."""

from __future__ import annotations

import math
from pathlib import Path

from .. import LoopError
from ..store.ledger import Record
from .base import Context, Proposal, Proposer
from .space import Configs, Param, apply_changes, config_key, describe, read_space, rounded


def distribution(p: Param):
    import optuna.distributions as d

    if p.kind == "choice":
        return d.CategoricalDistribution(list(p.choices))
    if p.kind == "log":
        return d.FloatDistribution(p.low, p.high, log=True)
    if p.kind in ("linear", "unit"):
        return d.FloatDistribution(p.low, p.high)
    if p.kind == "pow2":
        return d.IntDistribution(max(int(p.low), 1), int(p.high), log=True)
    return d.IntDistribution(int(p.low), int(p.high))


def crashed(rec: Record) -> bool:
    return rec.status == "crash" or rec.val_bpb is None


class TPEProposer(Proposer):
    """Rebuilds an in-memory optuna study from the history on every call (one trial per configuration tried: its
    mean over runs), then asks TPE for the next point.
    A crashed configuration is not dropped: it is a trial that violates a constraint (optuna's constrained
    TPE), so TPE learns where configurations crash."""

    name = "tpe"

    def __init__(self, context: Context):
        super().__init__(context)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.configs = Configs(context.repo, context.profile)

    def study(self, seed: int, trials: list):
        """A study that knows the finished trials of the history."""
        return tpe_study(seed, trials)

    def propose(self, workdir: Path, history: list[Record]) -> Proposal | None:
        path = workdir / "train.py"
        source = path.read_text()
        space, best = read_space(source, self.context.profile)
        moves = [(rec, cfg) for rec, cfg, _ in self.configs.moves(history)]
        study = self.study(self.context.seed + len(history), finished_trials(self.optuna, space, moves))
        tried = {config_key(best)} | {config_key(cfg) for rec, cfg in moves if rec.cause != "environment"}
        changes = ask(study, space, best, tried)
        if changes is None:
            return None
        path.write_text(apply_changes(source, self.context.profile, changes))
        return Proposal(describe(best, changes))


def tpe_study(seed: int, trials: list, multivariate: bool | None = None, startup: int | None = None):
    """An in-memory TPE study holding `trials`; crashes are failed constraints. multivariate None: optuna's
    default (independent sampling in 4, multivariate in 5); startup: random trials before TPE models (None:
    optuna's default, 10)."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():  # constraints_func is deprecated in optuna 5; multivariate experimental in 4
        warnings.simplefilter("ignore")
        options = {} if multivariate is None else {"multivariate": multivariate, "warn_independent_sampling": False}
        if startup is not None:
            options["n_startup_trials"] = startup
        sampler = optuna.samplers.TPESampler(seed=seed, constraints_func=constraint_of, **options)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.add_trials(trials)
    return study


def fits(dist, value) -> bool:
    """Is value one the distribution can hold? (A queued idea or a hand edit may have set a choice that is no
    longer declared, or a value outside today's range: that parameter is left out of the trial.)"""
    try:
        return dist._contains(dist.to_internal_repr(value))
    except (ValueError, TypeError):
        return False


def learnable(rec: Record) -> bool:
    """A finished run whose result says something about its configuration: not still training, and not a
    crash or slowdown of the machine (cause environment, disturbed), which may be tried again."""
    return rec.status in ("keep", "discard", "crash") and rec.cause != "environment" and not rec.gate.disturbed


def finished_trials(optuna, space: dict[str, Param], moves: list[tuple[Record, dict]]) -> list:
    """The history as optuna trials, one per configuration tried: its mean val_bpb over its runs, or, when
    its first run crashed, the worst value seen with a failed constraint (so TPE learns where crashes are)."""
    dists = {name: distribution(p) for name, p in space.items()}
    runs: dict[tuple, list] = {}
    configs: dict[tuple, dict] = {}
    for rec, cfg in moves:
        if learnable(rec):
            configs.setdefault(config_key(cfg), cfg)
            runs.setdefault(config_key(cfg), []).append(None if crashed(rec) else rec.val_bpb)
    worst = max((v for values in runs.values() for v in values if v is not None), default=None)
    trials = []
    for key, values in runs.items():
        cfg, scored = configs[key], [v for v in values if v is not None]
        if values[0] is None and worst is None:
            continue  # nothing to rank a crash against yet
        params = {n: cfg[n] for n in space if n in cfg and fits(dists[n], cfg[n])}
        failed = values[0] is None or not scored
        trials.append(
            optuna.trial.create_trial(
                params=params,
                distributions={n: dists[n] for n in params},
                value=worst if failed else sum(scored) / len(scored),
                state=optuna.trial.TrialState.COMPLETE,
                user_attrs={"constraint": [1.0 if failed else 0.0]},
            )
        )
    return trials


def as_declared(p: Param, value):
    """A sampled value as train.py will hold it: rounded floats, powers of two for a power-of-two constant
    (its distribution is the integers on a log scale)."""
    if p.kind == "pow2":
        low, high = math.ceil(math.log2(max(p.low or 1, 1))), math.floor(math.log2(max(p.high or value, 1)))
        return 2 ** min(max(round(math.log2(max(value, 1))), low), max(low, high))
    return rounded(value, p.kind)


def ask(study, space: dict[str, Param], best: dict, tried: set, allowed=None) -> dict | None:
    """The changes to the best that the study's sampler proposes next (an untried configuration that
    `allowed(changes)` accepts, when given), or None."""
    import optuna

    dists = {name: distribution(p) for name, p in space.items()}
    for _ in range(50):
        trial = study.ask(dists)
        config = {n: as_declared(space[n], v) for n, v in trial.params.items()}
        changes = {
            k: v for k, v in config.items() if v != best[k] and not (isinstance(v, float) and math.isclose(v, best[k]))
        }
        study.tell(trial, state=optuna.trial.TrialState.FAIL)  # a placeholder; the real result comes later
        if changes and config_key({**best, **changes}) not in tried and (allowed is None or allowed(changes)):
            return changes
    return None


def constraint_of(trial) -> list[float]:
    """> 0: the configuration crashed (a failed constraint)."""
    return trial.user_attrs.get("constraint", [0.0])


class CMAESProposer(TPEProposer):
    """optuna's CMA-ES (needs the `cmaes` extra), stateless like `tpe`: each call starts a
    warm-started CMA-ES (WS-CMA-ES) whose initial mean and covariance are fitted to the history's trials (a
    crash counts as the worst value seen), and samples from it. Choices are sampled independently (CMA-ES is
    continuous)."""

    name = "cmaes"

    def __init__(self, context: Context):
        super().__init__(context)
        try:
            import cmaes  # noqa: F401
        except ImportError:
            raise LoopError(
                "the cmaes proposer needs cmaes: "
                'pip install "autoloop-ml[cmaes]" (in a clone: pip install -e ".[cmaes]")'
            ) from None

    def study(self, seed: int, trials: list):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental-feature warnings of source_trials
            sampler = self.optuna.samplers.CmaEsSampler(
                seed=seed, warn_independent_sampling=False, source_trials=trials or None
            )
        return self.optuna.create_study(direction="minimize", sampler=sampler)
