"""The `autoloop` command line. Precedence for every option: command line > AUTOLOOP_* env > [tool.autoloop] > default."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path

import click
from click.core import ParameterSource

from . import LoopError, __version__, plugins
from .executors.base import Executor

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PLUGIN_KINDS = ("proposer", "executor")  # their options are declared by the plugins (orchestrator/plugins.py)
def default_tag() -> str:
    return time.strftime("%b%d").lower()  # e.g. nov30


def pyproject_settings(repo: Path) -> dict:
    path = repo / "pyproject.toml"
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, OSError) as e:
        raise click.ClickException(f"cannot read {path}: {e}; fix the file or remove its [tool.autoloop] table")
    return data.get("tool", {}).get("autoloop", {})


def apply_pyproject(ctx: click.Context, values: dict, repo: Path) -> dict:
    """Fill options left at their defaults from [tool.autoloop] in the repo's pyproject.toml."""
    config = pyproject_settings(repo)
    params = {p.name: p for p in ctx.command.params}
    for key, raw in config.items():
        name = key.replace("-", "_")
        if name not in params or name == "repo":
            known = ", ".join(sorted(n.replace("_", "-") for n in params if n != "repo"))
            if ctx.command.name in ("run", "doctor"):
                raise click.ClickException(f"unknown key {key!r} in [tool.autoloop] of {repo / 'pyproject.toml'}; "
                                           f"known keys: {known}")
            continue
        if ctx.get_parameter_source(name) == ParameterSource.DEFAULT:
            if params[name].multiple and isinstance(raw, str):
                raw = [raw]  # tracker = "mlflow" as well as ["mlflow", "wandb"]
            try:
                values[name] = params[name].type_cast_value(ctx, raw)
            except click.BadParameter as e:
                raise click.ClickException(f"[tool.autoloop] {key} = {raw!r} in {repo / 'pyproject.toml'}: "
                                           f"{e.message}")
    return values


def resolve_repo(repo: Path) -> Path:
    return repo.expanduser().resolve()


def check_tag(ctx, param, value):
    if value is not None and not TAG_RE.match(value):
        raise click.BadParameter("use letters, digits, '.', '_' or '-' (it names a git branch)")
    return value


repo_option = click.option("--repo", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
                           envvar="AUTOLOOP_REPO", show_envvar=True,
                           help="The git repository holding train.py and prepare.py.  [default: .]")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="autoloop")
def main() -> None:
    """autoloop: an autonomous research loop over train.py.

    It edits train.py, commits, trains under a fixed budget, reads val_bpb, keeps the commit if it improved
    or resets it, and logs every experiment to results.tsv.
    """


@main.command()
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              envvar="AUTOLOOP_BUDGET", show_envvar=True,
              help="Training seconds per experiment (passed to train.py as AUTOLOOP_TIME_BUDGET).")
@click.option("--max-experiments", type=click.IntRange(min=1), envvar="AUTOLOOP_MAX_EXPERIMENTS", show_envvar=True,
              help="Stop once the session holds this many experiments (the baseline included).")
@click.option("--max-hours", type=click.FloatRange(min=0, min_open=True), envvar="AUTOLOOP_MAX_HOURS",
              show_envvar=True, help="Stop starting new experiments after this many hours.")
@click.option("--proposer", default="search", show_default=True, envvar="AUTOLOOP_PROPOSER", show_envvar=True,
              help="Where ideas come from (see `autoloop proposers`).")
@click.option("--tag", callback=check_tag, envvar="AUTOLOOP_TAG", show_envvar=True,
              help="Session name; the loop works on branch autoloop/<tag>.  [default: today, e.g. nov30]")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), envvar="AUTOLOOP_TIMEOUT", show_envvar=True,
              help="Hard limit per run in seconds; the run's whole process tree is killed.  [default: 2 x budget + 120]")
@repo_option
@click.option("--profile", type=click.Choice(["gpu", "cpu", "tiny"]), envvar="AUTOLOOP_PROFILE", show_envvar=True,
              help="Harness size (prepare.py).  [default: gpu with CUDA, else cpu]")
@click.option("--dataset", envvar="AUTOLOOP_DATASET", show_envvar=True,
              help="climbmix | pypackages | pystdlib | tinystories | a directory of .txt/.jsonl/.parquet.  "
                   "[default: climbmix on the gpu profile, else pystdlib]")
@click.option("--seed", type=int, default=42, show_default=True, envvar="AUTOLOOP_SEED", show_envvar=True,
              help="Seed passed to every run (AUTOLOOP_SEED); owned by the controller, not train.py.")
@click.option("--gate", type=click.Choice(["noise", "strict"]), default="noise", show_default=True,
              envvar="AUTOLOOP_GATE", show_envvar=True,
              help="noise: keep only what beats the measured noise; strict: upstream's rule (any lower val_bpb).")
@click.option("--false-keep-rate", type=click.FloatRange(min=0.0001, max=0.5), default=0.015, show_default=True,
              envvar="AUTOLOOP_FALSE_KEEP_RATE", show_envvar=True,
              help="The chance, at most, that the noise gate keeps a change that does nothing (over all of the "
                   "candidate's runs).")
@click.option("--min-delta", type=click.FloatRange(min=0), default=0.0, show_default=True,
              envvar="AUTOLOOP_MIN_DELTA", show_envvar=True, help="Floor of the margin, in val_bpb.")
@click.option("--baseline-repeats", type=click.IntRange(min=0), default=2, show_default=True,
              envvar="AUTOLOOP_BASELINE_REPEATS", show_envvar=True,
              help="Extra runs of the baseline to measure σ (0: none).")
@click.option("--max-repeats", type=click.IntRange(min=1), default=10, show_default=True,
              envvar="AUTOLOOP_MAX_REPEATS", show_envvar=True,
              help="Runs of one candidate at most: a promising one runs again until it clears the noise or "
                   "turns hopeless.")
@click.option("--sandbox", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              envvar="AUTOLOOP_SANDBOX", show_envvar=True,
              help="Run each step in a bubblewrap sandbox: only its run directory and worktree writable, no "
                   "network. auto: where bubblewrap works (Linux), else unconfined with a note.")
@click.option("--sandbox-net", is_flag=True, default=False, envvar="AUTOLOOP_SANDBOX_NET", show_envvar=True,
              help="Let sandboxed runs reach the network.")
@click.option("--pass-env", multiple=True, metavar="NAME", envvar="AUTOLOOP_PASS_ENV", show_envvar=True,
              help="Also give runs and agents this variable of ours (repeatable); they get only an allow-list "
                   "otherwise (no API keys, tokens or credentials).")
@click.option("--max-crashes", type=click.IntRange(min=1), default=5, show_default=True,
              envvar="AUTOLOOP_MAX_CRASHES", show_envvar=True,
              help="Stop after this many crashes in a row (a failing GPU, disk or proposer; not only bad ideas).")
@click.option("--max-log-mb", type=click.FloatRange(min=1), default=64.0, show_default=True,
              envvar="AUTOLOOP_MAX_LOG_MB", show_envvar=True,
              help="Cap of each run's log in MiB; its first and last halves are kept.")
@click.option("--workers", type=click.IntRange(min=1), envvar="AUTOLOOP_WORKERS", show_envvar=True,
              help="Experiments at once (more than 1: generations, see README).  [default: one per GPU, else 1]")
@click.option("--executor", type=click.Choice(plugins.available("executor")), default="local", show_default=True,
              envvar="AUTOLOOP_EXECUTOR", show_envvar=True,
              help="Where runs execute: local slots, Ray tasks (needs the ray extra), inline (debugging), or a plugin.")
@click.option("--pipeline/--no-pipeline", default=None, envvar="AUTOLOOP_PIPELINE", show_envvar=True,
              help="Prepare the next idea while an experiment trains.  [default: on for agent and llm]")
@click.option("--max-tokens", type=click.IntRange(min=1), envvar="AUTOLOOP_MAX_TOKENS", show_envvar=True,
              help="Stop once the proposer's LLM usage reaches this many tokens.")
@click.option("--max-cost", type=click.FloatRange(min=0, min_open=True), envvar="AUTOLOOP_MAX_COST",
              show_envvar=True, help="Stop once the proposer's LLM cost reaches this many dollars.")
@click.option("--tracker", "tracker", multiple=True, type=click.Choice(["mlflow", "wandb"]),
              envvar="AUTOLOOP_TRACKER", show_envvar=True,
              help="Mirror the session to an experiment tracker (repeatable; extras mlflow, wandb): the session is a "
                   "parent run, each experiment a child run. MLFLOW_TRACKING_URI (unset: .autoloop/mlflow.db), "
                   "WANDB_MODE=offline work; one that fails warns once and is switched off. The env twin takes "
                   "names separated by spaces.")
@click.pass_context
def run(ctx: click.Context, **values) -> None:
    """Run the loop until a limit, the proposer runs dry, or Ctrl-C. Re-run the same command to resume."""
    from .loop import Terminated, run_loop

    settings = settings_from(ctx, values)
    try:
        run_loop(settings, echo=lambda line: click.echo(line))
    except LoopError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt as e:  # Ctrl-C: 130; SIGTERM: 143 (128 + the signal), as shells report them
        sys.exit(143 if isinstance(e, Terminated) else 130)


def settings_from(ctx: click.Context, values: dict):
    """The run's Settings from its options, [tool.autoloop] filling what the command line and env left unset."""
    from .core.noise import Gate
    from .core.settings import Settings

    repo = resolve_repo(values.pop("repo"))
    values = apply_pyproject(ctx, values, repo)
    if values["tag"] is not None and not TAG_RE.match(str(values["tag"])):  # a tag from [tool.autoloop] too
        raise click.ClickException(f"tag {values['tag']!r} in [tool.autoloop] of {repo / 'pyproject.toml'}: use "
                                   "letters, digits, '.', '_' or '-' (it names a git branch)")
    plugin_values = {kind: {o.name: values.pop(o.name) for o in plugins.options(kind)} for kind in PLUGIN_KINDS}
    for option in plugins.options("executor"):  # [tool.autoloop] values arrive unconverted: run the callbacks
        value = plugin_values["executor"][option.name]
        if option.callback is not None and isinstance(value, str):
            try:
                plugin_values["executor"][option.name] = option.callback(ctx, option, value)
            except click.BadParameter as e:
                raise click.ClickException(f"[tool.autoloop] {option.name.replace('_', '-')}: {e.message}") from None
    own = {o.name for o in getattr(plugins.load("executor", values["executor"], Executor), "options", ())} \
        if values["executor"] in plugins.available("executor") else set()
    for name, value in plugin_values["executor"].items():
        given = ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE  # an env twin left set is no error
        if value is not None and name not in own and given:
            owners = [n for n in plugins.available("executor")
                      if name in {o.name for o in getattr(plugins.load("executor", n, Executor), "options", ())}]
            raise click.UsageError(f"--{name.replace('_', '-')} is an option of the {' / '.join(owners)} executor, "
                                   f"not of the {values['executor']} executor")
    settings = Settings(repo=repo, tag=values["tag"] or default_tag(), tag_given=values["tag"] is not None, budget=values["budget"],
                        timeout=values["timeout"], max_experiments=values["max_experiments"],
                        max_hours=values["max_hours"], proposer=values["proposer"], profile=values["profile"],
                        dataset=values["dataset"], seed=values["seed"], pipeline=values["pipeline"],
                        max_tokens=values["max_tokens"], max_cost=values["max_cost"],
                        options={k: v for k, v in plugin_values["proposer"].items() if v is not None},
                        gate=Gate(values["gate"], values["false_keep_rate"], values["min_delta"], values["max_repeats"]),
                        baseline_repeats=values["baseline_repeats"], max_crashes=values["max_crashes"], pass_env=tuple(values["pass_env"]),
                        sandbox=values["sandbox"], sandbox_net=values["sandbox_net"],
                        max_log_mb=values["max_log_mb"], executor=values["executor"],
                        workers=values["workers"], trackers=tuple(values["tracker"]),
                        executor_options={k: v for k, v in plugin_values["executor"].items()
                                          if v is not None and k in own})
    return settings


# Options the installed proposers and executors declare (--agent, --llm-model, --gpus, --ray-address, ...).
run.params.extend(option for kind in PLUGIN_KINDS for option in plugins.options(kind))


@main.command(context_settings={"ignore_unknown_options": False})
@click.pass_context
def doctor(ctx: click.Context, **values) -> None:
    """Check the machine and repo for `autoloop run` with the same options: git identity and signing, GPU /
    driver / torch, the prepared data, free disk for the night, extras, the agent CLI. One line per check with
    its fix; exit 1 when something would stop the loop."""
    from .doctor import FAIL, WARN, run_checks

    settings = settings_from(ctx, values)
    try:
        findings = run_checks(settings)
    except LoopError as e:
        raise click.ClickException(str(e)) from None
    for finding in findings:
        click.echo(finding.line())
    failed = sum(f.status == FAIL for f in findings)
    warned = sum(f.status == WARN for f in findings)
    if failed:
        click.echo(f"doctor: {failed} problem{'s' if failed > 1 else ''} would stop the loop"
                   + (f" ({warned} warning{'s' if warned > 1 else ''})" if warned else ""))
        sys.exit(1)
    click.echo("doctor: ready" + (f" ({warned} warning{'s' if warned > 1 else ''})" if warned else ""))


doctor.params.extend(run.params)  # the same options as run (and [tool.autoloop]): it checks that run


@main.command()
@click.argument("directory", type=click.Path(path_type=Path), default=Path("."), required=False)
@click.option("--existing", is_flag=True,
              help="Add what is missing (prepare.py, program.md, .gitignore lines, [tool.autoloop]) to a git "
                   "repository that has a train.py, touching nothing else.")
def init(directory: Path, existing: bool) -> None:
    """Make DIRECTORY a ready workspace (train.py, prepare.py, program.md, .gitignore, [tool.autoloop]) and
    commit it.  [default: the current directory, which must be empty]"""
    from .scaffold import init_workspace

    try:
        changed, commit = init_workspace(directory, existing)
    except LoopError as e:
        raise click.ClickException(str(e)) from None
    where = directory.expanduser().resolve()
    if not changed:
        click.echo(f"{where} already has everything autoloop needs; nothing changed")
    else:
        click.echo(f"{'added' if existing else 'wrote'} {', '.join(changed)} in {where}; committed {commit[:7]}")
    go = "" if where == Path.cwd().resolve() else f"cd {shlex.quote(str(directory))} && "
    click.echo(f"next: {go}autoloop doctor && autoloop run   (the first run prepares the data; "
               "Ctrl-C stops, the same command resumes)")


@main.command()
@repo_option
@click.option("--tag", callback=check_tag, envvar="AUTOLOOP_TAG", help="Session to show.  [default: the latest]")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(repo: Path, tag: str | None, as_json: bool) -> None:
    """Show where a loop stands: running or not, experiments done, the best result, the current experiment."""
    from .views.status import collect, render

    repo = resolve_repo(repo)
    try:
        info = collect(repo, tag)
    except LoopError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(info, indent=1) if as_json else render(info))


def session_paths(repo: Path, tag: str | None):
    from .store.session import Paths, latest_tag

    repo = resolve_repo(repo)
    tag = tag or latest_tag(repo)
    if tag is None or not Paths(repo, tag).ledger.exists():
        raise click.ClickException(f"no autoloop session{' ' + repr(tag) if tag else ''} in {repo}; "
                                   "start one with `autoloop run`, or pass --tag / --repo")
    return repo, Paths(repo, tag)


@main.command()
@repo_option
@click.option("--tag", callback=check_tag, envvar="AUTOLOOP_TAG", help="Session to report.  [default: the latest]")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON instead of writing files.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where progress.png and report.md go.  [default: the repo root]")
def report(repo: Path, tag: str | None, as_json: bool, out: Path | None) -> None:
    """Summarise a session: progress.png, report.md (or --json). Makes the held-out check if it is missing."""
    from .core.holdout import for_report
    from .views.report import facts, write_report

    repo, paths = session_paths(repo, tag)
    try:
        for_report(repo, paths.tag, lambda line: click.echo(line, err=True))
    except Exception as e:  # noqa: BLE001 - the report itself must still be written
        click.echo(f"autoloop: held-out check not made: {type(e).__name__}: {e}", err=True)
    if as_json:
        click.echo(json.dumps(facts(paths), indent=1, default=str))
        return
    f = write_report(paths, repo, out or repo)
    where = out or repo
    click.echo(f"wrote {where / 'progress.png'} and {where / 'report.md'}")
    if f["best_bpb"] is not None:
        click.echo(f"{f['experiments']} experiments, {f['keep']} kept: val_bpb {f['baseline_bpb']:.6f} -> "
                   f"{f['best_bpb']:.6f} ({f['delta_percent']:+.2f}%) at {f['best_commit']}")


@main.command()
@repo_option
@click.option("--tag", callback=check_tag, envvar="AUTOLOOP_TAG", help="Session to list.  [default: the latest]")
@click.option("--status", "status_", type=click.Choice(["keep", "discard", "crash"]), help="Only rows with this status.")
@click.option("--limit", type=click.IntRange(min=1), help="Only the last N rows.")
def results(repo: Path, tag: str | None, status_: str | None, limit: int | None) -> None:
    """List a session's rows as a readable table."""
    from .views.report import table

    _, paths = session_paths(repo, tag)
    click.echo(table(paths, status_, limit))


@main.command()
def proposers() -> None:
    """List the installed proposers; one that fails to load is reported, not fatal."""
    from .proposers import available, load

    for name in available():
        try:
            cls = load(name)
            doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
            click.echo(f"{name:10s} {doc[0] if doc else ''}")
        except LoopError as e:
            click.echo(f"{name:10s} (failed to load: {str(e).split(': ', 1)[-1]})")


@main.group()
def queue() -> None:
    """Queue your own ideas; a running loop takes them first, in order."""


@queue.command("add")
@click.argument("description")
@click.option("--set", "assignments", multiple=True, metavar="NAME=VALUE",
              help="Set a train.py constant (repeatable), e.g. --set MATRIX_LR=0.03 --set WINDOW_PATTERN=SSSL.")
@click.option("--patch", type=click.File("r"), help="A unified diff against train.py (git diff format).")
@repo_option
def queue_add(description: str, assignments: tuple[str, ...], patch, repo: Path) -> None:
    """Append an idea: DESCRIPTION plus either --set NAME=VALUE ... or --patch FILE."""
    from .store.gitops import open_repo
    from .store.hparams import read_constants
    from .proposers.queue import Queue, parse_assignment
    from .store.session import Paths

    if bool(assignments) == bool(patch):
        raise click.UsageError("give either --set NAME=VALUE (one or more) or --patch FILE")
    repo = resolve_repo(repo)
    try:
        open_repo(repo)
        pairs = dict(parse_assignment(a) for a in assignments)
    except LoopError as e:
        raise click.ClickException(str(e)) from None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--set") from None
    if pairs:
        source = (repo / "train.py").read_text() if (repo / "train.py").exists() else ""
        names = {c.name for profile in (None, "gpu", "cpu", "tiny") for c in read_constants(source, profile)}
        unknown = sorted(set(pairs) - names)
        if unknown:
            raise click.ClickException(f"train.py has no hyperparameter {', '.join(unknown)}; "
                                       f"known: {', '.join(sorted(names))}")
    idea = Queue(Paths(repo, "_").queue).add(description, pairs, patch.read() if patch else "")
    click.echo(f"queued #{idea.id}: {idea.description}")


@queue.command("list")
@repo_option
def queue_list(repo: Path) -> None:
    """Show the ideas still waiting, in the order they will run."""
    from .proposers.queue import Queue
    from .store.session import Paths

    pending = Queue(Paths(resolve_repo(repo), "_").queue).pending()
    if not pending:
        click.echo("the queue is empty")
    for idea in pending:
        what = ", ".join(f"{k}={v}" for k, v in idea.set.items()) if idea.set else f"patch ({len(idea.patch.splitlines())} lines)"
        click.echo(f"#{idea.id}  {idea.description}  [{what}]")


@queue.command("rm")
@click.argument("idea_id", type=int)
@repo_option
def queue_rm(idea_id: int, repo: Path) -> None:
    """Remove a waiting idea by its number."""
    from .proposers.queue import Queue
    from .store.session import Paths

    if not Queue(Paths(resolve_repo(repo), "_").queue).remove(idea_id):
        raise click.ClickException(f"no waiting idea #{idea_id}; see `autoloop queue list`")
    click.echo(f"removed #{idea_id}")


if __name__ == "__main__":
    main()
