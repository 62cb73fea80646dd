"""The BlobCache against a BlobServer on "another host" (issue 7 item 1) and its retry backoff (item 16).

No Spark: a real BlobServer behind a real authenticated socket, and caches whose boot id differs from
the server's (the server then streams the body) or that cannot open the path the server names (same
kernel, another mount namespace).
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Any

import pytest
from sparksteward.blob.cache import BlobCache
from sparksteward.blob.client import BlobClient
from sparksteward.blob.key import BlobKey
from sparksteward.blob.messages import BlobGetRequest
from sparksteward.blob.server import BOOT_ID, BlobServer
from sparksteward.blob.store import FileSystemBlobStore, VoidBlobStore
from sparksteward.errors import BlobNotFoundError
from sparksteward.testing.clock import FakeClock
from sparksteward.wire import AgentServer, Connection, new_secret

OTHER_BOOT_ID = "00000000-1111-2222-3333-444444444444"


class _Server:
    """A BlobServer on 127.0.0.1, and a client to put blobs with."""

    def __init__(self, tmp: Path, ha: Any = None) -> None:
        self.secret = new_secret()
        self.ha = ha or VoidBlobStore()
        self.blobs = BlobServer(tmp / "server", self.ha, clock=FakeClock(), timer=False)
        self.sock = AgentServer("127.0.0.1", 0, self.secret, {})
        self.blobs.register_handlers(self.sock)
        self._conn = Connection.connect(self.sock.endpoint, self.secret)
        self.client = BlobClient(lambda: self._conn)
        self.gets: list[dict[str, Any]] = []

    def close(self) -> None:
        self._conn.close()
        self.sock.close()
        self.blobs.close()


@pytest.fixture()
def server(tmp_path):
    s = _Server(tmp_path)
    yield s
    s.close()


def _server_stat(server: _Server, name: str, value: int) -> None:
    """The server counts a stream once sendfile returned, which may be after the client has it all."""
    from tests.helpers import wait_until

    wait_until(lambda: server.blobs.stats.get(name, 0) == value, timeout=5,
               what=f"server stat {name} == {value} (is {server.blobs.stats.get(name, 0)})")


def _blob(server: _Server, size: int, job: str | None = "job-x", permanent: bool = False) -> tuple[BlobKey, bytes]:
    data = os.urandom(size)
    return server.client.put_bytes(data, job, permanent=permanent), data


def test_a_cache_on_another_host_receives_the_streamed_body(server, tmp_path):
    key, data = _blob(server, 3 << 20)  # several socket reads
    cache = BlobCache(tmp_path / "cache", server.ha, server.sock.endpoint, server.secret, boot_id=OTHER_BOOT_ID)
    path = cache.open("job-x", key)
    assert path.read_bytes() == data
    assert cache.stats["transfers"] == 1 and cache.stats.get("local_copies", 0) == 0
    _server_stat(server, "bytes_served", len(data))
    assert server.blobs.stats.get("served_local", 0) == 0
    # a second blob from the same cache: still streamed, one request per blob
    key2, data2 = _blob(server, 1000)
    assert cache.open("job-x", key2).read_bytes() == data2
    _server_stat(server, "served", 2)
    assert cache.stats["transfers"] == 2


def test_a_cache_without_a_boot_id_streams_too(server, tmp_path):
    key, data = _blob(server, 100_000, job=None)
    cache = BlobCache(tmp_path / "cache", server.ha, server.sock.endpoint, server.secret, boot_id="")
    assert cache.open(None, key).read_bytes() == data
    assert server.blobs.stats.get("served_local", 0) == 0


def test_a_permanent_blob_falls_back_from_an_invisible_ha_store_to_the_stream(tmp_path):
    ha = FileSystemBlobStore(str(tmp_path / "ha"), "c1")
    s = _Server(tmp_path, ha)
    try:
        key, data = _blob(s, 2 << 20, permanent=True)
        unreachable_ha = FileSystemBlobStore(str(tmp_path / "not-the-drivers-ha"), "c1")  # what the other host sees
        cache = BlobCache(tmp_path / "cache", unreachable_ha, s.sock.endpoint, s.secret, boot_id=OTHER_BOOT_ID)
        assert cache.open("job-x", key).read_bytes() == data
        assert cache.stats.get("ha_fetches", 0) == 0 and cache.stats["transfers"] == 1
    finally:
        s.close()


def _hand_out_invisible_paths(server: _Server, path: str | None = None) -> None:
    """Make the server's same-host replies name a path this process cannot open, as for a peer on the
    same kernel but in another mount namespace (or ``path``: what that peer sees under the server's
    name). Everything else is the real server's reply."""
    real_get = server.blobs._op_get

    class _Rewriting:
        def __init__(self, conn: Connection) -> None:
            self._conn = conn

        def send(self, msg: dict[str, Any]) -> None:
            if "path" in msg:
                msg = {**msg, "path": path or "/nonexistent-mount-namespace" + msg["path"]}
            self._conn.send(msg)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._conn, name)

    def get(conn: Connection, req: dict[str, Any]) -> None:
        server.gets.append(dict(req))
        return real_get(_Rewriting(conn), BlobGetRequest.from_wire(req))

    server.sock.add_handler("blob.get", get)


def test_a_cache_that_cannot_open_the_servers_path_gets_the_body_streamed(server, tmp_path):
    if not BOOT_ID:
        pytest.skip("no /proc/sys/kernel/random/boot_id: the server never names a path")
    _hand_out_invisible_paths(server)
    key, data = _blob(server, 1 << 20)
    cache = BlobCache(tmp_path / "cache", server.ha, server.sock.endpoint, server.secret, fetch_retries=0)
    assert cache.open("job-x", key).read_bytes() == data
    assert cache.stats["transfers"] == 1 and cache.stats.get("local_copies", 0) == 0
    _server_stat(server, "bytes_served", len(data))
    # later fetches stream right away instead of asking for a path first
    key2, data2 = _blob(server, 5000)
    assert cache.open("job-x", key2).read_bytes() == data2
    assert [("boot_id" in g) for g in server.gets] == [True, False, False]


@pytest.mark.parametrize("seen", ["another file", "/proc/version"])
def test_a_cache_that_sees_another_file_or_cannot_copy_it_gets_the_body_streamed(server, tmp_path, seen):
    """Another mount namespace may hold a different file under the server's path (checksum mismatch),
    or one that copy_file_range refuses (EXDEV from procfs): neither may fail the fetch."""
    if not BOOT_ID:
        pytest.skip("no /proc/sys/kernel/random/boot_id: the server never names a path")
    if seen == "another file":
        seen = str(tmp_path / "impostor")
        Path(seen).write_bytes(b"not the blob")
    _hand_out_invisible_paths(server, seen)
    key, data = _blob(server, 300_000)
    cache = BlobCache(tmp_path / "cache", server.ha, server.sock.endpoint, server.secret, fetch_retries=0)
    assert cache.open("job-x", key).read_bytes() == data
    assert cache.stats.get("local_copies", 0) == 0
    _server_stat(server, "bytes_served", len(data))
    assert [("boot_id" in g) for g in server.gets] == [True, False]


def test_a_same_host_cache_still_copies_by_path(server, tmp_path):
    if not BOOT_ID:
        pytest.skip("no /proc/sys/kernel/random/boot_id")
    key, data = _blob(server, 200_000)
    cache = BlobCache(tmp_path / "cache", server.ha, server.sock.endpoint, server.secret)
    assert cache.open("job-x", key).read_bytes() == data
    assert cache.stats["local_copies"] == 1 and server.blobs.stats.get("bytes_served", 0) == 0


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_retries_against_the_server_back_off_exponentially_with_a_cap_and_jitter(tmp_path):
    clock = FakeClock()
    cache = BlobCache(tmp_path / "cache", VoidBlobStore(), _closed_port(), new_secret(), fetch_retries=8,
                      clock=clock, rng=random.Random(7), initial_backoff=0.1, max_backoff=2.0)
    with pytest.raises(BlobNotFoundError, match="attempt 9"):
        cache.open("job-x", BlobKey.parse("t-" + "0" * 32))
    sleeps = clock.sleeps
    assert len(sleeps) == 8, "one pause before every retry, none before the first attempt or after the last"
    nominal = [min(2.0, 0.1 * 2 ** i) for i in range(8)]
    for got, cap in zip(sleeps, nominal):
        assert cap / 2 <= got <= cap, f"jittered sleep {got} outside [{cap / 2}, {cap}]"
    assert sleeps[:5] == sorted(sleeps[:5]) and sleeps[4] > 4 * sleeps[0], f"sleeps must grow: {sleeps}"
    assert max(sleeps) <= 2.0, "capped"
    assert len(set(sleeps)) == len(sleeps), "jittered, not a fixed schedule"


def test_a_missing_blob_is_not_retried(server, tmp_path):
    clock = FakeClock()
    cache = BlobCache(tmp_path / "cache", server.ha, server.sock.endpoint, server.secret, clock=clock,
                      boot_id=OTHER_BOOT_ID)
    with pytest.raises(BlobNotFoundError):
        cache.open("job-x", BlobKey.parse("t-" + "0" * 32))
    assert clock.sleeps == []


# --- a finished job's blobs leave the executor caches (issue 7 item 1: "a job's cleanup") -------------
def test_the_sweeper_drops_a_deleted_jobs_blobs_but_not_what_a_task_still_uses(server, tmp_path):
    from sparksteward.blob.job_sweeper import CacheJobSweeper

    (k1, _), (k2, _), (k3, _) = _blob(server, 2 << 20, "done-job"), _blob(server, 1000, "done-job"), \
        _blob(server, 1000, "live-job")
    cache = BlobCache(tmp_path / "cache", server.ha, server.sock.endpoint, server.secret, boot_id=OTHER_BOOT_ID)
    p1 = cache.open("done-job", k1)
    p2 = cache.open("done-job", k2, task_attempt_id=7)  # a running task still holds this one
    p3 = cache.open("live-job", k3)
    with CacheJobSweeper(cache, server.sock.endpoint, server.secret, start=False) as sweeper:
        assert sweeper.sweep_once() == [], "nothing deleted yet"
        server.blobs.delete_job("done-job")
        assert sweeper.sweep_once() == ["done-job"]
        assert not p1.exists() and p2.exists() and p3.exists()
        cache.release_task(7)
        sweeper.sweep_once()
        assert not p2.exists() and not p2.parent.exists(), "the job's directory is gone"
        assert cache.job_ids() == {"live-job"}
        # a forced re-run stores blobs under the same id again: they are not dropped
        k4, d4 = _blob(server, 1000, "done-job")
        assert cache.open("done-job", k4).read_bytes() == d4
        assert sweeper.sweep_once() == [] and cache.path("done-job", k4).exists()
        # and a dropped blob is fetched again if asked for
    assert cache.open("live-job", k3).exists()


def test_the_sweeper_thread_drops_within_its_interval_and_close_joins_it(server, tmp_path):
    from sparksteward.blob.job_sweeper import CacheJobSweeper

    from tests.helpers import wait_until

    key, _ = _blob(server, 1000, "short-job")
    cache = BlobCache(tmp_path / "cache", server.ha, server.sock.endpoint, server.secret, boot_id=OTHER_BOOT_ID)
    path = cache.open("short-job", key)
    sweeper = CacheJobSweeper(cache, server.sock.endpoint, server.secret, interval=0.05)
    try:
        server.blobs.delete_job("short-job")
        wait_until(lambda: not path.exists(), timeout=5, what="the sweeper to drop the job's blob")
    finally:
        sweeper.close()
        sweeper.close()
    assert not sweeper._thread.is_alive()


def test_deleted_jobs_rejects_a_malformed_request(server):
    from sparksteward.errors import InvalidIdError

    with Connection.connect(server.sock.endpoint, server.secret) as conn:
        with pytest.raises(InvalidIdError, match="job_ids"):
            conn.request("blob.deleted_jobs", job_ids="a-job")
        with pytest.raises(InvalidIdError):
            conn.request("blob.deleted_jobs", job_ids=["../x"])
