"""Secrets out of what leaves a run: its crash reason, error line and log tail reach results.tsv, record.json and
the next LLM prompt, and a run (unconfined, or given a key with --pass-env) can read the controller's keys.

`redact` replaces each secret value of the controller's environment (confine.SECRET_NAME names, as `allowed_env`
withholds them) in any of the encodings a run could print it in: literal, hex (either case), URL-encoded, and
base64 (standard and URL-safe) at each of the three alignments a value can have inside a longer encoded stream.
`clean` also masks long high-entropy tokens (a secret we do not know of, e.g. read from a file), for the short
texts a crash contributes; `record` applies it to a record before it is written.
"""

from __future__ import annotations

import base64
import functools
import math
import os
import re
from collections.abc import Mapping
from urllib.parse import quote, quote_plus

from .confine import MIN_SECRET_CHARS, SECRET_NAME

LONG_TOKEN = re.compile(r"[A-Za-z0-9+/=_-]{32,}")  # 32+ characters of the base64 (either) or hex alphabet
TOKEN_CHANGES = 0.3  # share of neighbouring characters of another class that makes a token random (_random)
MASK = "[long token]"


def _base64_runs(raw: bytes) -> set[str]:
    """The base64 text that encodes raw wherever it starts in a longer stream: for each of the three byte
    alignments, the characters whose six bits all come from raw (the ones at either end mix in neighbours)."""
    out = set()
    for shift in range(3):
        encoded = base64.b64encode(bytes(shift) + raw + bytes(2)).decode()
        first, end = math.ceil(8 * shift / 6), (8 * (shift + len(raw))) // 6
        out.add(encoded[first:end])
    return out


def encodings(value: str) -> set[str]:
    """The texts that betray value: itself, its hex, URL-encodings and base64 runs (both alphabets)."""
    raw = value.encode()
    runs = _base64_runs(raw)
    out = {
        value,
        raw.hex(),
        raw.hex().upper(),
        quote(value, safe=""),
        quote_plus(value),
        *runs,
        *(run.replace("+", "-").replace("/", "_") for run in runs),
    }
    return {text for text in out if len(text) >= MIN_SECRET_CHARS}


def secrets(environ: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """(value, name) of each secret-looking variable of the controller's environment."""
    env = os.environ if environ is None else environ
    found: dict[str, str] = {}
    for name, value in sorted(env.items()):
        if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_CHARS:
            found.setdefault(value, name)
    return tuple(found.items())


@functools.lru_cache(maxsize=8)
def _pattern(found: tuple[tuple[str, str], ...]) -> tuple[re.Pattern | None, dict[str, str]]:
    """One regular expression for every encoding of every secret (longest first), and encoding -> name; hex
    matches in any case."""
    names: dict[str, str] = {}
    for value, name in sorted(found, key=lambda item: -len(item[0])):
        for text in encodings(value):
            names.setdefault(text.lower() if _is_hex(text) else text, name)
    if not names:
        return None, names
    alternatives = [
        f"(?i:{re.escape(t)})" if _is_hex(t) else re.escape(t) for t in sorted(names, key=len, reverse=True)
    ]
    return re.compile("|".join(alternatives)), names


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text) and len(text) % 2 == 0


def redact(text: str, environ: dict[str, str] | None = None) -> str:
    """text with every secret of the controller's environment, in any encoding above, as [redacted NAME]."""
    pattern, names = _pattern(secrets(environ))
    if pattern is None or not text:
        return text
    return pattern.sub(lambda m: f"[redacted {names.get(m.group(0), names.get(m.group(0).lower(), '?'))}]", text)


def _random(token: str) -> bool:
    """Whether token reads like a key or an encoding of one: its characters change class (digit, upper, lower)
    at every third one or more often (random base64 ~2 in 3, hex ~1 in 2), where words, identifiers and paths
    change once a word (~1 in 6) and a number never."""
    classes = ["d" if c.isdigit() else "u" if c.isupper() else "l" for c in token if c.isalnum()]
    changes = sum(a != b for a, b in zip(classes, classes[1:]))
    return len(classes) > 1 and changes / (len(classes) - 1) >= TOKEN_CHANGES


def mask_tokens(text: str) -> str:
    """text with each long high-entropy token (32+ characters of the base64 or hex alphabet) as [long token]."""
    return LONG_TOKEN.sub(lambda m: MASK if _random(m.group(0)) else m.group(0), text)


def clean(text: str, environ: dict[str, str] | None = None) -> str:
    """What a crash may say outside its log: secrets redacted, then long random tokens masked."""
    return mask_tokens(redact(text, environ))


def line(text: str, limit: int = 160, environ: dict[str, str] | None = None) -> str:
    """One cleaned line of at most limit characters (cleaned first: a cut secret would no longer match)."""
    return clean(text, environ)[:limit]


def record(rec) -> None:
    """A Record (ledger.Record) cleaned in place before it is written or shown: its reason and string metrics
    (both the run's words), its description and the gate's note (the proposer's, which may quote a log)."""
    rec.reason = clean(rec.reason)
    rec.description = redact(rec.description)
    rec.metrics = {k: clean(v) if isinstance(v, str) else v for k, v in rec.metrics.items()}
    if isinstance(rec.gate.note, str):
        rec.gate.note = redact(rec.gate.note)
