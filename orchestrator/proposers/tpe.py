"""`tpe`: optuna's TPE sampler over the same space as `search` (needs the `optuna` extra)."""

from __future__ import annotations

import math
from pathlib import Path

from .. import LoopError
from ..ledger import Record
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
    """Rebuilds an in-memory optuna study from the history on every call, then asks TPE for the next point.
    A crashed configuration is not dropped: it is a trial that violates a constraint (optuna's constrained
    TPE), so TPE learns where configurations crash."""

    name = "tpe"

    def __init__(self, context: Context):
        super().__init__(context)
        try:
            import optuna
        except ImportError:
            raise LoopError(f"the {self.name} proposer needs optuna: pip install 'autoloop[optuna]'") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.configs = Configs(context.repo, context.profile)

    def study(self, seed: int, trials: list):
        """A study that knows the finished trials of the history."""
        import warnings

        with warnings.catch_warnings():  # optuna 5 deprecates constraints_func for set_constraint (not in 4)
            warnings.simplefilter("ignore", FutureWarning)
            sampler = self.optuna.samplers.TPESampler(seed=seed, constraints_func=constraint_of)
        study = self.optuna.create_study(direction="minimize", sampler=sampler)
        study.add_trials(trials)
        return study

    def propose(self, workdir: Path, history: list[Record]) -> Proposal | None:
        optuna = self.optuna
        path = workdir / "train.py"
        source = path.read_text()
        space, best = read_space(source, self.context.profile)
        dists = {name: distribution(p) for name, p in space.items()}
        trials = []
        tried = {config_key(best)}
        moves = [(rec, cfg) for rec, cfg, _ in self.configs.moves(history)]
        worst = max((rec.val_bpb for rec, _ in moves if not crashed(rec)), default=None)
        for rec, cfg in moves:
            tried.add(config_key(cfg))
            if rec.status not in ("keep", "discard", "crash"):
                continue  # still training
            params = {n: cfg[n] for n in space if n in cfg and dists[n]._contains(dists[n].to_internal_repr(cfg[n]))}
            if crashed(rec) and worst is None:
                continue  # nothing to rank a crash against yet
            trials.append(optuna.trial.create_trial(
                params=params, distributions={n: dists[n] for n in params},
                value=worst if crashed(rec) else rec.val_bpb, state=optuna.trial.TrialState.COMPLETE,
                user_attrs={"constraint": [1.0 if crashed(rec) else 0.0]}))
        study = self.study(self.context.seed + len(history), trials)
        for _ in range(50):
            trial = study.ask(dists)
            config = {n: rounded(v, space[n].kind) for n, v in trial.params.items()}
            changes = {k: v for k, v in config.items() if v != best[k] and not (isinstance(v, float) and
                                                                                 math.isclose(v, best[k]))}
            study.tell(trial, state=optuna.trial.TrialState.FAIL)  # placeholder; the real result comes later
            if changes and config_key({**best, **changes}) not in tried:
                path.write_text(apply_changes(source, self.context.profile, changes))
                return Proposal(describe(best, changes))
        return None


def constraint_of(trial) -> list[float]:
    """> 0: the configuration crashed (a failed constraint)."""
    return trial.user_attrs.get("constraint", [0.0])


class CMAESProposer(TPEProposer):
    """optuna's CMA-ES (needs the `optuna` extra, with cmaes), stateless like `tpe`: each call starts a
    warm-started CMA-ES (WS-CMA-ES) whose initial mean and covariance are fitted to the history's trials (a
    crash counts as the worst value seen), and samples from it. Choices are sampled independently (CMA-ES is
    continuous)."""

    name = "cmaes"

    def __init__(self, context: Context):
        super().__init__(context)
        try:
            import cmaes  # noqa: F401
        except ImportError:
            raise LoopError("the cmaes proposer needs cmaes: pip install 'autoloop[optuna]'") from None

    def study(self, seed: int, trials: list):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental-feature warnings of source_trials
            sampler = self.optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False,
                                                        source_trials=trials or None)
        return self.optuna.create_study(direction="minimize", sampler=sampler)
