"""The protected state: what no run may touch (the ledger, the records, the session pin, the queue, the
repository's refs, the git state git itself would act on, and the startup hooks of the Python that runs the
steps), taken before a generation's runs and checked, and put back, after each."""

from __future__ import annotations

import os
import shutil
import site
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import git

from .. import LoopError
from ..store import gitops
from ..store.session import Paths
from .state import State


@dataclass
class Protected:
    """What no run may touch, as it was before the runs of a generation (Protection.snapshot)."""

    files: dict[Path, bytes | None]
    refs: dict[str, tuple[str, str]]  # name -> (commit, symbolic target)
    hooks: dict[Path, Hook] | None = None  # the Python's startup hooks (startup_hooks()); None: not watched


# ---------------------------------------------------------------------------------------------------------------
# The Python's startup hooks: what `site` runs in every Python started without -S (a `.pth` file's `import` lines,
# sitecustomize, usercustomize). A run that plants one reaches every later process of this Python: the next
# run's steps, the harness's queries, the controller's own subprocesses. Entries are compared by what stat()
# says (ctime included: os.utime cannot set it back), and only the hooks are read (a few small files).
# ---------------------------------------------------------------------------------------------------------------

HOOK_MODULES = ("sitecustomize", "usercustomize")  # as .py, .pyc, an extension module or a package
MAX_HOOK_BYTES = 1 << 20  # a hook larger than this is kept by its stat() alone (restored as absent if planted)


@dataclass(frozen=True)
class Hook:
    """One startup hook as it was: its stat() fingerprint and, for a regular file, its bytes."""

    fingerprint: tuple[int, ...]  # (mode, inode, size, mtime_ns, ctime_ns)
    data: bytes | None


def site_dirs() -> list[Path]:
    """Where this Python (the one that runs the steps: executors.PYTHON is sys.executable) looks for startup
    hooks: its site-packages directories and the user's site directory, whether they exist yet or not."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [Path(d) for d in dict.fromkeys(os.path.abspath(d) for d in dirs if d)]


def is_hook(name: str) -> bool:
    return name.endswith(".pth") or name.split(".")[0] in HOOK_MODULES


def startup_hooks(dirs: list[Path] | None = None) -> dict[Path, Hook]:
    """Every startup hook in `dirs` (default: site_dirs()) as it is now; a directory that is missing has none."""
    hooks = {}
    for d in site_dirs() if dirs is None else dirs:
        try:
            entries = [e for e in os.scandir(d) if is_hook(e.name)]
        except OSError:  # missing, or not a directory
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            regular = stat.S_ISREG(st.st_mode) and st.st_size <= MAX_HOOK_BYTES
            hooks[Path(entry.path)] = Hook(_fingerprint(st), _read(Path(entry.path)) if regular else None)
    return hooks


def restore_hooks(before: dict[Path, Hook], dirs: list[Path] | None = None) -> list[str]:
    """The startup hooks that differ from `before` (startup_hooks(dirs)), each put back: a planted one removed,
    a changed or removed file written again as it was (one that was no small file is only named)."""
    now = startup_hooks(dirs)
    changed = []
    for path in sorted({*before, *now}):
        old, new = before.get(path), now.get(path)
        if old and new and old.fingerprint == new.fingerprint:
            continue
        if old is not None and old.data is None:  # e.g. a sitecustomize package of the user's: not ours to remove
            changed.append(f"{path} (not put back: restore it by hand)")
            continue
        changed.append(str(path))
        if new is not None:
            _remove(path)
        if old is not None and old.data is not None:
            path.write_bytes(old.data)
            os.chmod(path, stat.S_IMODE(old.fingerprint[0]))
    return changed


def _fingerprint(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class Protection:
    """The session's protected state: `snapshot()` before a generation, `touched()` after each of its runs.
    `hook_dirs`: where the Python's startup hooks are looked for (default: site_dirs())."""

    def __init__(
        self,
        repo: git.Repo,
        paths: Paths,
        root: Path,
        tag: str,
        echo: Callable[[str], None],
        hook_dirs: list[Path] | None = None,
    ):
        self.repo, self.paths, self.root, self.tag, self.echo = repo, paths, root, tag, echo
        self.hook_dirs = hook_dirs

    def snapshot(self, state: State, also: tuple[Path, ...] = (), hooks: bool = True) -> Protected:
        """What no run may touch, as it is now: the ledger, the records, the session pin, the queue, and the
        repository's refs, the Python's startup hooks (taken afresh here: `pip install -e .` between sessions
        or generations writes a .pth legitimately, a run never does); the git state git itself would act on
        (config, attributes, alternates, hooks, the worktrees' links and HEADs) is the guard's, taken afresh
        here. Whatever the guard put back while no run was going (e.g. after one that changed it was already
        judged) is said, not blamed on the next run. `hooks=False` where the runs are sandboxed: the Python's
        directories are read-only to them, so a hook that changes meanwhile is the user's (a `pip install` in
        another terminal), neither a run's doing nor to be undone."""
        guard = gitops.guard_of(self.repo)
        if stray := guard.check() + guard.drain():
            self.echo(f"autoloop: note: put back what was changed in git between runs: {', '.join(self._named(stray))}")
        guard.snapshot()
        paths = [
            self.paths.ledger,
            self.paths.session,
            self.paths.queue,
            *(self.paths.run_dir(r.n) / "record.json" for r in state.records),
            *also,  # e.g. `autoloop verify`'s plan, result and records
        ]
        watched = startup_hooks(self.hook_dirs) if hooks else None
        return Protected({path: _read(path) for path in paths}, gitops.refs(self.repo), watched)

    def touched(self, before: Protected) -> list[str]:
        """What a run changed of `before` (snapshot()) and of what the guard keeps, each put back as it was: a
        file rewritten, a hook or ref planted, a ref moved (but the controller's own: the run's tried ref, the
        session branch), a startup hook planted or changed in the Python's site directories. The queue may be
        created or grow (`autoloop queue add` while a loop runs), never change; other sessions' refs
        (refs/autoloop/<tag>/, autoloop/<tag> branches) are theirs. Confined or not: in the sandbox a run still
        writes its worktree's `.git` file."""
        guard = gitops.guard_of(self.repo)
        guard.check()
        changed = self._named(guard.drain())
        for path, old in before.files.items():
            data = _read(path)
            if data == old or path == self.paths.queue and data is not None and data.startswith(old or b""):
                continue
            changed.append(self._named([path])[0])
            if old is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(old)
        if before.hooks is not None:
            changed += restore_hooks(before.hooks, self.hook_dirs)
        return changed + self._moved_refs(before.refs, guard.written)

    def _moved_refs(self, before: dict[str, tuple[str, str]], written: dict[str, str]) -> list[str]:
        """Refs that differ from before other than by the controller's own update; each put back."""
        now = gitops.refs(self.repo)
        ours = (
            f"refs/autoloop/{self.tag}/",
            f"refs/heads/autoloop/{self.tag}",
            f"refs/heads/autoloop/{self.tag}-minimal",
        )
        moved = []
        for name in sorted({*before, *now}):
            expected = (written[name], "") if name in written else before.get(name)
            others = (
                name.startswith(("refs/autoloop/", "refs/heads/autoloop/"))
                and not (name.startswith(ours[0]) or name in ours[1:])
                or name in self._users_refs()
            )
            if now.get(name) != expected and not others:
                try:
                    gitops.restore_ref(self.repo, name, expected)
                except git.GitCommandError as e:  # e.g. a lock file planted next to it
                    raise LoopError(
                        f"a run changed the ref {name} and it could not be put back "
                        f"({' '.join(str(e.stderr).split())[:200]}); restore it (git update-ref), "
                        "then run the same command to resume"
                    ) from None
                moved.append(name)
        return moved

    def _users_refs(self) -> set[str]:
        """The refs you move yourself while a loop runs (committing or stashing in your checkout): the branch
        checked out in your worktree and the stash. A run is never blamed for them, nor are they set back; the
        sandbox keeps runs out of .git altogether."""
        try:
            head = self.repo.git.symbolic_ref("-q", "HEAD").strip()
        except git.GitCommandError:  # a detached HEAD
            head = ""
        return {name for name in (head, "refs/stash") if name}

    def _named(self, paths: list[Path]) -> list[str]:
        """Paths as the user knows them: relative to the repository where inside it."""
        root = self.root.resolve()
        resolved = dict.fromkeys(p.resolve() for p in paths)
        return [str(p.relative_to(root)) if p.is_relative_to(root) else str(p) for p in resolved]


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
