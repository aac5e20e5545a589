"""After a run: the harness's own measurement of the saved model, and an audit of the run's clock.

The number that goes into results.tsv is computed by `evaluate.py` in a process of its own, from the graph
train.py exported through prepare.evaluate_bpb (AUTOLOOP_EVAL_ARTIFACT), never from what train.py printed; that
process never runs train.py's Python (evaluate.load_exported) and writes its result to a file with a nonce.
"""

from __future__ import annotations

import hmac
import json
import math
import os
from pathlib import Path

from .summary import read_run_file

EVAL_TOLERANCE = 0.005  # relative: train.py's own number and the harness's may differ only by kernel noise


RESULT = "eval.json"  # where `evaluate.py --result` writes, in the run's directory


def evaluator_args(info, artifact: str, split: str, result: str | None) -> list[str]:
    """The evaluation's command line after the Python: `-I -S evaluate.py` where the harness has it. The evaluator
    starts in the run's worktree: isolated mode keeps what the run may have left there (a `json.py`, a `torch/`) and
    PYTHON* variables off its import path, and -S runs no site hook (a `.pth` or `sitecustomize` a run planted in
    the Python environment): evaluate.py adds the package directories by name. An older harness evaluates with
    `prepare.py --evaluate` (isolated), or imports train.py, which needs the worktree on the path."""
    channel = ["--result", result] if result and info.result_file else []
    if info.evaluator == "evaluate.py":
        return ["-I", "-S", "evaluate.py", artifact, "--split", split, *channel]
    return [*(["-I"] if info.exported else []), "prepare.py", "--evaluate", artifact, "--split", split, *channel]


def evaluator_code(info) -> tuple[str, ...]:
    """The harness files the evaluation runs (read-only to the run: it may start while train.py still runs)."""
    return ("prepare.py", "evaluate.py") if info.evaluator == "evaluate.py" else ("prepare.py",)


def read_result(path: Path, nonce: str, exit_code: int | None, split: str = "val") -> tuple[float | None, dict, str]:
    """(bits per byte, the whole result, '') from the file the harness evaluation wrote, or (None, ..., why not).

    It counts only with this run's nonce (which the harness read from stdin before importing train.py), the
    number a real finite float, and the process's exit status 0: printing a result, exiting early or writing
    the file from train.py's code changes nothing."""
    raw = read_run_file(path, 1 << 20, tail=False)  # never a link, a FIFO or /dev/zero the run left there
    if raw is None:
        return None, {}, f"the harness evaluation wrote no result (exit code {exit_code})"
    try:
        result = json.loads(raw)
    except ValueError:
        return None, {}, "the harness evaluation's result is malformed"
    if not isinstance(result, dict) or not hmac.compare_digest(str(result.get("nonce", "")), nonce):
        return None, {}, "the harness evaluation's result is not this run's (it was not written by the harness)"
    if isinstance(result.get("error"), str):
        return None, result, result["error"][:300]
    if exit_code != 0:
        return None, result, f"the harness evaluation exited with code {exit_code}"
    value = result.get(f"{split}_bpb" if split != "val" else "val_bpb")
    if type(value) is not float or not math.isfinite(value):
        return None, result, f"the harness measured no finite val_bpb ({value!r})"
    return value, result, ""


def read_evaluation(output: str, split: str = "val", failed: str = "no output") -> tuple[float | None, dict, str]:
    """(bits per byte, the whole AUTOLOOP_EVAL result, '') or (None, {}, why not)."""
    line = next((ln for ln in output.splitlines() if ln.startswith("AUTOLOOP_EVAL ")), None)
    if line is None:
        tail = output.strip().splitlines()[-1:] or [failed]
        return None, {}, f"the harness evaluation failed: {tail[0][:200]}"
    try:
        result = json.loads(line.split(" ", 1)[1])
    except ValueError:
        return None, {}, "the harness evaluation printed a malformed result"
    if not isinstance(result, dict):
        return None, {}, "the harness evaluation printed a malformed result"
    if "error" in result:
        return None, result, str(result["error"])
    value = result.get(f"{split}_bpb" if split != "val" else "val_bpb")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, result, f"the harness measured a non-finite val_bpb ({value})"
    return float(value), result, ""


CLOCK_SLACK = 0.05  # share of the budget a run may train beyond it (one slow last step), by the controller's clock
STARTUP_SLACK = 0.35  # share of the baseline's start-up a run may take beyond it (a bigger model compiles longer)
STARTUP_SLACK_CAP = 0.25  # ... but never more than this share of the budget: at small budgets the start-up is
#                           long next to the budget, and a slack in proportion to it hid a run training 1.67x
MIN_SLACK_S = 1.5  # seconds of start-up jitter always allowed (process start, imports on a loaded machine)
# The start-up the audit allows follows the machine: the slowest start-up among the recent runs of code already
# kept (the baseline's repeats, the best's runs: never a candidate's, so no edit buys itself time), at least the
# baseline's own, grown by never more than STARTUP_GROWTH_CAP of the budget: what it grows by is what an
# over-training edit could hide while it is grown (with the cap, the 1.67x slowed clock of
# test_the_start_up_slack_is_capped_at_a_quarter_of_the_budget is refused at any growth). Not in proportion to
# the baseline's start-up: where train.py ends its training before the budget (tiny: 20 s of 30) the baseline's
# is 0, and a loaded machine's 8-11 s of start-up then overran every honest edit (benchmarks/loaded_night.py).
STARTUP_GROWTH_CAP = 0.25
OVERRAN = "budget exceeded: train.py ran"  # how the audit's reason starts when the controller's clock refused a run
TEST_SLACK_ENV = "AUTOLOOP_TEST_CLOCK_SLACK_S"  # TEST-ONLY: see slack_for_tests()


def slack_for_tests() -> float:
    """Seconds the test suite adds to the clock audit's slack; 0 unless AUTOLOOP_TEST_CLOCK_SLACK_S is set.

    TEST-ONLY. The suite runs the real train.py at budgets of 0.5-5 s on a loaded 2-core machine, where an edit's
    start-up (torch imports, the export) takes 1-3 s longer than its baseline's did: more than MIN_SLACK_S, so
    honest runs read "budget exceeded". A test sets this only where its attacks overrun their budget by far more
    (tests/conftest.py: CLOCK_SLACK_S). Never set it for a real session: it widens what an over-training edit
    gets through by exactly this much."""
    try:
        return max(0.0, float(os.environ.get(TEST_SLACK_ENV, "0") or 0))
    except ValueError:
        return 0.0


def startup_allowance(baseline: float, recent: list[float], budget: float) -> float:
    """The start-up (seconds beyond the budget) the clock audit allows an edit: the slowest of the `recent`
    start-ups of kept code on this machine, never below the `baseline`'s own, and grown by at most
    STARTUP_GROWTH_CAP x budget."""
    ceiling = baseline + STARTUP_GROWTH_CAP * budget
    return min(ceiling, max([baseline, *recent]))


def clock_limit(budget: float, learned: float) -> float:
    """The longest train.py step that kept to the budget, given the start-up the session's kept runs need now
    (`learned`: startup_allowance): that start-up, the budget plus 5%, and a bounded slack for a slower one."""
    slack = max(MIN_SLACK_S, min(STARTUP_SLACK * learned, STARTUP_SLACK_CAP * budget))
    return learned + budget * (1 + CLOCK_SLACK) + slack + slack_for_tests()


def audit_clock(
    metrics: dict,
    budget: float,
    seconds_to_artifact: float | None,
    startup_s: float = 60.0,
    wall_s: float | None = None,
    learned: float | None = None,
) -> str:
    """'' if the run kept to its budget, else why not. The controller's clock decides, not train.py's report:
    once the session's baseline has run, the train step's wall time less the start-up the session's kept runs
    need (`learned`: their wall time beyond the budget, startup_allowance) must stay within the budget plus 5%
    and a small margin
    (so a run that trains 1.3x the budget is refused at --budget 60 while the start-up is under ~40 s, and at
    --budget 300 under ~200 s, at the baseline's start-up; while it is grown, 1.55x at most from 6 s up). A first
    overrun is run again, a second is the idea's crash (trial.overrun). Before that, the
    model must be ready within the budget plus `startup_s` (or half the budget, if more)."""
    reported = metrics.get("training_seconds")
    if isinstance(reported, (int, float)) and reported > budget * 1.25 + 5.0:  # one slow last step is fine
        return f"budget exceeded: training_seconds {reported:g} > budget {budget:g}"
    if learned is not None and wall_s is not None:
        if wall_s > clock_limit(budget, learned):
            extra = f" (with the test-only {TEST_SLACK_ENV}={slack_for_tests():g})" if slack_for_tests() else ""
            return (
                f"{OVERRAN} {wall_s:.1f}s; less the {learned:.1f}s of start-up the session's kept runs needed, "
                f"that is {wall_s - learned:.1f}s of training for a budget of {budget:g}s{extra}"
            )
        seconds_to_artifact = None  # judged by the learned start-up instead
    allowance = budget + max(startup_s, 0.5 * budget)
    if seconds_to_artifact is not None and seconds_to_artifact > allowance:
        return (
            f"budget exceeded: the model was ready {seconds_to_artifact:.0f}s after start, "
            f"more than budget {budget:g}s + start-up allowance {allowance - budget:.0f}s"
        )
    steps = metrics.get("num_steps")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        return f"implausible num_steps {steps!r}"
    return ""


def compare_printed(printed: float | None, measured: float) -> str:
    if printed is None:
        return ""
    if abs(printed - measured) > EVAL_TOLERANCE * max(1.0, measured):
        return f"train.py printed val_bpb {printed:.6f}, the harness measured {measured:.6f}"
    return ""


HOLDOUT_T = 2.0  # the held-out change is beyond the noise when it is this many standard errors from zero


def holdout_noise(result: dict, sigma: float | None = None) -> tuple[float | None, str]:
    """(the standard error of the held-out change, whether it is beyond the noise). The check scores one saved
    model of each, so the change carries two runs' noise: σ·√2, σ being the session's run-to-run spread of
    val_bpb (`sigma`, else the one stored with the check) standing for the held-out split's. (None, '') without
    σ (no configuration run twice) or a complete check."""
    sigma = sigma if sigma is not None else result.get("sigma")
    if result.get("error") or not isinstance(sigma, (int, float)) or not sigma > 0:
        return None, ""
    se = sigma * math.sqrt(2)
    gain = result["baseline"]["holdout_bpb"] - result["best"]["holdout_bpb"]
    if abs(gain) <= HOLDOUT_T * se:
        return se, "within the noise of one model each"
    return se, "beyond the noise" if gain > 0 else "worse, beyond the noise"


def holdout_text(result: dict, sigma: float | None = None) -> str:
    """One line for the console and the report: the held-out change next to the validation change, with its
    uncertainty where σ is known (holdout_noise), or why there is none."""
    if result.get("error"):
        return f"not available: {result['error']}"
    b, w = result["baseline"], result["best"]
    se, verdict = holdout_noise(result, sigma)
    noise = f" ± {se:.6f}, {verdict}" if se is not None else ""
    return (
        f"baseline {b['holdout_bpb']:.6f} -> best {w['holdout_bpb']:.6f} "
        f"({w['holdout_bpb'] - b['holdout_bpb']:+.6f}{noise}; on validation {w['val_bpb'] - b['val_bpb']:+.6f})"
    )
