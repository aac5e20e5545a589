"""The adversary suite for the metric: edits of train.py that try to forge the evaluated number, each planted as an
ordinary idea and run through the real loop with the real prepare.py (tiny profile, CPU, a small bigram model so
a run takes seconds). Each must end as a crash whose reason says what was refused, or as an honest value; and
no code of the run's may execute in the evaluator (a marker file it would write never appears).

The evaluation scores an exported graph (torch.export) in a process started with `python -I` that never imports
train.py; evaluate.load_exported reads the archive itself (JSON and raw tensor bytes: never a pickle, a guard or a
symbolic expression), allows only pure ATen operations, and probes causality, row independence and state on the
evaluation's own batches.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import fakes
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, make_repo

from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import read_rows

HONEST = '''"""a bigram model: train.py for the adversary suite"""
import time
import torch
import torch.nn as nn
import torch.nn.functional as F
from prepare import MAX_SEQ_LEN, Tokenizer, evaluate_bpb, make_dataloader

LR = 0.05  # [0.001, 1.0]
STEPS = 40  # [fixed]


class Bigram(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, vocab)

    def forward(self, idx):
        logits = self.emb(idx)
        return logits


torch.manual_seed(0)
tokenizer = Tokenizer.from_directory()
model = Bigram(tokenizer.get_vocab_size())
opt = torch.optim.Adam(model.parameters(), lr=LR)
loader = make_dataloader(tokenizer, 16, MAX_SEQ_LEN, "train", device="cpu")
t0 = time.time()
for steps in range(1, STEPS + 1):  # a fixed number of steps, well within the budget: equal models score equal
    x, y, _ = next(loader)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
training_seconds = time.time() - t0
val_bpb = evaluate_bpb(model, tokenizer, 16)
# (after evaluate_bpb)
print("---")
print(f"val_bpb:          {val_bpb:.6f}")
print(f"training_seconds: {training_seconds:.1f}")
print(f"num_steps:        {steps}")
'''


def forward_returns(expression: str, init: str = "") -> str:
    """HONEST with the model's forward returning `expression` (of `logits` and `idx`)."""
    source = HONEST.replace("        return logits\n", f"        return {expression}\n")
    return source.replace(
        "        self.emb = nn.Embedding(vocab, vocab)\n", "        self.emb = nn.Embedding(vocab, vocab)\n" + init
    )


def after_export(code: str) -> str:
    """HONEST, then `code` run on the exported archive (path in `artifact`) before the run ends."""
    prelude = (
        "import os as _os, json as _json, zipfile as _zip\nartifact = _os.environ['AUTOLOOP_' + 'EVAL_ARTIFACT']\n"
    )
    return HONEST.replace("# (after evaluate_bpb)\n", prelude + code + "\n")


REWRITE = """
def rewrite(edit):
    with _zip.ZipFile(artifact) as z:
        files = {name: z.read(name) for name in z.namelist()}
    edit(files)
    with _zip.ZipFile(artifact, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def program(files):
    name = next(n for n in files if n.endswith("models/model.json"))
    return name, _json.loads(files[name])
"""


def attacks(marker: str) -> list[tuple[str, str, str | None]]:
    """(description, train.py, what the crash says — None: an honest row)."""
    write_marker = f"open({marker!r}, 'w').write('ran')"
    code_expr = f"__import__('builtins').exec({write_marker!r})"  # sympify evaluates such a string
    return [
        (
            "peeks at the next token",
            forward_returns(
                "logits + 30 * F.embedding(torch.roll(idx, -1, 1), self.eye)",
                "        self.register_buffer('eye', torch.eye(vocab), persistent=False)\n",
            ),
            "must be causal",
        ),
        (
            "peeks, with one unscored logit at -1e6 to widen a tolerance",
            forward_returns(
                "logits + 50 * F.embedding(torch.roll(idx, -1, 1), self.eye) + self.big",
                "        self.register_buffer('eye', torch.eye(vocab), persistent=False)\n"
                "        self.register_buffer('big', torch.zeros(vocab), persistent=False)\n"
                "        self.big[vocab - 1] = -1e6  # a reserved token: never scored\n",
            ),
            "must be causal",
        ),
        (
            "peeks only in rows whose content hash is 0 mod 4 (a cheat on a quarter of the rows)",
            forward_returns(
                "logits + 30 * F.embedding(torch.roll(idx, -1, 1), self.eye) * (idx.sum(1, keepdim=True) % 4 == 0)"
                ".unsqueeze(-1)",
                "        self.register_buffer('eye', torch.eye(vocab), persistent=False)\n",
            ),
            "must be causal",
        ),
        (
            "peeks by less than the old probe's tolerance at every position (+0.00049 to the next token's logit)",
            forward_returns(
                "logits + 0.00049 * F.embedding(torch.roll(idx, -1, 1), self.eye)",
                "        self.register_buffer('eye', torch.eye(vocab), persistent=False)\n",
            ),
            "was likelier",
        ),
        ("rows see each other", forward_returns("logits + logits.mean(0, keepdim=True)"), "score each row on its own"),
        (
            "carries state",
            forward_returns("logits - self.calls.add_(1)", "        self.register_buffer('calls', torch.zeros(()))\n"),
            "in-place",
        ),
        (
            "patches math.log, walks to the evaluator's frames, writes the result file",
            after_export(f"""
import math, sys
math.log = lambda x: 10.0
frame = sys._getframe()
while frame is not None:
    frame.f_globals.get("_write_result") and frame.f_globals.update(_write_result=None)
    frame = frame.f_back
with open(_os.path.join(_os.path.dirname(artifact), "eval.json"), "w") as f:
    f.write(_json.dumps({{"val_bpb": 0.1, "nonce": "0" * 32}}))
for name in ("json.py", "math.py", "torch.py", "sitecustomize.py"):  # shadows for the evaluator's imports
    open(name, "w").write({write_marker!r})
"""),
            None,
        ),
        (
            "starts the evaluation early and rewrites the harness while it gets ready",
            HONEST.replace(
                "torch.manual_seed(0)\n",
                """import prepare as _prepare
_original = open("prepare.py").read()
print(getattr(_prepare, "EXPORT_LINE", "export"), flush=True)  # the sandboxed controller starts the evaluation
try:
    open("prepare.py", "w").write(_original.replace("value = nats / (math.log(2) * nbytes)", "value = 0.1"))
except OSError:
    pass
time.sleep(3)  # while the evaluation reads its code
torch.manual_seed(0)
""",
            ).replace(
                "# (after evaluate_bpb)\n",
                "try:\n    open('prepare.py', 'w').write(_original)\nexcept OSError:\n    pass\n",
            ),
            None,
        ),
        (
            "archive: code in guards",
            after_export(
                REWRITE
                + f"""
def edit(files):
    name, p = program(files)
    p["guards_code"] = [{write_marker!r}]
    files[name] = _json.dumps(p).encode()
rewrite(edit)
"""
            ),
            "symbolic shapes or guards",
        ),
        (
            "archive: a pickled weight",
            after_export(
                REWRITE
                + f"""
import pickle
class Payload:
    def __reduce__(self):
        return (exec, ({write_marker!r},))
def edit(files):
    config = next(n for n in files if n.endswith("model_weights_config.json"))
    c = _json.loads(files[config])
    for meta in c["config"].values():
        meta["use_pickle"] = True
        files[config.rsplit("/", 1)[0] + "/" + meta["path_name"]] = pickle.dumps(Payload())
    files[config] = _json.dumps(c).encode()
rewrite(edit)
"""
            ),
            "pickled objects are not loaded",
        ),
        (
            "archive: a symbolic size that is code",
            after_export(
                REWRITE
                + f"""
def edit(files):
    name, p = program(files)
    values = p["graph_module"]["graph"]["tensor_values"]
    first = next(iter(values.values()))
    first["sizes"][0] = {{"as_expr": {{"expr_str": {code_expr!r}, "hint": None}}}}
    files[name] = _json.dumps(p).encode()
rewrite(edit)
"""
            ),
            "holds expr values",
        ),
        (
            "archive: a weight declared 2**36 elements over one (stride 0): costs the evaluator time, not bytes",
            after_export(
                REWRITE
                + """
def edit(files):
    config = next(n for n in files if n.endswith("model_weights_config.json"))
    c = _json.loads(files[config])
    for meta in c["config"].values():
        meta["tensor_meta"]["sizes"] = [{"as_int": 2**36}]
        meta["tensor_meta"]["strides"] = [{"as_int": 0}]
    files[config] = _json.dumps(c).encode()
rewrite(edit)
"""
            ),
            "declares 68719476736 elements",
        ),
        (
            "archive: exported for another number of rows per forward (the run choosing the batches)",
            after_export(
                REWRITE
                + """
def edit(files):
    name, p = program(files)
    graph = p["graph_module"]["graph"]
    first = graph["tensor_values"][graph["inputs"][-1]["as_tensor"]["name"]]
    first["sizes"][0] = {"as_int": 1}
    files[name] = _json.dumps(p).encode()
rewrite(edit)
"""
            ),
            "it must take",
        ),
        (
            "archive: a random operation",
            after_export(
                REWRITE
                + """
def edit(files):
    name, p = program(files)
    p["graph_module"]["graph"]["nodes"][0]["target"] = "torch.ops.aten.bernoulli.default"
    files[name] = _json.dumps(p).encode()
rewrite(edit)
"""
            ),
            "not among the ATen operations",
        ),
    ]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("sandbox", ["off", "on"])
def test_forged_evaluations_are_refused_or_honest(tiny_env, tmp_path, monkeypatch, sandbox):
    """Unconfined and in the sandbox (as root in CI): the defences of the metric do not depend on the mode."""
    if sandbox == "on":
        from orchestrator.trust import confine

        monkeypatch.delitem(confine._PROBE, "result", raising=False)  # the suite's default: unconfined
        if problem := confine.sandbox_problem():
            pytest.skip(f"no sandbox here: {problem}")
    for key in ("AUTOLOOP_CACHE", "AUTOLOOP_PROFILE", "AUTOLOOP_DEVICE"):
        monkeypatch.setenv(key, tiny_env[key])
    repo = tmp_path / "proj"
    make_repo(
        repo,
        {
            "prepare.py": (ROOT / "prepare.py").read_text(),
            "evaluate.py": (ROOT / "evaluate.py").read_text(),
            "train.py": HONEST,
            ".gitignore": (ROOT / ".gitignore").read_text(),
        },
    )
    marker = tmp_path / "evaluator-ran-the-runs-code"
    steps = attacks(str(marker))
    plan = [{"description": name, "train": source} for name, source, _ in steps]
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(fakes.write_plan(tmp_path / "plan.json", plan)))
    run_loop(
        Settings(
            repo=repo,
            tag="forge",
            budget=30.0,
            proposer="fakes:Scripted",
            baseline_repeats=0,
            startup_allowance=30.0,
            max_crashes=len(steps) + 1,
            sandbox=sandbox,
        ),
        echo=lambda line: None,
    )
    rows = read_rows(repo / "results.tsv")
    assert rows[0].status == "keep" and rows[0].description == "baseline", rows[0]
    baseline = rows[0].val_bpb
    assert len(rows) == len(steps) + 1, [r.description for r in rows]
    for row, (name, _, expected) in zip(rows[1:], steps):
        if expected is None:  # honest: the unchanged model's value (same seed, same steps), not a forged one
            assert row.status in ("keep", "discard") and abs(row.val_bpb - baseline) < 1e-3, (name, row, baseline)
        else:
            assert row.status == "crash" and expected in row.description, (name, row.description)
    assert not marker.exists(), "the evaluator executed code the run wrote"


def _export_and_evaluate(env: dict, tmp_path) -> dict:
    """The real train.py exports its model as it does under the controller; `python -I -S evaluate.py` scores
    the graph (the controller's evaluation step), in a directory holding only the two files."""
    import json
    import shutil
    import subprocess
    import sys

    for name in ("train.py", "prepare.py", "evaluate.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    env = dict(env, AUTOLOOP_TIME_BUDGET="3", AUTOLOOP_EVAL_ARTIFACT=str(tmp_path / "model.pt"))
    train = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    assert "model exported for the autoloop harness" in train.stdout
    env.pop("AUTOLOOP_EVAL_ARTIFACT")
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "evaluate.py", "model.pt"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("AUTOLOOP_EVAL "))
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
@pytest.mark.slow
def test_the_real_model_passes_the_evaluations_checks(tiny_env, tmp_path, device):
    """train.py's GPT (with bf16 autocast where the device has it, and on Hopper FlashAttention-3 in training)
    exports to a graph the harness accepts: allowed operations, causal, rows apart, stateless within tolerance."""
    result = _export_and_evaluate(dict(tiny_env, AUTOLOOP_DEVICE=device), tmp_path)
    assert "error" not in result, result
    assert 0 < result["val_bpb"] < 20 and result["probes"] >= 64 and result["eval_tokens"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_training_step_cannot_read_what_it_is_scored_on(tiny_env, tmp_path, monkeypatch):
    """In the sandbox the validation and held-out files read as empty to train.py (only the evaluation gets them);
    the evaluation still scores them. Nor can the run rebuild the validation split from the offline corpus's
    sources, which it can read (the standard library): those scored are in test suites, hidden from it."""
    from orchestrator.trust import confine

    monkeypatch.delitem(confine._PROBE, "result", raising=False)  # the suite's default: unconfined
    if problem := confine.sandbox_problem():
        pytest.skip(f"no sandbox here: {problem}")
    for key in ("AUTOLOOP_CACHE", "AUTOLOOP_PROFILE", "AUTOLOOP_DEVICE"):
        monkeypatch.setenv(key, tiny_env[key])
    peek = HONEST.replace(
        "torch.manual_seed(0)\n",
        """torch.manual_seed(0)
import prepare as _p
for _split in ("v" + "al", "hold" + "out"):
    _size = sum(len(open(f, "rb").read()) for f in getattr(_p, "_split_" + "files")(_split))
    print(f"peek {_split}: {_size} bytes", flush=True)
_docs, _held, _ = _p.held_out_of_reach(_p.pystdlib_documents(), "pystdlib")
_pick = sorted((n for n, _t in _docs if _p.split_of(n, _held) == "v" + "al"), key=_p.eval_position)
_text = dict(_docs)
print("rebuilt split", __import__("hashlib").sha256("\\0".join(_text[n] for n in _pick).encode()).hexdigest(),
      flush=True)
print("copies elsewhere:", OTHER_COPIES(_p), "bytes", flush=True)
""".replace("OTHER_COPIES", OTHER_COPIES),
    )
    repo = tmp_path / "proj"
    make_repo(
        repo,
        {
            "prepare.py": (ROOT / "prepare.py").read_text(),
            "evaluate.py": (ROOT / "evaluate.py").read_text(),
            "train.py": HONEST,
            ".gitignore": (ROOT / ".gitignore").read_text(),
        },
    )
    monkeypatch.setenv(
        "AUTOLOOP_TEST_PLAN",
        str(fakes.write_plan(tmp_path / "plan.json", [{"description": "reads the validation data", "train": peek}])),
    )
    run_loop(
        Settings(
            repo=repo,
            tag="peek",
            budget=30.0,
            proposer="fakes:Scripted",
            baseline_repeats=0,
            startup_allowance=30.0,
            sandbox="on",
        ),
        echo=lambda line: None,
    )
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows][:1] == ["keep"] and len(rows) == 2, rows
    log = (repo / ".autoloop" / "peek" / "runs" / "2" / "run.log").read_text()
    assert "peek val: 0 bytes" in log and "peek holdout: 0 bytes" in log, log[-2000:]
    manifest = json.loads(next(Path(tiny_env["AUTOLOOP_CACHE"]).glob("*/manifest-tiny.json")).read_text())
    val = pq.read_table(Path(tiny_env["AUTOLOOP_CACHE"]) / "pystdlib" / "data" / "val.parquet")
    truth = hashlib.sha256("\0".join(val.column("text").to_pylist()).encode()).hexdigest()
    rebuilt = re.search(r"rebuilt split ([0-9a-f]{64})", log)
    assert rebuilt, log[-2000:]
    if manifest["hidden_sources"]:  # a Python with a test suite (else prepare.py warned: README, threat model)
        assert rebuilt.group(1) != truth
        # the machine's other Pythons hold copies of the scored test files: hidden too
        here = subprocess.run(
            [sys.executable, "-c", f"import prepare; print({OTHER_COPIES}(prepare))"],
            cwd=ROOT,
            env=tiny_env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
        assert "copies elsewhere: 0 bytes" in log or here == "0", log[-2000:]
    assert rows[1].status in ("keep", "discard") and rows[1].val_bpb > 0, rows[1]


# bytes of the .py files in the test suites of the machine's other Pythons (what a run could read copies from)
OTHER_COPIES = (
    "(lambda p: sum(__import__('os').path.getsize(f) for d in p.held_directories(p.other_pythons()) "
    "for f in __import__('glob').glob(d + '/**/*.py', recursive=True)))"
)


CLOCKED = (
    HONEST.replace(
        "STEPS = 40  # [fixed]\n", "STARTUP = 8.0  # seconds of set-up, as a compiling model needs  [fixed]\n"
    )
    .replace(
        "for steps in range(1, STEPS + 1):  # a fixed number of steps, well within the budget: equal models score equal\n",
        "time.sleep(STARTUP)\nt0, steps = time.time(), 0\nwhile time.time() - t0 < TIME_BUDGET:\n    steps += 1\n",
    )
    .replace("from prepare import MAX_SEQ_LEN,", "from prepare import MAX_SEQ_LEN, TIME_BUDGET,")
)


def test_the_start_up_slack_is_capped_at_a_quarter_of_the_budget():
    """A train.py whose clock runs at 0.6x trains 1.67x the budget and reports the budget. With a start-up long
    next to the budget (10 s for a 5 s budget, as compilation is on a GPU), a slack in proportion to the start-up
    (0.35 x 10 s) let it through; the slack is capped at a quarter of the budget. An honest run still passes.
    (The controller's clock decides: the numbers are its wall times, so this is exact; end to end: below.)"""
    from orchestrator.trust import evaluation

    reported = {"training_seconds": 5.0, "num_steps": 100}
    startup, budget = 10.0, 5.0
    slowed = startup + budget / 0.6
    assert evaluation.audit_clock(reported, budget, None, wall_s=slowed, learned=startup).startswith(
        "budget exceeded: train.py ran 18.3s"
    )
    assert evaluation.audit_clock(reported, budget, None, wall_s=startup + budget + 1.0, learned=startup) == ""
    uncapped = startup + budget * (1 + evaluation.CLOCK_SLACK) + evaluation.STARTUP_SLACK * startup
    assert slowed < uncapped  # what the cap is for


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_slowed_clock_is_refused_at_a_small_budget(tiny_env, tmp_path, monkeypatch, clock_slack):
    """End to end, behind a start-up long next to the budget (8 s of set-up for a 5 s budget): a train.py whose
    clock runs at 0.2x trains 5x the budget and reports the budget; it is refused, with the test-only clock slack
    too (20 s over the budget, the slack is 8 s): on a busy machine its first overrun is run again (the machine's
    load, perhaps), after a run of the baseline measured the start-up now, and its second is its crash; on a quiet
    one its first is; an honest edit passes."""
    from orchestrator.core.noise import Gate

    for key in ("AUTOLOOP_CACHE", "AUTOLOOP_PROFILE", "AUTOLOOP_DEVICE"):
        monkeypatch.setenv(key, tiny_env[key])
    slow = CLOCKED.replace(
        "import time\n",
        "import time\n_now, _t0 = time.time, time.time()\ntime.time = lambda: _t0 + 0.2 * (_now() - _t0)\n",
        1,
    )
    repo = tmp_path / "proj"
    make_repo(
        repo,
        {
            "prepare.py": (ROOT / "prepare.py").read_text(),
            "evaluate.py": (ROOT / "evaluate.py").read_text(),
            "train.py": CLOCKED,
            ".gitignore": (ROOT / ".gitignore").read_text(),
        },
    )
    monkeypatch.setenv(
        "AUTOLOOP_TEST_PLAN",
        str(
            fakes.write_plan(
                tmp_path / "plan.json",
                [
                    {"description": "slow clock", "train": slow},
                    {"description": "honest", "train": CLOCKED.replace("LR = 0.05", "LR = 0.06")},
                ],
            )
        ),
    )
    run_loop(
        Settings(
            repo=repo,
            tag="clock",
            budget=5.0,
            proposer="fakes:Scripted",
            baseline_repeats=0,
            startup_allowance=30.0,
            gate=Gate("strict"),  # the honest edit decided at once (the baseline's second run opens the noise gate)
        ),
        echo=lambda line: None,
    )
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows][0] == "keep" and len(rows) in (3, 5), rows
    if len(rows) == 5:  # other users kept the machine busy: the first overrun is perhaps theirs
        assert rows[1].status == "discard" and "overran its budget once" in rows[1].description, rows[1]
        assert rows[2].description.startswith("baseline (repeat: measuring the start-up after run 2"), rows[2]
        assert "run 2 of it overran too" in rows[3].description, rows[3]
    else:  # a quiet machine: the idea's own at once
        assert "on a machine nobody else kept busy" in rows[1].description, rows[1]
    assert rows[-2].status == "crash" and "budget exceeded" in rows[-2].description, rows[-2]
    assert rows[-1].status in ("keep", "discard"), rows[-1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_what_a_run_leaves_in_its_directory_is_read_as_a_file_or_not_at_all(tiny_env, tmp_path, monkeypatch):
    """The controller reads the run's log and result with rights the run may not have. A run that replaces its
    run.log by a link to a secret of the host and crashes: the reason is its own words, never the secret. A run
    that leaves a FIFO as eval.json and a model the evaluator fails on: a crash row, the loop does not hang."""
    for key in ("AUTOLOOP_CACHE", "AUTOLOOP_PROFILE", "AUTOLOOP_DEVICE"):
        monkeypatch.setenv(key, tiny_env[key])
    secret = tmp_path / "host-secret.txt"
    secret.write_text("RuntimeError: db_password hunter2-prod\n")
    link_log = (
        "import os as _os\nrun_dir = _os.path.dirname(_os.environ['AUTOLOOP_' + 'EVAL_ARTIFACT'])\n"
        "_os.unlink(_os.path.join(run_dir, 'run.log'))\n"
        f"_os.symlink({str(secret)!r}, _os.path.join(run_dir, 'run.log'))\nraise SystemExit(1)\n"
    )
    fifo = after_export("_os.mkfifo(_os.path.join(_os.path.dirname(artifact), 'eval.json'))\n").replace(
        "val_bpb = evaluate_bpb(model, tokenizer, 16)\n",
        "class Late(nn.Module):  # fine on the zeros export runs it on, out of range on real tokens\n"
        "    def __init__(self, m):\n        super().__init__()\n        self.m, self.e = m, nn.Embedding(1, m.vocab)\n"
        "    def forward(self, idx):\n        return self.m.emb(idx) + self.e(idx)\n"
        "val_bpb = evaluate_bpb(Late(model), tokenizer, 16)\n",
    )
    repo = tmp_path / "proj"
    make_repo(
        repo,
        {
            "prepare.py": (ROOT / "prepare.py").read_text(),
            "evaluate.py": (ROOT / "evaluate.py").read_text(),
            "train.py": HONEST,
            ".gitignore": (ROOT / ".gitignore").read_text(),
        },
    )
    monkeypatch.setenv(
        "AUTOLOOP_TEST_PLAN",
        str(
            fakes.write_plan(
                tmp_path / "plan.json",
                [
                    {
                        "description": "links its log to a secret",
                        "train": HONEST.replace("torch.manual_seed(0)\n", "torch.manual_seed(0)\n" + link_log),
                    },
                    {"description": "a FIFO for a result", "train": fifo},
                ],
            )
        ),
    )
    run_loop(
        Settings(
            repo=repo,
            tag="files",
            budget=30.0,
            timeout=120.0,
            proposer="fakes:Scripted",
            baseline_repeats=0,
            startup_allowance=30.0,
            max_crashes=3,
        ),
        echo=lambda line: None,
    )
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows] == ["keep", "crash", "crash"], rows
    assert "hunter2" not in (repo / "results.tsv").read_text()
    assert "hunter2" not in (repo / ".autoloop" / "files" / "runs" / "2" / "record.json").read_text()
    assert "IndexError" in rows[2].description, rows[2]  # the evaluator's own words, in a result it wrote anew


def test_a_local_corpus_is_hidden_from_training_unless_it_holds_the_repository(tmp_path):
    """From a `--dataset DIR`'s source a run could rebuild the validation split: the training step's sandbox
    hides it; never a directory holding the repository or the prepared data (that would hide the run itself)."""
    from types import SimpleNamespace

    from orchestrator.core.trial import corpus_source

    corpus, repo, cache = tmp_path / "corpus", tmp_path / "repo", tmp_path / "cache"
    for path in (corpus, repo, cache):
        path.mkdir()

    def ws(dataset):
        return SimpleNamespace(
            info=SimpleNamespace(dataset=dataset, cache=str(cache)), settings=SimpleNamespace(repo=repo)
        )

    assert corpus_source(ws(str(corpus))) == (str(corpus),)
    assert corpus_source(ws(str(tmp_path))) == ()  # holds the repository
    assert corpus_source(ws("pystdlib")) == () and corpus_source(ws(None)) == ()
