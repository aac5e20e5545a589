"""`autoloop init`: a ready workspace from the package's own files, so that a pip install needs no clone.

A workspace is a git repository with train.py (what the loop edits), prepare.py and evaluate.py (the fixed
harness and its evaluation), program.md (the brief LLM proposers read), a .gitignore for autoloop's state and a
[tool.autoloop] table in pyproject.toml. `--existing` adds whichever of these a repository with a committed
train.py lacks (a clone of upstream autoresearch, say) and touches nothing else: a file that is there is left as
it is, .gitignore only gains missing lines, pyproject.toml only a table it does not have.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

import git

from . import LoopError, __version__
from .store import gitops

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# workspace path -> file in orchestrator/template/ (dot-files are stored without their dot: packaging tools and
# editors treat a ".gitignore" inside a package as their own)
FILES = {
    "train.py": "train.py",
    "prepare.py": "prepare.py",
    "evaluate.py": "evaluate.py",
    "program.md": "program.md",
    ".gitignore": "gitignore",
    "pyproject.toml": "pyproject.toml",
}
IGNORED = (".autoloop/", "/results.tsv", "/progress.png", "/report.md")


def template(name: str) -> str:
    return (resources.files("orchestrator") / "template" / FILES[name]).read_text()


def init_workspace(target: Path, existing: bool = False) -> tuple[list[str], str | None]:
    """Write the workspace and commit what was added. Returns (paths added or changed, the commit or None).
    LoopError (with what to do) for a directory that is not empty, or with --existing one without train.py;
    whatever fails half-way, nothing written is left behind."""
    target = target.expanduser().absolute()
    try:
        return _existing(target) if existing else _new(target)
    except git.GitCommandError as e:
        said = " | ".join(line.strip() for line in (e.stderr or "").splitlines() if line.strip()) or str(e)
        raise LoopError(f"git failed in {target}: {said}") from None
    except OSError as e:
        raise LoopError(f"cannot write the workspace at {target}: {e.strerror or e}") from None


def _new(target: Path) -> tuple[list[str], str | None]:
    if target.exists() and not target.is_dir():
        raise LoopError(f"{target} is a file; give a new or empty directory")
    # a fresh virtualenv or editor settings (dot-entries) may be there already; nothing else may
    present = (
        sorted(p.name for p in target.iterdir() if not p.name.startswith(".") or p.name in FILES)
        if target.is_dir()
        else []
    )
    if present:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        hint = (
            "`autoloop init --existing` adds what is missing next to its train.py"
            if "train.py" in present
            else "give a new or empty directory"
        )
        raise LoopError(f"{target} is not empty ({shown}); {hint}")
    made_dir, made_git = not target.exists(), not (target / ".git").exists()
    try:
        target.mkdir(parents=True, exist_ok=True)
        if made_git:
            _git_init(target)
        for name in FILES:
            (target / name).write_text(template(name))
        return list(FILES), _commit(target, list(FILES), f"autoloop init: a workspace from autoloop-ml {__version__}")
    except BaseException:
        if made_dir:
            shutil.rmtree(target, ignore_errors=True)
        else:
            for name in FILES:
                (target / name).unlink(missing_ok=True)
            if made_git:
                shutil.rmtree(target / ".git", ignore_errors=True)
        raise


def _git_init(target: Path) -> None:
    """git init on branch main, with any git (`--initial-branch` needs 2.28)."""
    git.Repo.init(target)
    git.Repo(target).git.symbolic_ref("HEAD", "refs/heads/main")


def _existing(target: Path) -> tuple[list[str], str | None]:
    try:
        repo = gitops.isolated(git.Repo(target, search_parent_directories=True))
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise LoopError(
            f"{target} is not in a git repository; --existing adds autoloop's files to a repository "
            f"with a train.py. For a new workspace: `autoloop init DIR`"
        ) from None
    root = Path(repo.working_tree_dir)
    if root.resolve() != target.resolve():
        raise LoopError(
            f"{target} is inside the repository {root}; autoloop works on a train.py at a repository's "
            f"root: `autoloop init --existing {root}`"
        )
    if not (root / "train.py").exists():
        raise LoopError(
            f"no train.py in {root}; --existing adds autoloop's files next to your train.py. For a new "
            "workspace give a new directory: `autoloop init DIR`"
        )
    if not repo.head.is_valid() or not gitops.blob_sha(repo, "HEAD", "train.py"):
        raise LoopError(
            f"train.py is not committed in {root}; the loop starts from a commit: "
            "git add train.py && git commit -m 'train.py', then run this again"
        )
    dirty = [f for f in (".gitignore", "pyproject.toml") if repo.git.status("--porcelain", "--", f).strip()]
    if dirty:
        raise LoopError(
            f"uncommitted changes to {' and '.join(dirty)}; init commits the lines it adds there, so "
            "commit or stash yours first"
        )
    project = root / "pyproject.toml"
    text = project.read_text() if project.exists() else ""
    try:
        has_table = "autoloop" in tomllib.loads(text).get("tool", {})
    except tomllib.TOMLDecodeError as e:
        raise LoopError(f"{project} is not valid TOML ({e}); fix it, then run this again") from None
    writes: dict[str, str] = {}  # path -> its new text
    for name in ("prepare.py", "evaluate.py", "program.md"):  # evaluate.py scores for autoloop's prepare.py only
        if not (root / name).exists() and (name != "evaluate.py" or "prepare.py" in writes):
            writes[name] = template(name)
    ignore = root / ".gitignore"
    text_ignore = ignore.read_text() if ignore.exists() else ""
    missing = [line for line in IGNORED if line not in text_ignore.split()]
    if missing:
        head = "" if not text_ignore or text_ignore.endswith("\n") else "\n"
        writes[".gitignore"] = (
            text_ignore
            + head
            + ("\n" if text_ignore else "")
            + "# autoloop's own state (never committed)\n"
            + "\n".join(missing)
            + "\n"
        )
    if not has_table:
        writes["pyproject.toml"] = (
            text
            + ("\n" if text and not text.endswith("\n") else "")
            + ("\n" if text else "")
            + template("pyproject.toml")
        )
    if not writes:
        return [], None
    before = {name: (root / name).read_text() if (root / name).exists() else None for name in writes}
    try:
        for name, new in writes.items():
            (root / name).write_text(new)
        return list(writes), _commit(root, list(writes), "autoloop init --existing: add what autoloop needs")
    except BaseException:  # as it was: nothing half-added
        for name, old in before.items():
            if old is None:
                (root / name).unlink(missing_ok=True)
            else:
                (root / name).write_text(old)
        raise


def _commit(root: Path, paths: list[str], message: str) -> str:
    """Commit exactly `paths` (nothing else the user has staged or changed), as the user if git knows them."""
    repo = gitops.Repo(root)
    repo.git.add("--", *paths)
    gitops.commit_paths(repo, message, paths)
    return repo.head.commit.hexsha
