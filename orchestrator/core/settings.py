"""Settings of a run: flat and typed, field names as the command line's options (precedence lives in cli.py).

cli.py fills each field from the option of its name (a new option needs a field of its name, or an entry in
options.OPTION_OF); fields no option sets keep their defaults here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .noise import Gate

DEFAULT_GRACE_S = 120.0  # start-up and evaluation on top of twice the training budget


@dataclass
class Settings:
    repo: Path
    tag: str
    tag_given: bool = False  # the tag was chosen (flag, env, pyproject): a changed session is refused, not renamed
    budget: float = 300.0
    timeout: float | None = None  # hard timeout per run (seconds); default 2 x budget + grace
    max_experiments: int | None = None
    max_hours: float | None = None
    proposer: str = "search"
    profile: str | None = None
    dataset: str | None = None
    seed: int = 42
    cache: str | None = None
    pipeline: bool | None = None  # prepare the next idea while one trains; None: as the proposer prefers
    max_tokens: int | None = None  # stop once the proposer's LLM usage reaches this many tokens
    max_cost: float | None = None  # ... or this many dollars (needs prices in the proposer options)
    options: dict = field(default_factory=dict)  # proposer options (agent command, LLM endpoint, ...)
    gate: Gate = field(default_factory=Gate)  # the keep rule (noise-aware by default)
    sandbox: str = "auto"  # on | off | auto (on where bubblewrap works): runs write only their own directories
    sandbox_net: bool = False  # let sandboxed runs reach the network
    pass_env: tuple[str, ...] = ()  # variables runs and agents get besides the allow-listed ones (confine.py)
    max_log_mb: float = 64.0  # a run's log keeps its first and last half of this many MiB
    max_crashes: int = 5  # crashes in a row that stop the loop (the circuit breaker)
    baseline_repeats: int = 2  # extra runs of the baseline, to measure σ
    startup_allowance: float = 60.0  # seconds of start-up allowed on top of the budget before "budget exceeded"
    executor: str = "local"  # a registered executor: local | ray | inline | a plugin's
    workers: int | None = None  # experiments at once; default: one per GPU (local) or per cluster GPU (ray)
    executor_options: dict = field(default_factory=dict)  # the executor's own options (gpus, ray_address, ...)
    verify: bool = False  # `autoloop verify` at the end of the session (core/verify.py)
    transfer: float = 3.0  # verify's longer budget, as a multiple of the session's (0: no transfer)
    trackers: tuple[str, ...] = ()  # trackers the session is mirrored to (--tracker): mlflow, wandb, ... (trackers/)

    @property
    def hard_timeout(self) -> float:
        return self.timeout if self.timeout else 2 * self.budget + DEFAULT_GRACE_S
