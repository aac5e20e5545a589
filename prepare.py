"""
prepare.py -- the FIXED harness of autoloop. Never edited by the loop.

Owns everything that makes one experiment comparable to the next: the constants (sequence length,
vocabulary, evaluation size, time budget, seed), the data, the tokenizer, the dataloader and the metric
(`evaluate_bpb`). train.py imports from here; the autoloop controller checks this file's hash, and the
hashes of the prepared files, against a manifest before every run. Under the controller the number that counts
is computed by evaluate.py (fixed too), from the model evaluate_bpb exports, in a process of its own.

Usage:
    python prepare.py                          # offline default: Python's standard library sources
    python prepare.py --dataset tinystories    # online datasets: climbmix | tinystories
    python prepare.py --dataset ~/my_corpus    # a directory of .txt / .jsonl / .parquet files
    python prepare.py --profile tiny           # harness size: gpu | cpu | tiny (default: gpu if CUDA, else cpu)
    python prepare.py --check                  # verify the prepared files against the manifest

Environment (set by the controller): AUTOLOOP_TIME_BUDGET, AUTOLOOP_SEED, AUTOLOOP_CACHE,
AUTOLOOP_DATASET, AUTOLOOP_PROFILE.
"""

import argparse
import bisect
import glob
import hashlib
import http.client
import itertools
import json
import math
import os
import pickle
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

# ---------------------------------------------------------------------------
# Constants (fixed; the controller passes budget and seed through the environment)
# ---------------------------------------------------------------------------

TIME_BUDGET = float(os.environ.get("AUTOLOOP_TIME_BUDGET", "300"))  # training seconds
SEED = int(os.environ.get("AUTOLOOP_SEED", "42"))
CACHE_DIR = Path(os.environ.get("AUTOLOOP_CACHE") or "~/.cache/autoloop").expanduser()

# Harness sizes. "gpu" is upstream-like; "cpu" fits a 2-core laptop; "tiny" is for smoke tests.
# EVAL_TOKENS is the target: a corpus whose validation split holds fewer tokens (as the evaluator packs them)
# gets the evaluation it can fill, fixed in the manifest when the data is prepared.
PROFILES = {
    "gpu": {"MAX_SEQ_LEN": 2048, "VOCAB_SIZE": 8192, "EVAL_TOKENS": 40 * 524288},
    "cpu": {"MAX_SEQ_LEN": 256, "VOCAB_SIZE": 4096, "EVAL_TOKENS": 2**17},
    "tiny": {"MAX_SEQ_LEN": 64, "VOCAB_SIZE": 512, "EVAL_TOKENS": 2**12},
}
MIN_EVAL_TOKENS = 2**15  # below this an evaluation is too noisy to decide anything (tokens)
EVAL_LOGITS_BYTES = 2**30  # fp32 logits per evaluation forward at most: bounds the evaluation's memory
EVAL_MAX_ROWS = 32  # rows per forward of the harness's evaluation (evaluate.py), at most


def _default_profile():
    if os.environ.get("AUTOLOOP_DEVICE", "").startswith("cpu"):
        return "cpu"
    return "gpu" if torch.cuda.is_available() else "cpu"


PROFILE = os.environ.get("AUTOLOOP_PROFILE") or _default_profile()
if PROFILE not in PROFILES:
    sys.exit(f"prepare.py: unknown AUTOLOOP_PROFILE={PROFILE!r}; choose one of {', '.join(PROFILES)}")
MAX_SEQ_LEN = PROFILES[PROFILE]["MAX_SEQ_LEN"]  # context length (tokens)
VOCAB_SIZE = PROFILES[PROFILE]["VOCAB_SIZE"]  # BPE vocabulary, special tokens included
# Rows per forward of the harness's evaluation, fixed here (the model is exported for it): how the evaluation is
# cut into batches is never train.py's choice
EVAL_ROWS = max(1, min(EVAL_MAX_ROWS, EVAL_LOGITS_BYTES // (MAX_SEQ_LEN * VOCAB_SIZE * 4)))
# On a GPU an offline corpus is far too small to measure learning: the default there is upstream's climbmix.
DATASET = os.environ.get("AUTOLOOP_DATASET") or ("climbmix" if PROFILE == "gpu" else "pystdlib")

# BPE split pattern (GPT-4 style, digits in groups of at most two)
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = [f"<|reserved_{i}|>" for i in range(4)]
BOS_TOKEN = "<|reserved_0|>"

MIN_CORPUS_BYTES = 2_000_000  # below this a corpus is too small to train and evaluate on
VAL_PERCENT, HOLDOUT_PERCENT = 10, 5  # document split by path hash: holdout | val | train
# The offline corpora are the machine's own Python files, which a training run can read (it needs most of them
# to run at all): split by hash, it rebuilt the validation split byte for byte from them and trained on it. So
# there the documents scored come only from test-suite directories no training run imports (the standard
# library's test/, packages' tests/), split by hash as above; the rest of the corpus is trained on, and the
# sandbox hides those directories from the training step (manifest: "hidden_sources"). A Python with too little
# of a test suite (Debian's, without its testsuite package) falls back to the hash split, with a warning.
HELD_DIRS = frozenset({"test", "tests", "idle_test"})
HELD_MIN_BYTES = 6_000_000  # of test suites: the scored 15% fill a cpu profile's evaluation
TRAIN_SHARD_BYTES = 64 * 2**20  # text bytes per written train shard

# Offline corpora every machine with Python has (documents: source files). pystdlib is small (~7.6M training
# tokens at the gpu profile's vocabulary): a smoke test on a GPU. pypackages holds tens of millions of tokens.
OFFLINE = ("pystdlib", "pypackages")
OFFLINE_SOURCES = {"pystdlib": "Python standard library", "pypackages": "installed packages' Python"}
PYPACKAGES_MAX_FILE_BYTES = 1_000_000  # larger .py files are generated tables, not code

# Online datasets: a base URL, training shard names and pinned validation shard names.
ONLINE = {
    "climbmix": {
        "base_url": "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main",
        "train": [f"shard_{i:05d}.parquet" for i in range(10)],
        "val": ["shard_06542.parquet"],
    },
    "tinystories": {
        "base_url": "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/refs%2Fconvert%2Fparquet/default",
        "train": [f"train/{i:04d}.parquet" for i in range(4)],
        "val": ["validation/0000.parquet"],
    },
}


def dataset_key(dataset=DATASET):
    """Directory name under CACHE_DIR for a dataset (a local path gets a stable hashed name)."""
    if dataset in ONLINE or dataset in OFFLINE:
        return dataset
    path = os.path.abspath(os.path.expanduser(dataset))
    return f"local-{Path(path).name}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


DATA_DIR = CACHE_DIR / dataset_key() / "data"
TOKENIZER_DIR = CACHE_DIR / dataset_key() / f"tokenizer-{VOCAB_SIZE}"
MANIFEST_PATH = CACHE_DIR / dataset_key() / f"manifest-{PROFILE}.json"


def _prepared_constants():
    try:
        return json.loads(MANIFEST_PATH.read_text())["constants"]
    except (OSError, ValueError, KeyError):
        return {}


# Tokens scored per evaluation of the validation / held-out split, as fixed when the data was prepared.
EVAL_TOKENS = int(_prepared_constants().get("EVAL_TOKENS") or PROFILES[PROFILE]["EVAL_TOKENS"])
HOLDOUT_TOKENS = int(_prepared_constants().get("HOLDOUT_TOKENS") or EVAL_TOKENS)

# ---------------------------------------------------------------------------
# Small utilities
# ---------------------------------------------------------------------------


def log(msg):
    print(msg, flush=True)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_of(name, held=None):
    """Deterministic split of a document by the hash of its name: 'holdout', 'val' or 'train'. With `held` (the
    names under hidden test directories), only those can be scored; every other document is trained on."""
    if held is not None and name not in held:
        return "train"
    bucket = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100
    if bucket < HOLDOUT_PERCENT:
        return "holdout"
    return "val" if bucket < HOLDOUT_PERCENT + VAL_PERCENT else "train"


# Training reads its documents in this order. Sorted by path, a run's last steps fell on one directory's files
# (similar, often repetitive), so where a run stopped decided its val_bpb: runs of one configuration that did 6%
# more steps on a faster moment of the machine scored 3% worse. In a fixed pseudo-random order, every stretch
# of the stream is a mix. val and holdout are mixed the same way (with another key): the evaluation reads a
# fixed prefix of them, which in name order would be one directory's files.
TRAIN_ORDER = "sha256 of 'train order' and the name; val/holdout: of 'eval order'; held: test directories"


def train_position(name):
    return hashlib.sha256(b"train order\0" + name.encode()).digest()


def eval_position(name):
    return hashlib.sha256(b"eval order\0" + name.encode()).digest()


def write_parquet_atomic(path, texts):
    tmp = Path(f"{path}.tmp")
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), tmp, row_group_size=1024)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# Data sources
# ---------------------------------------------------------------------------


def _python_documents(roots, skip=(), max_bytes=None):
    """(relative path, text, held directory or None) of the .py files under roots, sorted by path; the held
    directory is the outermost test-suite directory (HELD_DIRS) the file lies in. Unreadable files are skipped."""
    docs, seen = [], set()
    for root in roots:
        root = Path(root)
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if set(skip).intersection(rel.parts[:-1]) or rel.as_posix() in seen:
                continue
            held = next((str(root.joinpath(*rel.parts[:i + 1])) for i, part in enumerate(rel.parts[:-1])
                         if part in HELD_DIRS), None)
            try:
                if max_bytes and path.stat().st_size > max_bytes:
                    continue
                docs.append((rel.as_posix(), path.read_text(encoding="utf-8"), held))
                seen.add(rel.as_posix())
            except (OSError, UnicodeDecodeError):
                continue
    return sorted(docs)


def python_roots(dataset):
    """The directories an offline corpus is read from."""
    if dataset == "pystdlib":
        return [sysconfig.get_paths()["stdlib"]]
    import site

    roots = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages(),
                                           sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]}
    return sorted(r for r in roots if os.path.isdir(r))


def pystdlib_documents():
    """(relative path, text, held directory) of the running Python's standard library sources, sorted by path."""
    return _python_documents(python_roots("pystdlib"), skip={"site-packages", "dist-packages", "__pycache__"})


def pypackages_documents():
    """(relative path, text, held directory) of the Python sources of every installed package (site-packages)."""
    return _python_documents(python_roots("pypackages"), skip={"__pycache__"}, max_bytes=PYPACKAGES_MAX_FILE_BYTES)


def held_directories(roots):
    """The outermost test-suite directories (HELD_DIRS) under roots, not following links."""
    found = set()
    for root in roots:
        for top, dirs, _ in os.walk(root):
            for name in [d for d in dirs if d in HELD_DIRS]:
                found.add(os.path.join(top, name))
                dirs.remove(name)  # its own test/ subdirectories are inside it
    return found


def other_pythons():
    """The library trees of the machine's other Pythons (other versions, environments, the system's): their
    test suites hold copies of the scored files, byte for byte, so the sandbox hides those too."""
    here = {os.path.realpath(sysconfig.get_paths()[key]) for key in ("stdlib", "purelib", "platlib")}
    patterns = [os.path.join(os.path.dirname(sys.base_prefix), "*", "lib", "python[0-9]*"),  # pyenv versions, conda envs
                os.path.join(sys.base_prefix, "envs", "*", "lib", "python[0-9]*"), os.path.join(sys.prefix, "lib", "python[0-9]*"),
                "/usr/lib/python[0-9]*", "/usr/local/lib/python[0-9]*", "/opt/*/lib/python[0-9]*", "/opt/conda/envs/*/lib/python[0-9]*",
                os.path.expanduser("~/.local/lib/python[0-9]*"), os.path.expanduser("~/.pyenv/versions/*/lib/python[0-9]*")]
    trees = {os.path.realpath(t) for pattern in patterns for t in glob.glob(pattern) if os.path.isdir(t)}
    return sorted(t for t in trees if not any(t == h or h.startswith(t + os.sep) for h in here)) + sorted(here)


def held_out_of_reach(documents, source, roots=()):
    """(docs, held names or None, hidden directories) for an offline corpus: scored only on the test-suite files
    when there are enough of them, else the hash split. Hidden from training: the test suites under the corpus's
    roots (a file skipped as a second copy of a path included) and those of the machine's other Pythons."""
    docs = [(name, text) for name, text, _ in documents]
    held = {name: where for name, text, where in documents if where}
    size = sum(len(text.encode("utf-8", "replace")) for name, text, where in documents if where)
    if size < HELD_MIN_BYTES:
        log(f"warning: this Python has only {size / 1e6:.2f} MB of test suites (need {HELD_MIN_BYTES / 1e6:.1f}), "
            f"so the {source} corpus is split by hash and a training run can read the source files of its "
            "validation split (and train on them). Install the test suite (Debian: libpython3-testsuite) or use "
            "--dataset /path/to/dir, whose source the sandbox hides")
        return docs, None, []
    return docs, set(held), sorted(set(held.values()) | held_directories([*roots, *other_pythons()]))


def local_documents(directory):
    """(name, text) of every .txt / .jsonl / .parquet document under a directory, sorted by name."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        sys.exit(f"prepare.py: --dataset {directory!r} is neither a known dataset nor a directory")
    docs = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if path.suffix == ".txt":
            docs.append((rel, path.read_text(encoding="utf-8", errors="replace")))
        elif path.suffix == ".jsonl":
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
                if line.strip():
                    docs.append((f"{rel}:{i}", str(json.loads(line)["text"])))
        elif path.suffix == ".parquet":
            texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
            docs.extend((f"{rel}:{i}", t) for i, t in enumerate(texts) if t)
    return docs


def fingerprint(docs):
    """sha256 over names and contents: results are comparable only within one fingerprint."""
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode() + b"\0" + text.encode("utf-8", "replace") + b"\0")
    return h.hexdigest()


def write_document_splits(docs, source, held=None, hidden=()):
    """Split documents by name hash (`held`: see split_of) and write train shards, val.parquet and holdout.parquet;
    `hidden`: the directories of the held documents, recorded for the sandbox."""
    total = sum(len(t.encode("utf-8", "replace")) for _, t in docs)
    if total < MIN_CORPUS_BYTES:
        sys.exit(
            f"prepare.py: the {source} corpus holds only {total / 1e6:.2f} MB of text "
            f"(need {MIN_CORPUS_BYTES / 1e6:.0f} MB; some Python distributions strip the standard library). "
            "Point at a directory of .txt/.jsonl/.parquet files instead: python prepare.py --dataset /path/to/dir"
        )
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    digest = fingerprint(docs)
    record = DATA_DIR / "splits.json"
    if record.exists():  # another profile already wrote these splits from the same corpus: reuse them
        previous = json.loads(record.read_text())
        hashes = previous.get("sha256", {})
        if previous["fingerprint"] == digest and previous.get("train_order") == TRAIN_ORDER and hashes and \
                previous.get("hidden_sources") == list(hidden) and all(
                (DATA_DIR / rel).exists() and sha256_file(DATA_DIR / rel) == h for rel, h in hashes.items()):
            log(f"Data: {len(docs)} documents already split in {DATA_DIR}")
            return previous
    splits = {"train": [], "val": [], "holdout": []}
    for name, text in docs:
        splits[split_of(name, held)].append((name, text))
    splits["train"].sort(key=lambda doc: train_position(doc[0]))
    seen = {text for _, text in splits["train"]}
    for key in ("val", "holdout"):  # a text also trained on (or scored twice) is not scored: copies of a file
        scored = []
        for name, text in sorted(splits[key], key=lambda doc: eval_position(doc[0])):
            if text.strip() and text not in seen:
                scored.append((name, text))
                seen.add(text)
        splits[key] = scored
    splits = {key: [text for _, text in named] for key, named in splits.items()}
    shards, current, size = [], [], 0
    for text in splits["train"]:
        current.append(text)
        size += len(text)
        if size >= TRAIN_SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    for i, texts in enumerate(shards):
        write_parquet_atomic(DATA_DIR / f"train_{i:05d}.parquet", texts)
    write_parquet_atomic(DATA_DIR / "val.parquet", splits["val"])
    write_parquet_atomic(DATA_DIR / "holdout.parquet", splits["holdout"])
    log(f"Data: {len(docs)} documents, {total / 1e6:.1f} MB -> {len(shards)} train shard(s), "
        f"{len(splits['val'])} val and {len(splits['holdout'])} holdout documents in {DATA_DIR}")
    result = {
        "train": [f"train_{i:05d}.parquet" for i in range(len(shards))],
        "val": ["val.parquet"],
        "holdout": ["holdout.parquet"],
        "fingerprint": digest,
        "train_order": TRAIN_ORDER,
        "hidden_sources": list(hidden),
    }
    files = [rel for key in ("train", "val", "holdout") for rel in result[key]]
    record.write_text(json.dumps({**result, "sha256": {rel: sha256_file(DATA_DIR / rel) for rel in files}}, indent=1))
    return result


class _Progress:
    """One line of download progress for all shards together (rewritten in place on a terminal)."""

    def __init__(self, total_files):
        self.total_files, self.done_files, self.bytes, self.t0, self.last = total_files, 0, 0, time.time(), 0.0
        self.tty, self.lock = sys.stdout.isatty(), threading.Lock()

    def add(self, nbytes=0, file_done=False):
        with self.lock:
            self.bytes += nbytes
            self.done_files += file_done
            now = time.time()
            if now - self.last < (0.2 if self.tty else 10.0) and not file_done:
                return
            self.last = now
            rate = self.bytes / max(now - self.t0, 1e-9) / 1e6
            line = f"  {self.done_files}/{self.total_files} shards | {self.bytes / 1e6:,.0f} MB | {rate:.1f} MB/s"
            print(f"\r{line}\x1b[K" if self.tty else line, end="" if self.tty else "\n", flush=True)

    def close(self):
        if self.tty:
            print(flush=True)


class _KeepLinkedEtag(urllib.request.HTTPRedirectHandler):
    """Remembers the sha256 a Hugging Face redirect announces (X-Linked-Etag) for the file behind it."""

    def __init__(self):
        self.sha256 = None

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.sha256 = _sha256_header(headers) or self.sha256
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _sha256_header(headers):
    for key in ("X-Linked-Etag", "X-Checksum-Sha256"):
        value = (headers.get(key) or "").strip().strip('"').removeprefix("W/").strip('"')
        if len(value) == 64 and all(c in "0123456789abcdef" for c in value.lower()):
            return value.lower()
    return None


STOP_DOWNLOADS = threading.Event()  # set on Ctrl-C: downloads in other threads stop at their next chunk


def download_file(url, dest, attempts=5, timeout=60, backoff=2.0, progress=None, validate=None):
    """Download url to dest: resumable (a .part file continued with a Range request after a failure), checked
    against the sha256 the server announces (when it does) and by `validate(path)` (raises if the file is
    not what was asked for), renamed into place only when complete. Returns True on success."""
    dest = Path(dest)
    if dest.exists():
        return True
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = Path(f"{dest}.part")
    for attempt in range(1, attempts + 1):
        etag = _KeepLinkedEtag()
        try:
            have = part.stat().st_size if part.exists() else 0
            request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
            try:
                response = urllib.request.build_opener(etag).open(request, timeout=timeout)
            except urllib.error.HTTPError as e:
                total = (e.headers.get("Content-Range") or "").rpartition("/")[2]
                if e.code != 416 or not have or total != str(have):
                    raise
                response, expected = None, have  # 416: the .part already holds the whole file
                etag.sha256 = etag.sha256 or _sha256_header(e.headers)
            if response is not None:
                with response:
                    if have and response.status != 206:  # the server ignored the range: start over
                        have = 0
                    length = response.headers.get("Content-Length")
                    expected = have + int(length) if length is not None else None
                    etag.sha256 = etag.sha256 or _sha256_header(response.headers)
                    with open(part, "ab" if have else "wb") as f:
                        for chunk in iter(lambda: response.read(1 << 20), b""):  # noqa: B023 (used at once)
                            if STOP_DOWNLOADS.is_set():
                                raise KeyboardInterrupt
                            f.write(chunk)
                            if progress:
                                progress.add(len(chunk))
            size = part.stat().st_size
            if expected is not None and size != expected:
                raise OSError(f"truncated: got {size} of {expected} bytes")
            problem = ""
            if etag.sha256 and sha256_file(part) != etag.sha256:
                problem = f"checksum mismatch: the download does not match the announced sha256 {etag.sha256[:12]}"
            elif validate is not None:
                try:
                    validate(part)
                except Exception as e:  # noqa: BLE001 - e.g. an HTML error page where a parquet file should be
                    problem = f"not a valid file ({type(e).__name__}: {str(e)[:100]})"
            if problem:
                part.unlink()
                raise OSError(problem)
            os.replace(part, dest)
            if progress:
                progress.add(file_done=True)
            return True
        except urllib.error.HTTPError as e:
            log(f"  attempt {attempt}/{attempts} failed for {url}: HTTP {e.code} {e.reason}")
            if e.code in (401, 403, 404):
                return False  # asking again will not help
            if e.code == 416:
                part.unlink(missing_ok=True)  # a range the server cannot serve: start over
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            log(f"  attempt {attempt}/{attempts} failed for {url}: {e}")
        if attempt < attempts:
            if STOP_DOWNLOADS.wait(backoff * 2 ** (attempt - 1)):
                raise KeyboardInterrupt
    return False


def offline_message(name, reason):
    return (f"prepare.py: cannot download {name} ({reason}). The gpu profile's default data is climbmix, which "
            "needs the network once. Ways out: a local corpus, --dataset /path/to/dir (a directory of "
            ".txt/.jsonl/.parquet files); --dataset pypackages (offline: the Python sources of the installed "
            "packages, tens of millions of tokens); --dataset pystdlib (offline, but only a smoke test on a GPU: "
            "too small to measure learning); or a mirror in AUTOLOOP_DATA_URL. Shards already downloaded are kept")


def check_reachable(name, url, timeout=10):
    """Fail fast, before any shard, when the data server cannot be reached at all (an offline machine)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            pass
    except urllib.error.HTTPError:
        pass  # the server answered: it is reachable; the download itself reports what is wrong
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        sys.exit(offline_message(name, getattr(e, "reason", e)))


def prepare_online(name, base_url=None, num_shards=None, workers=4):
    """Download training shards and the pinned validation shard (several at once); split the latter into
    val/holdout."""
    spec = ONLINE[name]
    base_url = base_url or os.environ.get("AUTOLOOP_DATA_URL") or spec["base_url"]
    train = spec["train"][:num_shards] if num_shards else spec["train"]
    raw = DATA_DIR / "raw"
    wanted = train + spec["val"]
    missing = [rel for rel in wanted if not (raw / rel).exists()]
    log(f"Data: {name}: {len(wanted)} shard(s) from {base_url} ({len(wanted) - len(missing)} already here)")
    if missing:
        check_reachable(name, f"{base_url}/{missing[0]}")
        progress = _Progress(len(missing))
        pool = ThreadPoolExecutor(max_workers=workers)
        try:
            ok = dict(zip(missing, pool.map(lambda rel: download_file(
                f"{base_url}/{rel}", raw / rel, progress=progress, validate=pq.ParquetFile), missing)))
        except KeyboardInterrupt:
            STOP_DOWNLOADS.set()  # running downloads stop at their next chunk; their .part files stay for a resume
            pool.shutdown(wait=False, cancel_futures=True)
            progress.close()
            sys.exit("prepare.py: interrupted; run the same command again to resume the downloads")
        pool.shutdown()
        progress.close()
        failed = [rel for rel, good in ok.items() if not good]
        if failed:
            sys.exit(offline_message(name, f"{len(failed)} shard(s) failed, e.g. {base_url}/{failed[0]}"))
    docs = []
    for rel in spec["val"]:
        texts = pq.read_table(raw / rel, columns=["text"]).column("text").to_pylist()
        docs.extend((f"{rel}:{i}", t) for i, t in enumerate(texts))
    val = [t for n, t in docs if split_of(n) != "holdout"]
    holdout = [t for n, t in docs if split_of(n) == "holdout"]
    write_parquet_atomic(DATA_DIR / "val.parquet", val)
    write_parquet_atomic(DATA_DIR / "holdout.parquet", holdout)
    h = hashlib.sha256()
    for rel in wanted:
        h.update(rel.encode() + b"\0" + sha256_file(raw / rel).encode())
    return {"train": [f"raw/{rel}" for rel in train], "val": ["val.parquet"], "holdout": ["holdout.parquet"],
            "fingerprint": h.hexdigest()}


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def iter_split_texts(files, max_chars=None, doc_cap=None):
    nchars = 0
    for rel in files:
        pf = pq.ParquetFile(DATA_DIR / rel)
        for rg in range(pf.num_row_groups):
            for text in pf.read_row_group(rg, columns=["text"]).column("text").to_pylist():
                text = text[:doc_cap] if doc_cap else text
                nchars += len(text)
                yield text
                if max_chars and nchars >= max_chars:
                    return


def train_tokenizer(train_files):
    """Train a BPE with rustbpe on the train split and save it as a tiktoken encoding + token byte lengths."""
    import rustbpe
    import tiktoken

    t0 = time.time()
    log(f"Tokenizer: training a {VOCAB_SIZE}-token BPE ...")
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(iter_split_texts(train_files, max_chars=1_000_000_000, doc_cap=10_000), VOCAB_SIZE - len(SPECIAL_TOKENS),
                            pattern=SPLIT_PATTERN)
    ranks = {bytes(k): v for k, v in bpe.get_mergeable_ranks()}
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    enc = tiktoken.Encoding(name="autoloop", pat_str=bpe.get_pattern(), mergeable_ranks=ranks, special_tokens=specials)
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    tmp = TOKENIZER_DIR / "tokenizer.pkl.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(enc, f)
    os.replace(tmp, TOKENIZER_DIR / "tokenizer.pkl")
    nbytes = [0 if i in specials.values() else len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]
    torch.save(torch.tensor(nbytes, dtype=torch.int32), TOKENIZER_DIR / "token_bytes.pt.tmp")
    os.replace(TOKENIZER_DIR / "token_bytes.pt.tmp", TOKENIZER_DIR / "token_bytes.pt")
    sample = "def f(x):\n    return x ** 2  # Unicode: ünïcödé"
    assert enc.decode(enc.encode_ordinary(sample)) == sample, "tokenizer round trip failed"
    log(f"Tokenizer: vocab {enc.n_vocab} trained in {time.time() - t0:.1f}s -> {TOKENIZER_DIR}")


# ---------------------------------------------------------------------------
# Manifest: what the controller verifies before every run
# ---------------------------------------------------------------------------


def manifest_files(splits):
    files = {f"data/{rel}": DATA_DIR / rel for key in ("train", "val", "holdout") for rel in splits[key]}
    for name in ("tokenizer.pkl", "token_bytes.pt"):
        files[f"{TOKENIZER_DIR.name}/{name}"] = TOKENIZER_DIR / name
    return files


def write_manifest(splits):
    manifest = {
        "dataset": DATASET,
        "profile": PROFILE,
        "constants": {"MAX_SEQ_LEN": MAX_SEQ_LEN, "VOCAB_SIZE": VOCAB_SIZE, "EVAL_TOKENS": EVAL_TOKENS,
                      "HOLDOUT_TOKENS": HOLDOUT_TOKENS},
        "fingerprint": splits["fingerprint"],
        "splits": {k: splits[k] for k in ("train", "val", "holdout")},
        "hidden_sources": splits.get("hidden_sources", []),  # what the training step must not read
        "prepare_sha256": sha256_file(__file__),
        "files": {rel: sha256_file(path) for rel, path in manifest_files(splits).items()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = MANIFEST_PATH.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, MANIFEST_PATH)
    return manifest


def load_manifest():
    if not MANIFEST_PATH.exists():
        raise FileNotFoundError(
            f"no prepared data for dataset {DATASET!r}, profile {PROFILE!r} (looked for {MANIFEST_PATH}); "
            f"run: python prepare.py --dataset {DATASET} --profile {PROFILE}")
    return json.loads(MANIFEST_PATH.read_text())


def manifest_digest(manifest):
    """What a session pins of the prepared data: everything in the manifest but when it was written."""
    return hashlib.sha256(json.dumps({k: v for k, v in manifest.items() if k != "created"}, sort_keys=True)
                          .encode()).hexdigest()


def verify_manifest(manifest=None):
    """Problems with the prepared files and prepare.py versus the manifest; an empty list means all is well."""
    manifest = manifest or load_manifest()
    root = MANIFEST_PATH.parent  # file paths are relative to the manifest, so a cache can be moved
    problems = []
    if sha256_file(__file__) != manifest["prepare_sha256"]:
        problems.append("prepare.py changed since the data was prepared")
    for rel, digest in sorted(manifest["files"].items()):
        path = root / rel
        if not path.exists():
            problems.append(f"missing prepared file {rel}")
        elif sha256_file(path) != digest:
            problems.append(f"prepared file {rel} changed")
    return problems


def prepare(dataset=DATASET, num_shards=None, base_url=None, force=False):
    """Make the data, tokenizer and manifest for the current dataset and profile; idempotent."""
    t0 = time.time()
    log(f"Preparing dataset {dataset!r}, profile {PROFILE!r} in {CACHE_DIR}")
    if MANIFEST_PATH.exists() and not force and not verify_manifest():
        log(f"Already prepared and verified: {MANIFEST_PATH}")
        return load_manifest()
    if dataset in OFFLINE:
        documents, roots = pystdlib_documents() if dataset == "pystdlib" else pypackages_documents(), python_roots(dataset)
        docs, held, hidden = held_out_of_reach(documents, dataset, roots)
        splits = write_document_splits(docs, OFFLINE_SOURCES[dataset], held, hidden)
    elif dataset in ONLINE:
        splits = prepare_online(dataset, base_url=base_url, num_shards=num_shards)
    else:
        splits = write_document_splits(local_documents(dataset), dataset)
    train_tokenizer(splits["train"])
    size_evaluation(splits)
    manifest = write_manifest(splits)
    log(f"Done in {time.time() - t0:.1f}s: evaluation {EVAL_TOKENS} validation / {HOLDOUT_TOKENS} held-out tokens, "
        f"fingerprint {manifest['fingerprint'][:12]}, manifest {MANIFEST_PATH}")
    if PROFILE == "gpu" and dataset == "pystdlib":
        log(SMOKE_TEST_WARNING)
    return manifest


SMOKE_TEST_WARNING = ("warning: pystdlib holds ~7.6M training tokens, which a GPU sees ~50 times in 5 minutes: "
                      "val_bpb then measures memorisation. Use it as a smoke test; for research use climbmix, "
                      "pypackages or a directory of your own text (--dataset)")


def size_evaluation(splits):
    """Fix EVAL_TOKENS / HOLDOUT_TOKENS: the profile's target, or what a smaller corpus's split can fill when
    packed exactly as the evaluator packs it; refuse a split too small to evaluate on."""
    global EVAL_TOKENS, HOLDOUT_TOKENS
    tokenizer = Tokenizer.from_directory()
    target = PROFILES[PROFILE]["EVAL_TOKENS"]
    floor = min(target, MIN_EVAL_TOKENS)
    sizes = {}
    for split in ("val", "holdout"):
        paths = [DATA_DIR / rel for rel in splits[split]]
        rows = sum(1 for _ in itertools.islice(_packed_rows(tokenizer, MAX_SEQ_LEN, paths, loop=False),
                                               -(-target // MAX_SEQ_LEN)))
        sizes[split] = min(target, rows * MAX_SEQ_LEN)
        if sizes[split] < floor:
            sys.exit(f"prepare.py: the {split} split holds only {rows * MAX_SEQ_LEN} tokens as the evaluator packs "
                     f"them (rows of {MAX_SEQ_LEN}); an evaluation needs at least {floor}. Use a larger corpus "
                     f"(--dataset /path/to/dir, or pypackages) or a smaller profile (--profile cpu or tiny)")
        if sizes[split] < target:
            log(f"Evaluation: the {split} split fills {sizes[split]} of the profile's {target} tokens; "
                f"evaluating on {sizes[split]}")
    EVAL_TOKENS, HOLDOUT_TOKENS = sizes["val"], min(sizes["holdout"], sizes["val"])


# ---------------------------------------------------------------------------
# Runtime utilities (imported by train.py)
# ---------------------------------------------------------------------------


class Tokenizer:
    """The prepared BPE (a tiktoken Encoding) with a BOS token."""

    def __init__(self, enc):
        self.enc = enc
        self.bos_token_id = enc.encode_single_token(BOS_TOKEN)

    @classmethod
    def from_directory(cls, tokenizer_dir=TOKENIZER_DIR):
        with open(Path(tokenizer_dir) / "tokenizer.pkl", "rb") as f:
            return cls(pickle.load(f))

    def get_vocab_size(self):
        return self.enc.n_vocab

    def get_bos_token_id(self):
        return self.bos_token_id

    def encode(self, text, prepend=None, num_threads=4):
        if isinstance(text, str):
            ids = self.enc.encode_ordinary(text)
            return [prepend, *ids] if prepend is not None else ids
        ids = self.enc.encode_ordinary_batch(text, num_threads=num_threads)
        return [[prepend, *row] for row in ids] if prepend is not None else ids

    def decode(self, ids):
        return self.enc.decode(ids)


def get_token_bytes(device="cpu"):
    return torch.load(TOKENIZER_DIR / "token_bytes.pt", map_location=device)


def _split_files(split):
    return [DATA_DIR / rel for rel in load_manifest()["splits"][split]]


def _document_batches(paths, batch_docs=128, loop=True):
    """Batches of documents of a split's files; with loop the split repeats forever (epochs), else passes once."""
    epoch = 1
    while True:
        for path in paths:
            pf = pq.ParquetFile(path)
            for rg in range(pf.num_row_groups):
                texts = pf.read_row_group(rg, columns=["text"]).column("text").to_pylist()
                for i in range(0, len(texts), batch_docs):
                    yield texts[i:i + batch_docs], epoch
        if not loop:
            return
        epoch += 1


class _FitBuffer:
    """The packing buffer: documents in arrival order, found by length in O(log n) (a sorted index of (length,
    arrival)): the longest that fits, the earliest of equal length; or, when none fits, the shortest."""

    def __init__(self):
        self.docs, self.index, self.arrivals = {}, [], 0

    def __len__(self):
        return len(self.index)

    def add(self, doc):
        bisect.insort(self.index, (len(doc), self.arrivals))
        self.docs[self.arrivals] = doc
        self.arrivals += 1

    def take(self, room):
        i = bisect.bisect_right(self.index, (room, math.inf)) - 1  # the longest that fits
        i = bisect.bisect_left(self.index, (self.index[i][0], -1)) if i >= 0 else 0  # its earliest; or the shortest
        return self.docs.pop(self.index.pop(i)[1])


def _packed_rows(tokenizer, T, paths, loop=True, buffer_size=1000):
    """
    BOS-aligned best-fit packing into rows of T+1 tokens (inputs and shifted targets): every row starts with
    BOS; documents fill rows best-fit first, and when none fits the shortest is cropped to fill the row exactly
    (no padding). Documents longer than a row are cut into BOS-led pieces first, so long files are not mostly
    thrown away. Yields (row, epoch); a single pass (loop=False) ends when the documents run out.
    """
    capacity = T + 1
    batches = _document_batches(paths, loop=loop)
    bos = tokenizer.get_bos_token_id()
    buffer, epoch, exhausted = _FitBuffer(), 1, False
    while True:
        row = []
        while len(row) < capacity:
            while len(buffer) < buffer_size and not exhausted:
                try:
                    docs, epoch = next(batches)
                except StopIteration:
                    exhausted = True
                    break
                for ids in tokenizer.encode(docs):
                    for start in range(0, max(len(ids), 1), capacity - 1):
                        buffer.add([bos, *ids[start:start + capacity - 1]])
            if not len(buffer):
                return  # a single pass ran out of documents (a partial row is dropped)
            remaining = capacity - len(row)
            row.extend(buffer.take(remaining)[:remaining])
        yield row, epoch


def make_dataloader(tokenizer, B, T, split, buffer_size=1000, device=None):
    """
    Batches of B packed rows (see _packed_rows) as (inputs, targets, epoch) on `device`; the train split repeats
    forever, val/holdout pass once. On CUDA the host side is pinned and double-buffered: a buffer is refilled
    only after the GPU copy out of it has completed (a CUDA event), so no batch can carry the next one's tokens.
    """
    assert split in ("train", "val", "holdout")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    rows = _packed_rows(tokenizer, T, _split_files(split), loop=(split == "train"), buffer_size=buffer_size)
    hosts = [torch.empty((2, B, T), dtype=torch.long, pin_memory=on_cuda) for _ in range(2 if on_cuda else 1)]
    copied = [None] * len(hosts)  # the event after the last copy out of each host buffer
    for i in itertools.cycle(range(len(hosts))):
        if copied[i] is not None:
            copied[i].synchronize()
        host, epoch = hosts[i], 1
        for r in range(B):
            row, epoch = next(rows, (None, epoch))
            if row is None:
                return  # a single-pass split ran out of documents
            packed = torch.tensor(row, dtype=torch.long)
            host[0, r], host[1, r] = packed[:-1], packed[1:]
        if on_cuda:
            batch = host.to(device, non_blocking=True)
            copied[i] = torch.cuda.Event()
            copied[i].record(torch.cuda.current_stream(device))  # the stream the copy was queued on
        else:
            batch = host.clone()
        yield batch[0], batch[1], epoch


# ---------------------------------------------------------------------------
# Evaluation (the fixed metric)
# ---------------------------------------------------------------------------


def split_tokens(split):
    """Tokens each evaluation of a split scores: EVAL_TOKENS on validation, HOLDOUT_TOKENS on the held-out split."""
    return HOLDOUT_TOKENS if split == "holdout" else EVAL_TOKENS


def eval_rows(tokenizer, paths, n_rows):
    """The first n_rows packed rows of a split's files, exactly as every evaluation scores them."""
    rows = [row for row, _ in itertools.islice(_packed_rows(tokenizer, MAX_SEQ_LEN, paths, loop=False), n_rows)]
    if len(rows) < n_rows:
        raise RuntimeError(f"the split holds {len(rows)} rows of {MAX_SEQ_LEN} tokens as the evaluator packs "
                           f"them, the evaluation needs {n_rows}; prepare the data again: python prepare.py --force")
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def _evaluate_split_bpb(model, tokenizer, batch_size, split):
    """Bits per byte over exactly split_tokens(split) target tokens, computed here from the model's logits
    (model(x) -> (rows, T, vocab)), in batches of at most batch_size rows (fewer when the logits would exceed
    EVAL_LOGITS_BYTES; the last batch partial)."""
    device = next(model.parameters()).device
    token_bytes = get_token_bytes(device=device)
    wanted = split_tokens(split)
    rows = eval_rows(tokenizer, _split_files(split), -(-wanted // MAX_SEQ_LEN))
    per_forward = eval_rows_per_forward(batch_size, len(token_bytes))
    total_nats, total_bytes, counted = 0.0, 0, 0
    for start in range(0, len(rows), per_forward):
        batch = rows[start:start + per_forward].to(device)
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        take = min(y.numel(), wanted - counted)  # the last row may count only in part
        logits = model(x).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                                                 reduction="none")[:take]
        nbytes = token_bytes[y.view(-1)[:take]]
        total_nats += (loss * (nbytes > 0)).sum().item()
        total_bytes += nbytes.sum().item()
        counted += take
    assert counted == wanted, (counted, wanted)
    return total_nats / (math.log(2) * total_bytes)


def evaluate_bpb(model, tokenizer, batch_size):
    """
    Validation bits per byte, the fixed metric: summed per-token cross-entropy (nats) over the summed UTF-8
    byte length of the target tokens (special tokens excluded), on EVAL_TOKENS tokens of the pinned validation
    split at MAX_SEQ_LEN. Independent of the vocabulary, so comparable across tokenizers.

    The model must map a (rows, MAX_SEQ_LEN) batch of token ids to logits (rows, MAX_SEQ_LEN, vocab): the loss
    is computed here. Under the autoloop controller (AUTOLOOP_EVAL_ARTIFACT set) the model is only exported there
    (torch.export) and nan is returned: the number that counts is computed from that graph by `python evaluate.py`,
    in a process that never runs train.py's code, so every experiment is evaluated once.
    """
    if os.environ.get("AUTOLOOP_EVAL_ARTIFACT"):
        t0 = time.time()
        print(EXPORT_LINE, flush=True)  # the controller may start the evaluation's process now (it gets ready)
        save_eval_artifact(model, batch_size, os.environ["AUTOLOOP_EVAL_ARTIFACT"])
        print(f"evaluate_bpb: model exported for the autoloop harness in {time.time() - t0:.1f}s; the harness "
              "measures val_bpb (eval.log)", flush=True)
        return float("nan")
    return _evaluate_split_bpb(model, tokenizer, batch_size, "val")


# The line evaluate_bpb prints under the controller when training is over and the export begins. A sandboxed
# controller starts `evaluate.py` then: it imports and reads its data while the model is exported, and
# waits for its nonce (stdin), which comes once train.py's process has ended. Printing it early only costs the
# run CPU time: the evaluation touches the saved model only after the nonce.
EXPORT_LINE = "evaluate_bpb: training is over; exporting the model for the autoloop harness"


def save_eval_artifact(model, batch_size, path):
    """Export the trained model for the harness: a graph of ATen operations plus its weights (torch.export), no
    Python. Its input is a (rows, MAX_SEQ_LEN) batch of token ids, its output the logits (rows, MAX_SEQ_LEN,
    vocab); the harness computes the loss itself. Written atomically, with how it was evaluated (autocast)."""
    device = next(model.parameters()).device
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    rows = EVAL_ROWS  # the harness's, whatever batch_size train.py asked for
    example = torch.zeros((rows, MAX_SEQ_LEN), dtype=torch.long, device=device)
    model.eval()
    with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):  # a plain graph: the harness
        program = torch.export.export(model, (example,))  # applies the autocast itself
    tmp = f"{path}.tmp.pt2"  # (torch.export.save warns about any other suffix)
    torch.export.save(program, tmp, extra_files={"autoloop.json": json.dumps(
        {"autocast": str(autocast) if autocast else None, "batch_size": batch_size})})
    os.replace(tmp, path)


def eval_rows_per_forward(batch_size, vocab_size):
    """Rows per evaluation forward: batch_size, fewer when the logits would exceed EVAL_LOGITS_BYTES."""
    return max(1, min(batch_size, EVAL_LOGITS_BYTES // (MAX_SEQ_LEN * vocab_size * 4)))


def evaluate_holdout_bpb(model, tokenizer, batch_size):
    """The same metric on the held-out split that no experiment is selected on."""
    return _evaluate_split_bpb(model, tokenizer, batch_size, "holdout")


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Prepare data and tokenizer for autoloop (the fixed harness)")
    parser.add_argument("--dataset", default=None,
                        help="climbmix (default on the gpu profile) | pystdlib (default otherwise, offline) | "
                             "pypackages (offline) | tinystories | path to a directory")
    parser.add_argument("--profile", default=None, choices=sorted(PROFILES),
                        help="harness size (default: gpu if CUDA is available, else cpu)")
    parser.add_argument("--num-shards", type=int, default=None, help="online datasets: training shards to fetch")
    parser.add_argument("--base-url", default=None, help="online datasets: mirror to download from")
    parser.add_argument("--force", action="store_true", help="prepare again even if the manifest verifies")
    parser.add_argument("--check", action="store_true", help="only verify the prepared files; exit 1 on mismatch")
    args = parser.parse_args()
    if ((args.dataset and args.dataset != DATASET) or (args.profile and args.profile != PROFILE)) \
            and not os.environ.get("_AUTOLOOP_REEXEC"):
        # Module constants derive from the environment: re-run with it set, so there is one source of truth.
        env = dict(os.environ, AUTOLOOP_PROFILE=args.profile or PROFILE, _AUTOLOOP_REEXEC="1")
        if args.dataset:
            env["AUTOLOOP_DATASET"] = args.dataset
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    if args.check:
        try:
            problems = verify_manifest()
        except FileNotFoundError as e:
            sys.exit(f"prepare.py: {e}")
        for p in problems:
            log(f"MISMATCH: {p}")
        log("OK: prepared files match the manifest" if not problems else "FAILED")
        sys.exit(1 if problems else 0)
    prepare(DATASET, num_shards=args.num_shards, base_url=args.base_url, force=args.force)
