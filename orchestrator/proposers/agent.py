"""`agent`: a coding-agent CLI (Claude Code, Codex, aider, Gemini CLI, opencode, or any command) edits train.py.

The agent runs non-interactively in the proposal worktree with the prompt (program.md, the best train.py, the
history, the last crash's log). It never trains, never touches git and never writes the ledger: the loop does,
and reverts (as a crash row) anything it changed besides train.py. It writes a one-line description to a file
the prompt names (fallback: its last line of output).
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import click

from .. import LoopError
from ..ledger import Record
from ..prompt import DEFAULT_PROMPT_CHARS, PROMPT_OPTIONS, build_prompt, read_program
from ..runner import run_command
from ..session import Paths
from ..summary import last_error_line
from .base import Context, Proposal, ProposalFailed, Proposer

# Non-interactive invocations, as each tool documents them. {prompt} is the prompt text as one argument,
# {prompt_file} a file holding it, {workdir} the directory the agent works in.
PRESETS = {
    "claude": ["claude", "-p", "{prompt}", "--permission-mode", "acceptEdits", "--output-format", "text"],
    "codex": ["codex", "exec", "--full-auto", "--skip-git-repo-check", "{prompt}"],
    "aider": ["aider", "--yes-always", "--no-git", "--no-auto-commits", "--no-show-model-warnings",
              "--message-file", "{prompt_file}", "train.py"],
    "gemini": ["gemini", "--yolo", "-p", "{prompt}"],
    "opencode": ["opencode", "run", "{prompt}"],
}
DEFAULT_TIMEOUT_S = 900.0

TASK = """Implement exactly ONE idea from the brief (or your own) that you expect to lower val_bpb, by editing
train.py in the current directory ({workdir}).
- Edit only train.py. Do not run training or prepare.py, do not use git, do not create other files.
- Keep the change small and self-contained; train.py must still run as `python train.py`.
- When you are done, write a single line describing the change (what and why, under 120 characters) to this
  file: {description_file}
"""


def agent_argv(options: dict) -> list[str]:
    """The agent's command line template from --agent-cmd or the --agent preset."""
    if options.get("agent_cmd"):
        argv = shlex.split(options["agent_cmd"])
        if not argv:
            raise LoopError("--agent-cmd is empty; give a command such as \"mytool --prompt-file {prompt_file}\"")
        return argv
    name = options.get("agent") or "claude"
    if name not in PRESETS:
        raise LoopError(f"unknown --agent {name!r}; presets: {', '.join(PRESETS)} (or pass --agent-cmd \"...\")")
    return list(PRESETS[name])


class AgentProposer(Proposer):
    name = "agent"
    pipeline = True
    options = (
        *PROMPT_OPTIONS,
        click.Option(["--agent"], type=click.Choice(sorted(PRESETS)), envvar="AUTOLOOP_AGENT", show_envvar=True,
                     help="Coding-agent preset for --proposer agent.  [default: claude]"),
        click.Option(["--agent-cmd"], envvar="AUTOLOOP_AGENT_CMD", show_envvar=True,
                     help="Any agent command instead of a preset; placeholders {prompt}, {prompt_file}, {workdir}."),
        click.Option(["--agent-timeout"], type=click.FloatRange(min=0, min_open=True), envvar="AUTOLOOP_AGENT_TIMEOUT",
                     show_envvar=True, help="Seconds an agent may take for one idea.  [default: 900]"),
    )

    def __init__(self, context: Context):
        super().__init__(context)
        self.template = agent_argv(context.options)
        if shutil.which(self.template[0]) is None and not Path(self.template[0]).exists():
            raise LoopError(f"agent command {self.template[0]!r} not found on PATH; install it, or choose another "
                            f"with --agent ({', '.join(PRESETS)}) or --agent-cmd \"...\"")
        self.timeout = float(context.options.get("agent_timeout") or DEFAULT_TIMEOUT_S)
        self.paths = Paths(context.repo, context.tag)
        self.scratch = self.paths.state / "agent"  # outside the worktree: nothing here counts as an edit

    def propose(self, workdir: Path, history: list[Record]) -> Proposal:
        self.scratch.mkdir(parents=True, exist_ok=True)
        prompt_file, description_file = self.scratch / "prompt.md", self.scratch / "description.txt"
        description_file.unlink(missing_ok=True)
        task = TASK.format(workdir=workdir, description_file=description_file)
        prompt = build_prompt(read_program(self.context.repo, self.context.options.get("program")),
                              (workdir / "train.py").read_text(), history, self.paths, task,
                              int(self.context.options.get("prompt_chars") or DEFAULT_PROMPT_CHARS))
        prompt_file.write_text(prompt)
        fill = {"prompt": prompt, "prompt_file": str(prompt_file), "workdir": str(workdir),
                "description_file": str(description_file)}
        argv = [arg.format(**fill) if "{" in arg else arg for arg in self.template]
        log_path = self.scratch / "agent.log"
        before = (workdir / "train.py").read_text()
        result = run_command(argv, workdir, dict(os.environ), log_path, self.timeout, cancel=self.cancelled)
        output = log_path.read_text(errors="replace")
        if result.timed_out:
            raise ProposalFailed("agent idea (timed out)", f"agent timed out after {self.timeout:.0f}s", log=output)
        if result.exit_code != 0:
            raise ProposalFailed("agent idea (agent failed)",
                                 f"agent exited with code {result.exit_code}: {last_error_line(output)}", log=output)
        description = description_file.read_text().strip() if description_file.exists() else ""
        if not description:
            lines = [line.strip() for line in output.splitlines() if line.strip()]
            description = lines[-1] if lines else "agent edit"
        if (workdir / "train.py").read_text() == before:
            raise ProposalFailed(description.splitlines()[0], "the agent did not change train.py", log=output)
        return Proposal(description.splitlines()[0], {"agent": self.template[0]}, log=output)
