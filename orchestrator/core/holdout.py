"""The held-out check: the baseline's and the best's saved models scored on the held-out split that no decision
ever used, each with its own train.py, so that over-fitting the validation split by selection shows."""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..executors import OUT, PYTHON, Executor, Job
from ..store.ledger import write_json_atomic
from ..trust.evaluation import RESULT, evaluator_args, holdout_text, read_evaluation, read_result
from ..trust.summary import read_tail
from .state import State

if TYPE_CHECKING:
    from .workspace import Workspace

MAX_ATTEMPTS = 4  # the executor may fail (a lost node); the evaluation itself is not retried
DISAGREE_SIGMAS = 3.0  # the noise allowed between the validation and held-out gains, in σ·√2 (see disagreement)
DISAGREE_SHARE = 0.5  # ... and at least this share of the validation gain


def due(ws: Workspace, state: State) -> bool:
    """Is there a best other than the baseline, with saved models, and no check of it yet?"""
    if not (ws.info and ws.info.artifacts) or state.best_run in (0, state.baseline_run):
        return False
    try:
        done = json.loads((ws.paths.state / "holdout.json").read_text())
        return done.get("best", {}).get("n") != state.best_run or bool(done.get("error"))
    except (OSError, ValueError, AttributeError):
        return True


def holdout_check(ws: Workspace, executor: Executor, state: State, echo: Callable[[str], None]) -> dict | None:
    """Run the check if it is due; write holdout.json and print one line. None when there is nothing to check."""
    if not due(ws, state):
        return None
    result: dict = {}
    for name, n in (("baseline", state.baseline_run), ("best", state.best_run)):
        record = next(r for r in state.records if r.n == n)
        artifact = ws.paths.run_dir(n) / "model.pt"
        value, why = (
            evaluate(ws, executor, record.commit, artifact, ws.paths.state / "holdout" / str(n))
            if artifact.exists()
            else (None, f"the saved model of #{n} is gone")
        )
        result[name] = {  # the best's val_bpb is its saved model's run's own, the one held-out data re-measures
            "n": n,
            "commit": record.commit,
            "holdout_bpb": value,
            "val_bpb": record.val_bpb if name == "best" else state.baseline_bpb,
        }
        if value is None:
            result["error"] = f"{name} (#{n}): {why}"
            break
    result["sigma"] = state.spread().sd  # the noise the disagreement is judged against, as the session knew it
    result["disagrees"] = disagreement(result)
    write_json_atomic(ws.paths.state / "holdout.json", result)
    echo(f"autoloop: held-out check: {holdout_text(result)}")
    return result


def disagreement(result: dict | None, sigma: float | None = None) -> str:
    """'' unless the held-out check disagrees with validation beyond the noise; else one line that says so.

    The rule: with G_val the best's validation gain over the baseline (baseline val_bpb minus the best's) and
    G_held its gain on the held-out split, they disagree when G_val > 0 and
        G_val - G_held > max(DISAGREE_SIGMAS * σ * √2, DISAGREE_SHARE * G_val),
    σ being the session's run-to-run spread of val_bpb (State.spread(): `sigma` here, else the one stored
    with the check). A validation gain is one run of the best against the baseline's mean: its noise is at most
    σ·√2, and 3 of those cover the luck that selecting the best among many adds; half the gain keeps a small
    honest gain from being flagged for a held-out gain of half its size. Without σ (no configuration run
    twice) only the second term counts. A best fitted to the validation split (an edit that read it) gains
    on validation and not held out: -2.64 against -0.007 bpb is flagged whatever σ is."""
    if not result or result.get("error") or not all(k in result for k in ("baseline", "best")):
        return ""
    b, w = result["baseline"], result["best"]
    values = (b.get("val_bpb"), w.get("val_bpb"), b.get("holdout_bpb"), w.get("holdout_bpb"))
    if any(not isinstance(v, (int, float)) for v in values):
        return ""
    on_val, held_out = values[0] - values[1], values[2] - values[3]
    sigma = sigma if sigma is not None else result.get("sigma")
    noise = DISAGREE_SIGMAS * math.sqrt(2) * sigma if isinstance(sigma, (int, float)) else 0.0
    margin = max(noise, DISAGREE_SHARE * on_val)
    if on_val <= 0 or on_val - held_out <= margin:
        return ""
    basis = f"3σ√2 = {noise:.6f} with σ = {sigma:.6f}" if noise else "σ not measured"
    return (
        f"the held-out check disagrees with validation: the best gains {on_val:.6f} bpb on validation but "
        f"{held_out:+.6f} held out, {on_val - held_out:.6f} apart, beyond the noise (max of {basis} and half "
        "the validation gain): the best may fit the validation split rather than the task (by luck of the "
        "selection, or an edit that read it); check its diff before trusting it"
    )


def warning(ws: Workspace, state: State) -> str:
    """The exit line's warning when the check of the current best disagrees with validation ('' otherwise)."""
    try:
        result = json.loads((ws.paths.state / "holdout.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(result, dict) or (result.get("best") or {}).get("n") != state.best_run:
        return ""
    flag = disagreement(result, state.spread().sd)
    return f"autoloop: WARNING: {flag}" if flag else ""


def evaluate(ws: Workspace, executor: Executor, commit: str, artifact: Path, out: Path) -> tuple[float | None, str]:
    """The held-out bits per byte of a saved model, measured by prepare.py at `commit`, on the executor's first
    slot (on a cluster the model travels to a GPU node; nothing is evaluated on the controller's CPU)."""
    try:
        ws.proposal_worktree(commit)
    except Exception as e:  # noqa: BLE001 - e.g. a copied .autoloop/ whose worktrees are gone
        return None, f"cannot check out {commit[:7]}: {str(e).strip().splitlines()[-1][:200]}"
    nonce = secrets.token_hex(16)
    job = Job(
        steps=[[PYTHON, *evaluator_args(ws.harness_info, f"{OUT}/model.pt", "holdout", f"{OUT}/{RESULT}")]],
        logs=["eval.log"],
        env={k: v for k, v in ws.env.items() if k != "AUTOLOOP_EVAL_ARTIFACT"},
        timeout_s=ws.settings.hard_timeout,
        workdir=ws.paths.proposal,
        out_dir=out,
        inputs={"model.pt": artifact},
        step_stdin=[nonce + "\n"],
        sandbox=ws.sandbox,
    )
    job.on_start = lambda pid: ws.processes.started("holdout", pid, time.time())  # killed on the way out if need be
    for _ in range(MAX_ATTEMPTS):
        handle = executor.submit(job, executor.slots[0])
        try:
            result = handle.result()
        except BaseException:
            handle.cancel()
            with contextlib.suppress(TimeoutError):
                handle.result(timeout=30.0)
            raise
        if not result.infra_error:
            break
    if result.infra_error or not result.steps:
        return None, f"the executor failed: {result.infra_error}"
    step = result.steps[0]
    if step.timed_out:
        return None, f"the harness evaluation timed out after {job.timeout_s:.0f}s"
    if step.killed:
        return None, f"the harness evaluation: {step.killed}"
    value, _, why = (
        read_result(out / RESULT, nonce, step.exit_code, "holdout")
        if ws.harness_info.result_file
        else read_evaluation(read_tail(step.log), "holdout")
    )
    (out / "model.pt").unlink(missing_ok=True)  # a copy of the input
    return value, why


def session_harness(session: dict, repo: Path):
    """The harness evaluation as a session's runs had it (session.json; one from before evaluate.py recorded none:
    the repository says whether it has one)."""
    from ..trust.harness import HarnessInfo

    evaluator = session.get("evaluator", "evaluate.py" if (repo / "evaluate.py").exists() else "")
    scorer = evaluator == "evaluate.py"
    return HarnessInfo(None, None, None, True, result_file=scorer, exported=scorer, evaluator=evaluator)


def for_report(repo: Path, tag: str, echo: Callable[[str], None]) -> dict | None:
    """`autoloop report`: make the check for a session that has none for its current best (it ended with Ctrl-C
    before the check, or the check was skipped), with the environment its runs had. Not while a loop runs on
    the tag (that loop makes its own), and not for a session recorded before its environment was kept."""
    from ..executors import LocalExecutor
    from ..store.session import Lock, Paths
    from .settings import Settings
    from .state import load_state
    from .workspace import Workspace

    paths = Paths(repo, tag)
    try:
        session = json.loads(paths.session.read_text())
    except (OSError, ValueError):
        return None
    if not session.get("artifacts") or not session.get("env"):
        return None
    lock = Lock(paths.lock)
    try:
        lock.acquire()
    except Exception:  # noqa: BLE001 - a loop holds the tag
        return None
    try:
        ws = Workspace(Settings(repo=repo, tag=tag), echo)
        ws.env.update(session["env"])
        ws.info = session_harness(session, repo)
        state = load_state(paths)
        if not due(ws, state):
            return None
        echo("autoloop: this session has no held-out check for its best yet: making it ...")
        executor = LocalExecutor(1)
        try:
            return holdout_check(ws, executor, state, echo)
        finally:
            executor.close()
    finally:
        lock.release()
