"""A progress line for the command line: ``<what>: <done>/<total>`` rewritten in place on a terminal.

Long commands (``steward checkpoints rm|savepoint|read``, ``steward blobs put|get``) hand a
:class:`TerminalProgress` to the function doing the work as its ``progress(done, total)`` callback.
Off a terminal (a pipe, a file, the shim's subprocess) it writes nothing, so scripts see only the
commands' own output.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["TerminalProgress"]

MB = 1 << 20


class TerminalProgress:
    """``<what>: <done>/<total>[ <unit>]`` rewritten in place on ``stream`` (default: ``sys.stderr`` when
    it is made), only when it is a terminal, at most every ``interval`` seconds; a newline once done.

    With ``as_bytes``, counts are bytes and show as megabytes (``12.3/256.0 MB``); otherwise ``unit``
    (say ``"subtasks"``) follows the counts. The report that reaches ``total`` is always shown. As a
    context manager, it ends a line left unfinished (the work failed or was interrupted) on exit, so
    an error message starts on a line of its own. The ``clock`` (monotonic seconds) is injected for
    tests. Not thread-safe: call it from one thread.
    """

    def __init__(self, what: str, stream: TextIO | None = None, interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, *, unit: str = "", as_bytes: bool = False) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty())
        self.interval = interval
        self.unit = "MB" if as_bytes else unit
        self.as_bytes = as_bytes
        self._clock = clock
        self._shown = float("-inf")
        self._unfinished = False

    def _counts(self, done: int, total: int) -> str:
        counts = f"{done / MB:.1f}/{total / MB:.1f}" if self.as_bytes else f"{done}/{total}"
        return f"{counts} {self.unit}" if self.unit else counts

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or (done < total and self._clock() - self._shown < self.interval):
            return
        self._shown = self._clock()
        self._unfinished = done < total
        self.stream.write(f"\r{self.what}: {self._counts(done, total)}" + ("" if self._unfinished else "\n"))
        self.stream.flush()

    def close(self) -> None:
        """End a line that was shown but did not reach its total. Idempotent."""
        if self._unfinished:
            self._unfinished = False
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> TerminalProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
