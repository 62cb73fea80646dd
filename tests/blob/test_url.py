"""``steward://`` URLs (issue 11): parsing, scopes, and ``blob.open_file`` on the executor's BlobCache
and the driver's BlobServer, over real sockets and over a real agent's pipes. No Spark."""

from __future__ import annotations

import os
import time
from pathlib import Path

import orjson
import pytest
from sparksteward import shim_protocol
from sparksteward.blob.cache import BlobCache
from sparksteward.blob.client import BlobClient
from sparksteward.blob.key import BlobKey
from sparksteward.blob.server import BlobServer
from sparksteward.blob.store import FileSystemBlobStore
from sparksteward.blob.url import BlobUrl, app_scope, cluster_scope
from sparksteward.errors import BlobNotFoundError, BlobScopeError, InvalidIdError
from sparksteward.testing.agent import AgentProcess
from sparksteward.testing.clock import FakeClock
from sparksteward.wire import AgentServer, Connection, new_secret

KEY = BlobKey.parse("p-" + "ab" * 16)


@pytest.mark.parametrize("job", [None, "app-20261122-0001", "ingest/2026-11-22", "ünïcode job", "a.b_c-d"])
def test_urls_round_trip_every_job_id(job):
    url = BlobUrl(app_scope("s" * 64), job, KEY, "udf-1.0.jar")
    text = str(url)
    assert text.startswith("steward://app-") and text.endswith(f"/{KEY}/udf-1.0.jar")
    assert text.count("/") == 5  # the job never adds a path segment
    assert BlobUrl.parse(text) == url


@pytest.mark.parametrize("bad", [
    "s3://bucket/x.jar", "steward://app-0123456789abcdef/job/p-00/x.jar",
    "steward://app-0123456789abcdef/job/" + str(KEY),  # no file name
    "steward://app-0123456789abcdef/a/b/" + str(KEY) + "/x.jar",  # a job with a slash, unencoded
    "steward://nobody/job/" + str(KEY) + "/x.jar",
    "steward://app-0123456789abcdef/job/" + str(KEY) + "/..",
    "steward://app-0123456789abcdef/~zz/" + str(KEY) + "/x.jar",
    "steward://app-0123456789abcdef/..%2F/" + str(KEY) + "/x.jar",
])
def test_malformed_urls_are_refused_naming_the_url(bad):
    with pytest.raises(InvalidIdError):
        BlobUrl.parse(bad)


def test_scope_of_another_application_or_cluster_is_refused():
    mine, other = new_secret(), new_secret()
    BlobUrl(app_scope(mine), "j", KEY, "x.jar").check_scope(mine, None)
    with pytest.raises(BlobScopeError, match="another application"):
        BlobUrl(app_scope(other), "j", KEY, "x.jar").check_scope(mine, "default")
    url = BlobUrl(cluster_scope("prod"), None, KEY, "x.jar")
    url.check_scope(mine, "prod")
    with pytest.raises(BlobScopeError, match="cluster id 'default'"):
        url.check_scope(mine, "default")
    with pytest.raises(BlobScopeError, match="no HA store"):
        url.check_scope(mine, None)


class _Cluster:
    """A BlobServer with an HA store behind a real socket, and an executor-side BlobCache behind another."""

    def __init__(self, tmp: Path) -> None:
        self.secret = new_secret()
        self.ha = FileSystemBlobStore(str(tmp / "ha"), "default")
        self.server = BlobServer(tmp / "server", self.ha, clock=FakeClock(), timer=False, secret=self.secret)
        self.driver = AgentServer("127.0.0.1", 0, self.secret, {})
        self.server.register_handlers(self.driver)
        self.cache = BlobCache(tmp / "cache", self.ha, self.driver.endpoint, self.secret, fetch_retries=1,
                               initial_backoff=0.01, max_backoff=0.02)
        self.executor = AgentServer("127.0.0.1", 0, self.secret, {})
        self.cache.register_handlers(self.executor)
        self.conn = Connection.connect(self.driver.endpoint, self.secret)
        self.client = BlobClient(lambda: self.conn)

    def close(self) -> None:
        self.conn.close()
        for c in (self.executor, self.driver, self.cache, self.server):
            c.close()


@pytest.fixture()
def cluster(tmp_path):
    c = _Cluster(tmp_path)
    yield c
    c.close()


def _open(endpoint: str, secret: str, url: str) -> dict:
    with Connection.connect(endpoint, secret) as conn:
        return conn.request("blob.open_file", url=url)


def test_open_file_on_executor_and_driver_serves_the_verified_blob(cluster):
    data = os.urandom(100_000)
    key = cluster.client.put_bytes(data, "job-1", permanent=True)
    url = str(BlobUrl(app_scope(cluster.secret), "job-1", key, "udf.jar"))
    on_exec = _open(cluster.executor.endpoint, cluster.secret, url)
    assert Path(on_exec["path"]).read_bytes() == data and on_exec["size"] == len(data)
    assert Path(on_exec["path"]).is_relative_to(cluster.cache.dir)
    assert cluster.cache.stats["ha_fetches"] == 1 and cluster.cache.stats["file_opens"] == 1
    _open(cluster.executor.endpoint, cluster.secret, url)  # a second open is a cache hit
    assert cluster.cache.stats["ha_fetches"] == 1 and cluster.cache.stats["hits"] == 1
    on_driver = _open(cluster.driver.endpoint, cluster.secret, url)
    assert Path(on_driver["path"]) == cluster.server.local_path("job-1", key)


def test_corrupt_ha_copy_falls_back_to_the_server_and_both_corrupt_names_every_source(cluster, tmp_path):
    data = os.urandom(50_000)
    key = cluster.client.put_bytes(data, "job-1", permanent=True)
    url = str(BlobUrl(app_scope(cluster.secret), "job-1", key, "udf.jar"))
    ha_file = next((tmp_path / "ha").rglob(str(key)))
    ha_file.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])   # never the same byte
    assert Path(_open(cluster.executor.endpoint, cluster.secret, url)["path"]).read_bytes() == data
    assert cluster.cache.stats["ha_fetches"] == 0 and cluster.cache.stats["transfers"] == 1
    # both corrupt: a fresh cache, and the server's local copy damaged too (it re-verifies after a refill)
    cluster.server.local_path("job-1", key).write_bytes(bytes([data[0] ^ 0x55]) + data[1:])
    cluster.server._verified.clear()
    cluster.cache.drop_job("job-1")
    with pytest.raises(BlobNotFoundError) as err:
        _open(cluster.executor.endpoint, cluster.secret, url)
    msg = str(err.value)
    assert str(key) in msg and "HA store" in msg and "BlobServer" in msg


def test_unknown_key_and_foreign_scope_are_clear_errors(cluster):
    unknown = str(BlobUrl(app_scope(cluster.secret), "job-1", KEY, "udf.jar"))
    with pytest.raises(BlobNotFoundError, match=str(KEY)):
        _open(cluster.executor.endpoint, cluster.secret, unknown)
    foreign = str(BlobUrl(app_scope(new_secret()), "job-1", KEY, "udf.jar"))
    for endpoint in (cluster.executor.endpoint, cluster.driver.endpoint):
        with pytest.raises(BlobScopeError, match="another application"):
            _open(endpoint, cluster.secret, foreign)


def _reply(agent: AgentProcess, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = agent.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the agent closed its stdout"
        msg = shim_protocol.decode(line)
        if msg["type"] == "reply":
            return msg
    raise AssertionError("no reply")


def test_the_shim_pipe_answers_open_file_with_the_socket_ops_handler(tmp_path):
    """Plays the JVM: open_file on the executor agent's stdin, reply lines on its stdout, one per id."""
    conf = {"spark.steward.state-dir": str(tmp_path / "state"),
            "spark.steward.blob.ha.storage-path": str(tmp_path / "ha")}
    with AgentProcess("driver", conf) as driver:
        assert driver.ready, driver.first
        with driver.connect() as conn:
            data = os.urandom(10_000)
            key = BlobClient(lambda: conn).put_bytes(data, "job-p", permanent=True)
        with AgentProcess("executor", conf, secret=driver.secret, rendezvous_dir=str(tmp_path / "exec"),
                          driver_endpoint=driver.endpoint) as executor:
            assert executor.ready, executor.first
            good = str(BlobUrl(app_scope(driver.secret), "job-p", key, "f.bin"))
            executor.event("open_file", id=7, url=good)
            reply = _reply(executor)
            assert reply["id"] == 7 and reply["ok"] and Path(reply["path"]).read_bytes() == data
            executor.event("open_file", id=8, url=str(BlobUrl(app_scope("x" * 64), "job-p", key, "f.bin")))
            executor.event("open_file", id=9, url="steward://nonsense")
            replies = {r["id"]: r for r in (_reply(executor), _reply(executor))}
            assert replies[8]["error"]["code"] == "BLOB_SCOPE" and not replies[8]["ok"]
            assert replies[9]["error"]["code"] == "INVALID_ID"
        driver.event("open_file", id=1, url=good)  # the driver agent answers from its store
        reply = _reply(driver)
        assert reply["ok"] and Path(reply["path"]).read_bytes() == data


def test_reply_lines_decode():
    assert shim_protocol.decode(shim_protocol.encode_reply(3, {"path": "/x", "size": 1}))["path"] == "/x"
    bad = shim_protocol.decode(shim_protocol.encode_reply(4, code="BLOB_NOT_FOUND", message="m"))
    assert bad["error"] == {"code": "BLOB_NOT_FOUND", "message": "m"}
    assert orjson.loads(shim_protocol.encode_reply(5, {}))["ok"] is True


def test_blobs_put_uploads_once_and_prints_a_url_executors_open(cluster, tmp_path, capsys):
    from sparksteward.cli import main

    jar = tmp_path / "udf-2.jar"
    jar.write_bytes(os.urandom(70_000))
    assert main(["blobs", "put", str(jar), "--ha", str(tmp_path / "ha")]) == 0
    out, err = capsys.readouterr()
    url = BlobUrl.parse(out.strip())
    assert url.cluster_id == "default" and url.job_id is None and url.name == "udf-2.jar" and "uploaded" in err
    (stored,) = (tmp_path / "ha").rglob(str(url.key))
    first = stored.stat()
    assert main(["blobs", "put", str(jar), "--ha", str(tmp_path / "ha")]) == 0  # same content: nothing sent
    out2, err2 = capsys.readouterr()
    assert out2 == out and "0 bytes transferred" in err2
    assert (stored.stat().st_ino, stored.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    opened = _open(cluster.executor.endpoint, cluster.secret, str(url))  # any application of the cluster
    assert Path(opened["path"]).read_bytes() == jar.read_bytes()
    assert Path(_open(cluster.driver.endpoint, cluster.secret, str(url))["path"]).read_bytes() == jar.read_bytes()
    assert main(["blobs", "put", str(jar), "--ha", str(tmp_path / "ha"), "--cluster-id", "other"]) == 0
    other = capsys.readouterr().out.strip()
    with pytest.raises(BlobScopeError, match="cluster id 'default'"):
        _open(cluster.executor.endpoint, cluster.secret, other)
    assert main(["blobs", "put", str(tmp_path / "missing.jar"), "--ha", str(tmp_path / "ha")]) == 2
