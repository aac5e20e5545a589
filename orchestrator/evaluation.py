"""After a run: the harness's own measurement of the saved model, and an audit of the run's clock.

The number that goes into results.tsv is computed by prepare.py's evaluate_bpb in a separate process from the
model train.py saved through evaluate_bpb (AUTOLOOP_EVAL_ARTIFACT), not parsed from what train.py printed.
"""

from __future__ import annotations

import json
import math

EVAL_TOLERANCE = 0.005  # relative: train.py's own number and the harness's may differ only by kernel noise


def parse_evaluation(output: str, split: str = "val", failed: str = "no output") -> tuple[float | None, str]:
    """(bits per byte, '') from the AUTOLOOP_EVAL line `prepare.py --evaluate` prints, or (None, why not)."""
    value, _, why = read_evaluation(output, split, failed)
    return value, why


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


def audit_clock(metrics: dict, budget: float, seconds_to_artifact: float | None, startup_s: float = 60.0) -> str:
    """'' if the run kept to its budget by its own report and by the controller's clock, else why not.

    startup_s: the least time allowed for start-up and compilation on top of the budget (half the budget if
    that is more), since those are not on train.py's training clock."""
    reported = metrics.get("training_seconds")
    if isinstance(reported, (int, float)) and reported > budget * 1.25 + 5.0:  # one slow last step is fine
        return f"budget exceeded: training_seconds {reported:g} > budget {budget:g}"
    allowance = budget + max(startup_s, 0.5 * budget)
    if seconds_to_artifact is not None and seconds_to_artifact > allowance:
        return (f"budget exceeded: the model was ready {seconds_to_artifact:.0f}s after start, "
                f"more than budget {budget:g}s + start-up allowance {allowance - budget:.0f}s")
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


def holdout_text(result: dict) -> str:
    """One line for the console and the report: the held-out change next to the validation change, or why not."""
    if result.get("error"):
        return f"not available: {result['error']}"
    b, w = result["baseline"], result["best"]
    return (f"baseline {b['holdout_bpb']:.6f} -> best {w['holdout_bpb']:.6f} "
            f"({w['holdout_bpb'] - b['holdout_bpb']:+.6f}; on validation {w['val_bpb'] - b['val_bpb']:+.6f})")
