"""Where an executor's Python workers find their executor agent.

``SparkFiles.getRootDirectory()`` names the same directory in the executor JVM and in its Python
workers, in local and in cluster mode. The executor agent writes ``.sparksteward/executor-agent.json``
there (mode 0600, staged then renamed): its endpoint, the application secret and its pid. Workers
read it and connect. The agent removes the file when it exits; a file whose pid is dead is stale.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import orjson

from sparksteward.errors import AgentUnavailableError, CorruptRecordError

__all__ = ["Rendezvous"]

_VERSION = 1


class Rendezvous:
    """The rendezvous file of one executor."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.dir = Path(root) / ".sparksteward"
        self.path = self.dir / "executor-agent.json"

    def publish(self, endpoint: str, secret: str, executor_id: str) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.dir / f".executor-agent.{os.getpid()}.tmp"
        body = orjson.dumps({"version": _VERSION, "endpoint": endpoint, "secret": secret,
                             "pid": os.getpid(), "executor_id": executor_id})
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, self.path)

    def withdraw(self) -> None:
        """Remove the file if this process wrote it. Idempotent."""
        with contextlib.suppress(FileNotFoundError, CorruptRecordError, AgentUnavailableError):
            if self.read(wait=0)["pid"] == os.getpid():
                self.path.unlink()

    def read(self, wait: float = 30.0) -> dict[str, object]:
        """Return the published record, waiting up to ``wait`` seconds for the agent to publish it."""
        deadline = time.monotonic() + wait
        while True:
            try:
                raw = self.path.read_bytes()
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise AgentUnavailableError(
                        f"no executor agent has published {self.path}: is the spark-steward plugin "
                        f"enabled (spark.plugins=sparksteward.shim.StewardPlugin)?") from None
                time.sleep(0.05)
        try:
            rec = orjson.loads(raw)
            if rec.get("version") != _VERSION:
                raise ValueError(f"version {rec.get('version')!r}")
            return rec
        except (orjson.JSONDecodeError, ValueError, AttributeError) as exc:
            raise CorruptRecordError(f"rendezvous file {self.path} is unreadable: {exc}") from exc
