"""A ``steward`` command run from a process of its own, started ahead and fired on a file: the nemesis
soak (tests/checkpoint/test_nemesis.py) runs ``steward checkpoints gc`` and ``savepoint`` in the
short windows of a batch (a ``_metadata`` being written, a merged file being sealed), which a cold
start of the command (imports, s3fs) would miss.

``python -m tests.helpers.nemesis_cli <dir> <steward args...>``: imports the command, writes
``<dir>/ready``, waits for ``<dir>/go`` (at most 300 s), runs ``steward <args>`` in this process as
its entry point does, and writes ``<dir>/result.json``: ``{"code", "out", "err", "started", "ended"}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    where = Path(sys.argv[1])
    argv = sys.argv[2:]
    import s3fs  # noqa: F401 - imported before the signal, as the command would import it
    from sparksteward.cli import main as steward

    (where / "ready").touch()
    deadline = time.monotonic() + 300
    while not (where / "go").exists():
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    out, err = io.StringIO(), io.StringIO()
    started = time.time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = steward(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        except Exception as exc:  # noqa: BLE001 - reported to the soak, which prints it
            code, _ = 3, err.write(f"{type(exc).__name__}: {exc}")
    tmp = where / ".result.tmp"
    tmp.write_text(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "started": started,
                               "ended": time.time()}))
    os.replace(tmp, where / "result.json")


if __name__ == "__main__":
    main()
