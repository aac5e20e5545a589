"""Git helpers (gitpython): the loop's branch lives in its own worktree; every tried commit stays reachable.

Runs are untrusted code with write access to their worktree (and, unconfined, to the whole repository), and the
controller runs git with its own rights, environment and network. So the controller never lets a file a run could
have written steer its git: each git command names its git directory and work tree (GIT_DIR, GIT_WORK_TREE and
GIT_COMMON_DIR, from what the controller registered, never from a worktree's `.git` file), hooks, the user's and
system attribute files and the system config are off, and before each command the Guard puts back what git would
read of a run's making (the repository's config, attributes, alternates, hooks, each worktree's links and HEAD).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import git

from .. import LoopError

PROTECTED = ("train.py", "prepare.py", "evaluate.py")
GIT_TIMEOUT_S = 120.0  # any git command of the loop that takes longer is stuck (a lock, a filesystem gone)
IDENTITY = ("-c", "user.name=autoloop", "-c", "user.email=autoloop@localhost")
# The user's git config must not break or hang the loop at 2 a.m.: no signing (a signer may prompt), no hooks
# (an LFS or lint hook may fail or be slow), no fsmonitor daemon, and never a terminal prompt.
# No attributes file but the repository's own (.gitattributes, info/attributes): a filter or diff driver is chosen
# by attributes and runs a command.
ISOLATED = {
    "commit.gpgsign": "false",
    "tag.gpgsign": "false",
    "core.hooksPath": "/dev/null",
    "core.fsmonitor": "false",
    "core.attributesFile": "/dev/null",
}
ISOLATED_ENV = {
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_ATTR_NOSYSTEM": "1",
    "GIT_CONFIG_COUNT": str(len(ISOLATED)),
    **{f"GIT_CONFIG_KEY_{i}": k for i, k in enumerate(ISOLATED)},
    **{f"GIT_CONFIG_VALUE_{i}": v for i, v in enumerate(ISOLATED.values())},
}


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


git.cmd.threading = _Threading()  # type: ignore[assignment]  # the module gitpython's execute() takes its Timer from


class _Git(git.Git):
    """git with a deadline: a command still running after GIT_TIMEOUT_S is killed (GitCommandError). With a
    guard, the repository's git state is checked (and put back) before each command, and a worktree's HEAD as
    the command leaves it is what the controller expects there next."""

    guard: Guard | None = None
    worktree_path: Path | None = None  # the registered worktree it runs in (None: the main repository); not
    #                                    `worktree`, which is git's command

    def execute(self, command, **kwargs):
        if not kwargs.get("as_process"):
            kwargs.setdefault("kill_after_timeout", GIT_TIMEOUT_S)
        if self.guard is None:
            return super().execute(command, **kwargs)
        with self.guard.command(self.worktree_path):
            return super().execute(command, **kwargs)


class _Repo(git.Repo):
    GitCommandWrapperType = _Git
    git: _Git


R = TypeVar("R", bound=git.Repo)


def tree(repo: git.Repo) -> Path:
    """The repository's working tree (autoloop never works in a bare one)."""
    if not repo.working_tree_dir:
        raise LoopError(f"{repo.git_dir} is a bare repository; autoloop needs a working tree")
    return Path(repo.working_tree_dir)


def isolated(repo: R) -> R:
    """The repo with every git command it runs isolated from the user's signing, hooks and prompts."""
    repo.git.update_environment(**ISOLATED_ENV)
    return repo


def Repo(path) -> git.Repo:  # noqa: N802 - git.Repo, isolated and with a deadline
    """The repository at path; a worktree the controller registered comes with its guard and explicit dirs."""
    for guard in list(_GUARDS.values()):
        if Path(path).resolve() in guard.links:
            return guard.worktree(Path(path))
    return isolated(_Repo(path))


def _read(path: Path) -> bytes | None:
    """A file's bytes (None: missing or not a file); a symlink reads as itself, never as what it points at."""
    try:
        if path.is_symlink():
            return b"symlink -> " + os.fsencode(os.readlink(path))
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def _put(path: Path, data: bytes | None) -> None:
    """Make path hold exactly data (None: nothing), whatever stands there now (a file, a link, a directory)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    if data is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


class Guard:
    """What of a repository's git state could make the controller's git run a run's code or read a run's
    repository, as the controller left it; checked, and put back, before each of its git commands and after
    each run (Workspace.touched). Covers the config (filters, diff drivers, fsmonitor...), attributes,
    alternates and hooks (taken afresh by snapshot() at each generation's start), and each registered
    worktree's links (its `.git` file, the gitdir, commondir and config.worktree of its administrative
    directory) and HEAD (as the controller's last command there left it). Refs are Workspace's (refs())."""

    def __init__(self, common: Path):
        self.common = common
        self.lock = threading.RLock()  # a check never sees a command's half-done work (the proposer's thread)
        self.links: dict[Path, Path] = {}  # worktree -> its administrative directory, <common>/worktrees/<name>
        self.pinned: dict[Path, bytes | None] = {}  # the links' files, as registered
        self.heads: dict[Path, bytes | None] = {}  # worktree -> HEAD as the controller's last command left it
        self.files: dict[Path, bytes | None] = {}
        self.written: dict[str, str] = {}  # refs the controller itself set, to what
        self.repaired: list[Path] = []  # put back by a check and not yet reported (drain())
        self.snapshot()

    def _watched(self) -> list[Path]:
        hooks = self.common / "hooks"
        return [
            self.common / name
            for name in (
                "config",
                "config.worktree",
                "info/attributes",
                "objects/info/alternates",
                "objects/info/http-alternates",
            )
        ] + (sorted(hooks.iterdir()) if hooks.is_dir() else [])

    def snapshot(self) -> None:
        """Take the repository's git state as it is now as the one to keep (the user's changes between
        generations stand)."""
        with self.lock:
            self.files = {path: _read(path) for path in self._watched()}

    def check(self) -> list[Path]:
        """Put back what changed since the controller last looked; returns (and keeps for drain()) what."""
        with self.lock:
            changed = [path for path in {*self.files, *self._watched()} if _read(path) != self.files.get(path)]
            for admin in self.links.values():
                if admin.is_symlink() or not admin.is_dir():  # a directory of the run's own in its place
                    _put(admin, None)
            heads = {self.links[wt] / "HEAD": data for wt, data in self.heads.items()}
            expected = {**self.files, **self.pinned, **heads}
            changed += [path for path, data in {**self.pinned, **heads}.items() if _read(path) != data]
            for path in changed:
                try:
                    _put(path, expected.get(path))
                except OSError as e:
                    raise LoopError(
                        f"{path} was changed (by a run?) and cannot be put back ({e}); restore it, "
                        "then run the same command to resume"
                    ) from None
            self.repaired += changed
            return changed

    def drain(self) -> list[Path]:
        with self.lock:
            out, self.repaired = self.repaired, []
            return out

    @contextlib.contextmanager
    def command(self, worktree: Path | None) -> Iterator[None]:
        """Around one controller git command in worktree (None: the main repository): the check before it, and
        the worktree's HEAD as it leaves it is the one expected there from now on."""
        with self.lock:
            self.check()
            try:
                yield
            finally:
                if worktree is not None and worktree in self.links:
                    self.heads[worktree] = _read(self.links[worktree] / "HEAD")

    def admin_of(self, path: Path) -> Path | None:
        """The administrative directory git registered for the worktree at path: known, or found by the one
        file that names it (its gitdir, which every check puts back), never by the worktree's own `.git`."""
        path = path.resolve()
        if path in self.links:
            return self.links[path]
        root = self.common / "worktrees"
        for admin in sorted(root.iterdir(), key=lambda a: a.name != path.name) if root.is_dir() else ():
            target = (_read(admin / "gitdir") or b"").decode(errors="replace").strip()
            if not admin.is_symlink() and target and os.path.normpath(admin / target) == str(path / ".git"):
                return admin
        return None

    def register(self, path: Path, admin: Path) -> None:
        """Pin the links of the worktree at path (its `.git` file made to name admin, as git writes it); once:
        what they are later is checked against that."""
        path = path.resolve()
        with self.lock:
            if self.links.get(path) == admin:
                return
            dotgit = path / ".git"
            if (_read(dotgit) or b"").decode(errors="replace").strip() != f"gitdir: {admin}":
                _put(dotgit, f"gitdir: {admin}\n".encode())
            self.links[path] = admin
            for file in (dotgit, admin / "gitdir", admin / "commondir", admin / "config.worktree"):
                self.pinned[file] = _read(file)
            self.heads[path] = _read(admin / "HEAD")

    def worktree(self, path: Path) -> git.Repo:
        """gitpython's Repo of the registered worktree at path: every git command it runs names the git
        directory, the common directory and the work tree; its Python-side reads use the registered ones."""
        path = path.resolve()
        admin = self.links[path]
        for _ in range(3):  # a run of another slot may rewrite the `.git` file between the check and the read
            with self.lock:
                self.check()  # gitpython reads the `.git` file once, here: as registered
                wt = _Repo(path)
            if Path(wt.git_dir).resolve() == admin.resolve() and Path(wt.working_tree_dir or "").resolve() == path:
                break
        else:
            raise LoopError(f"the worktree at {path} does not lead to its git directory {admin}")
        wt.git.update_environment(GIT_DIR=str(admin), GIT_WORK_TREE=str(path), GIT_COMMON_DIR=str(self.common))
        wt.git.guard, wt.git.worktree_path = self, path
        return isolated(wt)

    def expect_ref(self, name: str, commit: str) -> None:
        """The controller set ref name to commit (Workspace.touched lets that change stand)."""
        with self.lock:
            self.written[name] = commit


_GUARDS: dict[Path, Guard] = {}  # common git directory -> its guard (one per repository the controller opened)


def guard_of(repo: git.Repo) -> Guard:
    """The guard of repo's repository (made by open_repo)."""
    common = Path(repo.common_dir).resolve()
    if common not in _GUARDS:
        _GUARDS[common] = Guard(common)
    return _GUARDS[common]


def blob_sha(repo: git.Repo, commit: str, path: str) -> str:
    """The blob id of path at commit ('' when it is not there)."""
    try:
        return (repo.commit(commit).tree / path).hexsha
    except (KeyError, ValueError, git.BadName):
        return ""


def open_repo(path: Path) -> git.Repo:
    """The user's repository, its git directory found now (before any run) and named by each command after;
    with a fresh guard."""
    try:
        repo = isolated(_Repo(path, search_parent_directories=False))
    except git.NoSuchPathError:
        raise LoopError(
            f"{path} does not exist; pass --repo PATH of a workspace, or make one: autoloop init DIR"
        ) from None
    except git.InvalidGitRepositoryError:
        empty = path.is_dir() and not any(path.iterdir())
        raise LoopError(
            f"{path} is not a git repository; "
            + (
                "make it a workspace with `autoloop init` (train.py, prepare.py, program.md, committed)"
                if empty
                else "run `git init && git add -A && git commit -m init` there"
            )
            + ", or pass --repo PATH"
        ) from None
    if not repo.head.is_valid():
        raise LoopError(
            f"{path} has no commits yet; commit train.py and prepare.py first (git add -A && git commit -m init)"
        )
    if repo.working_tree_dir:
        repo.git.update_environment(GIT_DIR=str(Path(repo.git_dir).resolve()), GIT_WORK_TREE=str(tree(repo).resolve()))
    guard = _GUARDS[Path(repo.common_dir).resolve()] = Guard(Path(repo.common_dir).resolve())
    repo.git.guard = guard
    return repo


def require_clean(repo: git.Repo, files=PROTECTED) -> None:
    """Refuse to start when train.py / prepare.py / evaluate.py differ from HEAD: the loop starts from a commit."""
    dirty = [f for f in files if repo.git.status("--porcelain", "--", f).strip()]
    if dirty:
        names = " and ".join(dirty)
        raise LoopError(
            f"uncommitted changes to {names}; the loop starts from your last commit. "
            f"Commit them (git commit -am 'baseline') or discard them (git checkout -- {' '.join(dirty)})"
        )
    if not (tree(repo) / "train.py").exists():
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


def _registered(repo: git.Repo, path: Path) -> git.Repo | None:
    """The worktree at path if git has it registered for this repository (its links pinned from now on)."""
    guard = guard_of(repo)
    admin = guard.admin_of(path)
    if admin is None:
        return None
    guard.register(path, admin)
    return guard.worktree(path)


def _created(repo: git.Repo, path: Path) -> git.Repo:
    """The worktree git just added at path."""
    if (wt := _registered(repo, path)) is None:
        raise LoopError(f"git added a worktree at {path} but does not list it (git worktree list)")
    return wt


def ensure_worktree(repo: git.Repo, tag: str, path: Path) -> git.Repo:
    """The worktree of branch autoloop/<tag> at path: reused, re-attached or created from HEAD."""
    branch = f"autoloop/{tag}"
    repo.git.worktree("prune")
    if (wt := _registered(repo, path)) is not None:
        if wt.head.is_detached or wt.active_branch.name != branch:
            on = "a detached HEAD" if wt.head.is_detached else wt.active_branch.name
            raise LoopError(
                f"{path} is checked out on {on}, not {branch}; remove it (git worktree remove --force {path}) and retry"
            )
        return wt
    if path.exists() and any(path.iterdir()):
        raise LoopError(
            f"{path} is not a worktree of {repo.working_tree_dir} (git worktree list); remove it "
            f"(rm -rf {path}) and retry"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if branch in [h.name for h in repo.heads]:
            repo.git.worktree("add", str(path), branch)
        else:
            repo.git.worktree("add", "-b", branch, str(path), "HEAD")
    except git.GitCommandError as e:
        raise LoopError(f"could not create the worktree for {branch} at {path}: {e.stderr.strip()}") from None
    return _created(repo, path)


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
    _expect_head(wt)
    return wt.head.commit.hexsha


def commit_paths(repo: git.Repo, message: str, paths: list[str]) -> None:
    """Commit only `paths` (whatever else is staged or changed stays as it was)."""
    _git(repo, "commit", "-q", "--no-verify", "-m", message, "--", *paths)


def keep_only(wt: git.Repo, name: str) -> None:
    """Drop every change in the worktree but those to `name`."""
    path = tree(wt) / name
    content = path.read_bytes() if path.is_file() else None
    reset_to(wt, "HEAD")
    if content is not None:
        path.write_bytes(content)


def reset_to(wt: git.Repo, commit: str) -> None:
    """Point the branch at commit and make the worktree exactly that commit (untracked files removed)."""
    wt.git.reset("--hard", "-q", commit)
    _expect_head(wt)
    wt.git.clean("-ffdq")  # -ff: a nested repository a run made is removed too


def _expect_head(wt: git.Repo) -> None:
    """The branch checked out in wt (if any) is where the controller just put it."""
    guard = getattr(wt.git, "guard", None)
    if guard is not None and not wt.head.is_detached:
        guard.expect_ref(wt.head.ref.path, wt.head.commit.hexsha)


def mark_tried(repo: git.Repo, tag: str, n: int, commit: str) -> None:
    ref = f"refs/autoloop/{tag}/tried/{n}"
    repo.git.update_ref(ref, commit)
    guard_of(repo).expect_ref(ref, commit)


def refs(repo: git.Repo) -> dict[str, tuple[str, str]]:
    """Every ref of the repository (loose and packed): name -> (commit, the ref it points at if symbolic)."""
    out = repo.git.for_each_ref("--format=%(refname)%00%(objectname)%00%(symref)")
    return {
        name: (commit, symref)
        for name, commit, symref in (line.split("\0") for line in out.splitlines() if line.count("\0") == 2)
    }


def restore_ref(repo: git.Repo, name: str, value: tuple[str, str] | None) -> None:
    """Put ref name back as it was (None: it was not there)."""
    if value is None:
        repo.git.update_ref("--no-deref", "-d", name)
    elif value[1]:
        repo.git.symbolic_ref(name, value[1])
    else:
        repo.git.update_ref("--no-deref", name, value[0])


def ensure_detached_worktree(repo: git.Repo, path: Path, commit: str) -> git.Repo:
    """A detached worktree at path (for proposers to edit in while another experiment trains); what stands at
    path and is no worktree git registered for this repository is replaced (these worktrees are disposable)."""
    if (wt := _registered(repo, path)) is not None:
        return wt
    repo.git.worktree("prune")
    _put(path, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    repo.git.worktree("add", "--detach", str(path), commit)
    return _created(repo, path)


def checkout_clean(wt: git.Repo, commit: str) -> None:
    """Detached HEAD at commit with a pristine tree, ignored files gone too (a proposal starts from exactly the
    base commit; what earlier runs left, e.g. checkpoints under an ignored name, does not pile up)."""
    wt.git.checkout("-q", "--detach", "--force", commit)
    wt.git.clean("-ffdxq")  # -ff: nested repositories too (git leaves them with one -f)


def diff_all(wt: git.Repo, base: str, context: int = 3) -> str:
    """Everything changed in the worktree relative to base, untracked files included, as a binary patch."""
    wt.git.add("-A")
    try:
        return wt.git.diff(
            "--cached", "--binary", f"-U{context}", base, stdout_as_string=True, strip_newline_in_stdout=False
        )
    finally:
        wt.git.reset("-q")


def diff(wt: git.Repo, a: str, b: str, context: int = 3) -> str:
    """A binary patch from commit a to commit b that `git apply` takes back (trailing newline kept)."""
    return wt.git.diff("--binary", f"-U{context}", a, b, stdout_as_string=True, strip_newline_in_stdout=False)


def _apply(wt: git.Repo, patch: str, *options: str) -> str:
    """`git apply` of patch in wt, with wt's git environment (its explicit dirs) and guard; '' on success, else
    git's complaint in one line (the worktree reset to HEAD: a failed --3way leaves conflicts in the index)."""
    args = ["git", "apply", "--binary", "--whitespace=nowarn", *options, "-"]
    guard = getattr(wt.git, "guard", None)
    try:
        with guard.command(wt.git.worktree_path) if guard is not None else contextlib.nullcontext():
            proc = subprocess.run(
                args,
                cwd=wt.working_tree_dir,
                input=patch.encode(),
                capture_output=True,
                env={**os.environ, **ISOLATED_ENV, **wt.git.environment()},
                timeout=GIT_TIMEOUT_S,
            )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if proc.returncode != 0:
        reset_to(wt, "HEAD")
        return " ".join(proc.stderr.decode(errors="replace").split())[:200]
    return ""


def apply_patch(wt: git.Repo, patch: str, three_way: bool = False) -> str:
    """Apply a patch to the worktree; '' on success, else git's complaint in one line."""
    if not patch.strip():
        return ""
    error = _apply(wt, patch, *(["--3way"] if three_way else []))
    if not error and three_way:
        wt.git.reset("-q")  # --3way stages the result; the loop commits everything itself
    return error


def carry_over(wt: git.Repo, patch: str, patch_u0: str = "") -> str:
    """Apply a patch made on an older commit: a three-way merge, else its zero-context form (one-line edits of
    neighbouring constants conflict in a merge but not in fact). '' on success, else git's complaint."""
    error = apply_patch(wt, patch, three_way=True)
    if not error or not patch_u0.strip():
        return error
    return _apply(wt, patch_u0, "--unidiff-zero")
