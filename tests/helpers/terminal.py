"""A fake terminal for the progress lines of the command line (:class:`sparksteward.progress.TerminalProgress`)."""

from __future__ import annotations

import io


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal, so a progress line writes to it."""

    def isatty(self) -> bool:
        return True
