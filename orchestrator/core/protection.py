"""The protected state: what no run may touch (the ledger, the records, the session pin, the queue, the
repository's refs and the git state git itself would act on), taken before a generation's runs and checked,
and put back, after each."""

from __future__ import annotations

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


class Protection:
    """The session's protected state: `snapshot()` before a generation, `touched()` after each of its runs."""

    def __init__(self, repo: git.Repo, paths: Paths, root: Path, tag: str, echo: Callable[[str], None]):
        self.repo, self.paths, self.root, self.tag, self.echo = repo, paths, root, tag, echo

    def snapshot(self, state: State, also: tuple[Path, ...] = ()) -> Protected:
        """What no run may touch, as it is now: the ledger, the records, the session pin, the queue, and the
        repository's refs; the git state git itself would act on (config, attributes, alternates, hooks, the
        worktrees' links and HEADs) is the guard's, taken afresh here. Whatever the guard put back while no run
        was going (e.g. after one that changed it was already judged) is said, not blamed on the next run."""
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
        return Protected({path: _read(path) for path in paths}, gitops.refs(self.repo))

    def touched(self, before: Protected) -> list[str]:
        """What a run changed of `before` (snapshot()) and of what the guard keeps, each put back as it was: a
        file rewritten, a hook or ref planted, a ref moved (but the controller's own: the run's tried ref, the
        session branch). The queue may be created or grow (`autoloop queue add` while a loop runs), never
        change; other sessions' refs (refs/autoloop/<tag>/, autoloop/<tag> branches) are theirs. Confined or
        not: in the sandbox a run still writes its worktree's `.git` file."""
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
