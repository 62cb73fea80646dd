"""AgentLink: reused authenticated connections to one agent, replaced when stale, closed when idle."""

from __future__ import annotations

import threading

import pytest
from sparksteward.errors import AgentUnavailableError, StewardError
from sparksteward.wire import AgentServer, new_secret
from sparksteward.wire.link import AgentLink

from tests.helpers import wait_until


@pytest.fixture()
def server():
    calls: list[str] = []
    drop = threading.Event()

    def echo(conn, req):
        calls.append(req["op"])
        if drop.is_set():   # the agent goes away mid-request: the connection breaks before the reply
            drop.clear()
            conn.close()
            return None
        return {"n": req.get("n")}

    secret = new_secret()
    with AgentServer("127.0.0.1", 0, secret, {"echo": echo, "once": echo}, timeout=30) as srv:
        yield srv, secret, calls, drop


def test_requests_reuse_one_connection(server):
    srv, secret, calls, _ = server
    link = AgentLink(srv.endpoint, secret)
    try:
        for i in range(20):
            assert link.request("echo", n=i)["n"] == i
        assert link.handshakes == 1 and srv.handshakes == 1 and srv.requests["echo"] == 20
    finally:
        link.close()


def test_threads_at_once_get_a_connection_each_and_the_pool_keeps_at_most_max_pooled(server):
    srv, secret, _, _ = server
    link = AgentLink(srv.endpoint, secret, max_pooled=2)
    gate = threading.Barrier(6)

    def one(i: int) -> None:
        gate.wait(10)
        link.request("echo", n=i)

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert 2 <= link.handshakes <= 6
        before = link.handshakes
        link.request("echo", n=0)
        assert link.handshakes == before, "a pooled connection is reused"
        wait_until(lambda: len(srv._conns) <= 2, timeout=10, what="only the pooled connections left open")
    finally:
        link.close()


def test_a_connection_idle_past_max_idle_is_closed_and_replaced(server):
    srv, secret, _, _ = server
    link = AgentLink(srv.endpoint, secret, max_idle=0.2)
    try:
        link.request("echo")
        wait_until(lambda: len(srv._conns) == 1, timeout=5, what="one open connection")
        import time

        time.sleep(0.3)
        link.request("echo")   # the old one is not reused, and is closed
        assert link.handshakes == 2
        wait_until(lambda: len(srv._conns) == 1, timeout=5, what="the idle connection closed")
    finally:
        link.close()


def test_a_broken_connection_is_retried_only_for_ops_that_may_arrive_twice(server):
    srv, secret, calls, drop = server
    link = AgentLink(srv.endpoint, secret)
    try:
        link.request("echo")             # a pooled connection
        drop.set()
        assert link.request("echo", retry=True, n=7)["n"] == 7   # sent again on a new connection
        assert calls[-2:] == ["echo", "echo"] and link.handshakes == 2
        drop.set()
        with pytest.raises((OSError, StewardError)):
            link.request("once", n=8)    # not repeatable: the caller learns it may or may not have arrived
        assert calls[-1] == "once" and calls.count("once") == 1
    finally:
        link.close()


def test_an_agent_that_is_gone_is_reported_clearly(server):
    srv, secret, _, _ = server
    link = AgentLink(srv.endpoint, secret)
    link.request("echo")
    srv.close()
    try:
        with pytest.raises(AgentUnavailableError, match="cannot reach the spark-steward agent"):
            link.request("echo", retry=True)
    finally:
        link.close()
