"""The fixed harness: splits, manifest, evaluation, data sources (the real prepare.py, tiny profile)."""

from __future__ import annotations

import http.server
import json
import random
import shutil
import subprocess
import sys
import threading
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
    out = run_py("""
import json, prepare
names = [d for d, _ in prepare.pystdlib_documents()]
splits = {n: prepare.split_of(n) for n in names}
texts = {s: set(pq.read_table(p).column('text').to_pylist()) for s, p in
         [(s, prepare.DATA_DIR / f) for s, fs in prepare.load_manifest()['splits'].items() for f in fs]}
print(json.dumps({'splits': splits, 'sizes': {s: len(t) for s, t in texts.items()},
                  'overlap': len(texts['train'] & texts['val']) + len(texts['val'] & texts['holdout'])
                             + len(texts['train'] & texts['holdout'])}))
""".replace("import json, prepare", "import json, prepare\nimport pyarrow.parquet as pq"), tiny_env)
    first = json.loads(out)
    second = json.loads(run_py("import json, prepare; print(json.dumps({n: prepare.split_of(n) for n, _ in "
                               "prepare.pystdlib_documents()}))", tiny_env))
    assert first["splits"] == second  # stable across processes
    counts = {s: list(first["splits"].values()).count(s) for s in ("train", "val", "holdout")}
    assert counts["val"] > 0 and counts["holdout"] > 0 and counts["train"] > 5 * counts["val"]
    assert first["overlap"] == 0  # no document text in two splits
    assert first["sizes"]["val"] > 0


def test_manifest_records_fingerprint_and_constants(tiny_env):
    manifest = json.loads(run_py("import json, prepare; print(json.dumps(prepare.load_manifest()))", tiny_env))
    assert manifest["profile"] == "tiny" and manifest["dataset"] == "pystdlib"
    assert manifest["constants"] == {"MAX_SEQ_LEN": 64, "VOCAB_SIZE": 512, "EVAL_TOKENS": 4096}
    assert len(manifest["fingerprint"]) == 64
    assert any(k.endswith("tokenizer.pkl") for k in manifest["files"])


def test_manifest_detects_changed_file_and_changed_prepare(tiny_env, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_env["AUTOLOOP_CACHE"], cache)  # manifests are relative: a copied cache verifies
    env = dict(tiny_env, AUTOLOOP_CACHE=str(cache))
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "prepare.py", work / "prepare.py")
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
    out = run_py("""
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
""", dict(tiny_env, GLIBC_TUNABLES="glibc.malloc.check=0"))
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
    env = dict(__import__("os").environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="tiny")
    proc = subprocess.run([sys.executable, str(ROOT / "prepare.py"), "--dataset", str(corpus)], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "130 documents" in proc.stdout


def test_too_small_corpus_says_how_to_fix(tmp_path):
    corpus = tmp_path / "small"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 100)
    env = dict(__import__("os").environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="tiny")
    proc = subprocess.run([sys.executable, str(ROOT / "prepare.py"), "--dataset", str(corpus)], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "--dataset /path/to/dir" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------
# Online datasets against a local HTTP server
# ---------------------------------------------------------------------------


class _Handler(http.server.SimpleHTTPRequestHandler):
    truncate: set[str] = set()

    def log_message(self, *args):
        pass

    def do_GET(self):
        name = self.path.rsplit("/", 1)[-1]
        if name in self.truncate:  # promise 100000 bytes, send 10, hang up
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b"0123456789")
            return
        super().do_GET()


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
    _Handler.truncate = set()


def test_online_dataset_downloads_and_prepares(shard_server, tmp_path):
    url, _ = shard_server
    env = dict(__import__("os").environ, AUTOLOOP_CACHE=str(tmp_path / "cache"), AUTOLOOP_PROFILE="tiny")
    cmd = [sys.executable, str(ROOT / "prepare.py"), "--dataset", "climbmix", "--num-shards", "2", "--base-url", url]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    raw = tmp_path / "cache" / "climbmix" / "data" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == ["shard_00000.parquet", "shard_00001.parquet",
                                                      "shard_06542.parquet"]
    manifest = json.loads((tmp_path / "cache" / "climbmix" / "manifest-tiny.json").read_text())
    assert manifest["splits"]["train"] == ["raw/shard_00000.parquet", "raw/shard_00001.parquet"]
    assert manifest["splits"]["val"] == ["val.parquet"]  # from the pinned shard only


def test_failed_download_leaves_no_partial_file(shard_server, tmp_path):
    url, _ = shard_server
    _Handler.truncate = {"shard_00001.parquet"}
    dest = tmp_path / "dl"
    out = run_py(f"""
import prepare
ok0 = prepare.download_file({url!r} + "/shard_00000.parquet", {str(dest)!r} + "/a.parquet", attempts=2, backoff=0)
ok1 = prepare.download_file({url!r} + "/shard_00001.parquet", {str(dest)!r} + "/b.parquet", attempts=2, backoff=0)
ok2 = prepare.download_file({url!r} + "/missing.parquet", {str(dest)!r} + "/c.parquet", attempts=2, backoff=0)
print(ok0, ok1, ok2)
""", dict(__import__("os").environ, AUTOLOOP_PROFILE="tiny"))
    assert out.split()[-3:] == ["True", "False", "False"]
    assert sorted(p.name for p in dest.iterdir()) == ["a.parquet"]  # no b.parquet, no .tmp left behind
    assert "truncated" in out or "IncompleteRead" in out or "attempt" in out
