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
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator  # noqa: E402
from sparksteward.errors import CheckpointError  # noqa: E402
from sparksteward.testing.clock import FakeClock  # noqa: E402

from tests.helpers.checkpoint import BATCHES, M, P, expected_counts, run_batch, stored_counts  # noqa: E402


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


# --- a store that ignores conditional writes (issue 35 item 6) -------------------------------------
from tests.helpers.s3 import new_bucket  # noqa: E402
from tests.helpers.stores import ignoring_s3, no_mode_memory  # noqa: E402


@pytest.mark.parametrize("store", ["ignoring-s3", "no-mode"])
def test_a_store_that_ignores_conditional_writes_is_refused_by_name_before_any_lease_is_written(store, request):
    loc = ignoring_s3(request.getfixturevalue("s3"), "chk", "clicks") if store == "ignoring-s3" \
        else no_mode_memory("refused", "chk", "clicks")
    lease = StateLease(loc, "clicks", application="app-1", ttl=30)
    with pytest.raises(StateLeaseError) as err:
        lease.acquire()
    msg = str(err.value)
    assert "'clicks'" in msg and loc.url in msg and "conditional writes" in msg
    assert "AWS S3" in msg and "MinIO" in msg and "local" in msg   # the choices
    assert not loc.fs.exists(lease.path) and read_lease(loc) is None   # no lease was written
    assert lease.conditional_writes is not None and not lease.conditional_writes.honoured
    assert lease.info()["conditional_writes"]["honoured"] is False


def test_the_lease_records_the_probe_and_probes_once_per_store(store_url, request):
    s3 = request.getfixturevalue("s3") if store_url.startswith("s3://") else None
    s3 = new_bucket(s3) if s3 else None   # a store this process has not probed yet
    url = s3.url("chk") if s3 else store_url
    mark = s3.mark() if s3 else 0
    storage = CheckpointStorage.open(url, "clicks", "c1")
    first = StateLease(storage.location, "clicks", application="app-1", ttl=30)
    first.acquire()
    probed = first.conditional_writes
    assert probed is not None and probed.honoured and probed.store == storage.location.store
    info = first.info()
    assert info["held"] and info["problem"] is None and info["conditional_writes"] == probed.to_json()
    first.release()
    again = StateLease(CheckpointStorage.open(url, "clicks", "c1").location, "clicks", application="app-2", ttl=30)
    again.acquire()
    views = StateLease(CheckpointStorage.open(url, "views", "c1").location, "views", application="app-2", ttl=30)
    views.acquire()
    assert again.conditional_writes is probed and views.conditional_writes is probed   # cached per store
    if s3 is not None:
        from sparksteward.storage import PROBE_PREFIX

        puts = [r for r in s3.requests_since(mark) if r.op == "PutObject" and PROBE_PREFIX in r.key]
        assert len(puts) == 4 and all("/clicks/" in r.key for r in puts)   # one probe: 2 creates, 2 replaces
    again.release()
    views.release()


# --- one state's broken lease (issue 35 item 10) ---------------------------------------------------
def test_a_deleted_state_root_fences_its_lease_and_says_why(tmp_path, caplog):
    import shutil

    storage = CheckpointStorage.open(f"file://{tmp_path}/chk", "clicks", "c1")
    clock = Clock()
    lease = _lease(storage, "app-1", clock)
    lease.acquire()
    shutil.rmtree(storage.location.root)   # an operator deletes the live state's checkpoint folder
    with caplog.at_level("ERROR", logger="sparksteward.checkpoint.lease"):
        assert lease.renew() is False      # it used to raise FileNotFoundError out of the renewal thread
        assert lease.renew() is False
    assert len([r for r in caplog.records if "clicks" in r.getMessage()]) == 1   # said once
    assert not lease.held
    with pytest.raises(StateLeaseError, match=r"'clicks'.*lease record .*_lease was deleted"):
        lease.check()
    assert "was deleted" in lease.info()["problem"]
    assert not os.path.exists(storage.location.root)   # nothing was written back


def test_a_deleted_lease_record_on_s3_fences_its_lease(s3):
    storage = CheckpointStorage.open(s3.url("chk"), "clicks", "c1")
    clock = Clock()
    lease = _lease(storage, "app-1", clock)
    lease.acquire()
    storage.location.delete(lease.path)
    assert lease.renew() is False
    with pytest.raises(StateLeaseError, match="was deleted"):
        lease.check()


def test_a_failing_renewal_says_why_when_the_lease_runs_out(tmp_path, monkeypatch):
    storage = CheckpointStorage.open(f"file://{tmp_path}/chk", "clicks", "c1")
    clock = Clock()
    lease = _lease(storage, "app-1", clock, ttl=10.0)
    lease.acquire()

    def broken(self, path, data):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(type(storage.location), "write_atomic", broken)   # the store refuses writes now
    assert lease.renew() is True    # not lost: another writer did not take it
    clock.t += 9
    with pytest.raises(StateLeaseError, match=r"last renewed 9 s ago.*last renewal failed: .*Permission denied"):
        lease.check()
    assert "Permission denied" in lease.info()["problem"]


def test_a_renewal_whose_answer_was_lost_still_counts(tmp_path, monkeypatch):
    storage = CheckpointStorage.open(f"file://{tmp_path}/chk", "clicks", "c1")
    clock = Clock()
    lease = _lease(storage, "app-1", clock, ttl=10.0)
    lease.acquire()
    real = type(storage.location).write_atomic

    def lost_answer(self, path, data):   # the write lands, then the store's answer is lost
        real(self, path, data)
        raise TimeoutError("read timed out")

    monkeypatch.setattr(type(storage.location), "write_atomic", lost_answer)
    clock.t += 5
    assert lease.renew() is True and lease.info()["renewal_failed"] is None
    clock.t += 5
    lease.check()   # renewed 5 s ago, not 10
    monkeypatch.undo()
    assert lease.renew() is True and read_lease(storage.location).seq == 2
