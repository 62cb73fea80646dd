"""Issue 35 item 12: a job's delete and the puts of that job beside it, local and HA.

``delete_job(J)`` deletes J's local directory, then its HA directory. A permanent put of J that landed
between the two was acknowledged with its HA copy and lost it to the HA delete: the next agent
answered ``BlobNotFoundError`` (a forced re-run while the old run's cleanup is still going). Now a put
of J waits for a running delete of J, and one that was storing when the delete began stores its
copies again after it: every acknowledged permanent put not finished before the delete began has its
HA copy, and the next agent serves it.

The HA store here is a real :class:`FileSystemBlobStore` (file:// and moto S3) with a pause in it:
in ``delete_job`` (the server has deleted the local copies and not yet the HA ones) and after a
``put`` (the copy is stored, the reply not yet sent). The store is not the thing under test; the
server's ordering is.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sparksteward.blob.client import BlobClient
from sparksteward.blob.key import BlobKey
from sparksteward.blob.store import FileSystemBlobStore
from sparksteward.wire import Connection

from tests.helpers.blob import BlobRig

_n = itertools.count()


class PausingStore(FileSystemBlobStore):
    """A real HA store that calls ``before_delete_job(job_id)`` before deleting a job's directory and
    ``after_put(job_id, key)`` once a blob's copy is stored (both no-ops until a test sets them)."""

    def __init__(self, url: str, cluster_id: str) -> None:
        super().__init__(url, cluster_id)
        self.before_delete_job: Callable[[str | None], None] = lambda job_id: None
        self.after_put: Callable[[str | None, BlobKey], None] = lambda job_id, key: None

    def delete_job(self, job_id: str | None) -> None:
        self.before_delete_job(job_id)
        super().delete_job(job_id)

    def put(self, job_id: str | None, key: BlobKey, local: Path, **kw: Any) -> None:
        super().put(job_id, key, local, **kw)
        self.after_put(job_id, key)


@pytest.fixture(params=["file", "s3"])
def ha_url(request, tmp_path):
    if request.param == "file":
        return str(tmp_path / "ha")
    return request.getfixturevalue("s3").url(f"race-{next(_n)}")


@pytest.fixture()
def rig(tmp_path, ha_url):
    r = BlobRig(tmp_path / "first", PausingStore(ha_url, "c1"))
    yield r
    r.close()


class Call(threading.Thread):
    """Runs ``fn`` on a client of its own (a connection of its own, as every agent client has);
    keeps its result or error and when it was sent and answered."""

    def __init__(self, rig: BlobRig, fn: Callable[[BlobClient], Any]) -> None:
        super().__init__(daemon=True)
        self.rig, self.fn = rig, fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.sent = self.answered = 0.0

    def run(self) -> None:
        conn = Connection.connect(self.rig.sock.endpoint, self.rig.secret)
        try:
            self.sent = time.monotonic()
            self.result = self.fn(BlobClient(lambda: conn))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.error = exc
        finally:
            self.answered = time.monotonic()
            conn.close()

    def outcome(self) -> Any:
        self.join(60)
        assert not self.is_alive(), "the call did not return"
        if self.error is not None:
            raise self.error
        return self.result


def started(call: Call) -> Call:
    call.start()
    return call


def until(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


def until_time(t: float) -> None:
    """Until the monotonic clock reads ``t`` (a start time of the seeded schedule)."""
    until(lambda: time.monotonic() >= t, f"the time {t}")


def put_path(data: bytes, job_id: str) -> Callable[[BlobClient], BlobKey]:
    """A same-host put: the file is written into the server's incoming dir and moved into place."""
    def put(client: BlobClient) -> BlobKey:
        fd, staged = client.staging_file()
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return client.put_path(staged, job_id, permanent=True)
    return put


def next_agent_serves(tmp_path: Path, ha_url: str, blobs: dict[BlobKey, bytes], job_id: str) -> None:
    """A fresh server over the same HA store (the next agent) serves every one of ``blobs``."""
    nxt = BlobRig(tmp_path / f"next-{next(_n)}", FileSystemBlobStore(ha_url, "c1"))
    try:
        for key, data in blobs.items():
            assert nxt.client.get_bytes(key, job_id) == data, key
    finally:
        nxt.close()


def test_a_put_during_the_jobs_delete_keeps_its_ha_copy(rig, tmp_path, ha_url):
    """Puts of J sent while delete_job(J) is between its local and its HA delete: each one that is
    acknowledged is served by the next agent (it waited for the delete, then stored its copies)."""
    store: PausingStore = rig.ha
    job = "job-rerun"
    old = os.urandom(5000)
    rig.client.put_bytes(old, job, permanent=True)  # the old run's blob: its HA copy is still there
    in_delete, go_on = threading.Event(), threading.Event()
    store.before_delete_job = lambda job_id: (in_delete.set(), go_on.wait(30))
    deleter = started(Call(rig, lambda c: c.delete_job(job)))
    assert in_delete.wait(30), "delete_job never reached the HA store"
    # the re-run puts: the old run's content (a dedup hit on the HA copy about to be deleted), new
    # content streamed, and new content from this host (blob.put_path)
    blobs = [old, os.urandom(7000), os.urandom(3000)]
    puts = [started(Call(rig, lambda c, d=blobs[0]: c.put_bytes(d, job, permanent=True))),
            started(Call(rig, lambda c, d=blobs[1]: c.put_bytes(d, job, permanent=True))),
            started(Call(rig, put_path(blobs[2], job)))]
    until(lambda: all(not p.is_alive() for p in puts) or rig.server.stats["job_gate_waits"] >= len(puts),
          "the puts returned or wait for the delete")
    go_on.set()
    deleter.outcome()
    acked = {p.outcome(): data for p, data in zip(puts, blobs)}
    assert len(acked) == 3
    next_agent_serves(tmp_path, ha_url, acked, job)


def test_a_put_storing_when_the_jobs_delete_begins_stores_again_after_it(rig, tmp_path, ha_url):
    """A put of J whose HA copy is stored but whose reply is not sent yet when delete_job(J) begins:
    the delete waits for it, and it stores its copies again after the delete before it is acknowledged."""
    store: PausingStore = rig.ha
    job = "job-inflight"
    data = os.urandom(6000)
    stored, go_on = threading.Event(), threading.Event()
    store.after_put = lambda job_id, key: (stored.set(), go_on.wait(30))
    put = started(Call(rig, lambda c: c.put_bytes(data, job, permanent=True)))
    assert stored.wait(30), "the put never stored its HA copy"
    deleter = started(Call(rig, lambda c: c.delete_job(job)))
    until(lambda: not deleter.is_alive() or rig.server.stats["job_delete_waits"] >= 1,
          "the delete returned or waits for the put")
    go_on.set()
    deleter.outcome()
    key = put.outcome()
    next_agent_serves(tmp_path, ha_url, {key: data}, job)
    assert rig.server.stats["puts_after_delete"] == 1
    # and the delete did its job: nothing else of J is left
    assert [k for k, _ in rig.ha.keys(job)] == [key]
    assert len(rig.server._job_gate) == 0


def test_puts_beside_job_deletes_at_random_times(rig, tmp_path, ha_url):
    """Seeded (STEWARD_SEED repeats a schedule): rounds of one delete_job(J) beside puts of J started at
    random times, the delete and the HA puts paused for random times. Every put is acknowledged; each
    one sent after the delete reached the HA store, or answered after the delete returned, is served
    by the next agent."""
    seed = int(os.environ.get("STEWARD_SEED") or random.randrange(1 << 32))
    print(f"STEWARD_SEED={seed}")
    rng = random.Random(seed)
    store: PausingStore = rig.ha
    job = "job-seeded"
    lock = threading.Lock()

    def pause(limit: float) -> None:
        with lock:
            delay = rng.uniform(0, limit)
        time.sleep(delay)  # the injected slowness of the store, not a wait for an effect

    for rnd in range(4):
        olds = [os.urandom(1000 + rng.randrange(4000)) for _ in range(2)]
        for data in olds:
            rig.client.put_bytes(data, job, permanent=True)
        reached: list[float] = []
        store.before_delete_job = lambda job_id, r=reached: (r.append(time.monotonic()), pause(0.05))
        store.after_put = lambda job_id, key: pause(0.02)
        plan = sorted((rng.uniform(0, 0.08),
                       rng.choice(olds) if rng.random() < 0.4 else os.urandom(rng.randrange(1, 20_000)))
                      for _ in range(6))
        delete_at = rng.uniform(0, 0.05)
        t0 = time.monotonic()
        deleter: Call | None = None
        puts: list[tuple[Call, bytes]] = []
        for at, data in plan:
            if deleter is None and at >= delete_at:
                until_time(t0 + delete_at)
                deleter = started(Call(rig, lambda c: c.delete_job(job)))
            until_time(t0 + at)
            fn = ((lambda c, d=data: c.put_bytes(d, job, permanent=True)) if rng.random() < 0.7
                  else put_path(data, job))
            puts.append((started(Call(rig, fn)), data))
        if deleter is None:
            deleter = started(Call(rig, lambda c: c.delete_job(job)))
        deleter.outcome()
        keys = [(p.outcome(), p, data) for p, data in puts]  # every put is acknowledged
        must = {key: data for key, p, data in keys if p.sent > reached[0] or p.answered > deleter.answered}
        print(f"round {rnd}: {len(puts)} puts, {len(must)} after the delete; stats {dict(rig.server.stats)}")
        next_agent_serves(tmp_path, ha_url, must, job)
        assert len(rig.server._job_gate) == 0, "the job gate forgets a job nobody uses"
