"""Where the wall time of one real experiment goes: start-up, training, evaluation, controller.

Runs ONE experiment (the unmodified baseline) through the real controller, `autoloop run --max-experiments 1
--baseline-repeats 0`, in a fresh temporary git repo holding copies of train.py and prepare.py, with the data
prepared beforehand (not timed), and splits the experiment's wall time (record.json: ended - started) into

    start-up    train.py's process start until its counted training begins (python + torch import, the
                re-exec, tokenizer / model / first batch set-up, steps not counted against the budget), the
                time between steps that training_seconds leaves out, and the process exit after the summary
    training    train.py's `training_seconds`
    evaluation  train.py's evaluate_bpb (it saves the model for the harness; older harnesses also evaluate
                it there) and the harness step `evaluate.py` (a process of its own)
    controller  everything else: propose, checks, git, job set-up, recording

The split inside train.py's process comes from the times at which its lines reach run.log (the controller
runs it unbuffered), read while it runs. Headline: fixed cost = experiment wall - training_seconds, in
seconds and as a share of the budget (target <= 15%).

    python benchmarks/experiment_time.py                               # this checkout, cpu profile, 60 s
    python benchmarks/experiment_time.py --source /tmp/before          # an older checkout's train.py,
                                                                       # prepare.py and controller
    python benchmarks/experiment_time.py --budget 60 --profile cpu --json
    python benchmarks/experiment_time.py --sandbox off                 # unconfined (the evaluation starts
                                                                       # after train.py's process has ended)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from orchestrator.contract import make_git_repo

ROOT = Path(__file__).resolve().parent.parent
TAG = "bench"
TARGET_PERCENT = 15.0
POLL_S = 0.01


class LineClock(threading.Thread):
    """Polls a log file while it is written: when it appeared and when each complete line arrived."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path = path
        self.created: float | None = None
        self.lines: list[tuple[float, str]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        pos, partial = 0, b""
        while True:
            stopping = self._halt.is_set()
            now = time.time()
            if self.created is None and self.path.exists():
                self.created = now
            if self.created is not None:
                try:
                    with open(self.path, "rb") as f:
                        f.seek(pos)
                        data = f.read()
                except OSError:
                    data = b""
                if data:
                    pos += len(data)
                    *complete, partial = (partial + data).split(b"\n")
                    self.lines.extend((now, line.decode("utf-8", "replace")) for line in complete)
            if stopping:
                return
            self._halt.wait(POLL_S)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, s) for t, s in self.lines if re.search(pattern, s)), None)

    def last(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, s) for t, s in reversed(self.lines) if re.search(pattern, s)), None)


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished descendants (the controller, train.py, the evaluation)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the user's AUTOLOOP_* settings (they would change what is measured)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLOOP_")}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def summary_of(log_text: str) -> dict[str, str]:
    """The key: value lines after the last `---` line."""
    lines = log_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "---"]
    if not starts:
        return {}
    return dict(m.groups() for line in lines[starts[-1] + 1 :] if (m := re.match(r"^(\w+):\s+(\S+)\s*$", line)))


def num(value) -> float | None:
    try:
        return float(str(value).replace(",", ""))
    except (TypeError, ValueError):
        return None


def source_revision(source: Path) -> str:
    proc = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if (
        proc.returncode != 0
        or Path(
            subprocess.run(
                ["git", "-C", str(source), "rev-parse", "--show-toplevel"], capture_output=True, text=True
            ).stdout.strip()
            or "/"
        )
        != source
    ):
        digests = ", ".join(
            f"{name} {hashlib.sha256((source / name).read_bytes()).hexdigest()[:8]}"
            for name in ("train.py", "prepare.py", "evaluate.py")
            if (source / name).exists()
        )
        return f"not a git checkout; sha256 {digests}"
    dirty = subprocess.run(
        ["git", "-C", str(source), "status", "--porcelain", "--", "train.py", "prepare.py", "orchestrator"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"HEAD {proc.stdout.strip()}" + (" + uncommitted changes" if dirty else "")


def run_experiment(args, source: Path, cache: Path, workdir: Path) -> dict:
    """Prepare (untimed), run one experiment through the controller, and return the raw observations."""
    files = {
        name: (source / name).read_text()
        for name in ("train.py", "prepare.py", "evaluate.py", ".gitignore")
        if (source / name).exists()
    }
    repo = make_git_repo(workdir / "repo", files)
    base = {"AUTOLOOP_CACHE": str(cache), "AUTOLOOP_PROFILE": args.profile}
    if args.dataset:
        base["AUTOLOOP_DATASET"] = args.dataset
    if args.dtype:
        base["AUTOLOOP_DTYPE"] = args.dtype

    t = time.monotonic()
    prep = subprocess.run(
        [sys.executable, "prepare.py"], cwd=repo, env=clean_env(**base), capture_output=True, text=True
    )
    prepare_s = time.monotonic() - t
    if prep.returncode != 0:
        raise SystemExit(
            f"experiment_time: `python prepare.py` failed in {repo} (exit {prep.returncode}):\n"
            f"{(prep.stdout + prep.stderr)[-3000:]}"
        )

    controller_env = clean_env(**base, PYTHONPATH=str(source))
    which = subprocess.run(
        [sys.executable, "-c", "import orchestrator; print(orchestrator.__file__)"],
        cwd=repo,
        env=controller_env,
        capture_output=True,
        text=True,
    )
    if which.returncode != 0 or not Path(which.stdout.strip()).resolve().is_relative_to(source):
        raise SystemExit(
            f"experiment_time: the controller would not come from {source}: "
            f"{(which.stdout + which.stderr).strip()[-500:]}"
        )

    cmd = [
        sys.executable,
        "-c",
        "from orchestrator.cli import main; main()",
        "run",
        "--budget",
        f"{args.budget:g}",
        "--max-experiments",
        "1",
        "--profile",
        args.profile,
        "--baseline-repeats",
        "0",
        "--tag",
        TAG,
        *(["--sandbox", args.sandbox] if args.sandbox else []),
    ]
    run_dir = repo / ".autoloop" / TAG / "runs" / "1"
    train_clock = LineClock(run_dir / "run.log")
    train_clock.start()
    controller_log = workdir / "controller.log"
    busy_before, ours_before = busy_cpu_seconds(), children_cpu_seconds()
    t0 = time.time()
    with open(controller_log, "w") as out:
        proc = subprocess.run(cmd, cwd=repo, env=controller_env, stdout=out, stderr=subprocess.STDOUT)
    t1 = time.time()
    others = (busy_cpu_seconds() - busy_before) - (children_cpu_seconds() - ours_before)
    train_clock.stop()
    if proc.returncode != 0 or not (run_dir / "record.json").exists():
        raise SystemExit(
            f"experiment_time: the controller failed (exit {proc.returncode}); its output:\n"
            f"{controller_log.read_text()[-3000:]}\n(run directory: {run_dir})"
        )

    # Reference: what one cold `import prepare` (python + torch + pyarrow) costs here, paid by each process.
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import prepare"], cwd=repo, env=clean_env(**base), check=True)
    import_s = time.monotonic() - t
    return {
        "repo": repo,
        "run_dir": run_dir,
        "prepare_s": prepare_s,
        "import_s": import_s,
        "session": (t0, t1),
        "controller_log": controller_log.read_text(),
        "others_cpu_s": others,
        "record": json.loads((run_dir / "record.json").read_text()),
        "run_log": (run_dir / "run.log").read_text(errors="replace") if (run_dir / "run.log").exists() else "",
        "eval_result": json.loads((run_dir / "eval.json").read_text()) if (run_dir / "eval.json").exists() else {},
        "train_clock": train_clock,
    }


def analyse(obs: dict, budget: float) -> dict:
    """The split of the experiment's wall time (seconds)."""
    rec, log = obs["record"], obs["run_log"]
    timings = rec.get("timings", {})
    summary = summary_of(log)
    if rec.get("status") == "crash" or "training_seconds" not in summary:
        raise SystemExit(
            f"experiment_time: the experiment crashed or printed no summary "
            f"(status {rec.get('status')}, reason {rec.get('reason')!r}); run.log tail:\n{log[-3000:]}"
        )
    wall = rec["ended"] - rec["started"]
    train_wall = float(timings.get("train", 0.0))
    eval_wall = float(timings.get("eval", 0.0))
    training = float(summary["training_seconds"])
    total = num(summary.get("total_seconds"))
    startup_m = re.search(r"startup ([\d.]+)s", log)
    startup_printed = float(startup_m.group(1)) if startup_m else None
    step_lines = [line for line in log.splitlines() if re.match(r"step \d+", line)]
    first_dt = num(m.group(1)) / 1000 if step_lines and (m := re.search(r"dt: ([\d,.]+)ms", step_lines[0])) else None
    rates = sorted(num(m.group(1)) for line in step_lines[1:] if (m := re.search(r"tok/sec: ([\d,]+)", line)))

    clock = obs["train_clock"]
    startup_line = clock.first(r"startup [\d.]+s")
    first_step, last_step = clock.first(r"^step \d+"), clock.last(r"^step \d+")
    summary_line = clock.last(r"^---$")
    exact = bool(
        clock.created and startup_line and first_step and last_step and summary_line and startup_printed is not None
    )
    parts: dict[str, float] = {}
    if exact:
        proc_start = clock.created  # run.log is opened just before the process starts
        proc_end = proc_start + train_wall
        main_start = startup_line[0] - startup_printed  # train.py's main() starts its clock after the imports
        parts["before_main"] = main_start - proc_start
        parts["setup"] = startup_printed
        parts["first_step"] = first_step[0] - startup_line[0]
        parts["between_steps"] = (last_step[0] - first_step[0]) - training
        parts["own_eval"] = summary_line[0] - last_step[0]
        parts["exit"] = proc_end - summary_line[0]
    else:  # the lines were not seen arriving: the printed numbers alone (own_eval absorbs between_steps)
        parts["before_main"] = train_wall - (total or 0.0)  # also holds the exit
        parts["setup"] = startup_printed or 0.0
        parts["first_step"] = first_dt or 0.0
        parts["between_steps"] = 0.0
        parts["own_eval"] = (total or 0.0) - parts["setup"] - parts["first_step"] - training
        parts["exit"] = 0.0
    startup = parts["before_main"] + parts["setup"] + parts["first_step"] + parts["between_steps"] + parts["exit"]
    evaluation = parts["own_eval"] + eval_wall
    recorded = {k: float(timings.get(k, 0.0)) for k in ("propose", "check", "git", "record")}
    controller = wall - train_wall - eval_wall
    fixed = wall - training
    session_wall = obs["session"][1] - obs["session"][0]
    eval_result = obs["eval_result"]  # what the harness evaluation wrote for the controller
    return {
        "budget": budget,
        "status": rec.get("status"),
        "val_bpb": rec.get("val_bpb"),
        "printed_val_bpb": summary.get("val_bpb"),
        "num_steps": num(summary.get("num_steps")),
        "device": rec.get("device") or summary.get("device"),
        "dtype": summary.get("dtype"),
        "timed_from_log_lines": exact,
        "experiment_wall_s": wall,
        "training_seconds": training,
        "train_py_wall_s": train_wall,
        "train_py_total_seconds": total,
        "train_py_startup_printed_s": startup_printed,
        "harness_eval_wall_s": eval_wall,
        "harness_eval_tokens": eval_result.get("eval_tokens"),
        "startup_s": startup,
        "evaluation_s": evaluation,
        "controller_s": controller,
        "parts_s": parts,
        "controller_recorded_s": recorded,
        "controller_other_s": controller - sum(recorded.values()),
        "fixed_cost_s": fixed,
        "fixed_cost_percent_of_budget": 100 * fixed / budget,
        "target_percent": TARGET_PERCENT,
        "session_wall_s": session_wall,
        "session_outside_experiment_s": session_wall - wall,
        "prepare_untimed_s": obs["prepare_s"],
        "import_prepare_reference_s": obs["import_s"],
        "tokens_per_s_median": rates[len(rates) // 2] if rates else None,
        "others_cpus_average": obs["others_cpu_s"] / session_wall,
        "cpus": os.cpu_count(),
    }


def print_table(r: dict, args, source: Path, revision: str) -> None:
    wall, p = r["experiment_wall_s"], r["parts_s"]

    def row(label: str, seconds: float, indent: int = 0) -> None:
        pct = f"{100 * seconds / wall:7.1f}%"
        print(f"{' ' * indent}{label:<{58 - indent}}{seconds:9.2f}{pct}")

    print(f"one experiment: profile {args.profile}, budget {args.budget:g}s, source {source} ({revision})")
    rate = f"{r['tokens_per_s_median']:,.0f}" if r["tokens_per_s_median"] else "-"
    print(
        f"  status {r['status']}, val_bpb {r['val_bpb']} (train.py printed {r['printed_val_bpb']}), "
        f"{r['num_steps'] or 0:.0f} steps, median {rate} tok/s, device {r['device']}, dtype {r['dtype']}"
    )
    others = r["others_cpus_average"]
    print(
        f"  other processes used {others:.2f} of the {r['cpus']} CPUs on average during the session"
        + (
            "  [BUSY: every phase slows down, training steps most (OpenMP threads wait on each other); "
            "compare runs made on a quiet machine]"
            if others > 0.25
            else ""
        )
    )
    if not r["timed_from_log_lines"]:
        print(
            "  (run.log lines were not seen arriving: the split inside train.py is estimated from its summary; "
            "train.py's own evaluation then includes the time between steps)"
        )
    print(f"{'phase':<58}{'seconds':>9}{'of wall':>8}")
    row("start-up", r["startup_s"])
    row("python start, imports, re-exec (before train.py's main)", p["before_main"], 2)
    row('set-up in main (tokenizer, model, first batch; "startup")', p["setup"], 2)
    row("first step (not counted against the budget)", p["first_step"], 2)
    row("other uncounted steps + time between steps", p["between_steps"], 2)
    row("process exit after the summary", p["exit"], 2)
    row("training (training_seconds)", r["training_seconds"])
    row("evaluation", r["evaluation_s"])
    row("train.py evaluate_bpb (saves the model; own evaluation)", p["own_eval"], 2)
    row("harness step: evaluate.py (own process)", r["harness_eval_wall_s"], 2)
    row("controller", r["controller_s"])
    rec = r["controller_recorded_s"]
    row("propose / check / git / record (record.json timings)", sum(rec.values()), 2)
    row("other (job set-up, hashing, process hand-offs)", r["controller_other_s"], 2)
    row("experiment wall (record.json ended - started)", wall)
    print("  recorded controller phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in rec.items()))
    print(
        f"  train.py process {r['train_py_wall_s']:.2f}s (its own total_seconds {r['train_py_total_seconds']}), "
        f"harness eval process {r['harness_eval_wall_s']:.2f}s ({r['harness_eval_tokens']} tokens)"
    )
    print(
        f"  for reference: a cold `python -c 'import prepare'` (python + torch + pyarrow) takes "
        f"{r['import_prepare_reference_s']:.2f}s here; each of the two processes pays about that"
    )
    print(
        f"  session: controller process {r['session_wall_s']:.2f}s, of which {r['session_outside_experiment_s']:.2f}s "
        f"outside the experiment (session start-up, worktree, harness query, exit; once per session); "
        f"data preparation beforehand {r['prepare_untimed_s']:.2f}s (not counted)"
    )
    print(
        f"fixed cost = experiment wall - training_seconds = {r['fixed_cost_s']:.1f}s = "
        f"{r['fixed_cost_percent_of_budget']:.1f}% of the {args.budget:g}s budget (target <= {TARGET_PERCENT:g}%)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=60.0, help="training seconds (AUTOLOOP_TIME_BUDGET)")
    ap.add_argument("--profile", default="cpu", choices=["gpu", "cpu", "tiny"])
    ap.add_argument("--dataset", default=None, help="passed as AUTOLOOP_DATASET (default: the harness's)")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["bf16", "fp32"],
        help="AUTOLOOP_DTYPE for train.py (default: its own choice, which on a CPU with bf16 units is "
        "a quick timing probe that can flip between runs on a busy machine)",
    )
    ap.add_argument(
        "--source",
        type=Path,
        default=ROOT,
        help="directory whose train.py, prepare.py and orchestrator package are measured",
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="AUTOLOOP_CACHE (default: /tmp/autoloop-bench-cache/<hash of prepare.py>, kept)",
    )
    ap.add_argument(
        "--sandbox",
        default=None,
        choices=["auto", "on", "off"],
        help="autoloop run --sandbox (default: the controller's default, auto: on where bubblewrap works; only "
        "there does the evaluation start while train.py exports)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary repo (its path is printed)")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON instead of the table")
    args = ap.parse_args()
    source = args.source.expanduser().resolve()
    for name in ("train.py", "prepare.py", "orchestrator/cli.py"):  # (evaluate.py: since #44)
        if not (source / name).exists():
            sys.exit(f"experiment_time: {source / name} is missing; --source must be a checkout of this project")
    digest = hashlib.sha256((source / "prepare.py").read_bytes()).hexdigest()[:12]
    cache = (args.cache or Path(tempfile.gettempdir()) / "autoloop-bench-cache" / digest).expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    revision = source_revision(source)
    workdir = Path(tempfile.mkdtemp(prefix="autoloop-exptime-"))
    ok = False
    try:
        obs = run_experiment(args, source, cache, workdir)
        result = analyse(obs, args.budget)
        ok = True
    finally:
        if args.keep or not ok:
            print(f"experiment_time: the temporary repo is kept at {workdir / 'repo'}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(
            json.dumps(
                {"source": str(source), "revision": revision, "profile": args.profile, "cache": str(cache), **result},
                indent=1,
            )
        )
    else:
        print_table(result, args, source, revision)


if __name__ == "__main__":
    main()
