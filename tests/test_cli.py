"""The command line: option precedence, errors with fixes, status, and an end-to-end run of the real train.py."""

from __future__ import annotations

import re
import subprocess
import sys

import click
import fakes
import git
import pytest
from click.core import ParameterSource
from click.testing import CliRunner
from conftest import CLOCK_SLACK, ROOT, cli, make_repo, subprocess_env

from orchestrator.cli import main, settings_from
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths


def autoloop(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        env=env or subprocess_env(),
        timeout=timeout,
    )


def test_help_lists_every_run_option_with_its_env_twin():
    out = CliRunner().invoke(main, ["run", "--help"]).output
    for opt, env in [
        ("--budget", "AUTOLOOP_BUDGET"),
        ("--max-experiments", "AUTOLOOP_MAX_EXPERIMENTS"),
        ("--max-hours", "AUTOLOOP_MAX_HOURS"),
        ("--proposer", "AUTOLOOP_PROPOSER"),
        ("--tag", "AUTOLOOP_TAG"),
        ("--timeout", "AUTOLOOP_TIMEOUT"),
        ("--repo", "AUTOLOOP_REPO"),
        ("--profile", "AUTOLOOP_PROFILE"),
        ("--dataset", "AUTOLOOP_DATASET"),
        ("--seed", "AUTOLOOP_SEED"),
    ]:
        assert opt in out and env in out


def help_sections(command: str) -> dict[str, str]:
    """`autoloop <command> --help` as section title -> the section's lines."""
    sections, title = {}, None
    for line in CliRunner().invoke(main, [command, "--help"], terminal_width=200).output.splitlines():
        if re.fullmatch(r"[A-Z][\w ]*:", line):
            title = line[:-1]
            sections[title] = ""
        elif title:
            sections[title] += line + "\n"
    return sections


@pytest.mark.parametrize("command", ["run", "doctor"])
def test_help_lists_the_options_in_sections_each_option_in_exactly_one(command):
    sections = help_sections(command)
    assert list(sections) == [
        "Session",
        "Limits",
        "Noise gate",
        "Safety",
        "Execution",
        "Proposer",
        "Tracking",
        "Output",
    ]
    cmd = main.commands[command]
    ctx = click.Context(cmd)
    for param in cmd.get_params(ctx):  # the plugins' options and --help included
        first = param.get_help_record(ctx)[0]  # e.g. "--budget FLOAT RANGE", "-h, --help"
        holding = [t for t, text in sections.items() if re.search(rf"^  {re.escape(first)}(  |$)", text, re.M)]
        assert len(holding) == 1, (first, holding)
    for title, flag in [
        ("Limits", "--max-experiments"),
        ("Noise gate", "--false-keep-rate"),
        ("Safety", "--sandbox-net"),
        ("Execution", "--gpus"),
        ("Proposer", "--agent-cmd"),
        ("Tracking", "--tracker"),
    ]:
        assert re.search(rf"^  {flag} ", sections[title], re.M), (title, flag)
    assert [p.name for p in cmd.params] == [p.name for p in main.commands["run"].params]  # doctor: run's options


def test_every_run_option_has_its_env_twin_named_after_it():
    """--max-experiments: AUTOLOOP_MAX_EXPERIMENTS, shown in --help; and the documented option table (README or
    docs/) names the same."""
    params = {p.name: p for p in main.commands["run"].params}
    for name, param in params.items():
        assert param.envvar == "AUTOLOOP_" + name.upper() and param.show_envvar, (name, param.envvar)
    docs = "".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.exists())
    documented = re.findall(r"^\| `(--[a-z-]+)[^`]*` \| `(AUTOLOOP_\w+)`", docs, re.M)
    assert len(documented) >= 30
    for flag, env in documented:
        assert params[flag[2:].replace("-", "_")].envvar == env, flag


def test_pyproject_is_the_default_map_below_the_command_line_and_env(tmp_path, monkeypatch):
    """[tool.autoloop] reaches Settings as click's default_map: command line > env > pyproject > default. A value
    the command line or env overrides is never checked (the file's bad tag)."""
    (tmp_path / "pyproject.toml").write_text(
        "[tool.autoloop]\nbudget = 7\nseed = 3\nmax-experiments = 4\n"
        'tracker = "mlflow"\nfalse_keep_rate = 0.05\ntag = "a b"\n'
    )
    for param in main.commands["run"].params:
        monkeypatch.delenv(param.envvar, raising=False)
    monkeypatch.setenv("AUTOLOOP_SEED", "5")
    monkeypatch.setenv("AUTOLOOP_MAX_EXPERIMENTS", "6")
    monkeypatch.setenv("AUTOLOOP_TAG", "fromenv")
    ctx = main.commands["run"].make_context("run", ["--max-experiments", "9", "--repo", str(tmp_path)])
    assert {name: ctx.get_parameter_source(name) for name in ("max_experiments", "seed", "budget", "min_delta")} == {
        "max_experiments": ParameterSource.COMMANDLINE,
        "seed": ParameterSource.ENVIRONMENT,
        "budget": ParameterSource.DEFAULT_MAP,
        "min_delta": ParameterSource.DEFAULT,
    }
    settings = settings_from(ctx, dict(ctx.params))
    assert (settings.max_experiments, settings.seed, settings.budget, settings.gate.min_delta) == (9, 5, 7.0, 0.0)
    assert settings.trackers == ("mlflow",) and settings.gate.alpha == 0.05  # a name for a list; another spelling
    assert settings.tag == "fromenv" and settings.tag_given and settings.repo == tmp_path.resolve()


def test_help_does_not_import_torch():
    code = (
        "import sys; from orchestrator.cli import main\ntry:\n main(['--help'])\nexcept SystemExit: pass\n"
        "print('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip().endswith("False")


def test_bad_usage_exits_2_and_user_errors_exit_1(tmp_path):
    bad = autoloop("run", "--budget", "-3", "--repo", str(tmp_path))
    assert bad.returncode == 2 and "--budget" in bad.stderr
    for value in ("nan", "inf"):  # they pass click's range comparisons
        odd = cli("run", "--budget", value, "--repo", str(tmp_path))
        assert odd.returncode == 2 and f"{value!r} is not a finite number" in odd.stderr, odd.stderr
        odd = cli("run", "--false-keep-rate", value, "--repo", str(tmp_path))
        assert odd.returncode == 2 and "--false-keep-rate" in odd.stderr, odd.stderr
    bad_tag = autoloop("run", "--tag", "a b", "--repo", str(tmp_path))
    assert bad_tag.returncode == 2 and "git branch" in bad_tag.stderr
    not_repo = autoloop("run", "--repo", str(tmp_path))
    assert not_repo.returncode == 1 and "not a git repository" in not_repo.stderr and "autoloop init" in not_repo.stderr
    (tmp_path / "train.py").write_text("print(1)\n")  # files of one's own: make it a repository
    not_repo = autoloop("run", "--repo", str(tmp_path))
    assert not_repo.returncode == 1 and "git init && git add -A" in not_repo.stderr
    gone = cli("run", "--repo", str(tmp_path / "nope"))
    assert gone.returncode == 1 and "does not exist" in gone.stderr
    assert "Traceback" not in not_repo.stderr + bad.stderr
    bad_gpus = autoloop("run", "--gpus", "0,x", "--repo", str(tmp_path))
    assert bad_gpus.returncode == 2 and "0,1,2,3" in bad_gpus.stderr
    ray_gpus = autoloop("run", "--executor", "ray", "--gpus", "0", "--repo", str(tmp_path))
    assert ray_gpus.returncode == 2 and "--gpus is an option of the local executor" in ray_gpus.stderr


def test_more_workers_than_gpus_is_a_clear_error(fake_repo):
    repo = fake_repo(fakes.ok(1.0))
    proc = autoloop("run", "--repo", str(repo), "--workers", "3", "--gpus", "0,1")
    assert proc.returncode == 1 and "--workers 3 needs at least 3 GPUs" in proc.stderr
    assert "Traceback" not in proc.stderr and not (repo / "results.tsv").exists()


def test_precedence_cli_over_env_over_pyproject(tmp_path):
    plan = fakes.write_plan(
        tmp_path / "plan.json", [{"description": f"s{i}", "train": fakes.ok(0.9)} for i in range(5)]
    )
    pyproject = '[tool.autoloop]\nmax-experiments = 2\nbudget = 7\ntag = "fromfile"\nproposer = "fakes:Scripted"\n'
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": fakes.ok(1.0), "pyproject.toml": pyproject})
    env = subprocess_env(AUTOLOOP_TEST_PLAN=str(plan), AUTOLOOP_BUDGET="5")
    proc = autoloop("run", "--repo", str(repo), "--tag", "fromcli", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "tag fromcli" in proc.stdout  # command line beats pyproject
    assert "budget 5s" in proc.stdout  # environment beats pyproject
    assert len(read_rows(repo / ".autoloop" / "fromcli" / "results.tsv")) == 2  # pyproject beats the default
    assert "timeout 130s" in proc.stdout  # default: 2 x budget + 120
    both = autoloop("run", "--repo", str(repo), "--tag", "fromcli2", "--budget", "3", "--max-experiments", "1", env=env)
    assert both.returncode == 0 and "budget 3s" in both.stdout, both.stdout + both.stderr  # command line beats env


def test_a_bad_tag_from_pyproject_is_a_clear_error(tmp_path):
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": fakes.ok(1.0), "pyproject.toml": '[tool.autoloop]\ntag = "a b/../c"\n'})
    proc = autoloop("run", "--repo", str(repo))
    assert proc.returncode == 1 and "names a git branch" in proc.stderr and "Traceback" not in proc.stderr
    assert not (repo / ".autoloop").exists()


def test_unknown_pyproject_key_is_a_clear_error(tmp_path):
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": fakes.ok(1.0), "pyproject.toml": "[tool.autoloop]\nbudgett = 3\n"})
    proc = autoloop("run", "--repo", str(repo))
    assert proc.returncode == 1 and "unknown key 'budgett'" in proc.stderr and "budget" in proc.stderr


def test_status_of_a_finished_session(tmp_path):
    plan = fakes.write_plan(tmp_path / "plan.json", [{"description": "better", "train": fakes.ok(0.5)}])
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": fakes.ok(1.0)})
    env = subprocess_env(AUTOLOOP_TEST_PLAN=str(plan))
    assert autoloop("run", "--repo", str(repo), "--tag", "s1", "--proposer", "fakes:Scripted", env=env).returncode == 0
    out = autoloop("status", "--repo", str(repo), env=env).stdout
    assert "session s1: not running" in out and "experiments: 2 (2 keep, 0 crash)" in out
    assert "best val_bpb: 0.500000" in out and "baseline 1.000000" in out
    none = autoloop("status", "--repo", str(tmp_path), env=env)
    assert none.returncode == 1 and "autoloop run" in none.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_end_to_end_with_the_real_train_py(tiny_env, tmp_path):
    """`autoloop run` with the default noise gate in a repo holding the project's prepare.py and train.py (tiny
    profile, CPU): the baseline and its repeats measure σ, then two queued edits train for real."""
    repo = tmp_path / "proj"
    make_repo(
        repo, {name: (ROOT / name).read_text() for name in ("prepare.py", "evaluate.py", "train.py", ".gitignore")}
    )
    env = dict(
        tiny_env, **CLOCK_SLACK, PYTHONPATH=subprocess_env()["PYTHONPATH"]
    )  # no AUTOLOOP_BASELINE_REPEATS: the default
    user = git.Repo(repo)
    before = user.git.status("--porcelain")
    for name, value in (("MATRIX_LR", "0.03"), ("WARMDOWN_RATIO", "0.4")):
        assert (
            autoloop(
                "queue", "add", f"{name} to {value}", "--set", f"{name}={value}", "--repo", str(repo), env=env
            ).returncode
            == 0
        )
    proc = autoloop(
        "run",
        "--repo",
        str(repo),
        "--budget",
        "2",
        "--max-experiments",
        "5",
        "--tag",
        "e2e",
        "--proposer",
        "perturb",
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_rows(repo / "results.tsv")
    # three baseline runs (one more for each repeat a busy machine slowed: run again, not counted), then the ideas
    ideas = next(i for i, r in enumerate(rows) if not r.description.startswith("baseline"))
    assert ideas == 3 + sum("disturbed" in r.description for r in rows[:ideas]), rows
    assert rows[ideas].description.startswith("MATRIX_LR to 0.03")  # then a re-run of it, or the next queued idea
    assert all(r.description.startswith(("MATRIX_LR to 0.03", "WARMDOWN_RATIO to 0.4")) for r in rows[ideas:])
    assert rows[0].status == "keep" and {r.status for r in rows[1:ideas]} == {"discard"}
    assert all(r.status != "crash" and r.val_bpb > 0 for r in rows), rows  # the edits really trained
    assert "noise: typical σ = " in autoloop("status", "--repo", str(repo), env=env).stdout  # measured by the repeats
    assert user.git.status("--porcelain") == before
    branch = user.heads["autoloop/e2e"].commit.hexsha
    for r in rows:
        assert user.is_ancestor(user.commit(r.commit).hexsha, branch) == (r.status == "keep")
    summary = [line for line in proc.stdout.splitlines() if line.startswith("autoloop: stopped")]
    assert len(summary) == 1 and "5 experiments" in summary[0], proc.stdout


def train_span(run_dir) -> tuple[float, float]:
    """When the run's train.py trained (main(): the times it printed to its run.log)."""
    log = (run_dir / "run.log").read_text()
    return tuple(float(re.search(rf"^{key} (\S+)$", log, re.M).group(1)) for key in ("t_start", "t_end"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_workers_with_the_real_train_py(tiny_env, tmp_path):
    """`autoloop run --workers 2` on CPU slots (tiny profile): two real trainings at once, one worktree each."""
    repo = tmp_path / "proj"
    train, call = (ROOT / "train.py").read_text(), "\n        main()\n"  # when it trained, to run.log: see train_span
    assert train.count(call) == 1
    stamp = '        print(f"t_{} {{time.time()}}", flush=True)\n'
    train = train.replace(call, "\n" + stamp.format("start") + call[1:] + stamp.format("end"))
    make_repo(
        repo,
        {
            "train.py": train,
            **{name: (ROOT / name).read_text() for name in ("prepare.py", "evaluate.py", ".gitignore")},
        },
    )
    env = dict(
        tiny_env,
        **CLOCK_SLACK,
        **{k: v for k, v in subprocess_env().items() if k in ("PYTHONPATH", "AUTOLOOP_BASELINE_REPEATS")},
    )
    assert autoloop("queue", "add", "lower LR", "--set", "MATRIX_LR=0.03", "--repo", str(repo), env=env).returncode == 0
    proc = autoloop(
        "run",
        "--repo",
        str(repo),
        "--budget",
        "2",
        "--max-experiments",
        "4",
        "--tag",
        "w2",
        "--workers",
        "2",
        "--proposer",
        "perturb",
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 slot(s): cpu, cpu | generations of 2 runs" in proc.stdout
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows[:2]] == ["keep", "discard"] and len(rows) == 4
    assert all(r.val_bpb > 0 for r in rows if r.status != "crash")
    assert all(r.status != "crash" and r.val_bpb > 0 for r in rows[2:]), rows  # both edits really trained
    paths = Paths(repo, "w2")
    records = [read_record(paths.run_dir(n)) for n in range(1, 5)]
    for a, b in ((0, 1), (2, 3)):  # each generation's two runs trained at the same time, on different slots
        ra, rb = records[a], records[b]
        assert {ra.slot, rb.slot} == {0, 1}
        (start_a, end_a), (start_b, end_b) = (train_span(paths.run_dir(n)) for n in (a + 1, b + 1))
        assert max(start_a, start_b) < min(end_a, end_b), (a + 1, b + 1, start_a, end_a, start_b, end_b)
    assert all((paths.slot(i) / "train.py").exists() for i in (0, 1))
    user = git.Repo(repo)
    branch = user.heads["autoloop/w2"].commit.hexsha
    for r in rows:
        assert user.is_ancestor(user.commit(r.commit).hexsha, branch) == (r.status == "keep")
    assert not user.is_dirty(untracked_files=True)


def test_broken_plugin_is_reported_not_fatal(tmp_path):
    """A third-party proposer registered through a real entry point whose module does not import."""
    dist = tmp_path / "site" / "broken_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[autoloop.proposers]\nbroken = no_such_module_xyz:Proposer\n")
    env = subprocess_env(PYTHONPATH=str(tmp_path / "site"))
    listing = autoloop("proposers", env=env)
    assert listing.returncode == 0
    assert "broken" in listing.stdout and "failed to load" in listing.stdout and "search" in listing.stdout
    repo = tmp_path / "repo"
    make_repo(repo, {"train.py": fakes.ok(1.0)})
    run = autoloop("run", "--repo", str(repo), "--proposer", "broken", env=env)
    assert run.returncode == 1 and "proposer 'broken' failed to load" in run.stderr
    assert "Traceback" not in run.stderr


def test_ray_executor_without_ray_says_how_to_install(fake_repo, tmp_path):
    blocker = tmp_path / "no_ray"
    (blocker / "ray").mkdir(parents=True)
    (blocker / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    env = subprocess_env()
    env["PYTHONPATH"] = f"{blocker}:{env['PYTHONPATH']}"
    proc = autoloop("run", "--repo", str(fake_repo(fakes.ok(1.0))), "--executor", "ray", env=env)
    assert proc.returncode == 1 and 'pip install "autoloop-ml[ray]"' in proc.stderr and "Traceback" not in proc.stderr
