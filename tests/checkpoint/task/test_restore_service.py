"""The driver agent's restore_from/savepoint ops over a real authenticated socket, without Spark
(issue 8): state.check, state.register with restore_from (restored, kept after a restart, replaced
before the first checkpoint, ignored when open or checkpointed), state.savepoint."""

from __future__ import annotations

import uuid

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CheckpointError, ParallelismError
from sparksteward.wire import AgentServer, Connection, new_secret

from tests.helpers import wait_until
from tests.helpers.checkpoint import BATCHES, M, P, run_batch
from tests.helpers.state import timed


@pytest.fixture
def driver(tmp_path):
    """``connect()`` starts a fresh StateService (an application start; the previous application
    stops first, releasing its leases) and returns a connection."""
    secret = new_secret()
    opened = []

    def connect():
        for _, _, service in opened:
            service.close()
        server = AgentServer("127.0.0.1", 0, secret, {})
        service = StateService(str(tmp_path / "chk"), "c1", commit_timeout=30)
        service.register_handlers(server)
        conn = Connection.connect(server.endpoint, secret)
        opened.append((server, conn, service))
        return conn

    yield connect
    for server, conn, service in opened:
        conn.close()
        server.close()
        service.close()


@pytest.fixture
def source(tmp_path):
    storage = CheckpointStorage.open(str(tmp_path / "chk"), "a", "c1")
    coord = CheckpointCoordinator(storage, P, M)
    for n in range(2):
        run_batch(coord, storage, tmp_path / "a", n, BATCHES[n])
        coord.complete(n)
    return storage


def register(conn, name, **fields):
    return conn.request("state.register", name=name, checkpoint_dir=None, parallelism=P, max_parallelism=M,
                        key_type="string", num_retained=1, **fields)


def test_register_restores_keeps_replaces_and_ignores(tmp_path, driver, source):
    conn = driver()
    chk1, chk0 = source.url_of("chk-1"), source.url_of("chk-0")
    checked = conn.request("state.check", name="b", checkpoint_dir=None, max_parallelism=M, restore_from=chk1)
    assert checked["key_type"] == "string" and checked["restore_from"] == "no_claim"
    with pytest.raises(ParallelismError, match="Changing max_parallelism is refused"):
        conn.request("state.check", name="b", checkpoint_dir=None, max_parallelism=2 * M, restore_from=chk1)
    b = CheckpointStorage.open(str(tmp_path / "chk"), "b", "c1")
    assert not b.has_restored()

    reply = register(conn, "b", restore_from=chk1)
    assert reply["restore"]["action"] == "restored" and reply["restore"]["bytes_streamed"] == 0
    assert reply["restore"]["linked"] == len(b.stored_files()) > 0
    assert register(conn, "b", restore_from=chk0)["restore"]["action"] == "ignored"  # open already

    sp = str(tmp_path / "sp")
    saved = conn.request("state.savepoint", name="b", url=sp)
    assert saved["metadata"] == sp + "/_metadata" and saved["bytes_streamed"] == 0
    with pytest.raises(CheckpointError, match="already exists"):
        conn.request("state.savepoint", name="b", url=sp)

    conn = driver()  # the application restarts before b's first checkpoint
    assert register(conn, "b", restore_from=chk1)["restore"]["action"] == "kept"
    conn = driver()
    assert register(conn, "b", restore_from=chk0)["restore"]["action"] == "restored"  # replaced
    assert CheckpointStorage.open(str(tmp_path / "chk"), "b", "c1").read_metadata(-1).checkpoint_id == 0

    conn = driver()  # a state with its own checkpoints ignores restore_from, with a note
    reply = register(conn, "a", restore_from=sp)
    assert reply["restore"]["action"] == "ignored" and "already has checkpoint 1 of its own" in reply["restore"]["note"]
    reply = register(conn, "c", restore_from=sp)  # the savepoint restores elsewhere
    assert reply["restore"]["action"] == "restored" and reply["restore"]["checkpoint_id"] == 1
    with pytest.raises(CheckpointError, match="keyed state 'nothing' has no completed checkpoint"):
        conn.request("state.savepoint", name="nothing", url=str(tmp_path / "sp2"))


def test_savepoint_of_a_state_not_open_in_this_application(tmp_path, driver, source):
    conn = driver()
    sp = str(tmp_path / "sp-a")
    saved = conn.request("state.savepoint", name="a", url=sp, checkpoint_dir=None)
    assert saved["checkpoint_id"] == 1 and saved["bytes_streamed"] == 0
    reply = register(conn, "d", restore_from=sp)
    assert reply["restore"]["action"] == "restored" and reply["restore"]["source_state"] == "a"


def test_a_slow_restore_of_one_state_holds_up_no_other_state_and_no_heartbeat(tmp_path, s3):
    """Item 10: state b restores from S3 while every CopyObject takes 1.5 s; meanwhile state a's
    begin and info, and an executor agent's heartbeat, are answered at once (one service-wide lock
    held them for the whole copy before)."""
    import threading

    src = CheckpointStorage.open(s3.url(f"src-{uuid.uuid4().hex[:8]}"), "a", "c1")
    coord = CheckpointCoordinator(src, P, M)
    run_batch(coord, src, tmp_path / "src", 0, BATCHES[0])
    coord.complete(0)
    secret = new_secret()
    server = AgentServer("127.0.0.1", 0, secret, {})
    service = StateService(s3.url(f"chk-{uuid.uuid4().hex[:8]}"), "c1", commit_timeout=30)
    service.register_handlers(server)
    conns = [Connection.connect(server.endpoint, secret) for _ in range(2)]
    try:
        register(conns[0], "fast")
        errors = []

        def slow_register():
            try:
                register(conns[1], "slow", restore_from=src.url_of("chk-0"))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        with s3.slow("CopyObject", 1.5):
            t = threading.Thread(target=slow_register)
            t.start()
            wait_until(lambda: any(op == "CopyObject" for op, _ in s3.in_flight()), timeout=30, what="the copy")
            timings = timed({
                "begin": lambda: conns[0].request("state.begin", name="fast", checkpoint_id=0),
                "info": lambda: conns[0].request("state.info", name="fast"),
                "heartbeat": lambda: conns[0].request("state.merge_poll", agent="exec-1", wait=0, pools=[],
                                                      closed=[], working=[]),
            })
            copying = any(op == "CopyObject" for op, _ in s3.in_flight())
            t.join(120)
        assert not errors, errors
        assert copying, "the restore finished before the other requests were timed"
        assert max(timings.values()) < 1.0, timings
        assert conns[0].request("state.info", name="slow")["restore"]["action"] == "restored"
    finally:
        for c in conns:
            c.close()
        server.close()
        service.close()
