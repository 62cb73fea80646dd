"""The begun record (checkpoint/begun.py): one time, one alignment and one set of cuts per checkpoint,
durable before any task runs, shared by every attempt and delivery across coordinator restarts (a
restarted driver or driver agent), on file:// and moto S3. Issue 35, items 2 and 3."""

from __future__ import annotations

import pytest
from sparksteward.checkpoint.begun import BEGUN_FILE, BegunRecord, CheckpointTime, Cut, read_begun, time_of
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.unaligned.coordinator_cuts import translate_cuts
from sparksteward.errors import CheckpointOrderError, CorruptRecordError
from sparksteward.state.keygroups import key_group_range
from sparksteward.testing.clock import FakeClock

from tests.helpers.checkpoint import BATCHES, M, P, run_batch


def _restart(storage, clock, parallelism=P):
    """A fresh coordinator over the same store: what a restarted driver agent builds."""
    return CheckpointCoordinator(CheckpointStorage(storage.location, storage.state), parallelism, M, clock=clock)


def test_the_time_of_a_checkpoint_is_chosen_once_and_survives_a_restart(tmp_path, store_url):
    clock = FakeClock(1_800_000_000.0)
    storage = CheckpointStorage.open(store_url, "ttl")
    coord = CheckpointCoordinator(storage, P, M, clock=clock)
    first = coord.begin(0)
    assert first.time == CheckpointTime(1_800_000_000_000)
    assert read_begun(storage.location).time == first.time   # durable before any task runs

    clock.advance(30)
    assert coord.begin(0).time == first.time        # a second attempt (a sink failed, the batch re-applied)
    # the driver (or its agent) died with checkpoint 0 pending: the batch is delivered again
    coord = _restart(storage, clock)
    again, _ = run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    assert again.time == first.time
    meta = coord.complete(0)
    assert time_of(meta) == first.time

    clock.advance(30)
    coord = _restart(storage, clock)
    assert coord.begin(0).time == first.time        # a re-run of the completed checkpoint: its record's time


def test_a_clock_that_steps_back_never_moves_the_time_of_checkpoints_back(tmp_path, store_url):
    clock = FakeClock(1_800_000_000.0)
    storage = CheckpointStorage.open(store_url, "back")
    coord = CheckpointCoordinator(storage, P, M, clock=clock)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    t0 = coord.complete(0).properties["time"]["processing_ms"]

    clock.advance(-3600)                             # NTP stepped the driver's clock back an hour
    t1 = coord.begin(1).time.processing_ms
    assert t1 == t0

    clock.advance(-60)                               # and again, with checkpoint 1 begun but not completed
    coord = _restart(storage, clock)
    assert coord.begin(2).time.processing_ms == t0   # never below a checkpoint begun before either
    clock.advance(7200)
    assert coord.begin(3).time.processing_ms == int(clock.now() * 1000)


def test_cuts_are_durable_and_a_redelivery_after_a_restart_cuts_the_same(store_url):
    clock = FakeClock()
    storage = CheckpointStorage.open(store_url, "cuts")
    coord = CheckpointCoordinator(storage, 4, M, clock=clock)
    assert coord.begin(0, unaligned=True).unaligned
    ranges = [key_group_range(M, 4, i) for i in range(4)]
    proposed = {0: Cut(ranges[0].start + 1), 1: Cut(ranges[1].stop), 3: Cut(ranges[3].start, 7)}
    for s, c in proposed.items():
        assert coord.cut(0, s, c) == c
    assert read_begun(storage.location).cuts == proposed   # on the store before the tasks go on

    # the driver died after the sink wrote batch 0's output: a fresh coordinator, whose tasks would cut
    # by their own clocks, must cut where the first delivery did; subtask 2 never finished there
    coord = _restart(storage, clock, parallelism=4)
    begun = coord.begin(0, unaligned=False)          # the new application opened the state aligned
    assert begun.unaligned                           # the first delivery's alignment stands
    for s, c in proposed.items():
        assert coord.cut(0, s, Cut(ranges[s].stop)) == c  # later proposals follow the recorded cut
    assert coord.cut(0, 2) is None                   # free: no output of it reached a sink
    assert coord.cut(0, 2, Cut(ranges[2].start + 2)) == (ranges[2].start + 2, 0)


def test_an_aligned_first_delivery_is_redelivered_aligned(store_url):
    storage = CheckpointStorage.open(store_url, "aligned")
    coord = CheckpointCoordinator(storage, P, M, clock=FakeClock())
    assert not coord.begin(0, unaligned=False).unaligned
    coord = _restart(storage, FakeClock())
    assert not coord.begin(0, unaligned=True).unaligned


def test_a_redelivery_at_another_parallelism_defers_the_same_key_groups_or_is_refused(store_url):
    storage = CheckpointStorage.open(store_url, "rescaled")
    coord = CheckpointCoordinator(storage, 4, M, clock=FakeClock())
    coord.begin(0, unaligned=True)
    r = [key_group_range(M, 4, i) for i in range(4)]
    coord.cut(0, 0, Cut(r[0].stop))       # processed everything
    coord.cut(0, 1, Cut(r[1].start + 3, 5))  # deferred from +3, after its first 5 rows
    # restarted at parallelism 2: subtask 0 of 2 covers old 0 and 1, whose deferred groups are a suffix
    coord = _restart(storage, FakeClock(), parallelism=2)
    coord.begin(0, unaligned=True)
    assert coord.cut(0, 0, Cut(0)) == (r[1].start + 3, 5)
    assert coord.cut(0, 1) is None   # old subtasks 2 and 3 never finished
    assert read_begun(storage.location).parallelism == 2

    # cuts that no cut of the new parallelism can express are refused, naming the way out
    with pytest.raises(CheckpointOrderError, match="parallelism 4"):
        translate_cuts({0: Cut(r[0].start + 1), 1: Cut(r[1].stop)}, 4, 2, M, "checkpoint 0 of state 'x'")
    with pytest.raises(CheckpointOrderError, match="parallelism 4"):   # two key groups split inside
        translate_cuts({0: Cut(r[0].start + 1, 2), 1: Cut(r[1].start, 1)}, 4, 2, M, "checkpoint 0 of state 'x'")


def test_a_corrupt_begun_record_is_refused_by_name(store_url):
    storage = CheckpointStorage.open(store_url, "corrupt")
    loc = storage.location
    loc.write_atomic(loc.path(BEGUN_FILE), b'{"version": 1, "checkpoint_id": "x"}')
    with pytest.raises(CorruptRecordError, match="_begun"):
        CheckpointCoordinator(storage, P, M)
    with pytest.raises(ValueError):
        BegunRecord(0, 2, CheckpointTime(1), True, {5: Cut(1)})   # a subtask beyond the parallelism
    for bad in (b'"cuts": {"0": 3}, "cut_rows": {"1": 4}', b'"cuts": {"0": 3}, "cut_rows": {"0": -4}',
                b'"cuts": {"0": true}'):   # rows of a subtask without a cut, negative rows, not a key group
        loc.write_atomic(loc.path(BEGUN_FILE), b'{"version": 1, "checkpoint_id": 0, "parallelism": 2, '
                         b'"time": {"processing_ms": 1}, "unaligned": true, ' + bad + b'}')
        with pytest.raises(CorruptRecordError, match="cut"):
            CheckpointCoordinator(storage, P, M)


def test_a_rerun_of_a_completed_checkpoint_reads_its_cuts_while_the_next_one_records_its_own(tmp_path, store_url):
    """A second action on completed checkpoint 0 while checkpoint 1 records cuts: 0's cuts come from its
    record, and asking for them writes nothing and fails nothing."""
    storage = CheckpointStorage.open(store_url, "rerun-cuts")
    coord = CheckpointCoordinator(storage, P, M, clock=FakeClock())
    coord.begin(0, unaligned=True)
    r = [key_group_range(M, P, i) for i in range(P)]
    coord.cut(0, 0, Cut(r[0].start + 1, 3))
    run_batch(coord, storage, tmp_path, 0, BATCHES[0], begin=False)
    coord.complete(0)
    coord.begin(1, unaligned=True)
    coord.cut(1, 0, Cut(r[0].start))
    assert coord.cut(0, 0) == (r[0].start + 1, 3) and coord.cut(0, 1) == (r[1].stop, 0)
    assert read_begun(storage.location).cuts == {0: (r[0].start, 0)}
