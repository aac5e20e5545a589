"""A real night with a scripted LLM: a local OpenAI-compatible server whose ideas come from a fixed distribution
(some good, some repeats, some broken) drives a real `autoloop run` on the real train.py.

What it measures (issue #34): the repeats the server sent and how many of them trained (the idea memory should
make every exact repeat of an idea judged from the same parent a row at no cost), the runs and training seconds
that saved, the tokens the repeats cost; with `--proposer hybrid`, the allocation between the LLM and the search
and the search's tuning of the constants a kept structural idea introduced, read from the records.

The server reads the train.py in each prompt and answers with one idea that applies to it:
- REPEAT of the time, an idea it already sent that still applies (an exact repeat if the best has not moved);
- BROKEN of the time, an edit that does not compile;
- otherwise the next idea of a fixed list that applies: structural ones that add a constant (MLP_RATIO,
  ROPE_BASE, X0_INIT, HEAD_INIT_STD) or change the code (GELU), and moves of existing constants.

    python benchmarks/scripted_llm.py --proposer hybrid --budget 5 --max-experiments 30
    python benchmarks/scripted_llm.py --proposer hybrid --budget 5 --max-experiments 40 -- --gate strict
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

REPEAT, BROKEN = 0.3, 0.1
NEW_CONSTANT_AT = "# Evaluation\n"  # new constants go just above this line of train.py


def constant(line: str) -> tuple[str, str]:
    """The edit that adds a constant's line (with its range, so the search can tune it) above the evaluation's."""
    return NEW_CONSTANT_AT, f"{line}\n\n{NEW_CONSTANT_AT}"


# (description, [(search, replace), ...]): each applies only while every search text is in train.py
IDEAS = [
    (
        "a narrower MLP as a constant MLP_RATIO = 2 (tunable; was a hard-coded 4): more steps in a short budget",
        [
            constant("MLP_RATIO = 2  # MLP hidden width as a multiple of the model width  [1, 8]"),
            ("nn.Linear(config.n_embd, 4 * config.n_embd,", "nn.Linear(config.n_embd, MLP_RATIO * config.n_embd,"),
            ("nn.Linear(4 * config.n_embd, config.n_embd,", "nn.Linear(MLP_RATIO * config.n_embd, config.n_embd,"),
        ],
    ),
    (
        "a rotary base of 2000 for the short context, as a constant ROPE_BASE (tunable; was a hard-coded 10000)",
        [
            constant("ROPE_BASE = 2000.0  # rotary embedding base  [500.0, 100000.0]"),
            ("(10000 ** (torch.arange", "(ROPE_BASE ** (torch.arange"),
        ],
    ),
    ("DEPTH 2 -> 1 on tiny: a shallower model takes more steps", [("cpu=4, tiny=2)", "cpu=4, tiny=1)")]),
    (
        "start the x0 skip weights at 0.3, a constant X0_INIT (tunable; was a hard-coded 0.1)",
        [
            constant("X0_INIT = 0.3  # initial weight of the x0 skip per layer  [0.0, 0.5]"),
            ("self.x0_lambdas.fill_(0.1)", "self.x0_lambdas.fill_(X0_INIT)"),
        ],
    ),
    ("MATRIX_LR 0.04 -> 0.06: Muon tolerates a larger step", [("MATRIX_LR = 0.04 ", "MATRIX_LR = 0.06 ")]),
    ("swap the MLP's relu^2 for GELU", [("F.relu(self.c_fc(x)).square()", "F.gelu(self.c_fc(x))")]),
    (
        "initialise the output head at std 0.005, a constant HEAD_INIT_STD (tunable; was a hard-coded 0.001)",
        [
            constant("HEAD_INIT_STD = 0.005  # std of the output head's initial weights  [0.0001, 0.02]"),
            ("self.lm_head.weight, std=0.001)", "self.lm_head.weight, std=HEAD_INIT_STD)"),
        ],
    ),
    ("WARMDOWN_RATIO 0.5 -> 0.7: a longer warm-down", [("WARMDOWN_RATIO = 0.5 ", "WARMDOWN_RATIO = 0.7 ")]),
    ("EMBEDDING_LR 0.6 -> 0.9", [("EMBEDDING_LR = 0.6 ", "EMBEDDING_LR = 0.9 ")]),
    ("LOGIT_CAP 15 -> 30: a softer cap", [("LOGIT_CAP = 15.0 ", "LOGIT_CAP = 30.0 ")]),
    ("WEIGHT_DECAY 0.2 -> 0.1", [("WEIGHT_DECAY = 0.2 ", "WEIGHT_DECAY = 0.1 ")]),
]
BROKEN_IDEA = ("a refactor of the schedule (with a syntax error)", [constant("SCHEDULE = (")])


def reply(description: str, edits: list[tuple[str, str]]) -> str:
    nl = "\n"
    blocks = "".join(f"<<<<<<< SEARCH\n{s.rstrip(nl)}\n=======\n{r.rstrip(nl)}\n>>>>>>> REPLACE\n" for s, r in edits)
    return f"DESCRIPTION: {description}\n{blocks}"


class ScriptedLLM:
    """The server's brain: one idea per request, by a seeded draw, applicable to the train.py in the prompt."""

    def __init__(self, seed: int, repeat: float = REPEAT, broken: float = BROKEN):
        self.rng = random.Random(seed)
        self.repeat, self.broken = repeat, broken
        self.sent: list[int] = []  # the IDEAS sent, in order
        self.kinds: Counter = Counter()
        self.tokens: Counter = Counter()  # prompt + completion tokens by kind
        self.lock = threading.Lock()

    def answer(self, prompt: str) -> tuple[str, str]:
        applies = [i for i, (_, edits) in enumerate(IDEAS) if all(s in prompt for s, _ in edits)]
        draw = self.rng.random()
        again = [i for i in dict.fromkeys(self.sent) if i in applies]
        if draw < self.repeat and again:
            kind, i = "repeat", self.rng.choice(again)
        elif draw < self.repeat + self.broken or not applies:
            kind, i = "broken", -1
        else:
            fresh = [i for i in applies if i not in self.sent]
            kind, i = "new", (fresh or applies)[0]
        self.kinds[kind] += 1
        if i >= 0:
            self.sent.append(i)
        return reply(*(IDEAS[i] if i >= 0 else BROKEN_IDEA)), kind

    def serve(self) -> ThreadingHTTPServer:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                prompt = "\n".join(str(m.get("content", "")) for m in body.get("messages", []))
                with outer.lock:
                    content, kind = outer.answer(prompt)
                    usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(content) // 4}
                    outer.tokens[kind] += usage["prompt_tokens"] + usage["completion_tokens"]
                choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
                data = json.dumps(
                    {
                        "id": "chatcmpl-scripted",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": body.get("model", "scripted"),
                        "choices": [choice],
                        "usage": {**usage, "total_tokens": sum(usage.values())},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proposer", default="hybrid", choices=["hybrid", "llm"])
    ap.add_argument("--budget", type=float, default=5.0)
    ap.add_argument("--max-experiments", type=int, default=30)
    ap.add_argument("--profile", default="tiny", choices=["tiny", "cpu", "gpu"])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=float, default=REPEAT, help="share of the server's replies that repeat an idea")
    ap.add_argument("--broken", type=float, default=BROKEN, help="share of its replies that do not compile")
    ap.add_argument("--keep", type=Path, default=None, help="make the session's repo here and keep it")
    ap.add_argument("run_args", nargs="*", help="after --: more options for `autoloop run` (e.g. --gate strict)")
    args = ap.parse_args()
    if not (0 <= args.repeat and 0 <= args.broken and args.repeat + args.broken < 1):
        ap.error("--repeat and --broken are shares of the replies: 0 or more, less than 1 together")
    if args.max_experiments < 2 or args.budget <= 0 or args.workers < 1:
        ap.error("--max-experiments must be 2 or more, --budget positive, --workers 1 or more")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from search_quality import fresh_repo

    from orchestrator.core.state import group_of
    from orchestrator.store.ledger import read_record, read_rows
    from orchestrator.store.session import Paths

    brain = ScriptedLLM(args.seed, args.repeat, args.broken)
    server = brain.serve()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    with tempfile.TemporaryDirectory() as tmp:
        repo = fresh_repo((args.keep or Path(tmp)) / "repo")
        command = [
            sys.executable, "-c", "from orchestrator.cli import main; main()",
            "run", "--repo", str(repo), "--tag", "scripted",
            "--budget", str(args.budget), "--max-experiments", str(args.max_experiments),
            "--profile", args.profile, "--workers", str(args.workers), "--seed", str(args.seed),
            "--proposer", args.proposer, "--llm-base-url", url, "--llm-model", "scripted",
        ]  # fmt: skip
        if args.proposer == "hybrid":
            command += ["--hybrid-llm", "llm"]
        command += args.run_args
        t0 = time.monotonic()
        rc = subprocess.run(command, env={**os.environ, "AUTOLOOP_PROGRESS_SECONDS": "1e9"}).returncode
        wall = time.monotonic() - t0
        server.shutdown()
        paths = Paths(repo, "scripted")
        rows = read_rows(paths.ledger)
        records = [r for r in (read_record(paths.run_dir(n)) for n in range(1, len(rows) + 1)) if r is not None]
    by_n = {r.n: r for r in records}
    ideas = [r for r in records if group_of(r) == r.n and r.n > 1]
    duplicates = [r for r in records if r.gate.decision == "duplicate"]
    trained = [r for r in records if r.timings.get("train")]
    seconds = {r.n: float(r.timings.get("train", 0.0)) for r in records}
    earlier = [int(m.group(1)) for r in duplicates if (m := re.search(r"duplicate of #(\d+)", r.reason))]
    saved = sum(seconds.get(n, 0.0) for n in earlier)
    repeats_trained = []  # an exact repeat (same program, same parent) that trained anyway
    seen: dict[tuple, int] = {}
    for r in records:
        if r.gate.decision == "duplicate" or group_of(r) != r.n or not r.info.get("fingerprint"):
            continue
        key = (r.info["fingerprint"], r.parent)
        if key in seen:
            repeats_trained.append((r.n, seen[key]))
        seen.setdefault(key, r.n)
    print(f"\n{args.proposer}, {args.profile}, --budget {args.budget:g}: rc {rc}, {wall:.0f} s, {len(rows)} rows")
    print(f"server replies: {dict(brain.kinds)}; tokens by kind: {dict(brain.tokens)}")
    print(
        f"duplicate rows (not trained): {len(duplicates)}; exact repeats that trained: {len(repeats_trained)} "
        f"{repeats_trained}; runs saved {len(duplicates)}, training seconds saved {saved:.0f}"
    )
    print(f"runs trained: {len(trained)}; statuses: {dict(Counter(r.status for r in records))}")
    sources = Counter(by_n.get(group_of(r), r).info.get("source", "-") for r in records if r.n > 1)
    by_source = Counter(r.info.get("source", "-") for r in ideas)
    print(f"runs by source: {dict(sources)}; ideas by source: {dict(by_source)}")
    for r in ideas:
        info = r.info
        extra = f" tuning #{info['tuning']}" if info.get("tuning") else ""
        line = f"{info.get('source', '-'):11s} {r.status:9s} {r.val_bpb or 0:.4f}  {r.description[:70]}"
        print(f"  #{r.n:<3d} {line}{extra}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
