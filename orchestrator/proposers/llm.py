"""`llm`: any OpenAI-compatible chat-completions endpoint proposes an edit as search/replace blocks.

Works with hosted APIs and local servers (vLLM, llama.cpp, Ollama). The reply is applied to train.py; one that
does not apply is sent back once with the error, then recorded as a crash. Token usage (and cost, given prices)
is kept per experiment in record.json `info.usage`; `--max-tokens` / `--max-cost` stop the loop.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlparse

import click

from .. import LoopError
from ..plugins import FiniteRange
from ..store.ledger import Record
from ..store.session import Paths
from .base import Context, Proposal, ProposalFailed, Proposer
from .prompt import DEFAULT_PROMPT_CHARS, PROMPT_OPTIONS, build_prompt, read_program

DEFAULT_BASE_URL = "https://api.openai.com/v1"
SYSTEM = "You are an ML researcher improving a small GPT pretraining script. You reply with precise code edits."
TASK = """Propose exactly ONE idea that you expect to lower val_bpb, and apply it to train.py.
Reply in this format and nothing else:

DESCRIPTION: <one line, under 120 characters: what you changed and why>
<<<<<<< SEARCH
<lines copied exactly from the current train.py>
=======
<the lines that replace them>
>>>>>>> REPLACE

Use as many SEARCH/REPLACE blocks as the idea needs; each SEARCH text must appear exactly once in train.py.
If rewriting the whole file is simpler, give the complete new train.py in one ```python block instead."""

_BLOCK = re.compile(r"<<<<<<< SEARCH\n(.*?)\n?=======\n(.*?)\n?>>>>>>> REPLACE", re.S)
_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)
_DESC = re.compile(r"^\s*DESCRIPTION:\s*(.+?)\s*$", re.M | re.I)


class EditError(ValueError):
    pass


def _find(source: str, search: str, i: int) -> tuple[int, int]:
    """Span of the SEARCH text in source: exact, else ignoring trailing whitespace on each line."""
    count = source.count(search)
    if count == 1:
        start = source.index(search)
        return start, start + len(search)
    if count > 1:
        raise EditError(f"SEARCH block {i} matches {count} places in train.py; include more lines to make it unique")
    want = [line.rstrip() for line in search.splitlines()]
    lines = source.splitlines(keepends=True)
    for k in range(len(lines) - len(want) + 1):
        if [line.rstrip() for line in lines[k : k + len(want)]] == want:
            start = sum(len(line) for line in lines[:k])
            return start, start + sum(len(line) for line in lines[k : k + len(want)]) - 1
    raise EditError(f"SEARCH block {i} does not match train.py; copy the lines exactly from the current train.py")


def apply_reply(source: str, reply: str) -> tuple[str, str]:
    """(new train.py, description) from a reply with SEARCH/REPLACE blocks or a whole file."""
    m = _DESC.search(reply)
    description = (
        m.group(1)
        if m
        else next(
            (ln.strip() for ln in reply.splitlines() if ln.strip() and not ln.startswith(("<<<", "===", ">>>", "```"))),
            "",
        )
    )
    blocks = _BLOCK.findall(reply)
    if blocks:
        new = source
        for i, (search, replace) in enumerate(blocks, 1):
            if not search.strip():
                raise EditError(f"SEARCH block {i} is empty")
            start, end = _find(new, search, i)
            new = new[:start] + replace + new[end:]
    else:
        fences = _FENCE.findall(reply)
        whole = max(fences, key=len) if fences else ""
        if not whole or len(whole) < 0.5 * len(source):
            raise EditError("the reply has no SEARCH/REPLACE blocks and no complete train.py")
        new = whole
    if new.strip() == source.strip():
        raise EditError("the edit changes nothing")
    return new, description[:200] or "LLM edit"


def _is_local(url: str) -> bool:
    return (urlparse(url).hostname or "") in ("localhost", "127.0.0.1", "::1", "0.0.0.0")


class SpendExhausted(Exception):
    """--max-tokens / --max-cost is reached: no further request."""


class LLMProposer(Proposer):
    name = "llm"
    pipeline = True
    options = (
        *PROMPT_OPTIONS,
        click.Option(
            ["--llm-base-url"],
            help="OpenAI-compatible endpoint for --proposer llm.  [default: https://api.openai.com/v1]",
        ),
        click.Option(["--llm-model"], help="Model name for --proposer llm."),
        click.Option(
            ["--llm-api-key-env"],
            help="Environment variable holding the API key.  [default: OPENAI_API_KEY; optional for localhost]",
        ),
        click.Option(
            ["--llm-timeout"],
            type=FiniteRange(min=0, min_open=True),
            help="Seconds per LLM request.  [default: 600]",
        ),
        click.Option(
            ["--llm-price-in"],
            type=FiniteRange(min=0),
            help="Dollars per million prompt tokens (for cost tracking and --max-cost).",
        ),
        click.Option(
            ["--llm-price-out"],
            type=FiniteRange(min=0),
            help="Dollars per million completion tokens.",
        ),
    )

    def __init__(self, context: Context):
        super().__init__(context)
        try:
            import openai
        except ImportError:
            raise LoopError(
                "the llm proposer needs the openai client: "
                'pip install "autoloop-ml[llm]" (in a clone: pip install -e ".[llm]")'
            ) from None
        opts = context.options
        self.openai = openai
        self.model = opts.get("llm_model")
        if not self.model:
            raise LoopError("the llm proposer needs a model: pass --llm-model NAME (or set AUTOLOOP_LLM_MODEL)")
        base_url = opts.get("llm_base_url") or DEFAULT_BASE_URL
        key_env = opts.get("llm_api_key_env") or "OPENAI_API_KEY"
        key = os.environ.get(key_env)
        if not key:
            if not _is_local(base_url):
                raise LoopError(
                    f"no API key for {base_url}: set {key_env} (or name another variable with --llm-api-key-env)"
                )
            key = "not-needed"  # local servers (vLLM, llama.cpp, Ollama) accept any key
        self.client = openai.OpenAI(
            base_url=base_url, api_key=key, timeout=float(opts.get("llm_timeout") or 600), max_retries=2
        )
        self.price_in = float(opts.get("llm_price_in") or 0.0)  # dollars per million prompt tokens
        self.price_out = float(opts.get("llm_price_out") or 0.0)
        self.paths = Paths(context.repo, context.tag)

    def _ask(self, messages: list[dict], usage: dict) -> str:
        spend = self.context.spend
        if spend is not None and (why := spend.exceeded()):
            raise SpendExhausted(why)
        try:
            response = self.client.chat.completions.create(model=self.model, messages=messages)
        except self.openai.APIError as e:
            raise ProposalFailed(
                "LLM request failed", f"LLM API error: {type(e).__name__}: {e}"[:300], {"usage": usage}
            ) from None
        if response.usage is not None:
            prompt, completion = response.usage.prompt_tokens or 0, response.usage.completion_tokens or 0
            this = {
                "total_tokens": prompt + completion,
                "cost": (prompt * self.price_in + completion * self.price_out) / 1e6,
            }
            if spend is not None:
                spend.add(this, f"llm {self.model}")
            usage["prompt_tokens"] += prompt
            usage["completion_tokens"] += completion
            usage["total_tokens"] += this["total_tokens"]
            usage["cost"] += this["cost"]
        return response.choices[0].message.content or ""

    def propose(self, workdir: Path, history: list[Record]) -> Proposal | None:
        try:
            return self._propose(workdir, history)
        except SpendExhausted:
            return None  # the loop stops on the cap it reached

    def _propose(self, workdir: Path, history: list[Record]) -> Proposal:
        path = workdir / "train.py"
        source = path.read_text()
        prompt = build_prompt(
            read_program(self.context.repo, self.context.options.get("program")),
            source,
            history,
            self.paths,
            TASK,
            int(self.context.options.get("prompt_chars") or DEFAULT_PROMPT_CHARS),
        )
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cost": 0.0}
        transcript = []
        for attempt in (1, 2):
            reply = self._ask(messages, usage)
            transcript.append(f"--- reply {attempt} ---\n{reply}")
            try:
                new, description = apply_reply(source, reply)
            except EditError as e:
                if attempt == 2:
                    raise ProposalFailed(
                        _DESC.search(reply).group(1) if _DESC.search(reply) else "LLM edit",
                        f"LLM reply did not apply: {e}",
                        {"usage": usage},
                        log="\n".join(transcript),
                    ) from None
                messages += [
                    {"role": "assistant", "content": reply},
                    {
                        "role": "user",
                        "content": f"That edit could not be applied: {e}. Reply again in the required format.",
                    },
                ]
                continue
            path.write_text(new)
            return Proposal(description, {"usage": usage, "model": self.model}, log="\n".join(transcript))
        raise AssertionError("unreachable")
