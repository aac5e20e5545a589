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


class TPEProposer(Proposer):
    """Rebuilds an in-memory optuna study from the history on every call, then asks TPE for the next point."""

    name = "tpe"

    def __init__(self, context: Context):
        super().__init__(context)
        try:
            import optuna
        except ImportError:
            raise LoopError("the tpe proposer needs optuna: pip install 'autoloop[optuna]'") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.configs = Configs(context.repo, context.profile)

    def propose(self, workdir: Path, history: list[Record]) -> Proposal | None:
        optuna = self.optuna
        path = workdir / "train.py"
        source = path.read_text()
        space, best = read_space(source, self.context.profile)
        dists = {name: distribution(p) for name, p in space.items()}
        sampler = optuna.samplers.TPESampler(seed=self.context.seed + len(history))
        study = optuna.create_study(direction="minimize", sampler=sampler)
        tried = {config_key(best)}
        for rec, cfg, _ in self.configs.moves(history):
            tried.add(config_key(cfg))
            if rec.status not in ("keep", "discard", "crash"):
                continue  # still training
            params = {n: cfg[n] for n in space if n in cfg and dists[n]._contains(dists[n].to_internal_repr(cfg[n]))}
            state = optuna.trial.TrialState.COMPLETE if rec.val_bpb is not None and rec.status != "crash" \
                else optuna.trial.TrialState.FAIL
            value = rec.val_bpb if state == optuna.trial.TrialState.COMPLETE else None
            study.add_trial(optuna.trial.create_trial(params=params, distributions={n: dists[n] for n in params},
                                                      value=value, state=state))
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
