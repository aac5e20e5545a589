"""A run cannot steer the controller's git (P14): each test is an attack an unconfined edit of train.py made on
the controller's git state, run for real through the loop. Old: the controller opened a worktree through its
`.git` file (which the run can rewrite) and checked only the config, the hooks and its own files."""

from __future__ import annotations

from pathlib import Path

import fakes
import git

from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import read_rows
from orchestrator.store.session import Paths

# What every attack starts with: the run's worktree's administrative directory, and the repository's git dir,
# found as the run would (from its own .git file, before it touches anything).
FIND = (
    "from pathlib import Path\nimport os, subprocess\n"
    "admin = Path(Path('.git').read_text().split(':', 1)[1].strip())\ncommon = admin.parent.parent\n"
)


def loop(repo: Path, steps: list[dict], plan: Path, tag: str = "g") -> list:
    """The loop over the baseline and steps (proposed by fakes:Scripted), unconfined; its rows."""
    fakes.write_plan(plan, steps)
    run_loop(
        Settings(
            repo=repo,
            tag=tag,
            budget=1.0,
            timeout=30.0,
            proposer="fakes:Scripted",
            baseline_repeats=0,
            max_experiments=len(steps) + 1,
            max_crashes=len(steps) + 1,
            sandbox="off",
        ),
        echo=lambda line: None,
    )
    return read_rows(Paths(repo, tag).ledger)


def test_a_run_that_points_its_worktree_at_its_own_repository_runs_nothing(fake_repo, tmp_path, monkeypatch):
    """The attack as found: the run built a repository in a shared cache whose config has a smudge filter (and
    borrows our objects through alternates), and pointed its worktree's `.git` file at it; the controller's next
    `git checkout --force` there ran the filter, outside any sandbox, with the controller's environment."""
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(tmp_path / "plan.json"))
    repo = fake_repo(fakes.ok(1.0))
    marker, evil = tmp_path / "pwned", tmp_path / "cache" / "evil"
    attack = FIND + (
        f"evil = Path({str(evil)!r})\n"
        "subprocess.run(['git', 'init', '-q', str(evil)], check=True)\n"
        "(evil / '.git/objects/info/alternates').write_text(str(common / 'objects') + '\\n')\n"
        "with open(evil / '.git/config', 'a') as f:\n"
        f"    f.write('[filter \"x\"]\\n\\tsmudge = touch {marker}; cat\\n\\trequired = true\\n')\n"
        "(evil / '.git/info').mkdir(exist_ok=True)\n"
        "(evil / '.git/info/attributes').write_text('* filter=x\\n')\n"
        "Path('.git').write_text(f'gitdir: {evil}/.git\\n')\n"
    )
    rows = loop(
        repo,
        [
            {"description": "redirects git", "train": attack + fakes.ok(0.5)},
            {"description": "honest", "train": fakes.ok(0.9)},
        ],
        tmp_path / "plan.json",
    )
    assert not marker.exists()  # the filter never ran
    slot = Paths(repo, "g").slot(0)
    assert (slot / ".git").read_text().strip() == f"gitdir: {(repo / '.git' / 'worktrees' / '0').resolve()}"
    assert [(r.description.split(" [")[0], r.status) for r in rows] == [
        ("baseline", "keep"),
        ("redirects git", "crash"),
        ("honest", "keep"),
    ]
    assert "the run touched what it may not (restored)" in rows[1].description
    assert ".autoloop/g/slots/0/.git" in rows[1].description
    assert git.Repo(slot).head.commit.hexsha.startswith(rows[2].commit)  # the honest run ran in our repository


def test_each_piece_of_git_state_a_run_plants_is_put_back_and_its_run_is_a_crash(fake_repo, tmp_path, monkeypatch):
    """Old: refs, attributes, alternates, config.worktree and the worktrees' links were not checked at all (and
    nothing was, in the sandbox). Each is a crash naming it now, and is as it was after the run."""
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(tmp_path / "plan.json"))
    repo = fake_repo(fakes.ok(1.0))
    common = repo / ".git"
    marker = tmp_path / "pwned"
    git.Repo(repo).create_head("side")  # a branch of yours that is not checked out (that one you may move)
    config, main = (common / "config").read_bytes(), git.Repo(repo).heads.side.commit.hexsha
    payload = f"touch {marker}; cat"
    attacks = [
        (
            "plants a hook",
            ".git/hooks/post-checkout",
            "(common / 'hooks').mkdir(exist_ok=True)\n"
            f"(common / 'hooks/post-checkout').write_text('#!/bin/sh\\n{payload}\\n')\n"
            "(common / 'hooks/post-checkout').chmod(0o755)\n",
        ),
        (
            "plants a ref",
            "refs/heads/planted",
            "subprocess.run(['git', 'update-ref', 'refs/heads/planted', 'HEAD'], check=True)\n",
        ),
        (
            "moves a ref",
            "refs/heads/side",
            "subprocess.run(['git', 'update-ref', 'refs/heads/side', 'HEAD'], check=True)\n",
        ),
        (
            "adds attributes",
            ".git/info/attributes",
            "(common / 'info').mkdir(exist_ok=True)\n(common / 'info/attributes').write_text('* filter=x diff=x\\n')\n",
        ),
        (
            "adds alternates",
            ".git/objects/info/alternates",
            f"(common / 'objects/info/alternates').write_text({str(tmp_path / 'elsewhere')!r} + '\\n')\n",
        ),
        (
            "adds a filter to the config",
            ".git/config",
            f"open(common / 'config', 'a').write('[filter \"x\"]\\n\\tsmudge = {payload}\\n\\tclean = {payload}\\n"
            f"[diff \"x\"]\\n\\ttextconv = {payload}\\n[core]\\n\\tattributesFile = ' + str(common / 'attrs') + '\\n')\n"
            "(common / 'attrs').write_text('* filter=x diff=x\\n')\n"
            "Path('.gitattributes').write_text('* filter=x diff=x\\n')\n",
        ),
        (
            "adds a config.worktree",
            ".git/worktrees/0/config.worktree",
            f"(admin / 'config.worktree').write_text('[filter \"x\"]\\n\\tsmudge = {payload}\\n')\n",
        ),
        (
            "moves its gitdir",
            ".git/worktrees/0/gitdir",
            f"(admin / 'gitdir').write_text({str(tmp_path / 'elsewhere' / '.git')!r} + '\\n')\n",
        ),
        ("moves its HEAD", ".git/worktrees/0/HEAD", "(admin / 'HEAD').write_text('ref: refs/heads/main\\n')\n"),
    ]
    steps = [{"description": name, "train": FIND + code + fakes.ok(0.5)} for name, _, code in attacks]
    rows = loop(repo, [*steps, {"description": "honest", "train": fakes.ok(0.9)}], tmp_path / "plan.json")
    assert [r.status for r in rows] == ["keep"] + ["crash"] * len(attacks) + ["keep"], rows
    for row, (name, what, _) in zip(rows[1:], attacks):
        assert row.description.startswith(f"{name} [crash: the run touched what it may not (restored): ")
        assert what in row.description, (what, row.description)
    assert not marker.exists()
    assert (common / "config").read_bytes() == config
    assert git.Repo(repo).heads.side.commit.hexsha == main
    assert "planted" not in [h.name for h in git.Repo(repo).heads]
    assert not (common / "hooks" / "post-checkout").exists()
    for gone in ("info/attributes", "objects/info/alternates", "worktrees/0/config.worktree"):
        assert not (common / gone).exists(), gone
    slot = Paths(repo, "g").slot(0)
    assert (common / "worktrees" / "0" / "gitdir").read_text().strip() == str(slot.resolve() / ".git")
    assert (common / "worktrees" / "0" / "HEAD").read_text().strip() == git.Repo(slot).head.commit.hexsha


def test_the_controllers_own_refs_and_other_sessions_are_no_attack(fake_repo, tmp_path, monkeypatch):
    """The tried refs and the session branch the controller moves itself, and what another session on the same
    repository does meanwhile (its refs, its worktrees), are never taken for a run's doing."""
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(tmp_path / "plan.json"))
    repo = fake_repo(fakes.ok(1.0))
    other = (
        "import subprocess\nsubprocess.run(['git', 'update-ref', 'refs/autoloop/other/tried/1', 'HEAD'], "
        "check=True)\nsubprocess.run(['git', 'branch', '-f', 'autoloop/other', 'HEAD'], check=True)\n"
    )
    rows = loop(
        repo,
        [
            {"description": "better", "train": fakes.ok(0.8)},
            {"description": "like another session", "train": other + fakes.ok(0.7)},
            {"description": "worse", "train": fakes.ok(0.9)},
        ],
        tmp_path / "plan.json",
    )
    assert [r.status for r in rows] == ["keep", "keep", "keep", "discard"], rows
    refs = {r.path for r in git.Repo(repo).refs}
    assert {f"refs/autoloop/g/tried/{n}" for n in range(1, 5)} <= refs and "refs/autoloop/other/tried/1" in refs
    assert git.Repo(repo).heads["autoloop/g"].commit.hexsha.startswith(rows[2].commit)


def test_a_filter_planted_while_the_controller_works_in_another_worktree_never_runs(fake_repo, tmp_path):
    """A run still training (another slot's, or while the pipelined proposer works in its worktree) plants a
    filter: the controller's git commands meanwhile put the config back before they run, and say so."""
    from orchestrator.store import gitops

    repo = gitops.open_repo(fake_repo(fakes.ok(1.0)))
    head = repo.head.commit.hexsha
    other = gitops.ensure_detached_worktree(repo, tmp_path / "other", head)
    common, marker = Path(repo.common_dir), tmp_path / "pwned"
    config = (common / "config").read_bytes()
    with open(common / "config", "a") as f:
        f.write(f'[filter "x"]\n\tsmudge = touch {marker}; cat\n\tclean = touch {marker}; cat\n')
    (common / "info").mkdir(exist_ok=True)
    (common / "info" / "attributes").write_text("* filter=x\n")
    (tmp_path / "other" / "train.py").write_text("changed\n")  # the checkout below writes it again
    gitops.checkout_clean(other, head)
    gitops.commit_all(other, "a commit")  # git add runs the clean filter
    assert not marker.exists()
    assert (common / "config").read_bytes() == config and not (common / "info" / "attributes").exists()
    assert {p.name for p in gitops.guard_of(repo).drain()} == {"config", "attributes"}  # for Workspace.touched


def test_your_own_commit_in_your_checkout_while_a_run_trains_is_kept(fake_repo, tmp_path, monkeypatch):
    """You keep working while a loop runs: a commit on the branch checked out in your worktree is yours, never set
    back nor blamed on the run (the run here stands in for you; the sandbox keeps real runs out of .git)."""
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(tmp_path / "plan.json"))
    repo = fake_repo(fakes.ok(1.0))
    you = (
        f"import subprocess\nsubprocess.run(['git', '-C', {str(repo)!r}, '-c', 'user.name=you', '-c', "
        "'user.email=you@example.com', 'commit', '-q', '--allow-empty', '-m', 'my own work'], check=True, "
        "env={'PATH': __import__('os').environ['PATH']})\n"
    )
    rows = loop(repo, [{"description": "meanwhile you commit", "train": you + fakes.ok(0.9)}], tmp_path / "plan.json")
    assert [r.status for r in rows] == ["keep", "keep"], rows
    assert git.Repo(repo).head.commit.message.strip() == "my own work"


def test_a_nested_repository_in_an_ignored_folder_does_not_carry_to_the_next_run(fake_repo, tmp_path, monkeypatch):
    """git clean with one -f leaves an untracked nested repository alone, and `git status` does not list an
    ignored one: a run could leave its weights in `build/.git`-holding folders for the next run in its slot
    (training past the budget). The slot is cleaned with -ff."""
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(tmp_path / "plan.json"))
    repo = fake_repo(fakes.ok(1.0), {".gitignore": "build/\n__pycache__/\n"})
    leave = (
        "import subprocess\nfrom pathlib import Path\nfor d in ('build', '__pycache__/stash'):\n"
        "    subprocess.run(['git', 'init', '-q', d], check=True)\n    Path(d, 'weights.bin').write_text('w')\n"
    )
    find = (
        "from pathlib import Path\nfound = [str(p) for p in Path('.').rglob('weights.bin')]\n"
        "if found:\n    raise SystemExit(f'carried over: {found}')\n"
    )
    rows = loop(
        repo,
        [
            {"description": "leaves weights in nested repositories", "train": leave + fakes.ok(0.9)},
            {"description": "finds them", "train": find + fakes.ok(0.8)},
        ],
        tmp_path / "plan.json",
    )
    assert [r.status for r in rows] == ["keep", "keep", "keep"], rows
