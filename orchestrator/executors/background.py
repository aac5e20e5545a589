"""A function running in a daemon thread, waited for with an Event.

Never Thread.join: a join interrupted by Ctrl-C can leave the thread looking finished (CPython gh-90882), and
whatever it was waiting for (a run to be killed, an agent to stop) would then outlive the controller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Background:
    def __init__(self, fn: Callable[[], object], name: str):
        self._value: object = None
        self._error: BaseException | None = None
        self._finished = threading.Event()
        threading.Thread(target=self._run, args=(fn,), daemon=True, name=name).start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to whoever waits
            self._error = e
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None) -> bool:
        """Wait up to timeout seconds (None: until done), in short waits that keep Ctrl-C responsive."""
        if timeout is not None:
            return self._finished.wait(timeout)
        while not self._finished.wait(0.2):
            pass
        return True

    def outcome(self) -> tuple[object, BaseException | None]:
        """(value, error) of the finished function."""
        return self._value, self._error
