"""One plugin mechanism for proposers, executors and trackers: entry-point groups, built-ins registered alike.

A plugin is a class registered under a name in `autoloop.proposers`, `autoloop.executors` or `autoloop.trackers`
(see pyproject.toml), or named directly as `module:Class`. Proposers and executors declare the command-line
options they take (`options`: click.Option objects); `autoloop run` offers them all, and hands a plugin the
values of its own. A tracker takes its settings from its library's environment variables (MLFLOW_TRACKING_URI).
"""

from __future__ import annotations

import importlib
import math
from importlib.metadata import entry_points

import click

from . import LoopError

GROUPS = {"proposer": "autoloop.proposers", "executor": "autoloop.executors", "tracker": "autoloop.trackers"}


def registered(kind: str) -> dict:
    """name -> entry point, for a kind of GROUPS ("proposer", "executor", "tracker")."""
    return {ep.name: ep for ep in entry_points(group=GROUPS[kind])}


def available(kind: str) -> list[str]:
    return sorted(registered(kind))


def load(kind: str, name: str, base: type) -> type:
    """The class registered as `name` (or at `module:Class`), a subclass of `base`; else a LoopError that
    names the choices (a broken plugin is reported, never a traceback)."""
    eps = registered(kind)
    try:
        if name in eps:
            cls = eps[name].load()
        elif ":" in name:  # an import path, module:Class, for plugins that are not packaged
            module, _, attr = name.partition(":")
            cls = getattr(importlib.import_module(module), attr)
        else:
            raise LoopError(
                f"unknown {kind} {name!r}; available: {', '.join(available(kind))} (third-party "
                f"{kind}s register in the entry-point group '{GROUPS[kind]}')"
            )
    except LoopError:
        raise
    except Exception as e:  # noqa: BLE001
        raise LoopError(f"{kind} {name!r} failed to load: {type(e).__name__}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise LoopError(f"{kind} {name!r} is not a subclass of {base.__module__}.{base.__name__}")
    return cls


def options(kind: str) -> list:
    """The click options every loadable plugin of `kind` declares, each name once (plugins may share one, e.g.
    the prompt options of the agent and llm proposers); plugins that fail to load declare nothing."""
    seen: dict[str, object] = {}
    for name in available(kind):
        try:
            declared = getattr(registered(kind)[name].load(), "options", ())
        except Exception:  # noqa: BLE001 - listed with its error by `autoloop proposers`
            continue
        for option in declared:
            seen.setdefault(option.name, option)
    return list(seen.values())


class FiniteRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (which pass its comparisons): the options of run and of the
    plugins that take seconds, rates or money."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number
