"""FileDeleter is fenced before every delete, records included (decision 0013): a writer whose renewals
failed while another application took the state's lease over stops deleting at its next check, in the
middle of a long queue. Real lease records on file:// and moto S3; the holder's time is a fake clock."""

from __future__ import annotations

import threading
import time

import pytest
from sparksteward.checkpoint.coordination.deleter import FileDeleter
from sparksteward.checkpoint.lease import StateLease, read_lease
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.owner import OwnerRecord
from sparksteward.testing.clock import FakeClock

pytestmark = pytest.mark.usefixtures("deletes_stay_in_tmp_path")

ELSEWHERE = OwnerRecord("other-host", "boot", 4242, 1.0, "pid:[1]")
TTL = 30.0


class TakenOverMidJob(CheckpointStorage):
    """The real storage; during the ``at``-th delete request (data file or record), the holder's renewals
    have been failing for a whole ttl and another application takes the lease over."""

    def __init__(self, storage: CheckpointStorage, holder_clock: FakeClock, at: tuple[str, int]) -> None:
        super().__init__(storage.location, storage.state)
        self.holder_clock, self.at = holder_clock, at
        self.requests: list[str] = []
        self.taker: StateLease | None = None

    def _request(self, what: str) -> None:
        self.requests.append(what)
        kind, n = self.at
        if self.taker is None and sum(r.startswith(kind) for r in self.requests) == n:
            self.holder_clock.advance(TTL)   # no renewal got through for a ttl
            clock = FakeClock()
            self.taker = StateLease(self.location, self.state, application="app-new", ttl=TTL, owner=ELSEWHERE,
                                    wall=lambda: time.time() + 2 * TTL, monotonic=clock.now, sleep=clock.sleep)
            self.taker.acquire()

    def delete_files(self, paths: list[str]) -> int:
        self._request(f"file {paths}")
        return super().delete_files(paths)

    def delete_checkpoint_dir(self, checkpoint_id: int) -> None:
        self._request(f"record {checkpoint_id}")
        super().delete_checkpoint_dir(checkpoint_id)


@pytest.mark.parametrize("at", [("file", 5), ("record", 2)], ids=["during a file delete", "during a record delete"])
def test_a_deleter_whose_lease_was_taken_over_mid_job_stops_at_the_next_check(store_url, at):
    storage = CheckpointStorage.open(store_url, "a")
    loc = storage.location
    files = [f"shared/{i:032x}" for i in range(40)]
    for p in files:
        loc.write_atomic(loc.path(*p.split("/")), b"data")
    for cid in range(4):
        loc.write_atomic(storage.metadata_path(cid), b"{}")
    clock = FakeClock()
    holder = StateLease(loc, "a", application="app-old", ttl=TTL, monotonic=clock.now)
    holder.acquire()
    taken = TakenOverMidJob(storage, clock, at)
    lock = threading.RLock()
    deleter = FileDeleter(taken, holder, lock, needed=lambda p: False, held=set, background=True)
    with lock:   # the whole queue first: chk-0 and its 20 files, chk-1 and 20 more, chk-2, chk-3
        deleter.delete_files(files[:20], after=deleter.delete_record(0))
        deleter.delete_files(files[20:], after=deleter.delete_record(1))
        deleter.delete_record(2)
        deleter.delete_record(3)
    assert deleter.flush(30)
    deleter.close()

    assert taken.taker is not None and read_lease(loc).application == "app-new"
    took_over = next(i for i, r in enumerate(taken.requests) if sum(
        q.startswith(at[0]) for q in taken.requests[:i + 1]) == at[1])
    assert taken.requests[took_over + 1:] == [], "a delete after the takeover"
    left = storage.stored_files()
    if at[0] == "file":   # the 5th file of chk-0's job was being deleted: the rest stays, records too
        assert storage.checkpoint_ids() == [1, 2, 3]
        assert left == set(files[5:])
    else:                 # chk-1's delete was in flight: its files and the later records stay
        assert storage.checkpoint_ids() == [2, 3]
        assert left == set(files[20:])
