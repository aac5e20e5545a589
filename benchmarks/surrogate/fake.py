"""A train.py that answers from a fitted surrogate in milliseconds: same hyperparameters and ranges as the real
train.py (for one profile), no training.

Each run predicts the configuration's true val_bpb, its sd between runs and its crash probability, then draws
this run's outcome from a generator seeded by (session seed, configuration, how many times this configuration
ran before in this session): deterministic for a seed, different between repeats. It prints the summary block
with the noise-free value as `true_bpb`, which the benchmark reads and no proposer sees (proposers read
val_bpb from the ledger). With a memory limit (search_quality.py --oom-share), configurations too big for it
run out of memory every time, as on a GPU.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
# Seconds between the points of a surrogate's training curve: the controller looks for a stop (--early-stop)
# every 50 ms (executors/runner.py: CANCEL_TICK_S), so a stop lands at the point that decided it, or the next.
PAUSE = 0.03

BODY = """
# ---------------------------------------------------------------------------
# The surrogate (not a hyperparameter)
# ---------------------------------------------------------------------------
import fcntl, json, math, os, sys, time, zlib
import numpy as np
sys.path.insert(0, {here!r})
from model import Surrogate
from fake import activations

_names = {names!r}
_config = {{n: (globals()[n.split("[")[0]][int(n[n.index("[") + 1:-1])] if "[" in n else globals()[n]) for n in _names}}
_key = json.dumps(_config, sort_keys=True)
with open({state!r}, "a+") as f:  # how often this configuration ran before in this session
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    _seen = json.loads(f.read() or "{{}}")
    _n = _seen.get(_key, 0)
    _seen[_key] = _n + 1
    _k = _seen.get("", 0)  # runs of any configuration before this one: the machine's clock for a drift
    _seen[""] = _k + 1
    f.seek(0)
    f.truncate()
    f.write(json.dumps(_seen))
_limit = {memory_limit!r}  # set by hand (--oom-share): above it, out of memory every time
if _limit is not None and activations(_config) > _limit:
    raise RuntimeError(f"surrogate: out of memory (activations {{activations(_config)}} > {{_limit}})")
_surrogate = Surrogate.load({model!r})
_mean, _sd, _crash = (float(a[0]) for a in _surrogate.predict([_config]))
_rng = np.random.default_rng([int(os.environ.get("AUTOLOOP_SEED", "42")), zlib.crc32(_key.encode()), _n])
if _rng.random() < _crash:
    raise RuntimeError("surrogate: this configuration crashed (out of memory or a diverged loss)")
_z = _rng.standard_normal()
_drift = {drift!r} * math.sin(2 * math.pi * _k / {period!r})  # a machine whose speed drifts (--drift)
_value = _mean + {noise_scale!r} * _sd * _z + _drift
if _surrogate.has_curve:  # the training curve, a point at each tenth of the steps, paced so a stop can land
    _offsets, _curve_sd, _rho = _surrogate.predict_curve([_config])
    print("schedule: 100 steps", flush=True)
    for _i, (_o, _s, _r) in enumerate(zip(_offsets[0], _curve_sd, _rho)):
        _e = {noise_scale!r} * _s * (_r * _z + math.sqrt(max(0.0, 1 - _r * _r)) * _rng.standard_normal())
        time.sleep({pause!r})
        _loss = math.exp(math.log(_mean) + _o + _e + _drift / _mean)
        print(f"step {{10 * (_i + 1):05d}} ({{10.0 * (_i + 1):.1f}}%) | loss: {{_loss:.6f}}", flush=True)
else:
    print("step 00100 | loss: 1.0")
print("---")
print(f"val_bpb:          {{_value:.6f}}")
print(f"true_bpb:         {{_mean:.6f}}")
print(f"training_seconds: {{float(os.environ.get('AUTOLOOP_TIME_BUDGET', '1')):.1f}}")
print("total_seconds:    0.1")
print("peak_vram_mb:     1.0")
print("mfu_percent:      0.00")
print("total_tokens_M:   0.1")
print("num_steps:        100")
print("num_params_M:     0.1")
"""


def activations(config: dict) -> int:
    """What a configuration's activation memory grows with: depth x width x sequences per micro-batch (the
    width is DEPTH x ASPECT_RATIO rounded up to HEAD_DIM, as train.py builds it)."""
    width = -(-config["DEPTH"] * config["ASPECT_RATIO"] // config["HEAD_DIM"]) * config["HEAD_DIM"]
    return int(config["DEPTH"] * width * config["DEVICE_BATCH_SIZE"])


def memory_limit(space: dict, share: float, seed: int = 0, draws: int = 20_000) -> tuple[int, float]:
    """The smallest activation limit above which at most `share` of the space (sampled as random search samples
    it) runs out of memory, and the share that does: sizes are powers of two, so it is rarely exactly `share`."""
    import random

    from orchestrator.proposers.random_search import sample
    from orchestrator.proposers.space import rounded

    rng = random.Random(seed)
    values = sorted(activations({n: rounded(sample(p, rng), p.kind) for n, p in space.items()}) for _ in range(draws))
    # the largest value always qualifies (nothing is above it), so there is always an answer
    limit = next(v for v in sorted(set(values)) if sum(x > v for x in values) / draws <= share)
    return limit, sum(x > limit for x in values) / draws


def fake_train(
    real_source: str,
    profile: str,
    model: Path,
    state: Path,
    noise_scale: float = 1.0,
    memory_limit: int | None = None,
    drift: float = 0.0,
    period: int = 40,
    pause: float = PAUSE,
) -> str:
    """The fake train.py: the real one's hyperparameter constants (this profile's values and bounds, written
    as plain constants) and the surrogate's body. `noise_scale` multiplies the surrogate's run-to-run sd (a
    stress test: the same landscape, noisier runs). A configuration whose `activations` exceed `memory_limit`
    runs out of memory, every time (a crash region set by hand: the collections on a CPU have none). `drift`
    adds drift * sin(2 pi k / period) to the k-th run of the session, whatever its configuration: a machine
    whose speed drifts, which a time budget turns into val_bpb (true_bpb stays the configuration's own). A
    surrogate fitted with curves prints the run's training curve first (a point each tenth of its steps, `pause`
    seconds apart, noise correlated with its val_bpb's as measured), so early stopping has something to stop."""
    from orchestrator.proposers.space import read_space
    from orchestrator.store.hparams import format_value, read_constants

    lines = ['"""train.py answering from a surrogate (benchmarks/surrogate/fake.py)."""', "", "# Hyperparameters"]
    for c in read_constants(real_source, profile):
        if c.choices:
            bounds = "{" + ", ".join(str(x) for x in c.choices) + "}"
        elif c.low is not None:
            bounds = f"[{format_value(c.low)}, {format_value(c.high)}]"
        else:
            bounds = ""
        lines.append(f"{c.name} = {c.value!r}  # {bounds}".rstrip())
    space, _ = read_space(real_source, profile)
    return (
        "\n".join(lines)
        + "\n"
        + BODY.format(
            here=str(HERE),
            names=sorted(space),
            state=str(state),
            model=str(model),
            noise_scale=float(noise_scale),
            memory_limit=memory_limit,
            drift=float(drift),
            period=int(period),
            pause=float(pause),
        )
    )
