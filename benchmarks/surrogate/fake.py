"""A train.py that answers from a fitted surrogate in milliseconds: same hyperparameters and ranges as the real
train.py (for one profile), no training.

Each run predicts the configuration's true val_bpb, its sd between runs and its crash probability, then draws
this run's outcome from a generator seeded by (session seed, configuration, how many times this configuration
ran before in this session): deterministic for a seed, different between repeats. It prints the summary block
with the noise-free value as `true_bpb`, which the benchmark reads and no proposer sees (proposers read
val_bpb from the ledger).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

BODY = '''
# ---------------------------------------------------------------------------
# The surrogate (not a hyperparameter)
# ---------------------------------------------------------------------------
import fcntl, json, os, sys, zlib
import numpy as np
sys.path.insert(0, {here!r})
from model import Surrogate

_names = {names!r}
_config = {{n: (globals()[n.split("[")[0]][int(n[n.index("[") + 1:-1])] if "[" in n else globals()[n]) for n in _names}}
_key = json.dumps(_config, sort_keys=True)
with open({state!r}, "a+") as f:  # how often this configuration ran before in this session
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    _seen = json.loads(f.read() or "{{}}")
    _n = _seen.get(_key, 0)
    _seen[_key] = _n + 1
    f.seek(0)
    f.truncate()
    f.write(json.dumps(_seen))
_mean, _sd, _crash = (float(a[0]) for a in Surrogate.load({model!r}).predict([_config]))
_rng = np.random.default_rng([int(os.environ.get("AUTOLOOP_SEED", "42")), zlib.crc32(_key.encode()), _n])
if _rng.random() < _crash:
    raise RuntimeError("surrogate: this configuration crashed (out of memory or a diverged loss)")
_value = _mean + {noise_scale!r} * _sd * _rng.standard_normal()
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
'''


def fake_train(real_source: str, profile: str, model: Path, state: Path, noise_scale: float = 1.0) -> str:
    """The fake train.py: the real one's hyperparameter constants (this profile's values and bounds, written
    as plain constants) and the surrogate's body. `noise_scale` multiplies the surrogate's run-to-run sd (a
    stress test: the same landscape, noisier runs)."""
    from orchestrator.hparams import format_value, read_constants
    from orchestrator.proposers.space import read_space

    lines = ['"""train.py answering from a surrogate (benchmarks/surrogate/fake.py)."""', "",
             "# Hyperparameters"]
    for c in read_constants(real_source, profile):
        if c.choices:
            bounds = "{" + ", ".join(str(x) for x in c.choices) + "}"
        elif c.low is not None:
            bounds = f"[{format_value(c.low)}, {format_value(c.high)}]"
        else:
            bounds = ""
        lines.append(f"{c.name} = {c.value!r}  # {bounds}".rstrip())
    space, _ = read_space(real_source, profile)
    return "\n".join(lines) + "\n" + BODY.format(here=str(HERE), names=sorted(space), state=str(state),
                                                  model=str(model), noise_scale=float(noise_scale))
