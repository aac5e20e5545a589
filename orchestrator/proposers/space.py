"""The search space read from train.py's constants, and the configurations of past experiments (from git)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import git

from ..store.hparams import Constant, format_value, read_constants, set_constant
from ..store.ledger import Record


@dataclass
class Param:
    """One searchable dimension. kind: log | linear (floats), pow2 | int, unit (a tuple element in (0, 1)),
    choice. Tuple elements are addressed as NAME[i]."""

    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None

    def clip(self, value):
        if self.kind == "choice":
            return value
        if self.low is not None:
            value = max(value, self.low)
        if self.high is not None:
            value = min(value, self.high)
        return int(round(value)) if self.kind in ("int", "pow2") else value


def _is_pow2(v: int) -> bool:
    return v >= 2 and v & (v - 1) == 0


def params_of(const: Constant) -> list[Param]:
    """The dimensions a constant contributes (none for strings without declared choices or odd tuples)."""
    v = const.value
    if const.choices:
        return [Param(const.name, "choice", choices=const.choices)]
    if const.kind == "float":
        if const.low is not None and const.low <= 0:
            return [Param(const.name, "linear", const.low, const.high if const.high is not None else max(1.0, 2 * v))]
        if v <= 0:
            return []
        return [
            Param(
                const.name,
                "log",
                const.low if const.low is not None else v / 10,
                const.high if const.high is not None else v * 10,
            )
        ]
    if const.kind == "int":
        if _is_pow2(v):
            return [
                Param(
                    const.name,
                    "pow2",
                    const.low if const.low is not None else max(1, v // 8),
                    const.high if const.high is not None else v * 8,
                )
            ]
        return [
            Param(
                const.name,
                "int",
                const.low if const.low is not None else max(0, min(1, v)),
                const.high if const.high is not None else max(4, 4 * v),
            )
        ]
    if const.kind == "tuple" and v and all(isinstance(x, float) and 0 < x < 1 for x in v):
        return [Param(f"{const.name}[{i}]", "unit", 0.0, 0.999) for i in range(len(v))]
    return []


def read_space(source: str, profile: str | None) -> tuple[dict[str, Param], dict[str, object]]:
    """(dimensions by name, current value by name) of train.py's searchable constants."""
    space, config = {}, {}
    for const in read_constants(source, profile):
        for p in params_of(const):
            space[p.name] = p
            config[p.name] = const.value[int(p.name[p.name.index("[") + 1 : -1])] if "[" in p.name else const.value
    return space, config


def config_of(source: str, profile: str | None) -> dict[str, object]:
    return read_space(source, profile)[1]


def apply_changes(source: str, profile: str | None, changes: dict[str, object]) -> str:
    """train.py with the given dimension values, each a minimal edit of its constant's line."""
    consts = {c.name: c for c in read_constants(source, profile)}
    by_const: dict[str, object] = {}
    for name, value in changes.items():
        base = name.split("[")[0]
        if "[" in name:
            current = list(by_const.get(base, consts[base].value))
            current[int(name[name.index("[") + 1 : -1])] = value
            by_const[base] = tuple(current)
        else:
            by_const[base] = value
    for base, value in by_const.items():
        source = set_constant(source, read_constants_by_name(source, profile)[base], value)
    return source


def read_constants_by_name(source: str, profile: str | None) -> dict[str, Constant]:
    return {c.name: c for c in read_constants(source, profile)}


def show(value) -> str:
    if isinstance(value, float):
        return format_value(value)
    return str(value)


def describe(before: dict, changes: dict) -> str:
    return ", ".join(f"{name} {show(before[name])} -> {show(value)}" for name, value in changes.items())


def rounded(value, kind: str):
    """Values as they will be written (3 significant digits for floats), so configurations compare exactly."""
    if kind in ("log", "linear", "unit"):
        return float(f"{value:.3g}")
    return value


def config_key(config: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in config.items()))


class Configs:
    """The configuration of every experiment, read from train.py at its commit (cached): history survives restarts."""

    def __init__(self, repo: Path, profile: str | None):
        self.repo = git.Repo(repo)
        self.profile = profile
        self.cache: dict[str, dict | None] = {}

    def at(self, commit: str) -> dict | None:
        if not commit:
            return None
        if commit not in self.cache:
            try:
                self.cache[commit] = config_of(self.repo.git.show(f"{commit}:train.py"), self.profile)
            except (git.GitCommandError, SyntaxError, ValueError):
                self.cache[commit] = None
        return self.cache[commit]

    def moves(self, history: list[Record]) -> list[tuple[Record, dict, dict]]:
        """(record, its config, its parent's config) for every experiment whose configs can be read."""
        out = []
        for rec in history:
            cfg, parent = self.at(rec.commit), self.at(rec.parent)
            if cfg is not None:
                out.append((rec, cfg, parent if parent is not None else cfg))
        return out
