"""The command line's progress line: on a terminal only, throttled, counts or megabytes, a newline once done."""

from __future__ import annotations

import io

from sparksteward.progress import TerminalProgress

from tests.helpers.terminal import FakeTerminal


def test_progress_line_only_on_a_terminal():
    tty, pipe = FakeTerminal(), io.StringIO()
    for stream in (tty, pipe):
        p = TerminalProgress("deleting", stream, interval=0)
        for i in range(1, 4):
            p(i, 3)
    assert tty.getvalue() == "\rdeleting: 1/3\rdeleting: 2/3\rdeleting: 3/3\n" and pipe.getvalue() == ""
    slow = FakeTerminal()
    p = TerminalProgress("deleting", slow, interval=60)
    for i in range(1, 1001):
        p(i, 1000)
    assert slow.getvalue() == "\rdeleting: 1/1000\rdeleting: 1000/1000\n"   # throttled, the last one always


def test_the_clock_paces_the_line():
    now = [0.0]
    tty = FakeTerminal()
    p = TerminalProgress("restoring", tty, interval=1, clock=lambda: now[0], unit="subtasks")
    for i in range(1, 5):
        p(i, 4)
        now[0] += 0.6
    # shown at 0.0 and 1.2 s, skipped at 0.6 and 1.8 s but for the last report
    assert tty.getvalue() == "\rrestoring: 1/4 subtasks\rrestoring: 3/4 subtasks\rrestoring: 4/4 subtasks\n"


def test_byte_counts_show_as_megabytes():
    tty = FakeTerminal()
    p = TerminalProgress("uploading a.jar", tty, interval=0, as_bytes=True)
    p(0, 256 << 20)
    p(12_900_000, 256 << 20)
    p(256 << 20, 256 << 20)
    assert tty.getvalue() == ("\ruploading a.jar: 0.0/256.0 MB\ruploading a.jar: 12.3/256.0 MB"
                              "\ruploading a.jar: 256.0/256.0 MB\n")


def test_a_line_left_unfinished_ends_on_exit():
    tty = FakeTerminal()
    try:
        with TerminalProgress("copying", tty, interval=0) as p:
            p(1, 3)
            raise OSError("gone")
    except OSError:
        pass
    p.close()   # idempotent
    assert tty.getvalue() == "\rcopying: 1/3\n"
    done = FakeTerminal()
    with TerminalProgress("copying", done, interval=0) as p:
        p(3, 3)
    assert done.getvalue() == "\rcopying: 3/3\n"   # a finished line gets no second newline
