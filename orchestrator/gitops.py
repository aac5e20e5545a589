"""Git helpers (gitpython): the loop's branch lives in its own worktree; every tried commit stays reachable."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import git

from . import LoopError

PROTECTED = ("train.py", "prepare.py")
GIT_TIMEOUT_S = 120.0  # any git command of the loop that takes longer is stuck (a lock, a filesystem gone)
IDENTITY = ("-c", "user.name=autoloop", "-c", "user.email=autoloop@localhost")
# The user's git config must not break or hang the loop at 2 a.m.: no signing (a signer may prompt), no hooks
# (an LFS or lint hook may fail or be slow), no fsmonitor daemon, and never a terminal prompt.
ISOLATED = {"commit.gpgsign": "false", "tag.gpgsign": "false", "core.hooksPath": "/dev/null",
            "core.fsmonitor": "false"}
ISOLATED_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_COUNT": str(len(ISOLATED)),
                **{f"GIT_CONFIG_KEY_{i}": k for i, k in enumerate(ISOLATED)},
                **{f"GIT_CONFIG_VALUE_{i}": v for i, v in enumerate(ISOLATED.values())}}


class _DaemonTimer(threading.Timer):
    """gitpython's deadline watchdog, as a daemon: when Ctrl-C interrupts a git command, gitpython never cancels
    its timer, and a non-daemon one would hold the exiting controller for the whole deadline."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.daemon = True


class _Threading:
    Timer = _DaemonTimer

    def __getattr__(self, name):
        return getattr(threading, name)


git.cmd.threading = _Threading()  # the module gitpython's execute() takes its Timer from


class _Git(git.Git):
    """git with a deadline: a command still running after GIT_TIMEOUT_S is killed (GitCommandError)."""

    def execute(self, command, **kwargs):
        if not kwargs.get("as_process"):
            kwargs.setdefault("kill_after_timeout", GIT_TIMEOUT_S)
        return super().execute(command, **kwargs)


class _Repo(git.Repo):
    GitCommandWrapperType = _Git


def isolated(repo: git.Repo) -> git.Repo:
    """The repo with every git command it runs isolated from the user's signing, hooks and prompts."""
    repo.git.update_environment(**ISOLATED_ENV)
    return repo


def Repo(path) -> git.Repo:  # noqa: N802 - git.Repo, isolated and with a deadline
    return isolated(_Repo(path))


def blob_sha(repo: git.Repo, commit: str, path: str) -> str:
    """The blob id of path at commit ('' when it is not there)."""
    try:
        return (repo.commit(commit).tree / path).hexsha
    except (KeyError, ValueError, git.BadName):
        return ""


def open_repo(path: Path) -> git.Repo:
    try:
        repo = isolated(_Repo(path, search_parent_directories=False))
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise LoopError(f"{path} is not a git repository; run `git init && git add -A && git commit -m init` "
                        "there, or pass --repo PATH") from None
    if not repo.head.is_valid():
        raise LoopError(f"{path} has no commits yet; commit train.py and prepare.py first "
                        "(git add -A && git commit -m init)")
    return repo


def require_clean(repo: git.Repo, files=PROTECTED) -> None:
    """Refuse to start when train.py / prepare.py differ from HEAD: the loop starts from a commit."""
    dirty = [f for f in files if repo.git.status("--porcelain", "--", f).strip()]
    if dirty:
        names = " and ".join(dirty)
        raise LoopError(f"uncommitted changes to {names}; the loop starts from your last commit. "
                        f"Commit them (git commit -am 'baseline') or discard them (git checkout -- {' '.join(dirty)})")
    if not (Path(repo.working_tree_dir) / "train.py").exists():
        raise LoopError(f"no train.py in {repo.working_tree_dir}; autoloop edits a train.py at the repo root")


def exclude_state(repo: git.Repo) -> None:
    """Keep autoloop's files out of `git status` without touching any tracked file (.git/info/exclude)."""
    exclude = Path(repo.common_dir) / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    text = exclude.read_text() if exclude.exists() else ""
    missing = [p for p in ("/.autoloop/", "/results.tsv") if p not in text.split()]
    if missing:
        exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + "\n".join(missing) + "\n")


def identity_known(repo: git.Repo) -> bool:
    """Whether git itself resolves user.name and user.email here (GIT_CONFIG_GLOBAL and includes too, which
    gitpython's config reader does not follow)."""
    try:
        return all(repo.git.config("--get", key).strip() for key in ("user.name", "user.email"))
    except git.GitCommandError:  # exit 1: unset
        return False


def _git(repo: git.Repo, *args: str) -> str:
    """Run git as the user when they configured an identity, else as autoloop (so commits always work)."""
    return repo.git.execute(["git", *([] if identity_known(repo) else IDENTITY), *args])


def ensure_worktree(repo: git.Repo, tag: str, path: Path) -> git.Repo:
    """The worktree of branch autoloop/<tag> at path: reused, re-attached or created from HEAD."""
    branch = f"autoloop/{tag}"
    repo.git.worktree("prune")
    if (path / ".git").exists():
        wt = Repo(path)
        if wt.active_branch.name != branch:
            raise LoopError(f"{path} is checked out on {wt.active_branch.name}, not {branch}; remove it "
                            f"(git worktree remove --force {path}) and retry")
        return wt
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if branch in [h.name for h in repo.heads]:
            repo.git.worktree("add", str(path), branch)
        else:
            repo.git.worktree("add", "-b", branch, str(path), "HEAD")
    except git.GitCommandError as e:
        raise LoopError(f"could not create the worktree for {branch} at {path}: {e.stderr.strip()}") from None
    return Repo(path)


def changed_files(wt: git.Repo) -> list[str]:
    """Paths that differ from HEAD in the worktree, untracked included."""
    out = wt.git.status("--porcelain", "-uall", "--no-renames")
    return sorted({line[3:].strip().strip('"') for line in out.splitlines() if line.strip()})


def modified_tracked(wt: git.Repo) -> list[str]:
    """Tracked files that differ from HEAD (what a run must never change)."""
    return wt.git.diff("--name-only", "HEAD").split()


def commit_all(wt: git.Repo, message: str) -> str:
    """Commit everything in the worktree (an unchanged tree still gets its own commit); returns the hash."""
    wt.git.add("-A")
    _git(wt, "commit", "-q", "--allow-empty", "--no-verify", "-m", message)
    return wt.head.commit.hexsha


def commit_paths(repo: git.Repo, message: str, paths: list[str]) -> None:
    """Commit only `paths` (whatever else is staged or changed stays as it was)."""
    _git(repo, "commit", "-q", "--no-verify", "-m", message, "--", *paths)


def keep_only(wt: git.Repo, name: str) -> None:
    """Drop every change in the worktree but those to `name`."""
    path = Path(wt.working_tree_dir) / name
    content = path.read_bytes() if path.is_file() else None
    reset_to(wt, "HEAD")
    if content is not None:
        path.write_bytes(content)


def reset_to(wt: git.Repo, commit: str) -> None:
    """Point the branch at commit and make the worktree exactly that commit (untracked files removed)."""
    wt.git.reset("--hard", "-q", commit)
    wt.git.clean("-fdq")


def mark_tried(repo: git.Repo, tag: str, n: int, commit: str) -> None:
    repo.git.update_ref(f"refs/autoloop/{tag}/tried/{n}", commit)


def ensure_detached_worktree(repo: git.Repo, path: Path, commit: str) -> git.Repo:
    """A detached worktree at path (for proposers to edit in while another experiment trains)."""
    if not (path / ".git").exists():
        repo.git.worktree("prune")
        path.parent.mkdir(parents=True, exist_ok=True)
        repo.git.worktree("add", "--detach", str(path), commit)
    return Repo(path)


def checkout_clean(wt: git.Repo, commit: str) -> None:
    """Detached HEAD at commit with a pristine tree, ignored files gone too (a proposal starts from exactly the
    base commit; what earlier runs left, e.g. checkpoints under an ignored name, does not pile up)."""
    wt.git.checkout("-q", "--detach", "--force", commit)
    wt.git.clean("-fdxq")


def diff_all(wt: git.Repo, base: str, context: int = 3) -> str:
    """Everything changed in the worktree relative to base, untracked files included, as a binary patch."""
    wt.git.add("-A")
    try:
        return wt.git.diff("--cached", "--binary", f"-U{context}", base, stdout_as_string=True,
                           strip_newline_in_stdout=False)
    finally:
        wt.git.reset("-q")


def diff(wt: git.Repo, a: str, b: str) -> str:
    """A binary patch from commit a to commit b that `git apply` takes back (trailing newline kept)."""
    return wt.git.diff("--binary", a, b, stdout_as_string=True, strip_newline_in_stdout=False)


def apply_patch(wt: git.Repo, patch: str, three_way: bool = False) -> str:
    """Apply a patch to the worktree; '' on success, else git's complaint in one line."""
    if not patch.strip():
        return ""
    args = ["git", "apply", "--binary", "--whitespace=nowarn"] + (["--3way"] if three_way else []) + ["-"]
    try:
        proc = subprocess.run(args, cwd=wt.working_tree_dir, input=patch.encode(), capture_output=True,
                              env={**os.environ, **ISOLATED_ENV}, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if proc.returncode != 0:
        reset_to(wt, "HEAD")  # a failed --3way leaves conflicts in the index: drop everything
        return " ".join(proc.stderr.decode(errors="replace").split())[:200]
    if three_way:
        wt.git.reset("-q")  # --3way stages the result; the loop commits everything itself
    return ""


def carry_over(wt: git.Repo, patch: str, patch_u0: str = "") -> str:
    """Apply a patch made on an older commit: a three-way merge, else its zero-context form (one-line edits of
    neighbouring constants conflict in a merge but not in fact). '' on success, else git's complaint."""
    error = apply_patch(wt, patch, three_way=True)
    if not error or not patch_u0.strip():
        return error
    args = ["git", "apply", "--binary", "--whitespace=nowarn", "--unidiff-zero", "-"]
    try:
        proc = subprocess.run(args, cwd=wt.working_tree_dir, input=patch_u0.encode(), capture_output=True,
                              env={**os.environ, **ISOLATED_ENV}, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if proc.returncode != 0:
        reset_to(wt, "HEAD")
        return " ".join(proc.stderr.decode(errors="replace").split())[:200]
    return ""
