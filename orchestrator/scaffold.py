"""`autoloop init`: a ready workspace from the package's own files, so that a pip install needs no clone.

A workspace is a git repository with train.py (what the loop edits), prepare.py (the fixed harness), program.md
(the brief LLM proposers read), a .gitignore for autoloop's state and a [tool.autoloop] table in pyproject.toml.
`--existing` adds whichever of these a repository with a train.py lacks (a clone of upstream autoresearch, say)
and touches nothing else: a file that is there is left as it is, .gitignore only gains missing lines.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from . import LoopError, __version__, gitops

# workspace path -> file in orchestrator/template/ (dot-files are stored without their dot: packaging tools and
# editors treat a ".gitignore" inside a package as their own)
FILES = {"train.py": "train.py", "prepare.py": "prepare.py", "program.md": "program.md",
         ".gitignore": "gitignore", "pyproject.toml": "pyproject.toml"}
IGNORED = (".autoloop/", "/results.tsv", "/progress.png", "/report.md")
TABLE = re.compile(r"^\s*\[tool\.autoloop\]\s*$", re.MULTILINE)


def template(name: str) -> str:
    return (resources.files("orchestrator") / "template" / FILES[name]).read_text()


def init_workspace(target: Path, existing: bool = False) -> tuple[list[str], str | None]:
    """Write the workspace and commit what was added. Returns (paths added or changed, the commit or None).
    LoopError (with what to do) for a directory that is not empty, or with --existing one without train.py."""
    target = target.expanduser().resolve()
    if existing:
        return _existing(target)
    if target.exists() and not target.is_dir():
        raise LoopError(f"{target} is a file; give a new or empty directory")
    present = sorted(p.name for p in target.iterdir() if p.name != ".git") if target.is_dir() else []
    if present:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        hint = ("`autoloop init --existing` adds what is missing next to its train.py"
                if "train.py" in present else "give a new or empty directory")
        raise LoopError(f"{target} is not empty ({shown}); {hint}")
    target.mkdir(parents=True, exist_ok=True)
    if not (target / ".git").exists():
        import git

        git.Repo.init(target, initial_branch="main")
    for name in FILES:
        (target / name).write_text(template(name))
    return list(FILES), _commit(target, list(FILES), f"autoloop init: a workspace from autoloop-ml {__version__}")


def _existing(target: Path) -> tuple[list[str], str | None]:
    repo = gitops.open_repo(target)
    root = Path(repo.working_tree_dir)
    if root != target:
        raise LoopError(f"{target} is inside the repository {root}; autoloop works on a train.py at a repository's "
                        f"root: run `autoloop init --existing {root}`")
    if not (root / "train.py").exists():
        raise LoopError(f"no train.py in {root}; --existing adds autoloop's files next to your train.py. For a new "
                        "workspace give a new directory: `autoloop init DIR`")
    changed = []
    for name in ("prepare.py", "program.md"):
        if not (root / name).exists():
            (root / name).write_text(template(name))
            changed.append(name)
    ignore = root / ".gitignore"
    text = ignore.read_text() if ignore.exists() else ""
    missing = [line for line in IGNORED if line not in text.split()]
    if missing:
        head = "" if not text or text.endswith("\n") else "\n"
        ignore.write_text(text + head + ("\n" if text else "") + "# autoloop's own state (never committed)\n"
                          + "\n".join(missing) + "\n")
        changed.append(".gitignore")
    project = root / "pyproject.toml"
    text = project.read_text() if project.exists() else ""
    if not TABLE.search(text):
        table = template("pyproject.toml")
        project.write_text(text + ("\n" if text and not text.endswith("\n") else "") + ("\n" if text else "") + table)
        changed.append("pyproject.toml")
    if not changed:
        return [], None
    return changed, _commit(root, changed, "autoloop init --existing: add what autoloop needs")


def _commit(root: Path, paths: list[str], message: str) -> str:
    """Commit exactly `paths` (nothing else the user has staged or changed), as the user if git knows them."""
    repo = gitops.Repo(root)
    repo.git.add("--", *paths)
    gitops.commit_paths(repo, message, paths)
    return repo.head.commit.hexsha
