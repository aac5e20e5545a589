"""Noise-aware decisions: keep a change only when its runs show that it beats the best beyond run-to-run noise.

Upstream keeps any lower val_bpb, so a change that does nothing is kept about half the time. Here:

- Every configuration has its own spread. A configuration's variance is its own runs' sample variance shrunk
  towards a reference fitted to the other configurations measured more than once (empirical Bayes, as limma
  moderates variances: `reference_spread`), so one volatile candidate never widens the margin of the
  candidates after it, and a configuration with a single run borrows a typical spread.
- Candidate and best are compared by Welch's t test (unequal variances, Satterthwaite's degrees of freedom);
  early, with only the two measured, by the pooled two-sample t test.
- The test is sequential: a candidate has up to `max_repeats` looks, one after each of its runs. At look k it is
  kept when t clears the one-sided quantile at its share of `alpha` (shares growing as k**SPEND and summing to
  alpha: Bonferroni over the looks, so a change that does nothing is kept with probability about `alpha` at
  most however many runs it gets; simulated in benchmarks/README.md), discarded when t is not above the
  futility bound (hopeless: it stops early), and otherwise run again.
- A shorter train.py is kept when it is not worse by more than SIMPLER_T standard errors (upstream's
  simplicity criterion; these keeps are outside the false-keep budget: they trade a little val_bpb for code).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

PRIOR_DOF = 8  # how many runs' worth the reference spread counts for in a configuration's variance, at most
PARENT_RUNS = 12  # runs of the best at most that a pending candidate asks for (they serve later ones too)
COMPARISON_RUNS = 3  # runs of the best at most that one candidate's comparison asks for
FLOOR = 67.0  # every look's weight has this added: early looks keep a share however steep SPEND is
SPEND = 4.0  # the false-keep budget of look k grows as k**SPEND (benchmarks/README.md: the keep gate)
FUTILITY = (0.0, 0.5, 1.0, 1.25, 1.5)  # t at look 1, 2, ..., 5 and later not above which: discarded, no more runs
MIN_PRIOR_DOF = 2  # the reference counts for at least this many runs, however much configurations differ
SIMPLER_T = 1.0  # a shorter train.py may be worse by at most this many standard errors
RESOLUTION = 1e-6  # val_bpb is printed to 6 decimals: no spread or standard error is taken below this
# Every run so far identical (a deterministic CPU run at a small budget): a difference under this share of the
# value is run again before it counts, as one optimizer step more or less moves a short run about this much (the
# no-op edit of issue #45 moved val_bpb 1.04% by reaching one step count differently).
JITTER = 0.02


@dataclass
class Gate:
    mode: str = "noise"  # value (value.py) | noise (a false-keep rate) | strict (upstream: keep if lower at all)
    alpha: float = 0.035  # the chance, at most, that a change that does nothing is kept (one-sided, all looks)
    min_delta: float = 0.0  # a kept change must also be better by this much, in val_bpb
    max_repeats: int = 10  # runs of one candidate at most, the first included (its looks)
    early_stop: str = "off"  # on: a candidate's run clearly behind the best's curves is stopped (trust/curve.py)
    bundle: int = 3  # parked near misses that are tried together as one idea (0: never; bundle.py)


@dataclass(frozen=True)
class Spread:
    """The reference variance between runs of one configuration (fitted to the configurations measured more
    than once), and how many runs' worth it counts for (0: nothing measured yet)."""

    var: float | None
    dof: int

    @property
    def sd(self) -> float | None:
        return None if self.var is None else math.sqrt(self.var)


def reference_spread(groups: list[list[float]]) -> Spread:
    """The typical spread of groups of runs of one configuration each, and how many runs' worth it is: an
    empirical-Bayes fit of the groups' sample variances (Smyth's moderated variances, as limma does). The
    reference is the median of the log-variances, each corrected to be median-unbiased for its degrees of
    freedom (one volatile configuration barely moves it). Its worth follows from how much more the
    log-variances scatter than sampling alone makes them (trigamma(d/2) each): alike configurations give a
    reference worth many runs (PRIOR_DOF at most), configurations whose spreads truly differ one worth few
    (MIN_PRIOR_DOF at least), so each is judged mostly on its own runs."""
    from scipy.special import digamma, polygamma
    from scipy.stats import chi2

    measured = [g for g in groups if len(g) >= 2]
    if not measured:
        return Spread(None, 0)
    dofs = [len(g) - 1 for g in measured]
    variances = [max(statistics.variance(g), RESOLUTION**2) for g in measured]
    centre = statistics.median(math.log(v) - math.log(float(chi2.median(d)) / d) for v, d in zip(variances, dofs))
    if len(measured) < 3:  # too few to see how the spreads differ: worth their runs
        dof = float(sum(dofs))
    else:
        logs = [math.log(v) - float(digamma(d / 2)) + math.log(d / 2) for v, d in zip(variances, dofs)]
        excess = statistics.variance(logs) - statistics.fmean(float(polygamma(1, d / 2)) for d in dofs)
        dof = math.inf if excess <= 0 else 2 * _trigamma_inverse(excess)
    return Spread(math.exp(centre), int(min(PRIOR_DOF, max(MIN_PRIOR_DOF, dof))))


def _trigamma_inverse(y: float) -> float:
    """x with trigamma(x) = y (Newton's method on 1/x, as Smyth does)."""
    from scipy.special import polygamma

    if y > 1e7:
        return 1 / math.sqrt(y)
    x = 0.5 + 1 / y
    for _ in range(50):
        tri = float(polygamma(1, x))
        step = tri * (1 - tri / y) / float(polygamma(2, x))
        x += step
        if -step / x < 1e-8:
            break
    return x


def pooled_spread(groups: list[list[float]]) -> Spread:
    """The variance pooled over groups (each about its own mean), on all their degrees of freedom."""
    dof = sum(len(g) - 1 for g in groups)
    ss = sum(sum((x - statistics.fmean(g)) ** 2 for x in g) for g in groups)
    return Spread(ss / dof if dof else None, dof)


@dataclass(frozen=True)
class Sample:
    """One configuration's runs: mean, shrunk variance and its degrees of freedom."""

    n: int
    mean: float
    var: float
    dof: float

    @property
    def sd(self) -> float:
        return math.sqrt(self.var)


def sample(values: list[float], ref: Spread) -> Sample:
    n, mean = len(values), statistics.fmean(values)
    ss = sum((x - mean) ** 2 for x in values)
    prior_dof = ref.dof if ref.var is not None else 0
    dof = prior_dof + n - 1
    var = (prior_dof * (ref.var or 0.0) + ss) / dof if dof else 0.0
    return Sample(n, mean, var, dof)


@dataclass
class Verdict:
    decision: str  # keep | discard | rerun
    margin: float  # the improvement that would have been kept at this look (threshold x standard error)
    delta: float  # best mean - candidate mean (positive: the candidate is better)
    why: str
    evidence: dict = field(default_factory=dict)  # the test, its statistic and threshold (record.json gate)


def load_statistics() -> None:
    """Import scipy's statistics (a second or so on a loaded machine): the CLI's other commands start without."""
    import scipy.special  # noqa: F401
    import scipy.stats  # noqa: F401


def t_quantile(p: float, dof: float) -> float:
    from scipy import stats  # imported on first use: the CLI starts without it

    return float(stats.t.ppf(p, dof)) if dof > 0 else math.inf


def look_alpha(gate: Gate, look: int) -> float:
    """The share of the false-keep budget spent at this look: growing with the look (k^SPEND), since early
    looks, on one or two runs, can only keep large effects anyway; the shares sum to `alpha`."""
    weights = [k**SPEND + FLOOR for k in range(1, gate.max_repeats + 1)]
    return gate.alpha * weights[min(look, gate.max_repeats) - 1] / sum(weights)


def threshold(gate: Gate, look: int, dof: float) -> float:
    """One look's one-sided critical t (Bonferroni over the looks: the false-keep rate stays under alpha)."""
    return t_quantile(1.0 - look_alpha(gate, look), dof)


def parent_first(candidate: list[float], best: list[float], others: list[list[float]], asked: int = 0) -> bool:
    """Would a run of the best sharpen the comparison more than another run of the candidate? (The run that
    shrinks the standard error of the difference most; a tie goes to the best, whose runs serve every later
    candidate too.) Never beyond PARENT_RUNS runs of the best, nor when this comparison has `asked` for
    COMPARISON_RUNS already: a best whose runs keep scattering (a machine drifting in speed) would otherwise
    take every run, while the candidate's next run is what decides."""
    if len(best) >= PARENT_RUNS or asked >= COMPARISON_RUNS:
        return False
    c, b, ref = samples(candidate, best, others)
    return ref.var is not None and b.var > 0 and b.var / (b.n * (b.n + 1)) >= c.var / (c.n * (c.n + 1))


def significant_lines(source: str) -> int:
    """Lines of code that count for the simplicity criterion: not blank, not comments."""
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def welch(c: Sample, b: Sample) -> tuple[float, float]:
    """Standard error of the difference of means and Welch-Satterthwaite degrees of freedom."""
    vc, vb = c.var / c.n, b.var / b.n
    se = math.sqrt(vc + vb)
    parts = (vc * vc / c.dof if c.dof else math.inf if vc else 0.0) + (
        vb * vb / b.dof if b.dof else math.inf if vb else 0.0
    )
    dof = (vc + vb) ** 2 / parts if parts and math.isfinite(parts) else 0.0
    return se, dof


def samples(candidate: list[float], best: list[float], others: list[list[float]]) -> tuple[Sample, Sample, Spread]:
    """The two configurations' samples and the reference spread they were shrunk towards. Early, with no other
    configuration run twice, the two's own runs are all there is: one variance pooled over both (the classic
    two-sample t test, its degrees of freedom shared between them)."""
    ref = reference_spread(others)
    if ref.var is not None:
        return sample(candidate, ref), sample(best, ref), ref
    ref = pooled_spread([candidate, best])
    var = ref.var or 0.0
    return (
        Sample(len(candidate), statistics.fmean(candidate), var, ref.dof),
        Sample(len(best), statistics.fmean(best), var, ref.dof),
        ref,
    )


def judge(
    candidate: list[float],
    best: list[float],
    others: list[list[float]],
    gate: Gate,
    shorter: bool,
    ideas: list[tuple[float, float]] | None = None,
) -> Verdict:
    """Decide on the candidate's runs so far (this is look len(candidate)) against the best's runs; `others`
    are the runs of every other configuration (they give the reference spread), `ideas` the session's earlier
    candidates' measured improvements and their standard errors (the value rule's prior: value.py)."""
    delta = statistics.fmean(best) - statistics.fmean(candidate)
    look = len(candidate)
    more = look < gate.max_repeats
    if gate.mode == "strict":
        return Verdict("keep" if delta > 0 else "discard", 0.0, delta, "strict: lower is kept", {"test": "strict"})
    c, b, ref = samples(candidate, best, others)
    if ref.var is None:  # nothing measured twice (--baseline-repeats 0): upstream's rule until something is
        decision = "keep" if delta > gate.min_delta else "discard"
        why = "spread unknown (no configuration run twice yet): lower is kept"
        return Verdict(decision, gate.min_delta, delta, why, {"test": "none", "look": look, "looks": gate.max_repeats})
    se, dof = welch(c, b)
    if c.var == b.var and c.dof == b.dof == ref.dof:  # early, one pooled variance: the classic t test's dof
        dof = ref.dof
    if ref.var <= (10 * RESOLUTION) ** 2 and abs(delta) < JITTER * abs(b.mean):  # every run so far identical
        if look == 1:  # identical runs say the spread is small, not zero: its own second run shows what it is
            decision = "rerun" if more and delta > gate.min_delta else "discard"
            why = "the runs so far are identical: a spread of 0 is not proof; " + (
                "running it again" if decision == "rerun" else "not better"
            )
            return Verdict(decision, 0.0, delta, why, {"test": gate.mode, "look": look, "looks": gate.max_repeats})
        own = statistics.variance(candidate)  # its own spread, not shrunk towards the best's zero
        c = Sample(c.n, c.mean, max(own, RESOLUTION**2), c.n - 1)
        se, dof = welch(c, b)
    if gate.mode == "value":
        return judge_value(candidate, c, b, ref, se, dof, gate, shorter, ideas or [])
    q = threshold(gate, look, dof)
    se = max(se, RESOLUTION)  # every run of both alike: as exact as the printed value
    t = delta / se
    margin = max(gate.min_delta, q * se)
    evidence = {
        "test": "welch-t",
        "t": t,
        "threshold": q,
        "dof": dof,
        "se": se,
        "look": look,
        "looks": gate.max_repeats,
        "alpha": look_alpha(gate, look),
        "sd": c.sd,
        "best_sd": b.sd,
        "best_runs": b.n,
        "ref_sd": ref.sd,
        "ref_dof": ref.dof,
    }
    if t > q and delta > gate.min_delta:
        return Verdict("keep", margin, delta, f"beats the best: t {t:.2f} > {q:.2f}", evidence)
    if shorter and t > -SIMPLER_T:
        return Verdict(
            "keep",
            margin,
            delta,
            f"simplification: shorter, and not worse by more than {SIMPLER_T:g} standard error",
            evidence,
        )
    bound = FUTILITY[min(look, len(FUTILITY)) - 1]
    if more and t > bound:
        return Verdict("rerun", margin, delta, f"promising (t {t:.2f}): run again", evidence)
    why = (
        f"not better beyond the noise after {look} run(s) (t {t:.2f})"
        if not more
        else f"hopeless: t {t:.2f} <= {bound:g} at run {look}"
    )
    return Verdict("discard", margin, delta, why, evidence)


def judge_value(
    candidate: list[float],
    c: Sample,
    b: Sample,
    ref: Spread,
    se: float,
    dof: float,
    gate: Gate,
    shorter: bool,
    ideas: list[tuple[float, float]],
) -> Verdict:
    """The value rule (value.py): keep when the candidate is very likely better, run it again while another run
    is worth more than a new idea's, else discard. The likelihood is normal at the comparison's standard error
    (value.HEAVY_TAILS: Student's t at its degrees of freedom, tried, kept too little early)."""
    from . import value

    delta, look = b.mean - c.mean, len(candidate)
    se = max(se, RESOLUTION)
    dof = dof if dof > 0 else 1.0
    if not value.HEAVY_TAILS:
        dof = math.inf
    sigma = max(ref.sd or 0.0, RESOLUTION)
    prior = value.fit_prior(ideas, sigma)
    ahead = min(value.LOOKAHEAD, gate.max_repeats - look)
    best_more = max(0, COMPARISON_RUNS - (b.n - 1))  # runs of the best the comparison may still ask for (about)
    se_next = [  # after k more runs, shared between the two as the loop shares them (the one that helps more)
        min(math.sqrt(c.var / (c.n + k - j) + b.var / (b.n + j)) for j in range(0, min(k, best_more) + 1))
        for k in range(1, ahead + 1)
    ]
    se_one = math.sqrt(ref.var + b.var / b.n) if ref.var is not None else se
    choice = value.decide(prior, delta, se, se_next, se_one, dof)
    evidence = {
        "test": "value",
        "t": delta / se,
        "se": se,
        "look": look,
        "looks": gate.max_repeats,
        "dof": dof,
        "p_worse": choice.belief.worse,
        "gain": choice.belief.mean,
        "run_value": choice.cost,
        "rerun_value": choice.worth,
        "ideas": len(ideas),
        "sd": c.sd,
        "best_sd": b.sd,
        "best_runs": b.n,
        "ref_sd": ref.sd,
        "ref_dof": ref.dof,
    }
    margin = max(gate.min_delta, choice.margin)
    if choice.decision == "keep" and delta > gate.min_delta:
        return Verdict("keep", margin, delta, choice.why, evidence)
    if shorter and delta / se > -SIMPLER_T:
        why = f"simplification: shorter, and not worse by more than {SIMPLER_T:g} standard error"
        return Verdict("keep", margin, delta, why, evidence)
    if choice.decision == "rerun":
        return Verdict("rerun", margin, delta, choice.why, evidence)
    return Verdict("discard", margin, delta, choice.why, evidence)
