"""The checkpoint coordinator on file:// and moto S3, driven by real RocksDB subtasks: pending -> acked
-> _metadata -> completed, subsumption that keeps the base of a re-runnable batch, aborts, refusals,
and recovery (reference counts rebuilt, orphans of a SIGKILLed uploader swept)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.coordination.pending import AckResult
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import open_subtask
from sparksteward.checkpoint.task.transfer import upload_snapshot
from sparksteward.errors import CheckpointError, CheckpointOrderError, ParallelismError, StateEncodingError
from sparksteward.state.keygroups import key_group_range
from sparksteward.testing.clock import FakeClock

from tests.helpers.checkpoint import BATCHES, M, P, expected_counts, run_batch, stored_counts


def _assert_files_match_refs(coord, storage, unacked=frozenset()):
    """Every shared file is referenced, except uploads not acked yet (``unacked``)."""
    referenced = set().union(*(storage.read_metadata(c).physical_paths() for c in coord.retained()))
    assert storage.shared_files() - set(unacked) == referenced - set(unacked)


def test_checkpoints_complete_subsume_and_rerun(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M, num_retained=1, clock=FakeClock(1000.0))
    assert coord.last_completed is None
    begun, _ = run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    assert begun.base is None and not begun.rerun
    assert coord.pending() == [0]
    meta0 = coord.complete(0)
    assert meta0.created_at == 1000.0 and storage.checkpoint_ids() == [0]

    begun, results = run_batch(coord, storage, tmp_path, 1, BATCHES[1])
    assert begun.base == meta0 and begun.known
    assert all(r.files_reused > 0 for r in results)  # incremental: the base's SSTs are not re-sent
    meta1 = coord.complete(1)
    # num_retained=1, but checkpoint 0 is the base of 1, which Spark may still re-run
    assert coord.retained() == [0, 1]

    # the driver died after complete(1), before Spark recorded batch 1: the batch runs again
    begun, _ = run_batch(coord, storage, tmp_path, 1, BATCHES[1], attempt="rerun")
    assert begun.rerun and begun.base == meta0
    assert coord.complete(1) == meta1  # the first result stands
    _assert_files_match_refs(coord, storage)  # the re-run's own uploads are gone
    assert stored_counts(storage, meta1, tmp_path, "1") == expected_counts(BATCHES[:2])

    # batch 2 begins: now checkpoint 0 may go
    run_batch(coord, storage, tmp_path, 2, BATCHES[2])
    assert coord.retained() == [1]
    assert storage.checkpoint_ids() == [1]
    meta2 = coord.complete(2)
    assert coord.retained() == [1, 2]
    _assert_files_match_refs(coord, storage)
    assert stored_counts(storage, meta2, tmp_path, "2") == expected_counts(BATCHES[:3])

    with pytest.raises(CheckpointOrderError, match=r"checkpoint 1 of state 'clicks' is older than its last "
                                                   r"completed checkpoint 2.*Restart the query"):
        coord.begin(1)


def test_abort_deletes_only_what_the_checkpoint_uploaded(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    coord.complete(0)
    before = storage.shared_files()
    _, results = run_batch(coord, storage, tmp_path, 1, BATCHES[3], ack=False)
    coord.ack(1, results[0])  # subtask 1's task failed before its ack
    new_files = {p for r in results for p in r.uploaded}
    assert new_files and storage.shared_files() == before | new_files
    with pytest.raises(CheckpointError, match=r"checkpoint 1 of state 'clicks' cannot complete: subtasks \[1\] "
                                              r"of 2 have not acked"):
        coord.complete(1)
    only_1 = set(results[1].uploaded) - set(results[0].uploaded)  # CURRENT/OPTIONS can be equal in both
    assert coord.abort(1) == len(set(results[0].uploaded))
    # subtask 1's uploads were never acked, so the coordinator did not know them
    assert storage.shared_files() == before | only_1
    assert coord.abort(1) == 0  # idempotent
    with pytest.raises(CheckpointOrderError, match="checkpoint 1 .* is not pending"):
        coord.ack(1, results[1])  # its ack comes late: refused, and its files are deleted
    assert storage.shared_files() == before
    restarted = CheckpointCoordinator(storage, P, M)
    assert restarted.swept == 0
    assert restarted.retained() == [0]


def test_restart_rebuilds_references_and_keeps_newer_versions_files(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M, num_retained=2)
    for n in range(3):
        run_batch(coord, storage, tmp_path, n, BATCHES[n])
        coord.complete(n)
    assert coord.retained() == [1, 2]  # the base of the re-runnable 2 is 1, retained anyway
    again = CheckpointCoordinator(storage, P, M, num_retained=2)
    assert again.retained() == [1, 2] and again.swept == 0
    assert all(again.references(p) == coord.references(p) for p in storage.shared_files())
    assert again.begin(2).rerun
    # an orphan (a crashed upload) and a _metadata written by a newer version
    storage.location.fs.pipe_file(storage.location.path("shared", "f" * 32), b"orphan")
    storage.location.write_atomic(storage.metadata_path(7), b'{"version": 99}')
    third = CheckpointCoordinator(storage, P, M, num_retained=2)
    assert third.swept == 0 and ("shared/" + "f" * 32) in storage.shared_files()  # nothing swept
    storage.delete_checkpoint_dir(7)
    fourth = CheckpointCoordinator(storage, P, M, num_retained=2)
    assert fourth.swept == 1 and ("shared/" + "f" * 32) not in storage.shared_files()


UPLOADER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from sparksteward.checkpoint.storage import CheckpointStorage
    from sparksteward.checkpoint.task.transfer import upload_snapshot
    from sparksteward.state.keygroups import KeyGroupRange
    url, work = sys.argv[1], Path(sys.argv[2])
    storage = CheckpointStorage.open(url, "clicks")
    import sparksteward.checkpoint.storage as st
    real_put = st.CheckpointStorage._put
    count = 0
    def put_then_die(self, local, rel):
        global count
        real_put(self, local, rel)
        count += 1
        if count == 2:
            print("uploaded 2", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    st.CheckpointStorage._put = put_then_die
    for i in range(5):
        (work / "snap").mkdir(parents=True, exist_ok=True)
        (work / "snap" / f"00000{i}.sst").write_bytes(os.urandom(1000 + i))
    upload_snapshot(storage, work / "snap", 0, KeyGroupRange(0, 8))  # dies after its second upload
""")


def test_orphans_of_a_sigkilled_uploader_are_swept(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    coord.complete(0)
    before = storage.shared_files()
    proc = subprocess.run([sys.executable, "-c", UPLOADER, store_url, str(tmp_path / "u")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(storage.shared_files() - before) == 2  # two uploads landed, then the process died
    if storage.location.is_local:  # a staged temp file, as a kill in the middle of a copy leaves it
        storage.location.fs.pipe_file(storage.location.path("shared", ".abc.1234.tmp"), b"partial")
    restarted = CheckpointCoordinator(storage, P, M)
    assert storage.shared_files() == before and not storage.staged_files()
    assert restarted.swept >= 2


def test_a_speculative_duplicate_ack_replaces_the_first_and_its_files_go(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    _, first = run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    _, second = run_batch(coord, storage, tmp_path, 0, BATCHES[0], ack=False, attempt="spec", begin=False)
    assert coord.ack(0, second[0]) is AckResult.REPLACED  # a speculative copy of subtask 0 finished last
    meta = coord.complete(0)
    assert meta.subtasks[0] == second[0].handle
    referenced = meta.physical_paths()
    replaced = set(first[0].uploaded) - referenced
    assert replaced and not replaced & storage.shared_files()  # the first copy's own files were deleted
    # the speculative run's subtask-1 uploads were never reported (an agent that died): only a start sweeps them
    assert storage.shared_files() - referenced <= set(second[1].uploaded)
    CheckpointCoordinator(storage, P, M)
    _assert_files_match_refs(coord, storage)
    assert stored_counts(storage, meta, tmp_path, "spec") == expected_counts(BATCHES[:1])


def test_restart_with_another_max_parallelism_or_key_type_is_refused(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    coord.complete(0)
    with pytest.raises(ParallelismError, match=r"state 'clicks' was checkpointed with max_parallelism=16 "
                                               r"\(checkpoint 0\) and cannot be restored with max_parallelism=32"):
        CheckpointCoordinator(storage, P, 32)
    with pytest.raises(StateEncodingError, match="checkpointed with string keys .* cannot continue with long keys"):
        CheckpointCoordinator(storage, P, M, key_type="long")
    with pytest.raises(StateEncodingError, match="cast the key column to string"):
        open_subtask(storage, coord.completed(0), P, 0, tmp_path / "x", LocalFileCache(tmp_path / "c"),
                     max_parallelism=M, key_type="long")


def test_a_new_parallelism_continues_the_same_state(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    coord.complete(0)
    wider = CheckpointCoordinator(storage, 5, M)  # the query restarted with parallelism 5
    run_batch(wider, storage, tmp_path, 1, BATCHES[1])
    meta = wider.complete(1)
    assert meta.parallelism == 5
    assert stored_counts(storage, meta, tmp_path, "p5") == expected_counts(BATCHES[:2])



def test_late_acks_of_replaced_attempts_leave_no_files(tmp_path, store_url):
    """A late ack (a speculative task, a second action, an aborted attempt's upload) after its
    checkpoint completed or was aborted is refused, and its files are deleted; while another
    checkpoint is pending the deletion waits for it (a pending attempt may hold equal content)."""
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    _, spec = run_batch(coord, storage, tmp_path, 0, BATCHES[0], ack=False, attempt="spec", begin=False)
    _, spec2 = run_batch(coord, storage, tmp_path, 0, BATCHES[0], ack=False, attempt="spec2", begin=False)
    coord.complete(0)
    with pytest.raises(CheckpointOrderError, match=r"checkpoint 0 of state 'clicks' is not pending .*the ack of "
                                                   r"subtask 0 is refused and its uploaded files deleted"):
        coord.ack(0, spec[0])
    with pytest.raises(CheckpointOrderError):
        coord.ack(0, spec[1])
    spec2_files = {p for r in spec2 for p in r.uploaded}
    _assert_files_match_refs(coord, storage, unacked=spec2_files)  # nothing pending: deleted at once

    # an aborted attempt's uploads ack after the abort
    _, aborted = run_batch(coord, storage, tmp_path, 1, BATCHES[1], ack=False, attempt="x")
    coord.abort(1)
    for r in aborted:
        with pytest.raises(CheckpointOrderError, match="is not pending"):
            coord.ack(1, r)
    _assert_files_match_refs(coord, storage, unacked=spec2_files)

    # late acks while checkpoint 1 runs again: their files wait until 1 is no longer pending
    run_batch(coord, storage, tmp_path, 1, BATCHES[1], attempt="y")
    for r in spec2:
        with pytest.raises(CheckpointOrderError):
            coord.ack(0, r)
    assert spec2_files <= storage.shared_files()  # deferred
    meta1 = coord.complete(1)
    _assert_files_match_refs(coord, storage)
    assert stored_counts(storage, meta1, tmp_path, "late") == expected_counts(BATCHES[:2])


def test_a_newer_checkpoint_drops_older_pending_ones_and_their_files(tmp_path, store_url):
    """A second action after commit(N) re-runs N as a pending re-run that nobody commits; an
    attempt left pending by a failed batch: both are aborted when a newer checkpoint begins."""
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    coord.complete(0)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0], attempt="second-action")  # a re-run, never committed
    assert coord.pending() == [0]
    run_batch(coord, storage, tmp_path, 1, BATCHES[1])
    assert coord.pending() == [1]
    coord.complete(1)
    _assert_files_match_refs(coord, storage)
    run_batch(coord, storage, tmp_path, 2, BATCHES[2], ack=False)  # a batch whose tasks never acked
    assert coord.pending() == [2]
    run_batch(coord, storage, tmp_path, 3, BATCHES[2])
    assert coord.pending() == [3]
    meta = coord.complete(3)
    assert stored_counts(storage, meta, tmp_path, "3") == expected_counts(BATCHES[:3])
    # attempt 2's uploads were never acked: only they may be left (a coordinator start sweeps them)
    CheckpointCoordinator(storage, P, M)
    _assert_files_match_refs(coord, storage)


def test_a_task_cannot_restart_an_aborted_checkpoint_but_the_driver_can(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    coord.begin(0)
    coord.abort(0)
    with pytest.raises(CheckpointOrderError, match=r"checkpoint 0 of state 'clicks' was aborted: a task of the "
                                                   r"abandoned attempt cannot start it again; apply the batch "
                                                   r"again with checkpoint_id=0"):
        coord.begin(0, by_task=True)
    assert coord.pending() == []
    coord.begin(0)  # the driver applies the batch again
    assert coord.begin(0, by_task=True).checkpoint_id == 0  # its tasks join it


def test_a_rerun_of_the_last_batch_works_after_a_coordinator_restart(tmp_path, store_url):
    """The driver died after complete(1), before Spark recorded batch 1: a new coordinator, built from
    the checkpoint dir, still has 1's base, re-runs 1 from it and refuses anything older."""
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M, num_retained=1)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    meta0 = coord.complete(0)
    run_batch(coord, storage, tmp_path, 1, BATCHES[1])
    meta1 = coord.complete(1)
    restarted = CheckpointCoordinator(storage, P, M, num_retained=1)
    assert restarted.retained() == [0, 1] and restarted.swept == 0
    begun, _ = run_batch(restarted, storage, tmp_path, 1, BATCHES[1], attempt="rerun")
    assert begun.rerun and begun.base == meta0
    assert restarted.complete(1) == meta1
    _assert_files_match_refs(restarted, storage)
    with pytest.raises(CheckpointOrderError, match="checkpoint 0 .* is older than its last completed checkpoint 1"):
        restarted.begin(0)
    run_batch(restarted, storage, tmp_path, 2, BATCHES[2])
    assert stored_counts(storage, restarted.complete(2), tmp_path, "2") == expected_counts(BATCHES[:3])


def test_a_restart_with_background_deletes_subsumes_what_it_no_longer_retains(tmp_path, store_url):
    """A driver agent that restarts over more completed checkpoints than it retains (one died after a
    completion, before its subsume) queues their deletion at start; with background deletes that used to
    notify the deleter's thread without the lock (RuntimeError, seen in the soak)."""
    storage = CheckpointStorage.open(store_url, "restart", "c1")
    coord = CheckpointCoordinator(storage, P, M, num_retained=3)
    for cid in range(3):
        run_batch(coord, storage, tmp_path, cid, BATCHES[cid % len(BATCHES)])
        coord.complete(cid)
    coord.close()
    again = CheckpointCoordinator(storage, P, M, num_retained=1, background_deletes=True)
    assert again.retained() == [1, 2]   # 1 stays as the base of 2, which Spark may re-run
    assert again.deleter.flush(30)
    assert storage.checkpoint_ids() == [1, 2]
    again.close()


def test_a_file_uploaded_again_while_its_background_delete_runs_never_completes_a_checkpoint(tmp_path, s3):
    """Item 10's deleter thread and a content-addressed re-upload: attempt a of checkpoint 0 is
    aborted (its files queued for deletion, every delete request 2 s late on S3); attempt b uploads
    the same snapshot again (same checksums, so the same paths) and acks while one of them is being
    deleted. complete() must wait for that delete and then find the file gone (the attempt is
    refused, naming the fix), never write a record that names a file the delete removes after."""
    import uuid

    from tests.helpers import wait_until

    storage = CheckpointStorage.open(s3.url(f"bg-{uuid.uuid4().hex[:8]}"), "s", "c1")
    coord = CheckpointCoordinator(storage, P, M, background_deletes=True)
    begun, first = run_batch(coord, storage, tmp_path, 0, BATCHES[0], attempt="a")
    queued = {p for r in first for p in r.uploaded}
    referenced = set()
    with s3.slow("DeleteObjects", 2.0):
        assert coord.abort(0) > 0
        wait_until(lambda: coord.deleter.in_progress(), timeout=30, what="a delete in flight")
        coord.begin(0)
        for i in range(P):   # the same snapshot uploaded again: the same content-addressed paths
            snap = tmp_path / f"snap-0-a-{i}"
            result = upload_snapshot(storage, snap, i, key_group_range(M, P, i), known=begun.known)
            referenced |= {f.path for f in result.handle.all_files}
            coord.ack(0, result)
        with pytest.raises(CheckpointError, match=r"deleted after their upload\)\. Apply the batch again"):
            coord.complete(0)
    coord.close()
    assert coord.last_completed is None
    # the deleter skipped every queued file an ack referenced before its delete began
    missing = {p for p in referenced if not storage.location.exists(storage.location.path(*p.split("/")))}
    assert len(queued & referenced) > 2 and len(missing) <= 2, (len(queued & referenced), missing)


def test_the_watermark_advances_from_the_acks_survives_a_restart_and_never_goes_back(tmp_path, store_url):
    """Decision 0028: checkpoint N's watermark is the largest event time the acks of N-1 reported minus
    the delay, chosen at N's first begin and kept by every later delivery, a restarted coordinator's
    included; events that go back, or a clock that does, move it back never."""
    from sparksteward.checkpoint.coordination.stats import SubtaskStats

    storage = CheckpointStorage.open(store_url, "clicks")
    clock = FakeClock(1000.0)

    def batch(coord, cid, events, attempt="a"):
        begun, results = run_batch(coord, storage, tmp_path, cid, BATCHES[2], ack=False, attempt=attempt)
        for r, seen in zip(results, events):
            coord.ack(cid, r, stats=SubtaskStats(max_event_ms=seen, late_rows=1))
        return begun

    coord = CheckpointCoordinator(storage, P, M, clock=clock)
    coord.event_time = {"column": "ts", "delay_ms": 1000}
    assert batch(coord, 0, [5000, 9000]).time.watermark_ms is None   # the first batch has none
    meta0 = coord.complete(0)
    assert meta0.properties["max_event_ms"] == 9000
    assert meta0.properties["event_time"] == {"column": "ts", "delay_ms": 1000}
    assert "watermark_ms" not in meta0.properties["time"]
    assert batch(coord, 1, [3000, None]).time.watermark_ms == 8000   # a subtask without rows reports none
    coord.abort(1)

    clock = FakeClock(500.0)   # the driver restarts with a clock stepped back and another delay
    restarted = CheckpointCoordinator(storage, P, M, clock=clock)
    restarted.event_time = {"column": "ts", "delay_ms": 60_000}
    again = batch(restarted, 1, [3000, None], attempt="b")   # the re-delivery of batch 1
    assert again.time.watermark_ms == 8000 and again.time.processing_ms == 1_000_000
    meta1 = restarted.complete(1)
    assert meta1.properties["time"]["watermark_ms"] == 8000 and meta1.properties["max_event_ms"] == 3000
    rerun, _ = run_batch(restarted, storage, tmp_path, 1, BATCHES[2], attempt="c")   # after its commit
    assert rerun.rerun and rerun.time.watermark_ms == 8000
    assert restarted.complete(1) == meta1
    # the events went back (3000 - 60 s): the watermark stays
    assert batch(restarted, 2, [4000, 4000]).time.watermark_ms == 8000
    restarted.complete(2)
    restarted.event_time = None   # opened without event_time: the watermark stays where it was
    assert batch(restarted, 3, [None, None]).time.watermark_ms == 8000
