"""Where an executor's Python workers find their executor agent.

``SparkFiles.getRootDirectory()`` names the same directory in the executor JVM and in its Python
workers, in local and in cluster mode. The executor agent writes ``.sparksteward/executor-agent.json``
there (mode 0600 in a 0700 dir, created exclusively without following symlinks, staged then
renamed): its endpoint, the application secret and its pid. Workers
read it and connect. The agent removes the file when it exits; a file whose pid is dead is stale.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

import orjson

from sparksteward.errors import AgentUnavailableError, CorruptRecordError
from sparksteward.owner import private_dir

__all__ = ["Rendezvous"]

_VERSION = 1


class Rendezvous:
    """The rendezvous file of one executor."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.dir = Path(root) / ".sparksteward"
        self.path = self.dir / "executor-agent.json"

    def publish(self, endpoint: str, secret: str, executor_id: str, timeout: float = 120.0) -> None:
        """Write the record: private dir (0700, never a symlink), staged file created with
        ``O_CREAT|O_EXCL|O_NOFOLLOW`` and mode 0600 whatever the umask, fsynced, renamed into place (a
        rename replaces a symlink planted at the final name instead of following it). ``timeout`` is
        the socket timeout workers use (``spark.steward.rpc.timeout``)."""
        private_dir(self.dir)
        tmp = self.dir / f".executor-agent.{uuid.uuid4().hex}.tmp"
        body = orjson.dumps({"version": _VERSION, "endpoint": endpoint, "secret": secret,
                             "pid": os.getpid(), "executor_id": executor_id, "timeout": float(timeout)})
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

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
                fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
                with os.fdopen(fd, "rb") as f:
                    raw = f.read(1 << 20)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise AgentUnavailableError(
                        f"no executor agent has published {self.path}: is the spark-steward plugin "
                        f"enabled (spark.plugins=sparksteward.shim.StewardPlugin)?") from None
                time.sleep(0.05)
            except OSError as exc:  # ELOOP: a symlink planted at the name
                raise CorruptRecordError(f"rendezvous file {self.path} is not a regular file: {exc}") from exc
        try:
            rec = orjson.loads(raw)
            if rec.get("version") != _VERSION:
                raise ValueError(f"version {rec.get('version')!r}")
            return rec
        except (orjson.JSONDecodeError, ValueError, AttributeError) as exc:
            raise CorruptRecordError(f"rendezvous file {self.path} is unreadable: {exc}") from exc
