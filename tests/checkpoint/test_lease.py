"""The writer lease of a state root on file:// and moto S3: a second writer is refused by name, a
released or provably dead or expired holder is taken over, a holder whose lease was taken stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from sparksteward.checkpoint.lease import LEASE_FILE, StateLease, read_lease
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CorruptRecordError, StateLeaseError
from sparksteward.owner import OwnerRecord


class Clock:
    """Monotonic and wall clocks that only move when the test (or a sleep) moves them."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.wall = 1_700_000_000.0

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self.wall

    def sleep(self, s: float) -> None:
        self.t += s
        self.wall += s


ELSEWHERE = OwnerRecord("other-host", "boot", 4242, 1.0, "pid:[1]")


def _lease(storage, app, clock, ttl=30.0, owner=None):
    return StateLease(storage.location, storage.state, application=app, ttl=ttl, monotonic=clock.monotonic,
                      wall=clock.time, sleep=clock.sleep, owner=owner)


def test_a_second_writer_is_refused_naming_the_holder(store_url):
    storage = CheckpointStorage.open(store_url, "clicks", "c1")
    clock = Clock()
    first = _lease(storage, "app-1", clock)
    first.acquire()
    first.check()
    second = _lease(storage, "app-2", clock)
    with pytest.raises(StateLeaseError) as err:
        second.acquire()
    msg = str(err.value)
    assert "'clicks'" in msg and storage.url in msg and "application app-1" in msg and "pid" in msg
    assert "since" in msg and "Stop that application" in msg
    # it renews, so even a second opener whose wall clock says it is stale waits, sees it renew, and gives up
    clock.wall += 100
    first.renew()
    assert read_lease(storage.location).application == "app-1"
    first.release()
    second.acquire()   # released: taken over at once
    assert read_lease(storage.location).application == "app-2" and second.took_over.released


def test_an_expired_lease_is_taken_over_and_the_old_holder_stops(store_url):
    storage = CheckpointStorage.open(store_url, "clicks", "c1")
    clock = Clock()
    zombie = _lease(storage, "app-zombie", clock, ttl=10.0, owner=ELSEWHERE)   # no local liveness proof
    zombie.acquire()
    clock.wall += 11        # silent past its ttl by the wall clock
    clock.t += 11
    with pytest.raises(StateLeaseError, match="renewed"):
        zombie.check()      # silent for > 0.8 ttl on its own clock: it must not write
    replacement = _lease(storage, "app-new", clock, ttl=10.0)
    replacement.acquire()   # watched the record for a whole ttl without a change
    assert replacement.took_over.application == "app-zombie"
    assert not zombie.renew()
    with pytest.raises(StateLeaseError, match="app-new"):
        zombie.check()
    replacement.check()


def test_a_holder_that_keeps_renewing_is_never_taken_over(store_url):
    storage = CheckpointStorage.open(store_url, "s", "c1")
    clock = Clock()
    holder = _lease(storage, "app-1", clock, ttl=10.0, owner=ELSEWHERE)
    holder.acquire()
    assert holder.renew()
    clock.wall += 50        # the holder's wall clock is far behind: its record looks stale

    def sleep(s):  # the holder renews while the contender watches
        clock.t += s
        holder.renew()

    contender = StateLease(storage.location, "s", application="app-2", ttl=10.0, monotonic=clock.monotonic,
                           wall=lambda: clock.wall + 1000, sleep=sleep)
    with pytest.raises(StateLeaseError, match="renewed the lease while"):
        contender.acquire()
    assert read_lease(storage.location).application == "app-1"


def test_a_sigkilled_holder_on_this_host_is_taken_over_at_once(tmp_path):
    storage = CheckpointStorage.open(f"file://{tmp_path}/chk", "clicks", "c1")
    code = textwrap.dedent(f"""
        import sys, time
        from sparksteward.checkpoint.lease import StateLease
        from sparksteward.checkpoint.storage import CheckpointStorage
        s = CheckpointStorage.open({f"file://{tmp_path}/chk"!r}, "clicks", "c1")
        StateLease(s.location, "clicks", application="app-killed", ttl=3600).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == b"held"
        with pytest.raises(StateLeaseError, match="app-killed"):
            StateLease(storage.location, "clicks", application="app-2", ttl=3600).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    lease = StateLease(storage.location, "clicks", application="app-2", ttl=3600)
    lease.acquire()   # same host, its pid is gone: no waiting for the hour-long ttl
    assert lease.took_over.application == "app-killed"


def test_a_corrupt_lease_record_is_refused_by_name(tmp_path):
    storage = CheckpointStorage.open(f"file://{tmp_path}/chk", "clicks", "c1")
    storage.location.write_atomic(storage.location.path(LEASE_FILE), b"{not json")
    with pytest.raises(CorruptRecordError, match="_lease.*delete the file"):
        StateLease(storage.location, "clicks", application="a", ttl=5).acquire()


# --- the sweep, under the coordinator ------------------------------------------------------------
from sparksteward.checkpoint.coordinator import CheckpointCoordinator  # noqa: E402
from sparksteward.errors import CheckpointError  # noqa: E402
from sparksteward.testing.clock import FakeClock  # noqa: E402
from tests.helpers.checkpoint import BATCHES, M, P, stored_counts, expected_counts, run_batch  # noqa: E402


def test_a_restart_sweeps_only_old_orphans_and_never_completes_on_a_deleted_upload(tmp_path, store_url):
    """A driver restarts while a batch's uploads are in flight: with a grace period its start leaves
    them alone; without one (grace 0) it deletes them, and a late ack of the lost attempt pointing at
    them can no longer complete a checkpoint that would not restore."""
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    coord.complete(0)
    _, results = run_batch(coord, storage, tmp_path, 1, BATCHES[1], ack=False)   # uploaded, not acked yet
    uploads = {p for r in results for p in r.uploaded}
    assert uploads and uploads <= storage.shared_files()

    clock = FakeClock(start=__import__("time").time())
    graced = CheckpointCoordinator(storage, P, M, orphan_grace=600, clock=clock)
    assert graced.swept == 0 and uploads <= storage.shared_files()   # too young to be orphans
    clock.advance(601)
    assert graced.sweep() == len(uploads) and not uploads & storage.shared_files()

    graced.begin(1)   # the restarted driver applies batch 1 again; the lost attempt's acks come late
    for r in results:
        graced.ack(1, r)
    with pytest.raises(CheckpointError, match=r"cannot complete: it references .*deleted after their upload"):
        graced.complete(1)
    graced.abort(1)
    run_batch(graced, storage, tmp_path, 1, BATCHES[1], attempt="b")
    meta = graced.complete(1)
    assert stored_counts(storage, meta, tmp_path, "r") == expected_counts(BATCHES[:2])


def test_no_sweep_without_the_lease(tmp_path):
    storage = CheckpointStorage.open(f"file://{tmp_path}/chk", "clicks", "c1")
    storage.location.makedirs(storage.location.path("shared"))
    orphan = storage.location.path("shared", "0" * 32)
    storage.location.write_atomic(orphan, b"x")
    holder = StateLease(storage.location, "clicks", application="app-1", ttl=60)
    holder.acquire()
    lost = StateLease(storage.location, "clicks", application="app-2", ttl=60)   # never acquired
    coord = CheckpointCoordinator(storage, P, M, lease=lost)
    assert coord.swept == 0 and os.path.exists(orphan)
    with pytest.raises(StateLeaseError, match="does not hold the writer lease"):
        coord.begin(0)
    mine = CheckpointCoordinator(storage, P, M, lease=holder)
    assert mine.swept == 1 and not os.path.exists(orphan)
