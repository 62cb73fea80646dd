"""Requests against real agents and servers (issue 7 items 6, 7 and 8): typed fields, rejected
uploads, replies over the size bound, pagination, the bounded event buffer, and client retries."""

from __future__ import annotations

import threading
import time

import orjson
import pytest
from sparksteward.blob.server import BlobServer
from sparksteward.blob.store import VoidBlobStore
from sparksteward.client import Steward
from sparksteward.errors import AgentUnavailableError, MessageTooLargeError, ProtocolError, StewardError
from sparksteward.testing.agent import AgentProcess
from sparksteward.wire import AgentServer, Connection, new_secret
from sparksteward.wire import connection as wire

from tests.helpers import wait_until


@pytest.fixture()
def driver(tmp_path):
    conf = {"spark.steward.state-dir": str(tmp_path / "state"), "spark.steward.rpc.max-message-size": "64k",
            "spark.steward.agent.events.max-bytes": "64k"}
    with AgentProcess("driver", conf) as agent:
        assert agent.ready, agent.first
        yield agent


def _code(exc: BaseException) -> str:
    return getattr(exc, "remote_code", None) or getattr(exc, "code", "")


# --- item 6: typed fields -----------------------------------------------------------------------
def test_force_must_be_a_json_boolean(driver):
    with driver.connect() as conn:
        assert conn.request("jobs.begin", job_id="j1", force=False)["started"]
        conn.request("jobs.finish", job_id="j1", status="SUCCEEDED", wait=5)
        with pytest.raises(StewardError) as err:
            conn.request("jobs.begin", job_id="j1", force="false")
        assert _code(err.value) == "INVALID_REQUEST"
        assert "jobs.begin" in str(err.value) and "force" in str(err.value) and "'false'" in str(err.value)
        assert conn.request("jobs.get", job_id="j1")["entry"]["result"]["status"] == "SUCCEEDED"


@pytest.mark.parametrize("op", ["jobs.begin", "jobs.get", "jobs.finish", "jobs.add_cleanup"])
def test_missing_job_id_is_refused_not_turned_into_none(driver, op):
    with driver.connect() as conn:
        with pytest.raises(StewardError) as err:
            conn.request(op, status="SUCCEEDED", step={"kind": "delete_path", "target": "/tmp/x"})
        assert _code(err.value) == "INVALID_REQUEST" and "job_id" in str(err.value)
        assert conn.request("jobs.get", job_id="None")["entry"] is None


@pytest.mark.parametrize("wait", ["inf", "NaN", -1, 1e9, True])
def test_bad_wait_is_refused_before_anything_is_committed(driver, wait):
    with driver.connect() as conn:
        assert conn.request("jobs.begin", job_id="jw")["started"]
        with pytest.raises(StewardError) as err:
            conn.request("jobs.finish", job_id="jw", status="SUCCEEDED", wait=wait)
        assert _code(err.value) == "INVALID_REQUEST" and "wait" in str(err.value)
        assert conn.request("jobs.get", job_id="jw")["entry"] is None  # not finished
        assert conn.request("jobs.finish", job_id="jw", status="SUCCEEDED", wait=5)["entry"]["result"]["status"] == "SUCCEEDED"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, conn: Connection, req: dict) -> dict:
        self.calls.append(req)
        return {}


def _next_frame(conn: Connection, msg: dict) -> bytes:
    """The bytes ``conn`` would send for ``msg`` (and advance its sequence number)."""
    seal = getattr(conn, "_frame", None)
    body = orjson.dumps(msg)
    return seal(body) if seal else len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize("bad", [{"type": "x"}, {"job_id": 5}, {"size": "27"}])
def test_rejected_upload_body_is_never_parsed_as_requests(tmp_path, bad):
    secret, rec = new_secret(), Recorder()
    blobs = BlobServer(tmp_path / "server", VoidBlobStore(), timer=False)
    with AgentServer("127.0.0.1", 0, secret, {"record": rec}) as server:
        blobs.register_handlers(server)
        conn = Connection.connect(server.endpoint, secret, timeout=5)
        inner_body = orjson.dumps({"op": "record"})
        inner_len = 4 + len(inner_body) + getattr(wire, "TAG_SIZE", 0)
        head = _next_frame(conn, {"op": "blob.put", "job_id": "j", "type": "t", "size": inner_len, **bad})
        inner = _next_frame(conn, {"op": "record"})  # a valid next frame, smuggled as the body
        assert len(inner) == inner_len
        conn.sock.sendall(head + inner)
        with pytest.raises(StewardError) as err:
            Connection._check(conn.recv())
        assert _code(err.value) == "INVALID_REQUEST" and "blob.put" in str(err.value)
        with pytest.raises((ProtocolError, OSError)):
            conn.recv()  # the server closed the connection rather than read the body as requests
        assert rec.calls == []
        conn.close()
    blobs.close()


# --- item 7: reply size and pagination ----------------------------------------------------------
def test_reply_over_the_size_bound_is_a_too_large_error_and_the_connection_survives():
    secret = new_secret()
    handlers = {"big": lambda conn, req: {"x": "a" * 4096}, "ping": lambda conn, req: {"pong": True}}
    with AgentServer("127.0.0.1", 0, secret, handlers, max_message=1024) as server:
        with Connection.connect(server.endpoint, secret, timeout=5) as conn:
            with pytest.raises(MessageTooLargeError, match="big.*max-message-size"):
                conn.request("big")
            assert conn.request("ping")["pong"] is True


def test_jobs_list_pages_and_steward_reads_every_page(driver):
    with driver.connect() as conn:
        for i in range(150):
            conn.request("jobs.begin", job_id=f"job-{i:03d}")
            conn.request("jobs.finish", job_id=f"job-{i:03d}", status="SUCCEEDED", payload="p" * 1000, wait=5)
        page = conn.request("jobs.list", limit=10)
        assert [e["result"]["job_id"] for e in page["entries"]] == [f"job-{i:03d}" for i in range(10)]
        assert page["next"] == "job-009"
        page2 = conn.request("jobs.list", limit=10, cursor=page["next"])
        assert page2["entries"][0]["result"]["job_id"] == "job-010"
    st = Steward(driver.endpoint, driver.secret, timeout=10)
    ids = [e.job_id for e in st.job_results.list()]  # 150 KB of entries through a 64 KB bound
    assert ids == [f"job-{i:03d}" for i in range(150)]
    st.close()


def test_events_page_and_the_buffer_is_bounded_in_bytes(driver):
    for i in range(400):
        driver.event("executor_added", executor_id=str(i), host="h" * 1000, total_cores=1)
    with driver.connect() as conn:
        wait_until(lambda: conn.request("health")["events_seen"].get("executor_added") == 400, timeout=20)
        first = conn.request("events", type="executor_added", limit=5)
        assert len(first["events"]) == 5 and first["next"] is not None
    st = Steward(driver.endpoint, driver.secret, timeout=10)
    events = st.events("executor_added")
    size = sum(len(orjson.dumps(e)) for e in events)
    assert 0 < size <= 64 << 10, size  # bounded in bytes, though the count bound is larger
    assert events[-1]["executor_id"] == "399"  # the newest are kept
    assert [int(e["executor_id"]) for e in events] == sorted(int(e["executor_id"]) for e in events)
    st.close()


# --- item 8: retries and timeouts ---------------------------------------------------------------
class Slow:
    """Counts calls; the first call sleeps past the client's timeout."""

    def __init__(self, delay: float) -> None:
        self.delay, self.calls = delay, 0
        self.lock = threading.Lock()

    def __call__(self, conn: Connection, req: dict) -> dict:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            time.sleep(self.delay)
        return {"refs": 1, "entry": None, "state": "running"}


@pytest.mark.parametrize("op", ["jobs.finish", "blob.acquire", "blob.release"])
def test_non_idempotent_ops_are_sent_once_after_a_timeout(op):
    secret, slow = new_secret(), Slow(1.5)
    with AgentServer("127.0.0.1", 0, secret, {op: slow}) as server:
        st = Steward(server.endpoint, secret, timeout=0.5)
        with pytest.raises(AgentUnavailableError, match="not retried"):
            if op == "jobs.finish":
                st.request(op, job_id="j", status="SUCCEEDED", wait=0)
            elif op == "blob.acquire":
                st.blobs.acquire("t-" + "0" * 32, "j")
            else:
                st.blobs.release("t-" + "0" * 32, "j")
        time.sleep(2.0)  # give a retry every chance to arrive
        assert slow.calls == 1
        st.close()


def test_idempotent_ops_are_retried_after_a_timeout():
    secret, slow = new_secret(), Slow(1.5)
    with AgentServer("127.0.0.1", 0, secret, {"health": slow}) as server:
        st = Steward(server.endpoint, secret, timeout=0.5)
        assert st.health()["state"] == "running"
        assert slow.calls == 2
        st.close()


def test_socket_timeout_covers_the_requested_wait():
    secret = new_secret()

    def finish(conn, req):
        time.sleep(1.0)  # the server waits for the commit, as asked
        return {"entry": None}

    with AgentServer("127.0.0.1", 0, secret, {"jobs.finish": finish}) as server:
        st = Steward(server.endpoint, secret, timeout=0.4)
        assert st.request("jobs.finish", job_id="j", status="SUCCEEDED", wait=1.0) == {"ok": True, "entry": None}
        st.close()


def test_a_connection_the_agent_closed_while_idle_is_replaced_before_a_non_idempotent_send():
    secret, calls = new_secret(), []

    def finish(conn, req):
        calls.append(req)
        return {"entry": None}

    with AgentServer("127.0.0.1", 0, secret, {"jobs.finish": finish, "health": lambda c, r: {}},
                     timeout=0.3) as server:
        st = Steward(server.endpoint, secret, timeout=5)
        st.health()
        time.sleep(1.0)  # the agent drops the idle connection
        st.request("jobs.finish", job_id="j", status="SUCCEEDED", wait=0)
        assert len(calls) == 1
        st.close()


def test_steward_get_takes_the_rpc_timeout_from_the_spark_conf():
    class Conf:
        def get(self, key, default=None):
            return {"spark.steward.rpc.timeout": "7s"}.get(key, default)

        def getAll(self):
            return [("spark.steward.rpc.timeout", "7s")]

    from sparksteward.client import _client_settings

    assert _client_settings(Conf())["timeout"] == 7.0


def test_workers_and_executor_side_connections_use_the_rpc_timeout(tmp_path):
    """Python workers read the socket timeout from the rendezvous record; the cache and its job sweeper
    take ``spark.steward.rpc.timeout`` too (issue 7 item 8), instead of a hard-coded one."""
    from sparksteward import worker
    from sparksteward.blob.cache import BlobCache
    from sparksteward.blob.job_sweeper import CacheJobSweeper
    from sparksteward.rendezvous import Rendezvous

    secret = new_secret()
    with AgentServer("127.0.0.1", 0, secret, {"health": lambda conn, req: {}}) as server:
        Rendezvous(tmp_path).publish(server.endpoint, secret, "7", timeout=7.5)
        worker._cached = None
        conn = worker.executor_connection(str(tmp_path))
        try:
            assert conn.sock.gettimeout() == 7.5 and conn.request("health")["ok"]
        finally:
            conn.close()
            worker._cached = None
        cache = BlobCache(tmp_path / "cache", VoidBlobStore(), server.endpoint, secret, rpc_timeout=3.0)
        sweeper = CacheJobSweeper(cache, server.endpoint, secret, start=False, timeout=3.0)
        try:
            assert cache.rpc_timeout == 3.0 and sweeper._timeout == 3.0
        finally:
            sweeper.close()
            cache.close()


def test_an_agent_serves_at_most_rpc_max_connections_at_once(tmp_path):
    """spark.steward.rpc.max-connections bounds the authenticated connections an agent serves (the
    executor agents keep idle ones to the driver agent): one over the bound waits for a slot, up to
    rpc.timeout, and is then refused; once a connection closes, a new one is served."""
    from sparksteward.errors import AgentUnavailableError

    conf = {"spark.steward.state-dir": str(tmp_path / "state"), "spark.steward.rpc.max-connections": "2",
            "spark.steward.rpc.timeout": "1s"}
    with AgentProcess("driver", conf) as agent:
        assert agent.ready, agent.first
        held = [agent.connect(), agent.connect()]
        busy = threading.Event()

        def keep_busy() -> None:   # an idle connection is dropped after rpc.timeout, freeing its slot: these
            while not busy.is_set():   # two must stay in use while the third waits its rpc.timeout for one
                for conn in held:
                    conn.request("health")
                busy.wait(0.1)

        pinger = threading.Thread(target=keep_busy, daemon=True)
        try:
            for conn in held:
                conn.request("health")
            pinger.start()
            third = agent.connect()
            with pytest.raises(AgentUnavailableError, match="maximum number of connections"):
                third.request("health")
            third.close()
            busy.set()
            pinger.join(5)
            held.pop().close()
            with agent.connect() as fourth:
                assert fourth.request("health")["role"] == "driver"
        finally:
            busy.set()
            if pinger.is_alive():
                pinger.join(5)
            for conn in held:
                conn.close()
