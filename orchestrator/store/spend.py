"""What the session's proposer spent (.autoloop/<tag>/spend.jsonl), request by request.

Every LLM request and every agent call is counted when it is made, whether its idea then ran, was a duplicate,
or was thrown away when the best moved: --max-tokens and --max-cost are overrun by at most one request.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from .ledger import append_line


class Spend:
    def __init__(self, path: Path, max_tokens: int | None = None, max_cost: float | None = None):
        self.path, self.max_tokens, self.max_cost = path, max_tokens, max_cost
        self.tokens, self.cost, self.requests = 0, 0.0, 0
        self._lock = threading.Lock()  # ideas are made in a background thread while the loop checks the caps
        for line in path.read_text().splitlines() if path.exists() else ():
            try:
                entry = json.loads(line)
                self.tokens += int(entry.get("total_tokens", 0))
                self.cost += float(entry.get("cost", 0.0))
                self.requests += 1
            except (ValueError, TypeError, AttributeError):
                continue  # a line cut short by a kill

    def add(self, usage: dict, what: str = "") -> None:
        """Count one request's usage ({total_tokens, cost, ...}), persisted before it is counted."""
        tokens, cost = int(usage.get("total_tokens", 0) or 0), float(usage.get("cost", 0.0) or 0.0)
        if not tokens and not cost:
            return
        with self._lock:
            append_line(
                self.path,
                json.dumps({"t": round(time.time(), 3), "total_tokens": tokens, "cost": cost, "what": what}) + "\n",
            )
            self.tokens, self.cost, self.requests = self.tokens + tokens, self.cost + cost, self.requests + 1

    def exceeded(self) -> str:
        """Why no further request may be made ('' while under the caps)."""
        if self.max_tokens is not None and self.tokens >= self.max_tokens:
            return f"reached --max-tokens {self.max_tokens} ({self.tokens} used)"
        if self.max_cost is not None and self.cost >= self.max_cost:
            return f"reached --max-cost {self.max_cost:g} (${self.cost:.2f} spent)"
        return ""
