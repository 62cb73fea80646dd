"""A Spark Connect server with spark-steward for tests and benchmarks (decision 0030): ``steward
connect-server`` on a free port of 127.0.0.1, started as a new user's shell would (no PYSPARK_PYTHON,
SPARK_HOME or this venv on PATH unless ``env`` gives them), stopped at exit."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["connect_server"]


@contextlib.contextmanager
def connect_server(work: str | os.PathLike[str], master: str = "local[2]", conf: Mapping[str, str] | None = None,
                   timeout: float = 120.0) -> Iterator[str]:
    """Yield the ``sc://`` URL of a Connect server with the plugin (its log in ``work/server.log``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    settings = {"spark.connect.grpc.binding.address": "127.0.0.1", "spark.ui.enabled": "false", **(conf or {})}
    cmd = [sys.executable, "-m", "sparksteward", "connect-server", "--port", str(port), "--", "--master", master,
           *[a for k, v in settings.items() for a in ("--conf", f"{k}={v}")]]
    # the command must choose the workers' Python itself: a Connect server runs its clients' UDFs with $PYSPARK_PYTHON
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_HOME")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"the Connect server exited ({proc.returncode}): "
                                         f"{log_path.read_text(errors='replace')[-4000:]}")
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"the Connect server did not listen within {timeout:g} s: "
                                         f"{log_path.read_text(errors='replace')[-4000:]}")
                time.sleep(0.5)
            yield f"sc://127.0.0.1:{port}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(30)
