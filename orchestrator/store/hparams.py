"""Read and edit the UPPER_CASE hyperparameter constants of train.py with minimal, one-line text edits.

A constant is `NAME = <literal>` or `NAME = per_profile(gpu=..., cpu=..., tiny=...)` (then the active
profile's value is the one read and edited). A trailing comment may bound it: `# ... [lo, hi]` for numbers
(or per profile: `# ... [gpu: lo, hi; cpu: lo, hi; tiny: lo, hi]`), `# ... {a, b, c}` for choices;
`# ... [fixed]` keeps it out of the search.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass

_BOUNDS = re.compile(r"\[\s*([^,\]]+?)\s*,\s*([^\]]+?)\s*\]\s*$")
_PROFILE_BOUNDS = re.compile(r"\[\s*((?:\w+\s*:[^;\]]+;?\s*)+)\]\s*$")
_CHOICES = re.compile(r"\{([^}]*)\}\s*$")
_POW2 = re.compile(r"^\s*2\s*\*\*\s*\d+\s*$")


@dataclass(frozen=True)
class Constant:
    name: str
    value: object
    line: int  # 1-based line of the value's text
    col: int  # 0-based column span of the value's text on that line
    end_col: int
    text: str  # the value's source text
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None
    profile: str | None = None  # set when the value is the per_profile(...) keyword for this profile

    @property
    def kind(self) -> str:
        if isinstance(self.value, bool):
            return "bool"
        return type(self.value).__name__  # int | float | str | tuple


def _section_lines(lines: list[str]) -> tuple[int, int]:
    """1-based inclusive line range of the hyperparameter section: from its banner title to the next banner
    (the whole file when no section is marked)."""
    start = next(
        (i for i, line in enumerate(lines) if line.lstrip().startswith("#") and "hyperparameters" in line.lower()), None
    )
    if start is None:
        return 1, len(lines)
    banner = re.compile(r"^#\s*-{5,}\s*$")
    first_body = start + 2 if start + 1 < len(lines) and banner.match(lines[start + 1]) else start + 1
    end = next((i for i in range(first_body, len(lines)) if banner.match(lines[i])), len(lines))
    return start + 1, end


def _number(node: ast.AST):
    """A literal, or integer/float arithmetic on literals such as `2**19` or `40 * 524288`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.Mult, ast.Add, ast.Sub, ast.Div)):
        left, right = _number(node.left), _number(node.right)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            raise ValueError("not a number")
        ops = {
            ast.Pow: lambda a, b: a**b,
            ast.Mult: lambda a, b: a * b,
            ast.Add: lambda a, b: a + b,
            ast.Sub: lambda a, b: a - b,
            ast.Div: lambda a, b: a / b,
        }
        return ops[type(node.op)](left, right)
    return ast.literal_eval(node)


def _bound(text: str) -> float:
    return float(eval(text, {"__builtins__": {}}))  # a number or arithmetic such as 2**19 (from train.py itself)


def _parse_comment(line: str, profile: str | None = None) -> tuple[float | None, float | None, tuple | None]:
    if "#" not in line:
        return None, None, None
    comment = line.split("#", 1)[1].strip()
    if m := _PROFILE_BOUNDS.search(comment):
        for part in m.group(1).split(";"):
            name, _, bounds = part.partition(":")
            low, _, high = bounds.partition(",")
            if name.strip() == profile:
                try:
                    return _bound(low), _bound(high), None
                except Exception:
                    return None, None, None
        return None, None, None
    if m := _BOUNDS.search(comment):
        try:
            return _bound(m.group(1)), _bound(m.group(2)), None
        except Exception:
            return None, None, None
    if m := _CHOICES.search(comment):
        items = []
        for raw in m.group(1).split(","):
            raw = raw.strip()
            try:
                items.append(ast.literal_eval(raw))
            except (ValueError, SyntaxError):
                items.append(raw.strip("'\""))
        return None, None, tuple(items)
    return None, None, None


def read_constants(source: str, profile: str | None = None) -> list[Constant]:
    """The editable constants of train.py's hyperparameter section, in file order."""
    return list(_read_constants(source, profile))


@functools.lru_cache(maxsize=64)  # proposers read the same few sources many times per idea
def _read_constants(source: str, profile: str | None) -> tuple[Constant, ...]:
    lines = source.splitlines()
    first, last = _section_lines(lines)
    constants = []
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if not name.isupper() or not first <= node.lineno <= last or node.lineno != node.end_lineno:
            continue
        value_node, prof = node.value, None
        if isinstance(value_node, ast.Call) and getattr(value_node.func, "id", "") == "per_profile":
            match = [kw for kw in value_node.keywords if kw.arg == profile]
            if not match:
                continue
            value_node, prof = match[0].value, profile
        # the value's text (one line; ast columns are UTF-8 byte offsets)
        text = lines[node.lineno - 1].encode("utf-8")[value_node.col_offset : value_node.end_col_offset].decode("utf-8")
        try:
            value = _number(value_node)
        except (ValueError, SyntaxError, TypeError):
            continue
        if not isinstance(value, (int, float, str, tuple)):
            continue
        if re.search(r"#.*\[fixed\]\s*$", lines[node.lineno - 1]):
            continue  # the author marked it as not a hyperparameter to search
        low, high, choices = _parse_comment(lines[node.lineno - 1], profile)
        constants.append(
            Constant(
                name,
                value,
                node.lineno,
                value_node.col_offset,
                value_node.end_col_offset or 0,
                text,
                low,
                high,
                choices,
                prof,
            )
        )
    return tuple(constants)


def format_value(value, like: str = "") -> str:
    """Source text for a new value, keeping a `2**k` spelling where the old one used it."""
    if isinstance(value, bool) or isinstance(value, str) or isinstance(value, tuple):
        return repr(value)
    if isinstance(value, int):
        if _POW2.match(like) and value > 0 and value & (value - 1) == 0:
            return f"2**{value.bit_length() - 1}"
        return str(value)
    text = f"{value:.3g}"
    return text if any(c in text for c in ".e") else text + ".0"


def set_constant(source: str, const: Constant, value, text: str | None = None) -> str:
    """source with const's value replaced by `value` (or by the source `text` given); only that span changes."""
    lines = source.splitlines(keepends=True)
    line = lines[const.line - 1]
    encoded = line.encode("utf-8")  # ast columns are UTF-8 byte offsets
    new_text = (text if text is not None else format_value(value, const.text)).encode("utf-8")
    lines[const.line - 1] = (encoded[: const.col] + new_text + encoded[const.end_col :]).decode("utf-8")
    return "".join(lines)
