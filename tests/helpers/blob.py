"""A BlobServer behind a real authenticated socket, for the blob suites."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from sparksteward.blob.cache import BlobCache
from sparksteward.blob.client import BlobClient
from sparksteward.blob.server import BlobServer
from sparksteward.testing.clock import FakeClock
from sparksteward.wire import AgentServer, Connection, new_secret


class BlobRig:
    """A BlobServer behind a real authenticated socket, and caches that talk to it."""

    def __init__(self, tmp_path: Path, ha, retention: float = 60.0, **server_kw) -> None:
        self.secret = new_secret()
        self.clock = FakeClock()
        self.server = BlobServer(tmp_path / "server", ha, retention=retention, clock=self.clock, timer=False,
                                 **server_kw)
        self.sock = AgentServer("127.0.0.1", 0, self.secret, {})
        self.server.register_handlers(self.sock)
        self.ha, self.tmp = ha, tmp_path
        self.client = BlobClient(lambda: self._conn)
        self._conn = Connection.connect(self.sock.endpoint, self.secret)

    def cache(self, name: str = "cache", **kw) -> BlobCache:
        return BlobCache(self.tmp / name, self.ha, self.sock.endpoint, self.secret, **kw)

    def close(self) -> None:
        self._conn.close()
        self.sock.close()
        self.server.close()


def staged_bytes(server) -> int:
    """Bytes in the server's staged files, named (in incoming/ or @spare) or unnamed (open files of
    this process made in @spare): uploads in progress and spare files."""
    total = 0
    for d in (server.incoming, server.spare_dir):
        for f in d.iterdir():
            with contextlib.suppress(FileNotFoundError):
                total += f.stat().st_size
    return total + sum(size for _, size in staged_fds(server))


def staged_fds(server) -> list[tuple[int, int]]:
    """``(fd, size)`` of this process's open files in the server's incoming/ or @spare."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith((f"{server.incoming}/", f"{server.spare_dir}/")):
                out.append((int(name), os.fstat(int(name)).st_size))
        except OSError:  # closed meanwhile (the listing's own fd, too)
            pass
    return out
