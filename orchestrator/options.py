"""The options of `autoloop run` and `doctor`, and the Settings built from them. Precedence for every option:
command line > AUTOLOOP_* env > [tool.autoloop] > default.

RUN_OPTIONS (the plugins' own included) are listed in sections by --help, each has an AUTOLOOP_* twin named after
it, and the repo's [tool.autoloop] table is click's default_map."""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from pathlib import Path

import click
from click.core import ParameterSource

from . import plugins
from .executors.base import Executor
from .plugins import FiniteRange

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PLUGIN_KINDS = ("proposer", "executor")  # their options are declared by the plugins (orchestrator/plugins.py)
PYPROJECT_PROBLEM = "autoloop.pyproject_problem"  # ctx.meta key: a [tool.autoloop] table click cannot use


def default_tag() -> str:
    return time.strftime("%b%d").lower()  # e.g. nov30


def resolve_repo(repo: Path) -> Path:
    return repo.expanduser().resolve()


def check_tag(ctx, param, value):
    if value is not None and not TAG_RE.match(value):
        raise click.BadParameter("use letters, digits, '.', '_' or '-' (it names a git branch)")
    return value


def env_name(option_name: str) -> str:
    """The AUTOLOOP_* twin of an option: --max-experiments (name max_experiments) -> AUTOLOOP_MAX_EXPERIMENTS."""
    return "AUTOLOOP_" + option_name.upper()


class TransferFactor(click.ParamType):
    """A multiple of the budget: 3x, 3, 2.5x; 0 or off for none."""

    name = "FACTOR"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            factor = float(value)
        else:
            text = str(value).strip().lower()
            if text in ("0", "off", "none", "no"):
                return 0.0
            try:
                factor = float(text[:-1] if text.endswith("x") else text)
            except ValueError:
                self.fail(f"{value!r} is not a multiple of the budget such as 3x (or off)", param, ctx)
        if factor != 0 and not 1 < factor <= 100:
            self.fail(
                f"{value!r}: the transfer budget must be longer than the session's (more than 1x, at most 100x)",
                param,
                ctx,
            )
        return factor


class BundleSize(click.ParamType):
    """Parked near misses per bundle: 0 (never) or 2 or more (a bundle of one is the idea again)."""

    name = "N"

    def convert(self, value, param, ctx):
        try:
            size = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a whole number (0: no bundles; 2 or more: their size)", param, ctx)
        if size != 0 and size < 2:
            self.fail(f"{value!r}: a bundle holds 2 near misses or more (0: no bundles)", param, ctx)
        return size


class PluginChoice(click.Choice):
    """A registered plugin's name, or a plugin that is not packaged named as `module:Class` (plugins.load)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and ":" in value:
            return value
        return super().convert(value, param, ctx)


# ---------------------------------------------------------------------------------------------------------------
# The options of run and doctor: sections in --help, AUTOLOOP_* twins, [tool.autoloop] as click's default_map

SESSION, LIMITS, GATE, SAFETY, EXECUTION, PROPOSER, TRACKING, OUTPUT = (
    "Session",
    "Limits",
    "Noise gate",
    "Safety",
    "Execution",
    "Proposer",
    "Tracking",
    "Output",
)
SECTIONS = (SESSION, LIMITS, GATE, SAFETY, EXECUTION, PROPOSER, TRACKING, OUTPUT)  # --help's order
PLUGIN_SECTIONS = {"proposer": PROPOSER, "executor": EXECUTION}  # where the plugins' own options are listed
# Settings (and Gate) fields set by an option of another name; every other option is its field's namesake
OPTION_OF = {"trackers": "tracker", "mode": "gate", "alpha": "false_keep_rate"}


def with_env_twin(option: click.Option) -> click.Option:
    """The option with its AUTOLOOP_* variable, shown in --help (a plugin that names its own keeps it)."""
    option.envvar = option.envvar or env_name(option.name)
    option.show_envvar = True
    return option


class RunOption(click.Option):
    """An option of run and doctor: listed under `section` in --help, with its AUTOLOOP_* twin."""

    def __init__(self, *args, section: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.section = section
        with_env_twin(self)


def plugin_options() -> list[click.Option]:
    """The options the installed proposers and executors declare (--agent, --llm-model, --gpus, --ray-address,
    ...), copied (the plugin's own objects stay as declared) to carry a section and an env twin."""
    found = []
    for kind, section in PLUGIN_SECTIONS.items():
        for option in plugins.options(kind):
            option = with_env_twin(copy.copy(option))
            option.section = section
            found.append(option)
    return found


class RunCommand(click.Command):
    """A command whose --help lists its options in sections (as pytest's option groups do)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list] = {title: [] for title in SECTIONS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                rows[getattr(param, "section", OUTPUT)].append(record)  # -h/--help: Output
        for title, records in rows.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        if PYPROJECT_PROBLEM in ctx.meta:  # after parsing, so usage errors and --help come first, as before
            raise click.ClickException(ctx.meta[PYPROJECT_PROBLEM])
        return rest


def pyproject_settings(repo: Path) -> dict:
    path = repo / "pyproject.toml"
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, OSError) as e:
        raise click.ClickException(
            f"cannot read {path}: {e}; fix the file or remove its [tool.autoloop] table"
        ) from None
    return data.get("tool", {}).get("autoloop", {})


@dataclasses.dataclass(eq=False)
class FromPyproject:
    """A [tool.autoloop] value in click's default_map. Click calls it only for an option the command line and env
    left unset, so a value they override is never checked; a bad one is an error of the file (exit 1)."""

    ctx: click.Context
    param: click.Parameter
    key: str
    raw: object
    path: Path

    def __call__(self) -> object:
        value = [self.raw] if self.param.multiple and isinstance(self.raw, str) else self.raw  # tracker = "mlflow"
        try:
            self.param.process_value(self.ctx, value)  # its type and callback (the tag's, --gpus'), as click will
        except click.BadParameter as e:
            raise click.ClickException(
                f"[tool.autoloop] {self.key} = {self.raw!r} in {self.path}: {e.message}"
            ) from None
        return value

    def __str__(self) -> str:  # the default `autoloop run --repo R --help` shows
        return str(self.raw)


def load_pyproject(ctx: click.Context, param: click.Parameter, repo: Path) -> Path:
    """--repo's callback (eager: it runs before the other options): the repo's [tool.autoloop] becomes the
    default_map, below the command line and env. An unreadable table or an unknown key is kept for after parsing."""
    repo = resolve_repo(repo)
    try:
        table = pyproject_settings(repo)
    except click.ClickException as e:
        ctx.meta[PYPROJECT_PROBLEM] = e.message
        return repo
    params = {p.name: p for p in ctx.command.params if p.name != "repo"}
    path = repo / "pyproject.toml"
    ctx.default_map = {}
    for key, raw in table.items():
        name = key.replace("-", "_")
        if name in params:
            ctx.default_map[name] = FromPyproject(ctx, params[name], key, raw, path)
        else:
            known = ", ".join(sorted(n.replace("_", "-") for n in params))
            ctx.meta.setdefault(
                PYPROJECT_PROBLEM, f"unknown key {key!r} in [tool.autoloop] of {path}; known keys: {known}"
            )
    return repo


REPO_HELP = "The git repository holding train.py and prepare.py.  [default: .]"
RUN_OPTIONS: list[click.Option] = [
    # Session
    RunOption(
        ["--repo"],
        section=SESSION,
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("."),
        is_eager=True,
        callback=load_pyproject,
        help=REPO_HELP,
    ),
    RunOption(
        ["--tag"],
        section=SESSION,
        callback=check_tag,
        help="Session name; the loop works on branch autoloop/<tag>.  [default: today, e.g. nov30]",
    ),
    RunOption(
        ["--profile"],
        section=SESSION,
        type=click.Choice(["gpu", "cpu", "tiny"]),
        help="Harness size (prepare.py).  [default: gpu with CUDA, else cpu]",
    ),
    RunOption(
        ["--dataset"],
        section=SESSION,
        help="climbmix | pypackages | pystdlib | tinystories | a directory of .txt/.jsonl/.parquet.  "
        "[default: climbmix on the gpu profile, else pystdlib]",
    ),
    RunOption(
        ["--seed"],
        section=SESSION,
        type=int,
        default=42,
        show_default=True,
        help="Seed passed to every run (AUTOLOOP_SEED); owned by the controller, not train.py.",
    ),
    RunOption(
        ["--verify/--no-verify"],
        section=SESSION,
        default=False,
        show_default=True,
        help="At the end of the session, `autoloop verify` its kept stack: leave-one-out ablation, the minimal "
        "stack, and the transfer to a longer budget.",
    ),
    RunOption(
        ["--transfer"],
        section=SESSION,
        type=TransferFactor(),
        default="3x",
        show_default=True,
        help="verify's longer budget, as a multiple of the session's (e.g. 3x; 0 or off: no transfer check).",
    ),
    # Limits
    RunOption(
        ["--budget"],
        section=LIMITS,
        type=FiniteRange(min=0, min_open=True),
        default=300.0,
        show_default=True,
        help="Training seconds per experiment (passed to train.py as AUTOLOOP_TIME_BUDGET).",
    ),
    RunOption(
        ["--timeout"],
        section=LIMITS,
        type=FiniteRange(min=0, min_open=True),
        help="Hard limit per run in seconds; the run's whole process tree is killed.  [default: 2 x budget + 120]",
    ),
    RunOption(
        ["--max-experiments"],
        section=LIMITS,
        type=click.IntRange(min=1),
        help="Stop once the session holds this many experiments (the baseline included).",
    ),
    RunOption(
        ["--max-hours"],
        section=LIMITS,
        type=FiniteRange(min=0, min_open=True),
        help="Stop starting new experiments after this many hours.",
    ),
    RunOption(
        ["--max-crashes"],
        section=LIMITS,
        type=click.IntRange(min=1),
        default=5,
        show_default=True,
        help="Stop after this many crashes in a row (a failing GPU, disk or proposer; not only bad ideas).",
    ),
    RunOption(
        ["--max-tokens"],
        section=LIMITS,
        type=click.IntRange(min=1),
        help="Stop once the proposer's LLM usage reaches this many tokens.",
    ),
    RunOption(
        ["--max-cost"],
        section=LIMITS,
        type=FiniteRange(min=0, min_open=True),
        help="Stop once the proposer's LLM cost reaches this many dollars.",
    ),
    # Noise gate
    RunOption(
        ["--gate"],
        section=GATE,
        type=click.Choice(["value", "noise", "strict"]),
        default="noise",
        show_default=True,
        help="noise: keep only what beats the measured noise (a sequential test); value: keep what is very likely "
        "better, run again only where a run is worth more than a new idea's; strict: upstream's rule (any lower "
        "val_bpb).",
    ),
    RunOption(
        ["--false-keep-rate"],
        section=GATE,
        type=FiniteRange(min=0.0001, max=0.5),
        default=0.035,
        show_default=True,
        help="The chance, at most, that the noise gate keeps a change that does nothing "
        "(over all of the candidate's runs).",
    ),
    RunOption(
        ["--min-delta"],
        section=GATE,
        type=FiniteRange(min=0),
        default=0.0,
        show_default=True,
        help="Floor of the margin, in val_bpb.",
    ),
    RunOption(
        ["--baseline-repeats"],
        section=GATE,
        type=click.IntRange(min=0),
        default=2,
        show_default=True,
        help="Extra runs of the baseline to measure σ (0: none).",
    ),
    RunOption(
        ["--max-repeats"],
        section=GATE,
        type=click.IntRange(min=1),
        default=10,
        show_default=True,
        help="Counted runs of one candidate at most: a promising one runs again until it clears the noise or turns "
        "hopeless (a run slowed from outside does not count, and runs again).",
    ),
    RunOption(
        ["--early-stop"],
        section=GATE,
        type=click.Choice(["off", "on"]),
        default="off",
        show_default=True,
        help="on: stop a candidate's run whose training loss is clearly behind the best's runs at equal fractions "
        "of their planned steps, before the warm-down (recorded as a discard, with the evidence); one judged run in "
        "ten trains on as an audit of the rule.",
    ),
    RunOption(
        ["--bundle"],
        section=GATE,
        type=BundleSize(),
        default=3,
        show_default=True,
        help="Near misses (measured better, not proven) are parked; once this many are, they are tried together "
        "as one idea, judged on its own runs, its record naming them (0: never). Not with --gate strict.",
    ),
    # Safety
    RunOption(
        ["--sandbox"],
        section=SAFETY,
        type=click.Choice(["auto", "on", "off"]),
        default="auto",
        show_default=True,
        help="Run each step in a bubblewrap sandbox: only its run directory and worktree "
        "writable, no network. auto: where bubblewrap works (Linux); without it the gpu profile stops "
        "before experiment 1, others run unconfined with a note (`autoloop doctor` names the fix).",
    ),
    RunOption(
        ["--sandbox-net"], section=SAFETY, is_flag=True, default=False, help="Let sandboxed runs reach the network."
    ),
    RunOption(
        ["--pass-env"],
        section=SAFETY,
        multiple=True,
        metavar="NAME",
        help="Also give runs and agents this variable of ours (repeatable); they get only an allow-list "
        "otherwise (no API keys, tokens or credentials).",
    ),
    # Execution (then the executors' own options)
    RunOption(
        ["--executor"],
        section=EXECUTION,
        type=click.Choice(plugins.available("executor")),
        default="local",
        show_default=True,
        help="Where runs execute: local slots, Ray tasks (needs the ray extra), inline (debugging), or a plugin.",
    ),
    RunOption(
        ["--workers"],
        section=EXECUTION,
        type=click.IntRange(min=1),
        help="Experiments at once (more than 1: generations, see README).  [default: one per GPU, else 1]",
    ),
    RunOption(
        ["--pipeline/--no-pipeline"],
        section=EXECUTION,
        default=None,
        help="Prepare the next idea while an experiment trains.  [default: on for agent and llm]",
    ),
    # Proposer (then the proposers' own options)
    RunOption(
        ["--proposer"],
        section=PROPOSER,
        default="search",
        show_default=True,
        help="Where ideas come from (see `autoloop proposers`).",
    ),
    # Tracking
    RunOption(
        ["--tracker"],
        section=TRACKING,
        multiple=True,
        type=PluginChoice(plugins.available("tracker")),
        help="Mirror the session to an experiment tracker (repeatable; each installed by the extra of its "
        "name; or module:Class): the session is a parent run, each experiment a child run. "
        "MLFLOW_TRACKING_URI (unset: .autoloop/mlflow.db), WANDB_MODE=offline work; one that fails warns "
        "once and is switched off. The env twin takes names separated by spaces.",
    ),
    # Output
    RunOption(
        ["--max-log-mb"],
        section=OUTPUT,
        type=FiniteRange(min=1),
        default=64.0,
        show_default=True,
        help="Cap of each run's log in MiB; its first and last halves are kept.",
    ),
] + plugin_options()


# ---------------------------------------------------------------------------------------------------------------
# Commands

repo_option = click.option(
    "--repo",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    envvar=env_name("repo"),
    show_envvar=True,
    help=REPO_HELP,
)


def fields_from(cls: type, values: dict) -> dict:
    """Pop the options that set fields of dataclass `cls`: each field's namesake, or the option OPTION_OF names."""
    names = {f.name: OPTION_OF.get(f.name, f.name) for f in dataclasses.fields(cls)}
    return {field: values.pop(option) for field, option in names.items() if option in values}


def executor_options(ctx: click.Context, executor: str, given: dict) -> dict:
    """The executor's own options that are set; one of another executor given on the command line is a usage
    error (an env twin left set is not)."""
    own = (
        {o.name for o in getattr(plugins.load("executor", executor, Executor), "options", ())}
        if executor in plugins.available("executor")
        else set()
    )
    for name, value in given.items():
        given_here = ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE
        if value is not None and name not in own and given_here:
            owners = [
                n
                for n in plugins.available("executor")
                if name in {o.name for o in getattr(plugins.load("executor", n, Executor), "options", ())}
            ]
            raise click.UsageError(
                f"--{name.replace('_', '-')} is an option of the {' / '.join(owners)} executor, "
                f"not of the {executor} executor"
            )
    return {k: v for k, v in given.items() if v is not None and k in own}


def settings_from(ctx: click.Context, values: dict):
    """The run's Settings from its options (the command line, env and [tool.autoloop] already resolved by click)."""
    from .core.noise import Gate
    from .core.settings import Settings

    plugin_values = {kind: {o.name: values.pop(o.name) for o in plugins.options(kind)} for kind in PLUGIN_KINDS}
    executor_given = executor_options(ctx, values["executor"], plugin_values["executor"])
    values["tag_given"] = values["tag"] is not None  # chosen (flag, env, pyproject): a changed session is refused
    values["tag"] = values["tag"] or default_tag()
    gate = Gate(**fields_from(Gate, values))
    settings = Settings(
        **fields_from(Settings, values),
        gate=gate,
        executor_options=executor_given,
        options={k: v for k, v in plugin_values["proposer"].items() if v is not None},
    )
    assert not values, f"options without a Settings field: {sorted(values)}"  # name one, or add it to OPTION_OF
    return settings
