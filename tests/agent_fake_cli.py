#!/usr/bin/env python3
"""Fake coding-agent CLIs that behave like the real ones where autoloop meets them: `agent_fake_cli.py aider|claude|
codex ARGS...` (tests install a wrapper named aider, claude or codex on PATH, so the presets run verbatim).

Each parses its tool's flags and exits 2 on one it does not know (as the real CLIs do), lowers train.py's BPB by
10%, and writes the one-line description to the file the prompt names ($AUTOLOOP_TEST_NO_DESCRIPTION: it does not).
- aider (0.86): writes .aider.chat.history.md into its cwd unless --chat-history-file points elsewhere; with
  --yes-always it accepts the analytics opt-in (recorded in $HOME/.aider/analytics.json) and, when
  $AUTOLOOP_TEST_AIDER_NEWER is set, a self-upgrade after which it exits without editing, as aider does.
- claude (-p): writes only inside its cwd and with --permission-mode acceptEdits; a write elsewhere is refused
  and the run fails. --output-format json prints one result object with usage and cost.
- codex (exec): writes only inside its cwd (the workspace-write sandbox); --json prints JSONL events.
Each answers `--version` ($AUTOLOOP_TEST_CLI_BROKEN: fails, as a CLI that is not logged in may).
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

BOOL = argparse.BooleanOptionalAction
DESCRIPTION_NAME = ".autoloop-description.txt"


def edit() -> str:
    """Lower BPB in train.py by 10%; returns a one-line description of the edit."""
    train = Path("train.py")
    old = float(re.search(r"^BPB = ([0-9.e-]+)", train.read_text(), flags=re.M).group(1))
    new = round(old * 0.9, 6)
    train.write_text(re.sub(r"^BPB = .*$", f"BPB = {new!r}  # [0.1, 10.0]", train.read_text(), flags=re.M))
    return f"lower BPB from {old} to {new}"


def description_path(prompt: str) -> Path:
    return Path(re.search(r"to this\s+file: (\S+)", prompt).group(1))


def inside_cwd(path: Path) -> bool:
    return Path.cwd().resolve() in (Path.cwd() / path).resolve().parents


def aider(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="aider")
    p.add_argument("files", nargs="*")
    p.add_argument("--message-file", "-f")
    p.add_argument("--yes-always", action="store_true")
    p.add_argument("--disable-playwright", action="store_true")
    p.add_argument("--map-tokens", type=int)
    p.add_argument("--chat-history-file", default=".aider.chat.history.md")
    p.add_argument("--input-history-file", default=".aider.input.history")
    for flag in (
        "git",
        "gitignore",
        "auto-commits",
        "show-model-warnings",
        "analytics",
        "check-update",
        "show-release-notes",
        "detect-urls",
        "suggest-shell-commands",
        "auto-lint",
        "auto-test",
        "pretty",
        "stream",
        "fancy-input",
    ):
        p.add_argument(f"--{flag}", action=BOOL, default=None)
    args = p.parse_args(argv)
    if args.analytics is not False and args.yes_always:
        print("Allow collection of anonymous analytics to help improve aider? (Y)es/(N)o [Yes]: y")
        home = Path.home() / ".aider"
        home.mkdir(parents=True, exist_ok=True)
        (home / "analytics.json").write_text(json.dumps({"asked_opt_in": True, "permanently_disable": False}))
    if args.check_update is not False and os.environ.get("AUTOLOOP_TEST_AIDER_NEWER") and args.yes_always:
        print(
            "Newer aider version v0.99.0 is available.\nRun pip install? (Y)es/(N)o [Yes]: y\n"
            "Re-run aider to use new version."
        )
        return 0
    prompt = Path(args.message_file).read_text()
    with open(args.chat_history_file, "a") as history:  # always, as aider does: /dev/null keeps it out
        history.write(f"# aider chat started\n\n#### {prompt[:200]}\n")
    desc = edit()
    print("Applied edit to train.py")
    if not os.environ.get("AUTOLOOP_TEST_NO_DESCRIPTION"):
        description_path(prompt).write_text(desc + "\n")
        print(f"Applied edit to {DESCRIPTION_NAME}")
    print("Tokens: 2.1k sent, 120 received.")
    return 0


def claude(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="claude")
    p.add_argument("-p", "--print", action="store_true", required=True)
    p.add_argument("prompt")
    p.add_argument(
        "--permission-mode", choices=["default", "acceptEdits", "bypassPermissions", "plan"], default="default"
    )
    p.add_argument("--output-format", choices=["text", "json", "stream-json"], default="text")
    args = p.parse_args(argv)
    target = description_path(args.prompt)
    for path in (Path("train.py"), target):
        if args.permission_mode != "acceptEdits" or not inside_cwd(path):
            print(f"Claude requested permissions to write to {path}, but you haven't granted it yet.", file=sys.stderr)
            return 1
    desc = edit()
    if not os.environ.get("AUTOLOOP_TEST_NO_DESCRIPTION"):
        target.write_text(desc + "\n")
    result = f"I edited train.py.\n{desc} (said the result)"
    if args.output_format == "text":
        print(result)
    else:
        print(
            json.dumps(
                {
                    "type": "result",
                    "subtype": "success",
                    "is_error": False,
                    "duration_ms": 1234,
                    "num_turns": 3,
                    "result": result,
                    "session_id": "fake",
                    "total_cost_usd": 0.0421,
                    "usage": {
                        "input_tokens": 12,
                        "cache_creation_input_tokens": 3000,
                        "cache_read_input_tokens": 9000,
                        "output_tokens": 450,
                        "service_tier": "standard",
                    },
                }
            )
        )
    return 0


def codex(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="codex")
    p.add_argument("command", choices=["exec"])
    p.add_argument("--full-auto", action="store_true")
    p.add_argument("--skip-git-repo-check", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("prompt")
    args = p.parse_args(argv)
    target = description_path(args.prompt)
    if not (args.full_auto and inside_cwd(target)):
        print(f"sandbox: write to {target} denied", file=sys.stderr)
        return 1
    desc = edit()
    if not os.environ.get("AUTOLOOP_TEST_NO_DESCRIPTION"):
        target.write_text(desc + "\n")
    events = [
        {"type": "thread.started", "thread_id": "fake"},
        {"type": "turn.started"},
        {"type": "item.completed", "item": {"id": "item_0", "type": "reasoning", "text": "thinking"}},
        {
            "type": "item.completed",
            "item": {"id": "item_1", "type": "agent_message", "text": f"Done.\n{desc} (said codex)"},
        },
        {"type": "turn.completed", "usage": {"input_tokens": 5000, "cached_input_tokens": 4000, "output_tokens": 300}},
    ]
    print("\n".join(json.dumps(e) for e in events) if args.json else f"{desc} (said codex)")
    return 0


if __name__ == "__main__":
    if sys.argv[2:] == ["--version"]:  # as the real ones answer (autoloop's preflight asks)
        if os.environ.get("AUTOLOOP_TEST_CLI_BROKEN"):
            sys.exit(f"{sys.argv[1]}: error: not logged in")
        sys.exit(
            print({"aider": "aider 0.86.1", "claude": "2.0.14 (Claude Code)", "codex": "codex-cli 0.46.0"}[sys.argv[1]])
        )
    sys.exit({"aider": aider, "claude": claude, "codex": codex}[sys.argv[1]](sys.argv[2:]))
