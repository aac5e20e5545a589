"""The value rule (`--gate value`): decide each candidate by what its runs say of its true effect, and run it
again only while another run is worth more than a run spent on a new idea.

- Ideas' true effects: a prior learned from this session's own candidates (their measured differences from the
  best they were judged against, each with its standard error): a spike at zero, worse ideas spread below it,
  better ones above it, fitted by maximum likelihood and drawn towards a skeptical default while the session
  has judged few ideas (`fit_prior`). Most ideas of a night do nothing or hurt; the prior learns how many.
- A candidate's posterior: the prior times the likelihood of its measured difference (the best's fresh runs'
  mean minus its runs' mean, standard error from the shrunk spreads, noise.py).
- Kept when the posterior chance that it is truly no better than the best is at most `WORSE` (so at most about
  that share of keeps are truly worse, where the prior is right), and its posterior mean gain is positive.
- Otherwise run again while the expected gain of deciding after k more runs, per run, beats what a run of a new
  idea is worth under the same prior (one run, kept by the same test), and while those runs can make it a keep
  at all (`HOPELESS`). Early in a night, when ideas are often large gains, a run is dear and a marginal
  candidate is dropped; late, when the ideas left are small, a close contender earns its runs.
Measured on the surrogate nights in benchmarks/README.md ("The value rule"): not the default yet.
Everything here is in val_bpb; improvements are positive (the best's mean minus the candidate's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

WORSE = 0.05  # a keep's posterior chance of being truly no better than the best, at most
PRIOR_WEIGHT = 6.0  # ideas' worth of the skeptical default prior in the fitted one
DEFAULT_SHARES = np.array([0.3, 0.5, 0.2])  # the default's shares of ideas that do nothing, hurt, help
SCALES = (2.0, 1.0)  # the default's scales (sd) of the worse ideas' spread and the better ones' (mode)
SLAB = 0.01  # the share of the prior spread flat over every effect (a heavy tail for surprises)
HEAVY_TAILS = False  # Student's t likelihood at the comparison's dof (on the surrogate: too few keeps early)
MARGIN_CAP = 40.0  # standard errors: the margin reported when no measured improvement up to it would be kept
HOPELESS = 0.01  # a candidate whose chance of becoming a keep within the runs looked ahead is below this: discarded
LOOKAHEAD = 6  # runs ahead at most that the value of information looks (and never past the looks left)
# the grid of true effects, in units of the run-to-run sd: fine near zero, where decisions are made
_GRID = np.unique(
    np.concatenate([np.linspace(-3, 3, 121), np.linspace(-12, -3, 19), np.linspace(3, 12, 19), [-40.0, 40.0]])
)
_WIDTHS = np.gradient(_GRID)  # each grid point's cell


@dataclass(frozen=True)
class Prior:
    """A distribution of ideas' true effects: weights on grid points (val_bpb)."""

    points: np.ndarray
    weights: np.ndarray

    def posterior(self, delta: float, se: float, dof: float = math.inf) -> np.ndarray:
        """The belief about the candidate's true improvement once `delta` was measured with standard error `se`
        (Student's t likelihood on `dof` degrees of freedom: a spread estimated from few runs has heavy tails)."""
        z = (delta - self.points) / se
        loglik = -0.5 * z**2 if not math.isfinite(dof) else -0.5 * (dof + 1) * np.log1p(z**2 / dof)
        w = self.weights * np.exp(loglik - loglik.max())
        return w / w.sum()


def fit_prior(observed: list[tuple[float, float]], sigma: float) -> Prior:
    """The prior of ideas' true effects from the session's judged candidates (delta, its se), in val_bpb: a
    spike at zero (changes that do nothing), worse ones spread exponentially below it, better ones as a
    gamma of shape 2 above it (its mode away from zero); their shares and scales fitted by maximum likelihood
    of the measured deltas on the grid, drawn towards the skeptical default (DEFAULT_SHARES, SCALES) with
    PRIOR_WEIGHT ideas' worth, and a thin flat slab (SLAB) under it all. A parametric prior, not a free one on
    the grid: noisy deltas cannot tell a spike at zero from mass smeared a little above it, and a free fit (the
    NPMLE, tried: benchmarks/README.md) smears it, which lets no-ops pass for small gains. `sigma` (the
    run-to-run sd) sets the scales."""
    from scipy.optimize import minimize

    obs = [(d, s) for d, s in observed if math.isfinite(d) and math.isfinite(s) and s > 0]
    start = np.array([*np.log(DEFAULT_SHARES), *np.log(SCALES)])
    if obs:
        d = np.array([x for x, _ in obs])[:, None] / sigma
        s = np.array([y for _, y in obs])[:, None] / sigma
        lik = np.exp(-0.5 * ((d - _GRID[None, :]) / s) ** 2) / s  # ideas x grid

        def nll(x: np.ndarray) -> float:
            shares = np.exp(x[:3] - np.logaddexp.reduce(x[:3]))
            marginal = lik @ _weights(shares, math.exp(x[3]), math.exp(x[4]))
            pull = PRIOR_WEIGHT * float(np.dot(DEFAULT_SHARES, np.log(shares)))  # pseudo-ideas of the default
            scales = 0.5 * float(((x[3:] - np.log(SCALES)) ** 2).sum())  # log-normal about the default, sd 1
            return -float(np.log(np.maximum(marginal, 1e-300)).sum()) - pull + scales

        bounds = [(-12.0, 3.0)] * 3 + [(math.log(0.05), math.log(30.0)), (math.log(0.05), math.log(10.0))]
        start = minimize(nll, start, method="L-BFGS-B", bounds=bounds).x
    shares = np.exp(start[:3] - np.logaddexp.reduce(start[:3]))
    return Prior(_GRID * sigma, _weights(shares, math.exp(start[3]), math.exp(start[4])))


def _weights(shares: np.ndarray, down: float, up: float) -> np.ndarray:
    """The prior on _GRID (units of sd): shares of the spike (on the grid's zero), the worse side
    (exponential, scale `down`) and the better side (gamma of shape 2, scale `up`), each integrated over the
    grid's cells."""
    g = _GRID
    spike = (g == 0).astype(float)
    worse = np.where(g < 0, np.exp(np.minimum(g, 0) / down), 0.0) * _WIDTHS
    better = np.where(g > 0, g * np.exp(-np.maximum(g, 0) / up), 0.0) * _WIDTHS
    flat = np.where(g != 0, _WIDTHS, 0.0)  # a thin slab over the whole grid: a large effect, measured, is believed
    parts = [shares[0] * spike, shares[1] * worse / worse.sum(), shares[2] * better / better.sum()]
    return (1 - SLAB) * sum(parts) + SLAB * flat / flat.sum()


@dataclass(frozen=True)
class Belief:
    worse: float  # posterior chance that the candidate is truly no better than the best
    mean: float  # posterior mean of its true improvement


def belief(prior: Prior, delta: float, se: float, dof: float = math.inf) -> Belief:
    post = prior.posterior(delta, se, dof)
    return Belief(float(post[prior.points <= 0].sum()), float(post @ prior.points))


def keepable(b: Belief) -> bool:
    return b.worse <= WORSE and b.mean > 0


def _nodes(count: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """Gauss-Hermite nodes and weights for an expectation over a standard normal."""
    x, w = np.polynomial.hermite_e.hermegauss(count)
    return x, w / w.sum()


def _decided(prior: Prior, post: np.ndarray, s_new: float) -> tuple[float, float]:
    """Once a measurement of sd s_new is added to the belief `post`: the expected posterior gain of what would
    then be kept (0 where it would not be), and the chance that it would be kept, over that measurement's
    predictive distribution."""
    points = prior.points
    live = post > 1e-9
    mu, p = points[live], post[live]
    x, w = _nodes()
    obs = mu[:, None] + s_new * x[None, :]  # true effect x node
    lik = np.exp(-0.5 * ((obs[..., None] - points[None, None, :]) / s_new) ** 2)  # x grid
    q = post[None, None, :] * lik
    q /= q.sum(axis=2, keepdims=True)
    worse = q[..., points <= 0].sum(axis=2)
    mean = q @ points
    take = (worse <= WORSE) & (mean > 0)
    weight = p[:, None] * w[None, :]
    return float((weight * np.where(take, mean, 0.0)).sum()), float((weight * take).sum())


def gain_after(prior: Prior, delta: float, se: float, se_after: float, dof: float = math.inf) -> tuple[float, float]:
    """Deciding after more runs bring the standard error from `se` to `se_after`: the expected gain (the
    posterior mean of what would then be kept, 0 where it would not be, averaged over what the runs may show),
    and the chance that it would then be kept."""
    if se_after >= se:
        return 0.0, 0.0
    s_new = 1.0 / math.sqrt(1.0 / se_after**2 - 1.0 / se**2)  # the sd of what the new runs alone measure
    return _decided(prior, prior.posterior(delta, se, dof), s_new)


def run_value(prior: Prior, se_one: float) -> float:
    """What a run spent on a new idea is worth, in expected val_bpb gained: one run of it against the best
    (standard error se_one), kept by the same test."""
    return _decided(prior, prior.weights, se_one)[0]


def keep_margin(prior: Prior, se: float, dof: float = math.inf) -> float:
    """The least measured improvement that is kept at this standard error (bisection; MARGIN_CAP standard
    errors when none up to that is)."""
    lo, hi = 0.0, MARGIN_CAP * se
    if not keepable(belief(prior, hi, se, dof)):
        return hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if keepable(belief(prior, mid, se, dof)) else (mid, hi)
    return hi


@dataclass(frozen=True)
class Choice:
    decision: str  # keep | rerun | discard
    belief: Belief
    cost: float  # a new idea's run's worth
    worth: float  # the best expected gain per run of running this candidate again (0: not asked)
    margin: float
    why: str


def decide(prior: Prior, delta: float, se: float, se_next: list[float], se_one: float, dof: float = math.inf) -> Choice:
    """Keep, run again or discard a candidate measured `delta` better than the best with standard error `se` on
    `dof` degrees of freedom; `se_next[k-1]` is the standard error after k more runs (as the loop would
    allocate them; [] when it has no look left), `se_one` a new idea's standard error on its one run."""
    b = belief(prior, delta, se, dof)
    margin = keep_margin(prior, se, dof)
    if keepable(b):
        return Choice("keep", b, 0.0, 0.0, margin, f"beats the best: P(no better) {b.worse:.3f} <= {WORSE:g}")
    cost = run_value(prior, se_one)
    ahead = [gain_after(prior, delta, se, s, dof) for s in se_next]
    worth = max((gain / k for k, (gain, _) in enumerate(ahead, 1)), default=0.0)
    chance = max((p for _, p in ahead), default=0.0)  # of becoming a keep within the runs looked ahead
    if worth > cost and chance >= HOPELESS:
        ratio = worth / max(cost, 1e-12)
        why = f"promising (P(no better) {b.worse:.2f}; a run of it is worth {ratio:.1f}x a new idea's)"
        return Choice("rerun", b, cost, worth, margin, why)
    if not se_next:
        why = f"not better beyond the noise after its last look (P(no better) {b.worse:.2f})"
    elif chance < HOPELESS:
        why = (
            f"hopeless: {len(se_next)} more run(s) would make it a keep {chance:.1%} of the time "
            f"(P(no better) {b.worse:.2f})"
        )
    else:
        why = (
            f"another run is worth less than a new idea's ({worth / max(cost, 1e-12):.2f}x; P(no better) {b.worse:.2f})"
        )
    return Choice("discard", b, cost, worth, margin, why)
