"""`agent`: a coding-agent CLI (Claude Code, Codex, aider, Gemini CLI, opencode, or any command) edits train.py.

The agent runs non-interactively in the proposal worktree with the prompt (program.md, the best train.py, the
history, the last crash's log). It never trains, never touches git and never writes the ledger: the loop does,
and reverts (as a crash row) anything it changed besides train.py. It writes a one-line description to a file
in its working directory, which is read and deleted before the loop looks at the edit (fallback: its last line
of output). Token usage and cost are read from the CLI's JSON output where it prints one (Claude Code, Codex).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
from pathlib import Path

import click

from .. import LoopError
from ..executors.runner import run_command
from ..plugins import FiniteRange
from ..store.ledger import Record
from ..store.session import Paths
from ..trust.confine import allowed_env
from ..trust.summary import last_error_line
from .base import Context, Proposal, ProposalFailed, Proposer
from .prompt import DEFAULT_PROMPT_CHARS, PROMPT_OPTIONS, build_prompt, read_program

# Placeholders are replaced only when they are a whole argument: the prompt is never parsed by a shell and other
# braces stay literal. {prompt} is the prompt text, {prompt_file} a file holding it, {workdir} the directory the
# agent works in, {description_file} where it writes its one-line description.
PLACEHOLDERS = ("prompt", "prompt_file", "workdir", "description_file")
# Inside the workdir, as agents that may only write there (Claude Code, Codex) need; deleted after each idea.
DESCRIPTION = ".autoloop-description.txt"
# Files agents leave in their working directory, deleted after each idea (a backstop to the flags below):
# aider's chat and input histories and tag caches.
SIDE_FILES = (".aider*",)

# Non-interactive invocations, as each tool documents them.
PRESETS = {
    "claude": ["claude", "-p", "{prompt}", "--permission-mode", "acceptEdits", "--output-format", "json"],
    "codex": ["codex", "exec", "--full-auto", "--skip-git-repo-check", "--json", "{prompt}"],
    # --yes-always answers every question, so everything that asks is switched off: analytics opt-in, the
    # self-upgrade (which exits), release notes and URLs (a browser), shell commands, lint and test fix-up rounds;
    # the histories go to /dev/null instead of .aider* files in the worktree.
    "aider": [
        "aider",
        "--message-file",
        "{prompt_file}",
        "--yes-always",
        "--no-git",
        "--no-gitignore",
        "--no-auto-commits",
        "--no-show-model-warnings",
        "--no-analytics",
        "--no-check-update",
        "--no-show-release-notes",
        "--no-detect-urls",
        "--no-suggest-shell-commands",
        "--no-auto-lint",
        "--no-auto-test",
        "--no-pretty",
        "--no-stream",
        "--no-fancy-input",
        "--map-tokens",
        "0",
        "--disable-playwright",
        "--chat-history-file",
        os.devnull,
        "--input-history-file",
        os.devnull,
        "train.py",
    ],
    "gemini": ["gemini", "--yolo", "-p", "{prompt}"],
    "opencode": ["opencode", "run", "{prompt}"],
}
# What each preset's CLI needs of our environment besides the allow-list (confine.py): its own key and endpoint.
PRESET_ENV = {
    "claude": (
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_AUTH_TOKEN",
        "ANTHROPIC_BASE_URL",
        "ANTHROPIC_MODEL",
        "CLAUDE_CODE_OAUTH_TOKEN",
        "CLAUDE_CONFIG_DIR",
        "CLAUDE_CODE_USE_BEDROCK",
        "CLAUDE_CODE_USE_VERTEX",
    ),
    "codex": ("OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_HOME"),
    "aider": (
        "AIDER_*",
        "OPENAI_API_KEY",
        "OPENAI_API_BASE",
        "ANTHROPIC_API_KEY",
        "GEMINI_API_KEY",
        "OPENROUTER_API_KEY",
        "DEEPSEEK_API_KEY",
        "OLLAMA_API_BASE",
    ),
    "gemini": (
        "GEMINI_API_KEY",
        "GOOGLE_API_KEY",
        "GOOGLE_CLOUD_PROJECT",
        "GOOGLE_CLOUD_LOCATION",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "GOOGLE_GENAI_USE_VERTEXAI",
    ),
    "opencode": ("OPENCODE_*", "ANTHROPIC_API_KEY", "OPENAI_API_KEY", "GEMINI_API_KEY", "OPENROUTER_API_KEY"),
}
DEFAULT_TIMEOUT_S = 900.0

TASK = """Implement exactly ONE idea from the brief (or your own) that you expect to lower val_bpb, by editing
train.py in the current directory ({workdir}).
- Edit only train.py. Do not run training or prepare.py, do not use git, do not create other files (but the
  description file below).
- Keep the change small and self-contained; train.py must still run as `python train.py`.
- When you are done, write a single line describing the change (what and why, under 120 characters) to this
  file: {description_file}
"""


def agent_argv(options: dict) -> list[str]:
    """The agent's command line template from --agent-cmd or the --agent preset."""
    if options.get("agent_cmd"):
        argv = shlex.split(options["agent_cmd"])
        if not argv:
            raise LoopError('--agent-cmd is empty; give a command such as "mytool --prompt-file {prompt_file}"')
        for arg in argv:
            inside = [p for p in PLACEHOLDERS if f"{{{p}}}" in arg and arg != f"{{{p}}}"]
            if inside:  # it would stay literal (substituting it into a shell string would let the prompt run)
                raise LoopError(
                    f"--agent-cmd: {{{inside[0]}}} must be a whole argument, not part of {arg!r}; "
                    'pass it on its own ("mytool --file {prompt_file}"), or inside sh -c read '
                    '"$AUTOLOOP_PROMPT_FILE", "$AUTOLOOP_WORKDIR", "$AUTOLOOP_DESCRIPTION_FILE"'
                )
        return argv
    name = options.get("agent") or "claude"
    if name not in PRESETS:
        raise LoopError(f'unknown --agent {name!r}; presets: {", ".join(PRESETS)} (or pass --agent-cmd "...")')
    return list(PRESETS[name])


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def read_json_output(output: str) -> tuple[dict | None, str, str]:
    """(usage, final answer, error) from a CLI's JSON output: Claude Code's result object (`-p --output-format
    json`, or the last event of stream-json) or Codex's events (`exec --json`); (None, "", "") for plain text.
    usage has the llm proposer's shape: prompt_tokens, completion_tokens, total_tokens, cost."""
    text = output.strip()
    try:
        events = [json.loads(text)]
    except ValueError:  # JSON lines, maybe mixed with stderr
        events = []
        for line in text.splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    prompt = completion = cost = 0.0
    found, answer, error = False, "", ""
    for event in events:
        if not isinstance(event, dict):
            continue
        kind = event.get("type")
        if kind == "result":  # Claude Code: input_tokens excludes the cache reads and writes, billed apart
            usage = event.get("usage") if isinstance(event.get("usage"), dict) else {}
            prompt += sum(
                _number(usage.get(k))
                for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
            )
            completion += _number(usage.get("output_tokens"))
            cost += _number(event.get("total_cost_usd"))
            found, answer = True, str(event.get("result") or "")
            if event.get("is_error"):
                error = answer or str(event.get("subtype") or "error")
        elif kind == "turn.completed" and isinstance(event.get("usage"), dict):  # Codex: cached inputs included
            prompt += _number(event["usage"].get("input_tokens"))
            completion += _number(event["usage"].get("output_tokens"))
            found = True
        elif kind == "item.completed" and isinstance(event.get("item"), dict):
            if event["item"].get("type") == "agent_message":
                answer = str(event["item"].get("text") or "")
        elif kind in ("turn.failed", "error"):
            detail = event.get("error") if isinstance(event.get("error"), dict) else event
            error = str(detail.get("message") or kind)
    if not found:
        return None, answer, error
    usage = {
        "prompt_tokens": int(prompt),
        "completion_tokens": int(completion),
        "total_tokens": int(prompt + completion),
        "cost": cost,
    }
    return usage, answer, error


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class AgentProposer(Proposer):
    name = "agent"
    pipeline = True
    options = (
        *PROMPT_OPTIONS,
        click.Option(
            ["--agent"],
            type=click.Choice(sorted(PRESETS)),
            help="Coding-agent preset for --proposer agent.  [default: claude]",
        ),
        click.Option(
            ["--agent-cmd"],
            help="Any agent command instead of a preset; placeholders (whole arguments only) {prompt}, "
            "{prompt_file}, {workdir}, {description_file}.",
        ),
        click.Option(
            ["--agent-timeout"],
            type=FiniteRange(min=0, min_open=True),
            help="Seconds an agent may take for one idea.  [default: 900]",
        ),
    )

    def __init__(self, context: Context):
        super().__init__(context)
        self.template = agent_argv(context.options)
        if shutil.which(self.template[0]) is None and not Path(self.template[0]).exists():
            raise LoopError(
                f"agent command {self.template[0]!r} not found on PATH; install it, or choose another "
                f'with --agent ({", ".join(PRESETS)}) or --agent-cmd "..."'
            )
        self.timeout = float(context.options.get("agent_timeout") or DEFAULT_TIMEOUT_S)
        # the allow-list, what the preset's CLI needs, and --pass-env: never every secret of the controller
        wanted = PRESET_ENV.get(
            "" if context.options.get("agent_cmd") else context.options.get("agent") or "claude", ()
        )
        self.env = allowed_env(
            pass_env=tuple(context.pass_env)
            + tuple(name for name in os.environ if any(fnmatch.fnmatchcase(name, w) for w in wanted))
        )
        self.paths = Paths(context.repo, context.tag)
        self.scratch = self.paths.state / "agent"  # outside the worktree: nothing here counts as an edit

    def propose(self, workdir: Path, history: list[Record]) -> Proposal | None:
        if self.context.spend is not None and self.context.spend.exceeded():
            return None  # --max-tokens / --max-cost reached: no further paid call (the loop says which)
        self.scratch.mkdir(parents=True, exist_ok=True)
        prompt_file, description_file = self.scratch / "prompt.md", workdir / DESCRIPTION
        description_file.unlink(missing_ok=True)
        task = TASK.format(workdir=workdir, description_file=description_file)
        prompt = build_prompt(
            read_program(self.context.repo, self.context.options.get("program")),
            (workdir / "train.py").read_text(),
            history,
            self.paths,
            task,
            int(self.context.options.get("prompt_chars") or DEFAULT_PROMPT_CHARS),
        )
        prompt_file.write_text(prompt)
        files = {"prompt_file": str(prompt_file), "workdir": str(workdir), "description_file": str(description_file)}
        fill = {f"{{{k}}}": v for k, v in {"prompt": prompt, **files}.items()}
        argv = [fill.get(arg, arg) for arg in self.template]
        env = {**self.env, **{f"AUTOLOOP_{k.upper()}": v for k, v in files.items()}}  # for sh -c '...'
        log_path = self.scratch / "agent.log"
        before, present = (workdir / "train.py").read_text(), set(os.listdir(workdir))
        try:
            result = run_command(argv, workdir, env, log_path, self.timeout, cancel=self.cancelled)
            try:
                description = description_file.read_text(errors="replace").strip()
            except OSError:
                description = ""
        finally:  # the loop takes every file left in the worktree for part of the edit
            self._tidy(workdir, present)
        output = log_path.read_text(errors="replace")
        usage, answer, error = read_json_output(output)
        info = {"agent": self.template[0], **({"usage": usage} if usage else {})}
        if result.timed_out:
            raise ProposalFailed(
                "agent idea (timed out)", f"agent timed out after {self.timeout:.0f}s", info, log=output
            )
        if result.exit_code != 0 or error:
            why = f"exited with code {result.exit_code}" if result.exit_code != 0 else "reported an error"
            raise ProposalFailed(
                "agent idea (agent failed)",
                f"agent {why}: {(_last_line(error) or last_error_line(output))[:160]}",
                info,
                log=output,
            )
        description = description or _last_line(answer) or _last_line(output) or "agent edit"
        if (workdir / "train.py").read_text() == before:
            raise ProposalFailed(description.splitlines()[0], "the agent did not change train.py", info, log=output)
        return Proposal(description.splitlines()[0], info, log=output)

    def _tidy(self, workdir: Path, present: set[str]) -> None:
        """Delete the description file and the agent's known side files that were not there before."""
        for name in os.listdir(workdir):
            if name == DESCRIPTION or (name not in present and any(fnmatch.fnmatch(name, p) for p in SIDE_FILES)):
                path = workdir / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
