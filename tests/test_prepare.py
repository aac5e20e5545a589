"""The fixed harness: splits, manifest, evaluation, data sources (the real prepare.py, tiny profile)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT


def run_py(code: str, env: dict, cwd: Path = ROOT) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_split_is_deterministic_and_disjoint(tiny_env):
    """The offline default is scored on the standard library's test suites only (a run can read the rest, which
    it needs to run): val and holdout documents all lie in the directories hidden from the training step."""
    code = """
import json, prepare
docs, held, hidden = prepare.held_out_of_reach(prepare.pystdlib_documents(), 'pystdlib')
splits = {n: prepare.split_of(n, held) for n, _ in docs}
"""
    out = run_py(
        code
        + """
import pyarrow.parquet as pq
texts = {s: set(pq.read_table(p).column('text').to_pylist()) for s, p in
         [(s, prepare.DATA_DIR / f) for s, fs in prepare.load_manifest()['splits'].items() for f in fs]}
print(json.dumps({'splits': splits, 'sizes': {s: len(t) for s, t in texts.items()}, 'hidden': hidden,
                  'recorded': prepare.load_manifest()['hidden_sources'],
                  'overlap': len(texts['train'] & texts['val']) + len(texts['val'] & texts['holdout'])
                             + len(texts['train'] & texts['holdout'])}))
""",
        tiny_env,
    )
    first = json.loads(out)
    second = json.loads(run_py(code + "print(json.dumps(splits))", tiny_env))
    assert first["splits"] == second  # stable across processes
    counts = {s: list(first["splits"].values()).count(s) for s in ("train", "val", "holdout")}
    assert counts["val"] > 0 and counts["holdout"] > 0 and counts["train"] > 100
    assert first["overlap"] == 0  # no document text in two splits
    assert first["sizes"]["val"] > 0
    if not first["hidden"]:
        pytest.skip("this Python has no test suite: the offline corpus falls back to the hash split")
    assert first["recorded"] == first["hidden"] and all(Path(d).is_dir() for d in first["hidden"])
    scored = {n for n, s in first["splits"].items() if s != "train"}
    in_tests = {n for n in first["splits"] if {"test", "tests", "idle_test"} & set(n.split("/")[:-1])}
    assert scored and scored <= in_tests  # scored: only the test suites' files


def test_manifest_records_fingerprint_and_constants(tiny_env):
    manifest = json.loads(run_py("import json, prepare; print(json.dumps(prepare.load_manifest()))", tiny_env))
    assert manifest["profile"] == "tiny" and manifest["dataset"] == "pystdlib"
    assert manifest["constants"] == {"MAX_SEQ_LEN": 64, "VOCAB_SIZE": 512, "EVAL_TOKENS": 4096, "HOLDOUT_TOKENS": 4096}
    assert len(manifest["fingerprint"]) == 64
    assert any(k.endswith("tokenizer.pkl") for k in manifest["files"])


def test_manifest_detects_changed_file_and_changed_prepare(tiny_env, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_env["AUTOLOOP_CACHE"], cache)  # manifests are relative: a copied cache verifies
    env = dict(tiny_env, AUTOLOOP_CACHE=str(cache))
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "prepare.py", work / "prepare.py")
    shutil.copy(ROOT / "evaluate.py", work / "evaluate.py")
    check = [sys.executable, "prepare.py", "--check"]
    assert subprocess.run(check, cwd=work, env=env, capture_output=True).returncode == 0
    val = cache / "pystdlib" / "data" / "val.parquet"
    original = val.read_bytes()
    val.write_bytes(original[:-10] + b"0123456789")
    proc = subprocess.run(check, cwd=work, env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "data/val.parquet changed" in proc.stdout
    val.write_bytes(original)
    with open(work / "prepare.py", "a") as f:
        f.write("\n# an edit\n")
    proc = subprocess.run(check, cwd=work, env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "prepare.py changed" in proc.stdout
    assert "data/val.parquet" not in proc.stdout


def test_evaluate_bpb_is_deterministic(tiny_env):
    out = run_py(
        """
import torch, train, prepare
torch.manual_seed(0)
tok = prepare.Tokenizer.from_directory()
cfg = train.GPTConfig(prepare.MAX_SEQ_LEN, tok.get_vocab_size(), 2, 2, 2, 64, "L")
model = train.GPT(cfg); model.init_weights()
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.01 * torch.randn_like(p))
model.eval()
a = prepare.evaluate_bpb(model, tok, 8); b = prepare.evaluate_bpb(model, tok, 8)
c = prepare.evaluate_bpb(model, tok, 16)
print(a, b, c)
""",
        dict(tiny_env, GLIBC_TUNABLES="glibc.malloc.check=0"),
    )
    a, b, c = map(float, out.split()[-3:])
    assert a == b
    assert 1.0 < a < 20.0
    assert abs(a - c) < 0.05 * a  # batch size changes only the order of summation, not the tokens


def test_local_directory_dataset(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    words = [f"w{i}" for i in range(400)]
    for i in range(120):
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(5000)))
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(200))}) for _ in range(10)]
    (corpus / "extra.jsonl").write_text("\n".join(lines))
    env = dict(os.environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="tiny")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "prepare.py"), "--dataset", str(corpus)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "130 documents" in proc.stdout


@pytest.mark.slow  # prepares a 200-document corpus twice, a tokenizer each time (~20 s)
def test_training_reads_documents_in_a_fixed_mixed_order(tmp_path):
    """Train shards hold their documents in a fixed pseudo-random order (sorted by path, a run's last steps fell
    on one directory's files and where it stopped decided its score); val and holdout are mixed too, with another
    key (the evaluation reads a fixed prefix, which in name order is one directory's). Data split in an old
    order is written again."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(1)
    words = [f"w{i}" for i in range(300)]
    for i in range(200):
        (corpus / f"doc{i:03d}.txt").write_text(f"doc{i:03d} " + " ".join(rng.choice(words) for _ in range(3000)))
    env = dict(os.environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="tiny")

    def prepare(*extra):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "prepare.py"), "--dataset", str(corpus), *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    prepare()
    out = json.loads(
        run_py(
            """
import json, prepare
import pyarrow.parquet as pq
splits = prepare.load_manifest()['splits']
read = lambda key: [t.split()[0] for f in splits[key] for t in pq.read_table(prepare.DATA_DIR / f).column('text').to_pylist()]
print(json.dumps({'train': read('train'), 'val': read('val'), 'record': str(prepare.DATA_DIR / 'splits.json'),
                  'expected': sorted(read('train'), key=lambda n: prepare.train_position(n + '.txt')),
                  'expected_val': sorted(read('val'), key=lambda n: prepare.eval_position(n + '.txt'))}))
""",
            dict(env, AUTOLOOP_DATASET=str(corpus)),
        )
    )
    assert len(out["train"]) > 150 and out["train"] == out["expected"] and out["train"] != sorted(out["train"])
    assert out["val"] == out["expected_val"] != sorted(out["val"])
    record = Path(out["record"])
    assert "already split" in prepare("--force")  # the same corpus in the same order: reused
    old = json.loads(record.read_text())
    del old["train_order"]  # splits written by a prepare.py that read them in name order
    record.write_text(json.dumps(old))
    assert "already split" not in prepare("--force")


def test_too_small_corpus_says_how_to_fix(tmp_path):
    corpus = tmp_path / "small"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 100)
    env = dict(os.environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="tiny")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "prepare.py"), "--dataset", str(corpus)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "--dataset /path/to/dir" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------
# Online datasets against a local HTTP server
# ---------------------------------------------------------------------------


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves shards like a CDN: Range requests (206), an announced sha256 (X-Linked-Etag), and faults on demand."""

    truncate: set[str] = set()  # promise the whole file, send half, hang up (once per name)
    wrong_sha: set[str] = set()  # announce a sha256 the content does not have
    garbage: set[str] = set()  # serve something that is not a parquet file
    ranges: list[str] = []  # Range headers received
    refuse = False  # answer every request with a connection reset (an unreachable server)

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.do_GET(head=True)

    def do_GET(self, head=False):
        if self.refuse:
            self.connection.close()
            return
        path = Path(self.directory) / self.path.split("?", 1)[0].lstrip("/")
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        sha = hashlib.sha256(data).hexdigest() if path.name not in self.wrong_sha else "0" * 64
        if path.name in self.garbage:  # a captive portal's page where a shard should be, no checksum
            data, sha = b"<html>please log in</html>" * 100, None
        start = 0
        if rng := self.headers.get("Range"):
            type(self).ranges.append(rng)
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        if sha:
            self.send_header("X-Linked-Etag", f'"{sha}"')
        self.end_headers()
        if head:
            return
        if path.name in self.truncate:
            type(self).truncate = self.truncate - {path.name}
            self.wfile.write(data[start : start + (len(data) - start) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(data[start:])


@pytest.fixture
def shard_server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    rng = random.Random(1)
    words = [f"tok{i}" for i in range(300)] + ["the", "a", "story", "of"]

    def shard(name, docs):
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(50, 400))) for _ in range(docs)]
        pq.write_table(pa.table({"text": texts}), root / name)

    shard("shard_00000.parquet", 400)
    shard("shard_00001.parquet", 400)
    shard("shard_06542.parquet", 300)

    def handler(*args, **kwargs):
        return _Handler(*args, directory=str(root), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()
    _Handler.truncate, _Handler.wrong_sha, _Handler.garbage, _Handler.ranges = set(), set(), set(), []
    _Handler.refuse = False


def test_online_dataset_downloads_and_prepares(shard_server, tmp_path):
    url, _ = shard_server
    env = dict(os.environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="tiny")
    cmd = [sys.executable, str(ROOT / "prepare.py"), "--dataset", "climbmix", "--num-shards", "2", "--base-url", url]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3/3 shards" in proc.stdout  # the progress line
    raw = tmp_path / "cache" / "climbmix" / "data" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == [
        "shard_00000.parquet",
        "shard_00001.parquet",
        "shard_06542.parquet",
    ]
    manifest = json.loads((tmp_path / "cache" / "climbmix" / "manifest-tiny.json").read_text())
    assert manifest["splits"]["train"] == ["raw/shard_00000.parquet", "raw/shard_00001.parquet"]
    assert manifest["splits"]["val"] == ["val.parquet"]  # from the pinned shard only


def test_download_resumes_and_checks_the_announced_sha256(shard_server, tmp_path):
    url, root = shard_server
    _Handler.truncate = {"shard_00001.parquet"}
    _Handler.wrong_sha = {"shard_06542.parquet"}
    dest = tmp_path / "dl"
    out = run_py(
        f"""
import prepare
ok0 = prepare.download_file({url!r} + "/shard_00000.parquet", {str(dest)!r} + "/a.parquet", attempts=2, backoff=0)
ok1 = prepare.download_file({url!r} + "/shard_00001.parquet", {str(dest)!r} + "/b.parquet", attempts=2, backoff=0)
ok2 = prepare.download_file({url!r} + "/missing.parquet", {str(dest)!r} + "/c.parquet", attempts=2, backoff=0)
ok3 = prepare.download_file({url!r} + "/shard_06542.parquet", {str(dest)!r} + "/d.parquet", attempts=2, backoff=0)
print(ok0, ok1, ok2, ok3)
""",
        dict(os.environ, AUTOLOOP_PROFILE="tiny"),
    )
    assert out.split()[-4:] == ["True", "True", "False", "False"]
    # b: cut off halfway, then continued from where it stopped with a Range request, and complete
    assert len(_Handler.ranges) == 1 and _Handler.ranges[0] != "bytes=0-"
    assert (dest / "b.parquet").read_bytes() == (root / "shard_00001.parquet").read_bytes()
    assert "HTTP 404" in out and "checksum mismatch" in out
    assert sorted(p.name for p in dest.iterdir()) == ["a.parquet", "b.parquet"]  # nothing partial is renamed in


def test_download_of_a_complete_part_file_or_of_garbage(shard_server, tmp_path):
    url, root = shard_server
    dest = tmp_path / "dl"
    dest.mkdir()
    # killed after the last byte but before the rename: the server answers the resume with 416
    (dest / "a.parquet.part").write_bytes((root / "shard_00000.parquet").read_bytes())
    _Handler.garbage = {"shard_00001.parquet"}
    out = run_py(
        f"""
import prepare, pyarrow.parquet as pq
ok0 = prepare.download_file({url!r} + "/shard_00000.parquet", {str(dest)!r} + "/a.parquet", attempts=2, backoff=0,
                            validate=pq.ParquetFile)
ok1 = prepare.download_file({url!r} + "/shard_00001.parquet", {str(dest)!r} + "/b.parquet", attempts=2, backoff=0,
                            validate=pq.ParquetFile)
print(ok0, ok1)
""",
        dict(os.environ, AUTOLOOP_PROFILE="tiny"),
    )
    assert out.split()[-2:] == ["True", "False"], out
    assert (dest / "a.parquet").read_bytes() == (root / "shard_00000.parquet").read_bytes()
    assert "not a valid file" in out
    assert sorted(p.name for p in dest.iterdir()) == ["a.parquet"]


def test_offline_stops_at_once_naming_the_ways_out(shard_server, tmp_path):
    url, _ = shard_server
    _Handler.refuse = True
    env = dict(os.environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="tiny")
    cmd = [sys.executable, str(ROOT / "prepare.py"), "--dataset", "climbmix", "--num-shards", "1", "--base-url", url]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 30  # no minutes of retries on an offline machine
    for way_out in ("--dataset /path/to/dir", "--dataset pypackages", "--dataset pystdlib", "AUTOLOOP_DATA_URL"):
        assert way_out in proc.stderr


def test_gpu_profile_defaults_to_climbmix(tmp_path):
    env = dict(os.environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="gpu")
    env.pop("AUTOLOOP_DATASET", None)
    out = run_py("import prepare; print(prepare.DATASET)", env)
    assert out.split()[-1] == "climbmix"
    assert run_py("import prepare; print(prepare.DATASET)", dict(env, AUTOLOOP_PROFILE="cpu")).split()[-1] == "pystdlib"


# ---------------------------------------------------------------------------
# The evaluator never runs dry: it scores exactly EVAL_TOKENS / HOLDOUT_TOKENS, whatever the batch size
# ---------------------------------------------------------------------------

COUNT_TOKENS = """
import math, torch, prepare

class Uniform(torch.nn.Module):
    # predicts every token with probability 1/V: the loss is log(V) per token, so bpb reveals the token count
    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.anchor, self.seen = vocab, torch.nn.Parameter(torch.zeros(1)), []
    def forward(self, x):  # logits; the evaluator computes the loss itself
        assert x.shape[0] <= self.batch and x.shape[1] == prepare.MAX_SEQ_LEN
        self.seen.append(x)
        return torch.zeros(*x.shape, self.vocab) + 0 * self.anchor

tok = prepare.Tokenizer.from_directory()
model, tb = Uniform(tok.get_vocab_size()), prepare.get_token_bytes()
for split in ("val", "holdout"):
    wanted = prepare.split_tokens(split)
    rows = prepare.eval_rows(tok, prepare._split_files(split), -(-wanted // prepare.MAX_SEQ_LEN))
    targets = rows[:, 1:].reshape(-1)[:wanted]
    expected = (tb[targets] > 0).sum().item() * math.log2(tok.get_vocab_size()) / tb[targets].sum().item()
    for batch in (1, 3, 1000):
        model.batch, model.seen = batch, []
        got = prepare._evaluate_split_bpb(model, tok, batch, split)
        assert torch.equal(torch.cat(model.seen), rows[:, :-1])  # exactly the packed rows, each once, in order
        assert abs(got - expected) < 1e-5 * expected, (split, batch, got, expected)
    print(split, wanted)
"""


BIGGER = (("cpu", "pystdlib"), ("gpu", "pystdlib"), ("tiny", "pypackages"))  # a minute or more each: the slow tier


@pytest.mark.parametrize(
    "profile,dataset", [("tiny", "pystdlib"), *(pytest.param(*case, marks=pytest.mark.slow) for case in BIGGER)]
)
def test_evaluator_scores_exactly_the_prepared_tokens(profile, dataset, tmp_path_factory):
    """For each offline corpus (pypackages: ~270 MB here, so its larger profiles are left to the GPU check)."""
    cache = tmp_path_factory.getbasetemp() / "eval-cache"  # one corpus each, one tokenizer per profile
    env = dict(
        os.environ, AUTOLOOP_CACHE=str(cache), AUTOLOOP_PROFILE=profile, AUTOLOOP_DATASET=dataset, AUTOLOOP_DEVICE="cpu"
    )
    proc = subprocess.run([sys.executable, "prepare.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = run_py(COUNT_TOKENS, env)
    sizes = dict(line.split() for line in out.splitlines() if line.startswith(("val ", "holdout ")))
    assert int(sizes["val"]) >= min(int(sizes["holdout"]), 2**15) > 0


def test_a_corpus_too_small_to_evaluate_is_refused(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(400)]  # ~1 token each
    for i in range(400):  # ~2.6 MB: enough to prepare, too few held-out tokens (~5%) to evaluate on
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(1100)))
    env = dict(os.environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="gpu", AUTOLOOP_DEVICE="cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "prepare.py"), "--dataset", str(corpus)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "as the evaluator packs them" in proc.stderr and "--profile cpu" in proc.stderr
    assert not list((tmp_path / "cache").glob("*/manifest-gpu.json"))  # nothing half-prepared passes for ready


def test_the_packer_picks_the_longest_document_that_fits_else_the_shortest(tiny_env):
    """The packing buffer's index picks what a scan of the buffer in arrival order would: the longest document
    that fits the row's room (the earliest of equal length), or, when none fits, the shortest (the earliest)."""
    out = run_py(
        """
import random, prepare
rng = random.Random(0)
for trial in range(300):
    docs = [[trial, i] + [0] * rng.randrange(0, 12) for i in range(rng.randrange(1, 30))]
    buffer, scan = prepare._FitBuffer(), list(docs)
    for d in docs:
        buffer.add(d)
    while scan:
        room = rng.randrange(1, 16)
        fits = [d for d in scan if len(d) <= room]
        want = max(fits, key=len) if fits else min(scan, key=len)  # max/min keep the first of equal length
        scan.remove(want)
        assert buffer.take(room) is want, (trial, room)
    assert len(buffer) == 0
print("ok")
""",
        tiny_env,
    )
    assert out.split()[-1] == "ok"


def test_dataloader_batches_carry_the_packed_rows_in_order(tiny_env):
    """Several consecutive batches hold exactly the rows the packer makes, inputs and targets shifted by one
    (the host buffers are reused; on CUDA a reused buffer would otherwise be overwritten before its copy)."""
    out = run_py(
        """
import torch, prepare
tok = prepare.Tokenizer.from_directory()
B, T = 3, prepare.MAX_SEQ_LEN
rows = prepare._packed_rows(tok, T, prepare._split_files("train"))
batches = prepare.make_dataloader(tok, B, T, "train", device="cpu")
held = []
for _ in range(6):
    x, y, epoch = next(batches)
    held.append((x, y))  # kept alive while later batches are made
    assert x.shape == y.shape == (B, T) and x.dtype == torch.long and epoch == 1
for x, y in held:
    expected = torch.tensor([next(rows)[0] for _ in range(B)])
    assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])
    assert (x[:, 0] == tok.get_bos_token_id()).all()
print("ok", len(held))
""",
        tiny_env,
    )
    assert out.split()[-2:] == ["ok", "6"]


@pytest.mark.slow
def test_evaluation_refuses_a_manifest_changed_since_the_session_pinned_it(tiny_env, tmp_path):
    """A run that rewrites the manifest (e.g. EVAL_TOKENS = 64) must not get a number measured on its terms."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_env["AUTOLOOP_CACHE"], cache)
    env = dict(
        tiny_env, AUTOLOOP_CACHE=str(cache), AUTOLOOP_TIME_BUDGET="1", AUTOLOOP_EVAL_ARTIFACT=str(tmp_path / "m.pt")
    )
    proc = subprocess.run([sys.executable, "train.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "val_bpb:          nan" in proc.stdout  # under the controller train.py does not evaluate
    manifest_path = cache / "pystdlib" / "manifest-tiny.json"
    digest = run_py("import prepare; print(prepare.manifest_digest(prepare.load_manifest()))", env).split()[-1]
    evaluate = [sys.executable, "-I", "-S", "evaluate.py", str(tmp_path / "m.pt")]
    env = dict(env, AUTOLOOP_MANIFEST_DIGEST=digest)
    env.pop("AUTOLOOP_EVAL_ARTIFACT")
    good = subprocess.run(evaluate, cwd=ROOT, env=env, capture_output=True, text=True)
    assert good.returncode == 0 and '"eval_tokens": 4096' in good.stdout, good.stdout + good.stderr
    manifest = json.loads(manifest_path.read_text())
    manifest["constants"]["EVAL_TOKENS"] = 64
    manifest_path.write_text(json.dumps(manifest))
    bad = subprocess.run(evaluate, cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 3 and "manifest" in bad.stdout and "val_bpb" not in bad.stdout, bad.stdout + bad.stderr


def test_controller_reprepares_data_made_by_another_prepare_py(tiny_env, tmp_path):
    from orchestrator.trust import harness

    manifest = Path(tiny_env["AUTOLOOP_CACHE"]) / "pystdlib" / "manifest-tiny.json"
    assert harness.verify(manifest, ROOT / "prepare.py") == []
    other = tmp_path / "prepare.py"
    other.write_text((ROOT / "prepare.py").read_text() + "\n# an older or newer harness\n")
    assert harness.verify(manifest, other) == ["the data was prepared by another prepare.py"]
    assert (
        harness.manifest_digest(manifest)
        == run_py("import prepare; print(prepare.manifest_digest(prepare.load_manifest()))", tiny_env).split()[-1]
    )


def test_a_python_without_its_test_suite_falls_back_to_the_hash_split_and_says_so(tiny_env, tmp_path):
    """Debian's Python ships without most of its test suite: too little to score on, so the offline corpus is
    split by hash (its validation sources readable by a run), with a warning; the controller repeats it."""
    out = run_py(
        """
import json, prepare
docs = [(f"pkg/m{i}.py", "x = 1\\n" * 50, None) for i in range(5)] + [("test/t.py", "y = 2\\n", "/py/test")]
plain, held, hidden = prepare.held_out_of_reach(docs, "pystdlib")
print(json.dumps([len(plain), held, hidden]))
big = [("test/t%d.py" % i, "z = %d\\n" % i * 20000, "/py/test") for i in range(60)]
print(json.dumps(prepare.held_out_of_reach(docs + big, "pystdlib")[2]))
print(json.dumps(sorted(prepare.held_directories(prepare.other_pythons()))))
""",
        tiny_env,
    )
    assert "warning: this Python has only" in out and "libpython3-testsuite" in out
    lines = [line for line in out.splitlines() if line.startswith("[")]
    hidden, others = json.loads(lines[1]), json.loads(lines[2])
    assert json.loads(lines[0]) == [6, None, []]
    assert hidden == sorted({"/py/test", *others})  # and the test suites of every Python on the machine

    from orchestrator.trust.harness import scored_on_readable_sources

    manifest = tmp_path / "manifest.json"
    for recorded, readable in [
        ({"dataset": "pystdlib", "hidden_sources": []}, True),
        ({"dataset": "pypackages"}, True),  # prepared by an older prepare.py
        ({"dataset": "pystdlib", "hidden_sources": ["/py/test"]}, False),
        ({"dataset": "climbmix", "hidden_sources": []}, False),
    ]:
        manifest.write_text(json.dumps(recorded))
        assert scored_on_readable_sources(manifest) is readable, recorded
