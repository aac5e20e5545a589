"""The evaluation's probes (evaluate.py) as a decision table, on synthetic models in this process: rows sampled from
the whole evaluation, a signed test at the cuts, bounds on what moves before them. An honest model with kernel-like
noise is never refused; a model that peeks (on a quarter of the rows, by a hair everywhere, or hard on a few
positions), lets rows see each other or keeps state is, as often as the docs say. Then the evaluator itself: a
`.pth` hook planted in the Python environment does not reach `python -I -S evaluate.py` (slow)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import site
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from conftest import ROOT

ROWS, T, VOCAB, N_ROWS = 4, 16, 32, 64


@pytest.fixture(scope="module")
def ev():
    """evaluate.py, imported here (its prepare.py beside it), sized down: 4 rows per forward of 16 tokens."""
    spec = importlib.util.spec_from_file_location("evaluate_under_test", ROOT / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.EVAL_ROWS, module.MAX_SEQ_LEN = ROWS, T
    return module


def data(seed=0):
    return torch.randint(0, VOCAB, (N_ROWS, T + 1), generator=torch.Generator().manual_seed(seed))


def honest(noise=0.0):
    """A causal model: a bigram table plus a running mean of the past's embeddings; `noise`: nats of independent
    noise on every call, as kernels that order their sums by the batch would add."""
    g = torch.Generator().manual_seed(1)
    table, emb = torch.randn(VOCAB, VOCAB, generator=g), torch.randn(VOCAB, VOCAB, generator=g)

    def forward(x):
        past = emb[x].cumsum(1) / torch.arange(1, x.shape[1] + 1)[None, :, None]
        logits = table[x] + 0.5 * past
        return logits + noise * torch.randn(logits.shape) if noise else logits

    return forward


def peeking(delta, where=lambda x: torch.ones_like(x, dtype=torch.bool)):
    """The honest model, plus `delta` on the next token's logit at the positions `where` picks."""
    base = honest()

    def forward(x):
        nxt = torch.nn.functional.one_hot(torch.roll(x, -1, 1), VOCAB)
        return base(x) + delta * nxt * where(x)[..., None]

    return forward


def verdict(ev, forward, seed, rows=None):
    rows = data() if rows is None else rows
    gen = torch.Generator().manual_seed(seed)
    picks = ev.probe_rows(len(rows), gen)
    token_bytes = torch.ones(VOCAB, dtype=torch.long)
    _, _, kept = ev.score(forward, rows, len(rows) * T, VOCAB, token_bytes, torch.device("cpu"), picks)
    return ev.probe(forward, rows, kept, picks, gen, VOCAB, torch.device("cpu"), "cpu")


def test_rows_are_sampled_from_the_whole_evaluation(ev):
    big = ev.probe_rows(10240, torch.Generator().manual_seed(0))  # the gpu profile's rows (16 per forward)
    assert len(big) == 1280 and len(set(big.tolist())) == 1280 and big.max() > 9000 and big.min() < 1000
    assert len(ev.probe_rows(512, torch.Generator())) == 64 and len(ev.probe_rows(40, torch.Generator())) == 40
    # a cheat that moves a prediction past the bound at 1% of the positions passes 1280 probed rows rarely
    assert (1 - 0.01) ** len(big) < 1e-3


@pytest.mark.parametrize("noise", [0.0, 1e-4])
def test_an_honest_model_is_never_refused_kernel_noise_or_not(ev, noise):
    for seed in range(20):
        cheat, stats = verdict(ev, honest(noise), seed)
        assert cheat == "", (seed, stats)
        assert stats["rows"] == N_ROWS and abs(stats["z"]) < ev.EVAL_PROBE_Z


def test_a_model_that_peeks_in_a_quarter_of_the_rows_is_refused_every_time(ev):
    forward = peeking(30.0, lambda x: (x.sum(1, keepdim=True) % 4 == 0).expand_as(x))
    for seed in range(10):
        cheat, _ = verdict(ev, forward, seed)
        assert "must be causal" in cheat, seed


def test_a_peek_below_any_tolerance_is_caught_by_the_signed_test(ev):
    """+0.00049 on the next token's logit everywhere passed the old max-abs bound of 1e-3 every time."""
    for seed in range(10):
        cheat, stats = verdict(ev, peeking(0.00049), seed)
        assert "was likelier" in cheat and stats["max_abs"] < 1e-3 and stats["z"] > ev.EVAL_PROBE_Z, (seed, stats)


def test_a_peek_inside_the_noise_is_caught_when_it_gains_more_than_the_noise_allows(ev):
    base = honest(1e-4)
    nxt_delta = 0.005  # a gain of ~0.005 nats per token: ten times what 64 probes of noise 1e-4 leave unseen

    def forward(x):
        return base(x) + nxt_delta * torch.nn.functional.one_hot(torch.roll(x, -1, 1), VOCAB)

    assert all("was likelier" in verdict(ev, forward, seed)[0] for seed in range(10))


def test_a_hard_cheat_on_a_few_positions_passes_as_often_as_computed(ev):
    """5% of the positions, +5 to the next token's logit: it passes 64 probed rows with probability 0.95^64 = 3.7%."""
    share = 0.05
    forward = peeking(5.0, lambda x: (x * 7919 + torch.arange(T)[None, :] * 104729) % 1000 < share * 1000)
    passed = sum(verdict(ev, forward, seed)[0] == "" for seed in range(40))
    assert passed <= 6  # binomial(40, 0.037): 7 or more happens with probability 0.07% (seeds fixed: no flake)


def test_rows_that_see_each_other_only_at_the_last_position_are_refused(ev):
    """No cut reaches the last position (its target is never in the input), so a model that uses its batch-mates
    there only (a cache of what follows the row's last token elsewhere in the batch: 0.018 bpb better than honest
    on tiny, probes clean) is seen only by the rows run again whole."""
    base = honest()

    def last_position_cache(x):
        logits = base(x)
        seen = torch.nn.functional.one_hot(x, VOCAB).float().sum((0, 1))  # the batch's tokens, all rows
        return torch.cat([logits[:, :-1], logits[:, -1:] + 0.5 * seen.log1p()], 1)

    for seed in range(5):
        cheat, stats = verdict(ev, last_position_cache, seed)
        assert "score each row on its own" in cheat and stats["whole_rows"] == N_ROWS // 4, (seed, stats)


def test_rows_that_see_each_other_or_state_are_refused(ev):
    base = honest()
    calls = []

    def mixing(x):
        logits = base(x)
        return logits + 0.1 * logits.mean(0, keepdim=True)

    def stateful(x):
        calls.append(1)
        return base(x) + 0.01 * len(calls) * torch.arange(VOCAB) / VOCAB

    assert "score each row on its own" in verdict(ev, mixing, 0)[0]
    assert "keep no state" in verdict(ev, stateful, 0)[0]


@pytest.mark.slow
def test_a_pth_hook_in_the_python_environment_does_not_reach_the_evaluator(tiny_env, tmp_path):
    """Unconfined, a run can write into site-packages: a `.pth` there runs in every Python that starts with site
    hooks. One that halves the evaluator's cross-entropy changes what `python -I evaluate.py` measures; the
    controller starts `python -I -S evaluate.py`, which it does not reach."""
    for name in ("train.py", "prepare.py", "evaluate.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    env = dict(tiny_env, AUTOLOOP_TIME_BUDGET="1", AUTOLOOP_EVAL_ARTIFACT=str(tmp_path / "model.pt"))
    train = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    env.pop("AUTOLOOP_EVAL_ARTIFACT")
    hook = Path(site.getsitepackages()[0]) / f"autoloop_test_{uuid.uuid4().hex[:8]}.pth"
    key = f"AUTOLOOP_TEST_PTH_{uuid.uuid4().hex[:8]}"  # the hook acts only in this test's processes
    hook.write_text(
        "import os; exec('import torch.nn.functional as F\\nF.cross_entropy = (lambda f: lambda *a, **k: "
        f"f(*a, **k) * 0.5)(F.cross_entropy)') if os.environ.get({key!r}) else None\n"
    )

    def measured(*flags):
        proc = subprocess.run(
            [sys.executable, *flags, "evaluate.py", "model.pt"],
            cwd=tmp_path,
            env={**env, key: "1"},
            capture_output=True,
            text=True,
        )
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("AUTOLOOP_EVAL "))
        return json.loads(line.split(" ", 1)[1])["val_bpb"]

    try:
        hooked, guarded = measured("-I"), measured("-I", "-S")
    finally:
        hook.unlink()
    honest_value = measured("-I", "-S")
    assert hooked < 0.6 * honest_value  # the hook works where site hooks run ...
    assert guarded == pytest.approx(honest_value, rel=1e-9)  # ... and not in the controller's evaluator
