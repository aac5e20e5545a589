"""A surrogate of train.py fitted on real runs (collect.py's CSV): val_bpb, its noise per configuration, and the
chance of a crash, as a function of the configuration.

- The mean: a Gaussian process (Matérn 5/2 with a length scale per dimension, plus white noise) on the log of
  each configuration's mean val_bpb, capped at its 90th percentile (diverged runs reach 30: they are all just
  bad, and must not flatten the rest), dimensions encoded in their natural scale (log for rates and powers of
  two, one-hot for choices) on [0, 1].
- The noise: log(sd) linear in the log of the predicted mean (slope clipped to [0, 2]), fitted on the
  configurations run more than once and kept within half the least and twice the largest sd they showed
  (worse configurations, e.g. high learning rates, are noisier; nothing is extrapolated beyond the repeats).
- Crashes: a logistic regression on the same encoding.

`fit` needs scikit-learn (the benchmark's extra); `Surrogate.predict` needs numpy only, so the fake train.py
that answers from it starts in milliseconds. `fidelity` is the Spearman rank correlation of predicted and
measured means on held-out configurations (k-fold); `--compare` gives a random forest's and extra trees' on the
same folds.

    python benchmarks/surrogate/model.py benchmarks/surrogate/tiny-10s.csv --out /tmp/tiny.npz [--compare]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# The worst tenth of the configurations (diverged runs reach val_bpb 30) is modelled as equally bad, at the 90th
# percentile of the log means: left as they are, those few set the scale of the fit and the GP takes the
# differences among the rest for noise (held-out Spearman 0.65 -> 0.73 and 0.35 -> 0.49 on the two collections).
CAP_QUANTILE = 0.9
CURVE = tuple(f"{0.1 * i:.1f}" for i in range(1, 11))  # the curve's fractions of planned steps (collect.py's loss@)


class Encoding:
    """Configuration -> vector in [0, 1]^d, from the dimensions train.py declares."""

    def __init__(self, dims: list[dict]):
        self.dims = dims  # [{"name", "kind", "low", "high", "choices"}]

    @classmethod
    def from_space(cls, space) -> Encoding:
        return cls(
            [
                {
                    "name": n,
                    "kind": p.kind,
                    "low": p.low,
                    "high": p.high,
                    "choices": list(p.choices) if p.choices else None,
                }
                for n, p in sorted(space.items())
            ]
        )

    def row(self, config: dict) -> list[float]:
        out = []
        for d in self.dims:
            v = config[d["name"]]
            if d["kind"] == "choice":
                out += [1.0 if str(v) == str(c) else 0.0 for c in d["choices"]]
                continue
            v, lo, hi = float(v), d["low"], d["high"]
            if d["kind"] in ("log", "pow2"):
                v, lo, hi = math.log(v), math.log(lo), math.log(hi)
            elif d["kind"] == "unit":
                v, lo, hi = -math.log(1 - v), -math.log(1 - lo), -math.log(1 - hi)
            out.append((v - lo) / (hi - lo) if hi > lo else 0.0)
        return out

    def matrix(self, configs: list[dict]) -> np.ndarray:
        return np.array([self.row(c) for c in configs], dtype=float)


class Surrogate:
    """The fitted surrogate, as plain arrays (saved with numpy; predicting needs numpy only)."""

    def __init__(self, arrays: dict, dims: list[dict]):
        self.a, self.encoding = arrays, Encoding(dims)

    def _mean(self, x: np.ndarray) -> np.ndarray:
        return np.exp(gp_predict(self.a, "", x))

    @property
    def has_curve(self) -> bool:
        return "curve_sd" in self.a

    def predict_curve(self, configs: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets, sd, rho) of the training loss at CURVE fractions: a run's log loss at fraction i is
        log(its configuration's true val_bpb) + offsets[:, i] + sd[i] * (rho[i] * z + sqrt(1 - rho[i]^2) * e),
        where z is the standard normal that drew the run's val_bpb and e a fresh one (its own batch noise)."""
        x = self.encoding.matrix(configs)
        offsets = np.stack([gp_predict(self.a, f"curve{i}_", x) for i in range(len(CURVE))], axis=1)
        return offsets, self.a["curve_sd"], self.a["curve_rho"]

    def predict(self, configs: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(true val_bpb, its sd between runs, crash probability) for each configuration."""
        x = self.encoding.matrix(configs)
        mean = self._mean(x)
        sd = np.exp(self.a["sd_coef"][0] + self.a["sd_coef"][1] * (np.log(mean) - self.a["y_mean"]))
        sd = np.clip(sd, self.a["sd_range"][0], self.a["sd_range"][1])  # no extrapolation beyond the repeats
        logit = x @ self.a["crash_coef"] + self.a["crash_intercept"]
        crash = 1 / (1 + np.exp(-logit)) if self.a["crash_seen"] else np.zeros(len(configs))
        return mean, sd, crash

    def save(self, path: Path) -> None:
        np.savez(path, dims=np.array(json.dumps(self.encoding.dims)), **self.a)

    @classmethod
    def load(cls, path: Path) -> Surrogate:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files if k != "dims"}
            return cls(arrays, json.loads(str(z["dims"])))


def gp_predict(a: dict, prefix: str, x: np.ndarray) -> np.ndarray:
    """A fitted GP's mean (fit_gp's arrays under `prefix`) at encoded configurations, in the target's units."""
    d = np.sqrt((((x[:, None, :] - a[prefix + "X"][None, :, :]) / a[prefix + "length_scale"]) ** 2).sum(-1))
    d *= math.sqrt(5)
    k = a[prefix + "amplitude"] * (1 + d + d * d / 3) * np.exp(-d)
    return a[prefix + "y_mean"] + a[prefix + "y_std"] * (k @ a[prefix + "alpha"])


def fit_gp(x: np.ndarray, y: np.ndarray, prefix: str = "") -> dict:
    """A Gaussian process (Matern 5/2, a length scale per dimension, white noise) on standardised y: its arrays."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

    y_mean, y_std = float(y.mean()), float(y.std() or 1.0)
    kernel = ConstantKernel(1.0, (1e-3, 1e3)) * Matern(np.ones(x.shape[1]), (1e-2, 1e2), nu=2.5) + WhiteKernel(
        1e-2, (1e-6, 1.0)
    )
    gp = GaussianProcessRegressor(kernel, normalize_y=False, n_restarts_optimizer=2, random_state=0)
    with warnings.catch_warnings():  # a length scale at its upper bound: the data show no effect of that dimension
        warnings.simplefilter("ignore", ConvergenceWarning)
        gp.fit(x, (y - y_mean) / y_std)
    k = gp.kernel_
    return {
        prefix + "X": x,
        prefix + "alpha": np.asarray(gp.alpha_, dtype=float).ravel(),
        prefix + "length_scale": np.asarray(k.k1.k2.length_scale, dtype=float),
        prefix + "amplitude": np.array(float(k.k1.k1.constant_value)),
        prefix + "y_mean": np.array(y_mean),
        prefix + "y_std": np.array(y_std),
    }


def read_runs(csv_path: Path, space) -> tuple[list[dict], list[float | None]]:
    """(configurations, val_bpb or None for a crash) of a collection."""
    import pandas as pd

    frame = pd.read_csv(csv_path)
    configs, values = [], []
    for _, row in frame.iterrows():
        config = {}
        for name, p in space.items():
            v = row[name]
            config[name] = (
                (type(p.choices[0])(v) if p.choices and not isinstance(p.choices[0], str) else str(v))
                if p.kind == "choice"
                else float(v)
            )
        configs.append(config)
        values.append(None if pd.isna(row["val_bpb"]) else float(row["val_bpb"]))
    return configs, values


def read_curves(csv_path: Path) -> list[dict]:
    """Each run's training curve ({fraction key: loss}, collect.py's loss@ columns; {} where it has none)."""
    import pandas as pd

    frame = pd.read_csv(csv_path)
    columns = [(key, f"loss@{key}") for key in CURVE if f"loss@{key}" in frame.columns]
    return [{key: float(row[col]) for key, col in columns if not pd.isna(row[col])} for _, row in frame.iterrows()]


def curve_table(configs: list[dict], values: list[float | None], curves: list[dict], encoding: Encoding) -> list:
    """Per fraction: the rank correlation (Spearman, over runs) of the loss there with the run's final val_bpb,
    and the surrogate's held-out fidelity there (5-fold: the predicted mean loss of configurations left out
    against their measured mean)."""
    from scipy.stats import spearmanr

    rows = []
    pairs = {key: [(c[key], v) for c, v in zip(curves, values) if v is not None and key in c] for key in CURVE}
    ok = [i for i, v in enumerate(values) if v is not None]
    order = np.random.default_rng(0).permutation(len(ok))
    predicted: dict[int, np.ndarray] = {}
    for f in range(5):
        test = [ok[j] for k, j in enumerate(order) if k % 5 == f]
        train = [ok[j] for k, j in enumerate(order) if k % 5 != f]
        model = fit([configs[i] for i in train], [values[i] for i in train], encoding, [curves[i] for i in train])
        offsets, _, _ = model.predict_curve([configs[i] for i in test])
        means = model.predict([configs[i] for i in test])[0]
        for i, row, mean in zip(test, offsets, means):
            predicted[i] = np.exp(np.log(mean) + row)
    for j, key in enumerate(CURVE):
        runs = pairs[key]
        by: dict[str, list] = {}
        for i in ok:
            if key in curves[i]:
                by.setdefault(json.dumps(configs[i], sort_keys=True), []).append(i)
        measured = [np.mean([curves[i][key] for i in idx]) for idx in by.values()]
        guessed = [np.mean([predicted[i][j] for i in idx]) for idx in by.values()]
        rows.append(
            {
                "fraction": key,
                "runs": len(runs),
                "spearman_with_final": float(spearmanr(*zip(*runs)).statistic) if len(runs) > 2 else None,
                "held_out_spearman": float(spearmanr(guessed, measured).statistic) if len(by) > 2 else None,
            }
        )
    return rows


def group(configs: list[dict], values: list[float | None]) -> dict[str, dict]:
    """Runs by configuration: {key: {"config", "values", "crashes"}}."""
    out: dict[str, dict] = {}
    for c, v in zip(configs, values):
        g = out.setdefault(json.dumps(c, sort_keys=True), {"config": c, "values": [], "crashes": 0})
        if v is None:
            g["crashes"] += 1
        else:
            g["values"].append(v)
    return out


def observed(groups: list[dict], encoding: Encoding) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """The configurations that ran at least once, encoded, and the log of each one's mean val_bpb."""
    ok = [g for g in groups if g["values"]]
    return ok, encoding.matrix([g["config"] for g in ok]), np.log([np.mean(g["values"]) for g in ok])


def fit(
    configs: list[dict], values: list[float | None], encoding: Encoding, curves: list[dict] | None = None
) -> Surrogate:
    """The surrogate of a collection; with `curves` (each run's {fraction key: training loss}, collect.py's
    loss@ columns), also its training curve (fit_curve)."""
    from sklearn.linear_model import LogisticRegression

    groups = list(group(configs, values).values())
    ok, x, y = observed(groups, encoding)
    y = np.minimum(y, np.quantile(y, CAP_QUANTILE))  # the diverged are all just bad (CAP_QUANTILE)
    gp = fit_gp(x, y)
    y_mean = float(gp["y_mean"])
    # the noise: log sd linear in the mean, on the configurations measured more than once
    rep = [g for g in ok if len(g["values"]) >= 2]
    if len(rep) >= 2:
        means = np.log([np.mean(g["values"]) for g in rep]) - y_mean
        sds = np.array([max(np.std(g["values"], ddof=1), 1e-4) for g in rep])
        slope, intercept = np.polyfit(means, np.log(sds), 1) if np.ptp(means) > 0 else (0.0, np.log(sds).mean())
        slope = float(np.clip(slope, 0.0, 2.0))  # sd grows with the mean at most as fast as mean**2
        intercept = float(np.mean(np.log(sds) - slope * means))
        # a sample sd is biased low in the log; the pooled variance sets the level
        pooled = math.sqrt(
            sum((len(g["values"]) - 1) * np.var(g["values"], ddof=1) for g in rep)
            / sum(len(g["values"]) - 1 for g in rep)
        )
        fitted = np.exp(intercept + slope * means)
        intercept += math.log(pooled / math.sqrt(np.mean(fitted**2)))
        sd_range = [0.5 * float(sds.min()), 2.0 * float(sds.max())]
    else:
        slope, intercept = 0.0, math.log(max(float(np.std(y)) * 0.05, 1e-4))
        sd_range = [0.0, math.inf]
    # crashes
    xc = encoding.matrix([g["config"] for g in groups for _ in range(len(g["values"]) + g["crashes"])])
    yc = np.array([1 if i < g["crashes"] else 0 for g in groups for i in range(len(g["values"]) + g["crashes"])])
    seen = 0 < yc.sum() < len(yc)
    coef, icpt = np.zeros(xc.shape[1]), 0.0
    if seen:
        clf = LogisticRegression(C=1.0, max_iter=2000).fit(xc, yc)
        coef, icpt = clf.coef_[0], float(clf.intercept_[0])
    arrays = {
        **gp,
        "sd_coef": np.array([intercept, slope]),
        "sd_range": np.array(sd_range),
        "crash_coef": coef,
        "crash_intercept": np.array(icpt),
        "crash_seen": np.array(bool(seen)),
    }
    if curves is not None and any(curves):
        arrays.update(fit_curve(configs, values, curves, encoding))
    return Surrogate(arrays, encoding.dims)


def fit_curve(configs: list[dict], values: list[float | None], curves: list[dict], encoding: Encoding) -> dict:
    """The training curve's arrays: at each fraction, a GP of the configuration's mean log loss there minus the
    log of its mean val_bpb (how far above its final value the configuration's curve runs: a slow starter's
    runs higher early), both capped as the mean is; and the run-to-run noise of the log loss there (pooled over
    configurations run more than once) with its correlation with the run's own val_bpb noise."""
    out: dict = {}
    sds, rhos = [], []
    for i, key in enumerate(CURVE):
        by: dict[str, dict] = {}
        for c, v, curve in zip(configs, values, curves):
            loss = curve.get(key)
            if v is None or loss is None or not (math.isfinite(loss) and loss > 0):
                continue
            g = by.setdefault(json.dumps(c, sort_keys=True), {"config": c, "val": [], "loss": []})
            g["val"].append(v)
            g["loss"].append(math.log(loss))
        groups = list(by.values())
        x = encoding.matrix([g["config"] for g in groups])
        log_val = np.log([np.mean(g["val"]) for g in groups])
        log_loss = np.array([np.mean(g["loss"]) for g in groups])
        log_val = np.minimum(log_val, np.quantile(log_val, CAP_QUANTILE))
        log_loss = np.minimum(log_loss, np.quantile(log_loss, CAP_QUANTILE))
        out.update(fit_gp(x, log_loss - log_val, prefix=f"curve{i}_"))
        e_loss, e_val = [], []  # each run's deviation from its configuration's mean: log loss, val in sds
        for g in (g for g in groups if len(g["val"]) >= 2):
            sd = np.std(g["val"], ddof=1)
            if sd > 0:
                e_loss += list(np.array(g["loss"]) - np.mean(g["loss"]))
                e_val += list((np.array(g["val"]) - np.mean(g["val"])) / sd)
        dof = sum(len(g["val"]) - 1 for g in groups if len(g["val"]) >= 2)
        sds.append(math.sqrt(sum(e * e for e in e_loss) / dof) if dof else 0.0)
        rhos.append(float(np.clip(np.corrcoef(e_loss, e_val)[0, 1], -1, 1)) if len(e_loss) > 2 else 0.0)
    out["curve_sd"], out["curve_rho"] = np.array(sds), np.array(rhos)
    return out


class Forest:
    """A tree ensemble on the same encoding and target (log mean val_bpb), for comparison with the GP
    (`--compare`): scikit-learn's random forest or extra trees."""

    def __init__(self, kind: str, configs: list[dict], values: list[float | None], encoding: Encoding):
        from sklearn.ensemble import ExtraTreesRegressor, RandomForestRegressor

        _, x, y = observed(list(group(configs, values).values()), encoding)
        cls = ExtraTreesRegressor if kind == "extra trees" else RandomForestRegressor
        self.encoding = encoding
        self.model = cls(n_estimators=500, min_samples_leaf=2, random_state=0).fit(x, y)

    def predict(self, configs: list[dict]) -> tuple[np.ndarray]:
        return (np.exp(self.model.predict(self.encoding.matrix(configs))),)


def fidelity(
    configs: list[dict], values: list[float | None], encoding: Encoding, folds: int = 5, seed: int = 0, fitter=fit
) -> dict:
    """Spearman rank correlation between predicted and measured means on held-out configurations (k-fold):
    `fitter(configs, values, encoding)` is fitted on the other folds and predicts each fold."""
    from scipy.stats import spearmanr

    groups = list(group(configs, values).values())
    ok = [g for g in groups if g["values"]]
    order = np.random.default_rng(seed).permutation(len(ok))
    predicted, measured = np.zeros(len(ok)), np.array([np.mean(g["values"]) for g in ok])
    for f in range(folds):
        test = [i for k, i in enumerate(order) if k % folds == f]
        train = [i for k, i in enumerate(order) if k % folds != f]
        cfg, val = [], []
        for i in train:
            cfg += [ok[i]["config"]] * len(ok[i]["values"])
            val += ok[i]["values"]
        model = fitter(cfg, val, encoding)
        predicted[test] = model.predict([ok[i]["config"] for i in test])[0]
    rho = float(spearmanr(predicted, measured).statistic)
    return {"spearman": rho, "configs": len(ok), "folds": folds, "mae": float(np.mean(np.abs(predicted - measured)))}


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from orchestrator.proposers.space import read_space

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path, help="a collection (collect.py --out)")
    ap.add_argument("--profile", default="tiny", choices=["gpu", "cpu", "tiny"])
    ap.add_argument("--out", type=Path, help="save the fitted surrogate here (.npz)")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also the held-out Spearman of a random forest and extra trees on the same folds",
    )
    args = ap.parse_args()
    space, _ = read_space((ROOT / "train.py").read_text(), args.profile)
    encoding = Encoding.from_space(space)
    configs, values = read_runs(args.csv, space)
    curves = read_curves(args.csv)
    print(json.dumps(fidelity(configs, values, encoding)))
    if any(curves):
        print("fraction  runs  Spearman(loss there, final val_bpb)  held-out Spearman of the surrogate's curve")
        for row in curve_table(configs, values, curves, encoding):
            print(
                f"{row['fraction']:>8s}  {row['runs']:4d}  {row['spearman_with_final'] or float('nan'):35.3f}  "
                f"{row['held_out_spearman'] or float('nan'):.3f}"
            )
    for kind in ("random forest", "extra trees") if args.compare else ():
        rho = fidelity(configs, values, encoding, fitter=functools.partial(Forest, kind))["spearman"]
        print(json.dumps({"model": kind, "spearman": rho}))
    if args.out:
        fit(configs, values, encoding, curves).save(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
