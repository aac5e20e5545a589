"""The `autoloop` command line: its commands (the options of `run` and `doctor` are in options.py)."""

from __future__ import annotations

import copy
import json
import shlex
import sys
from pathlib import Path

import click

from . import LoopError, __version__
from .options import RUN_OPTIONS, RunCommand, check_tag, env_name, repo_option, resolve_repo, settings_from


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="autoloop")
def main() -> None:
    """autoloop: an autonomous research loop over train.py.

    It edits train.py, commits, trains under a fixed budget, reads val_bpb, keeps the commit if it improved
    or resets it, and logs every experiment to results.tsv.
    """


@main.command(cls=RunCommand, params=list(RUN_OPTIONS))
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


@main.command(cls=RunCommand, params=list(RUN_OPTIONS), context_settings={"ignore_unknown_options": False})
@click.pass_context
def doctor(ctx: click.Context, **values) -> None:
    """Check the machine and repo for `autoloop run` with the same options: git identity and signing, GPU /
    driver / torch, the sandbox, the prepared data, free disk for the night, extras, the agent CLI. One line
    per check with its fix; exit 1 when something would stop the loop."""
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
        click.echo(
            f"doctor: {failed} problem{'s' if failed > 1 else ''} would stop the loop"
            + (f" ({warned} warning{'s' if warned > 1 else ''})" if warned else "")
        )
        sys.exit(1)
    click.echo("doctor: ready" + (f" ({warned} warning{'s' if warned > 1 else ''})" if warned else ""))


VERIFY_OPTIONS = (  # of run's options, those that say how and where runs execute (the rest are the session's)
    "repo",
    "tag",
    "transfer",
    "timeout",
    "max_crashes",
    "sandbox",
    "sandbox_net",
    "pass_env",
    "executor",
    "workers",
    "tracker",
    "max_log_mb",
)


def verify_params() -> list[click.Parameter]:
    from .options import PLUGIN_SECTIONS, plugin_options

    executors = {o.name for o in plugin_options() if getattr(o, "section", "") == PLUGIN_SECTIONS["executor"]}
    params = [copy.copy(p) for p in RUN_OPTIONS if p.name in VERIFY_OPTIONS or p.name in executors]
    for p in params:
        if p.name == "tag":
            p.help = "Session to verify.  [default: the latest]"
    return params


@main.command(cls=RunCommand, params=verify_params())
@click.pass_context
def verify(ctx: click.Context, **values) -> None:
    """Which kept changes of a session matter, and does its best hold at a longer budget? Leave-one-out
    ablation of each kept change, the minimal stack (branch autoloop/<tag>-minimal), the transfer to --transfer
    times the budget on the held-out split. Runs with the session's budget, seed, data and gate; Ctrl-C stops
    it and the same command resumes it. The result: verify.json, `autoloop report`, `autoloop status`."""
    from .loop import Terminated, verify_session
    from .options import PLUGIN_KINDS, plugins
    from .store.session import latest_tag

    repo = values["repo"]
    if values["tag"] is None:
        values["tag"] = latest_tag(repo)
        if values["tag"] is None:
            raise click.ClickException(f"no autoloop session in {repo}; run one with `autoloop run` first")
    for kind in PLUGIN_KINDS:  # the options verify does not take keep their defaults
        for option in plugins.options(kind):
            values.setdefault(option.name, None)
    settings = settings_from(ctx, values)
    settings.tag_given = True
    try:
        verify_session(settings, echo=lambda line: click.echo(line))
    except LoopError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt as e:
        sys.exit(143 if isinstance(e, Terminated) else 130)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path), default=Path("."), required=False)
@click.option(
    "--existing",
    is_flag=True,
    help="Add what is missing (prepare.py, program.md, .gitignore lines, [tool.autoloop]) to a git "
    "repository that has a train.py, touching nothing else.",
)
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
    click.echo(
        f"next: {go}autoloop doctor && autoloop run   (the first run prepares the data; "
        "Ctrl-C stops, the same command resumes)"
    )


@main.command()
@repo_option
@click.option("--tag", callback=check_tag, envvar=env_name("tag"), help="Session to show.  [default: the latest]")
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
        raise click.ClickException(
            f"no autoloop session{' ' + repr(tag) if tag else ''} in {repo}; "
            "start one with `autoloop run`, or pass --tag / --repo"
        )
    return repo, Paths(repo, tag)


@main.command()
@repo_option
@click.option("--tag", callback=check_tag, envvar=env_name("tag"), help="Session to report.  [default: the latest]")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON instead of writing files.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where progress.png and report.md go.  [default: the repo root]",
)
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
        click.echo(
            f"{f['experiments']} experiments, {f['keep']} kept: val_bpb {f['baseline_bpb']:.6f} -> "
            f"{f['best_bpb']:.6f} ({f['delta_percent']:+.2f}%) at {f['best_commit']}"
        )


@main.command()
@repo_option
@click.option("--tag", callback=check_tag, envvar=env_name("tag"), help="Session to list.  [default: the latest]")
@click.option(
    "--status", "status_", type=click.Choice(["keep", "discard", "crash"]), help="Only rows with this status."
)
@click.option("--limit", type=click.IntRange(min=1), help="Only the last N rows.")
@click.option(
    "--verify", "verify_runs", is_flag=True, help="The runs of `autoloop verify` instead (not in results.tsv)."
)
def results(repo: Path, tag: str | None, status_: str | None, limit: int | None, verify_runs: bool) -> None:
    """List a session's rows as a readable table."""
    from .views.report import table, verify_table

    _, paths = session_paths(repo, tag)
    click.echo(verify_table(paths, limit) if verify_runs else table(paths, status_, limit))


@main.command()
@repo_option
@click.option("--tag", callback=check_tag, envvar=env_name("tag"), help="Session to show.  [default: the latest]")
@click.option(
    "--chars", type=click.IntRange(min=500), default=6000, show_default=True, help="Size of the journal, at most."
)
def journal(repo: Path, tag: str | None, chars: int) -> None:
    """Print what a session has learned, as its LLM prompts carry it: the kept changes, what was tried and not
    kept by theme, the crashes, the open leads, the repeats caught (and not run)."""
    from .core.state import load_state
    from .proposers.memory import journal as journal_text

    _, paths = session_paths(repo, tag)
    try:
        state = load_state(paths)
    except LoopError as e:
        raise click.ClickException(str(e)) from None
    click.echo(journal_text(state.records, chars))


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
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="NAME=VALUE",
    help="Set a train.py constant (repeatable), e.g. --set MATRIX_LR=0.03 --set WINDOW_PATTERN=SSSL.",
)
@click.option("--patch", type=click.File("r"), help="A unified diff against train.py (git diff format).")
@repo_option
def queue_add(description: str, assignments: tuple[str, ...], patch, repo: Path) -> None:
    """Append an idea: DESCRIPTION plus either --set NAME=VALUE ... or --patch FILE."""
    from .proposers.queue import Queue, parse_assignment
    from .store.gitops import open_repo
    from .store.hparams import read_constants
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
            raise click.ClickException(
                f"train.py has no hyperparameter {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            )
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
        what = (
            ", ".join(f"{k}={v}" for k, v in idea.set.items())
            if idea.set
            else f"patch ({len(idea.patch.splitlines())} lines)"
        )
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
