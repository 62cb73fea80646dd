"""One JobResultStore contract, run against memory, file:// and s3:// (moto's server on 127.0.0.1).

The ``store`` fixture is parametrized over the three implementations; every test in the first part
runs on each. File-only behaviour (unreadable files, interrupted commits, the on-disk layout) is
skipped for the in-memory store. The record tests at the end cover JobResult's encoding.
"""

from __future__ import annotations

import re
import threading

import orjson
import pytest
from sparksteward.errors import (
    CorruptRecordError,
    InvalidIdError,
    InvalidRecordError,
    JobResultExistsError,
    JobResultNotFoundError,
)
from sparksteward.jobs.result import Failure, FinalCheckpoint, JobResult, JobStatus, SparkJobOutcome, StepState
from sparksteward.jobs.store import JobResultStore, JobResultView, JobResultWriter
from sparksteward.testing.clock import FakeClock

from tests.helpers.jobs import names, needs_files, result


# --- the contract ---------------------------------------------------------------------------
def test_both_interfaces_are_implemented(store):
    assert isinstance(store, JobResultView) and isinstance(store, JobResultWriter)
    assert isinstance(store, JobResultStore)
    with store as same:
        assert same is store
    store.close()
    store.close()  # idempotent


def test_a_missing_store_dir_is_empty_and_created_lazily(stores):
    store = stores()
    listing = store.list()
    assert listing.entries == () and listing.corrupt == () and listing.stale == ()
    assert store.get("job-1") is None and store.dirty_entries() == []
    assert store.prune(0, 10**10) == []
    assert not store.delete("job-1")
    if stores.files:
        assert not store.base.exists(store.base.root) or stores.kind == "s3", "reads must not create the directory"
        store.create_dirty(result())
        assert names(store) == ["job-1_DIRTY.json"]


def test_create_is_dirty_and_readable(stores, store):
    entry = store.create_dirty(result())
    assert entry.dirty and not entry.clean and entry.state == "dirty" and entry.result == result()
    assert entry.source.endswith("job-1_DIRTY.json")
    got = store.get("job-1")
    assert got is not None and got.dirty and got.result == result() and got.source == entry.source
    assert [e.job_id for e in store.list().entries] == ["job-1"]
    assert [e.job_id for e in store.dirty_entries()] == ["job-1"]
    if stores.files:
        doc = orjson.loads(store.base.read_bytes(store.base.path("job-1_DIRTY.json")))
        assert doc["version"] == 1 and doc["result"]["job_id"] == "job-1" and doc["result"]["status"] == "SUCCEEDED"


def test_duplicate_create_is_refused_dirty_or_clean(store):
    store.create_dirty(result())
    with pytest.raises(JobResultExistsError, match="'job-1' already has a dirty result"):
        store.create_dirty(result(status=JobStatus.FAILED))
    store.mark_clean("job-1")
    with pytest.raises(JobResultExistsError, match="clean result"):
        store.create_dirty(result())
    assert store.get("job-1").status is JobStatus.SUCCEEDED


def test_concurrent_creates_from_two_store_instances_have_one_winner(stores):
    a, b = stores(), stores()
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def create(store, i):
        barrier.wait()
        try:
            store.create_dirty(result(status=JobStatus.SUCCEEDED if i % 2 else JobStatus.FAILED))
            outcomes.append("won")
        except JobResultExistsError:
            outcomes.append("lost")

    threads = [threading.Thread(target=create, args=((a, b)[i % 2], i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["lost"] * 7 + ["won"]


def test_update_dirty_then_clean_twice(stores, store):
    store.create_dirty(result())
    updated = result().with_cleanup((StepState("delete_path", "/tmp/x0", "done", 1),))
    assert store.update_dirty(updated).result == updated
    assert store.get("job-1").result.cleanup[0].state == "done" and store.get("job-1").dirty
    first = store.mark_clean("job-1")
    second = store.mark_clean("job-1")  # already clean: a no-op
    assert first.clean and second.clean and first.result == second.result == updated
    assert store.get("job-1").clean and store.dirty_entries() == []
    if stores.files:
        assert names(store) == ["job-1.json"]
    with pytest.raises(JobResultNotFoundError, match="already clean"):
        store.update_dirty(updated)


def test_clean_or_update_of_a_missing_entry_is_an_error(store):
    with pytest.raises(JobResultNotFoundError, match="'nope'"):
        store.mark_clean("nope")
    with pytest.raises(JobResultNotFoundError, match="'nope'"):
        store.update_dirty(result("nope"))


def test_delete_on_commit(stores):
    store = stores(delete_on_commit=True)
    store.create_dirty(result())
    assert store.mark_clean("job-1") is None
    assert store.get("job-1") is None and store.list().entries == ()
    with pytest.raises(JobResultNotFoundError):  # nothing is left to say it was clean
        store.mark_clean("job-1")
    if stores.files:
        assert names(store) == []


def test_delete_removes_every_file(stores, store):
    store.create_dirty(result("a"))
    store.create_dirty(result("b"))
    store.mark_clean("b")
    assert store.delete("a") and store.delete("b") and not store.delete("a")
    assert store.list().entries == ()
    store.create_dirty(result("a"))  # the id is free again


def test_cluster_ids_are_namespaces(stores):
    a = stores(cluster_id="a")
    a.create_dirty(result(cluster_id="a"))
    b = stores(cluster_id="b")
    assert b.get("job-1") is None and b.list().entries == ()
    b.create_dirty(result(cluster_id="b", status="FAILED"))
    assert stores(cluster_id="a").get("job-1").status is JobStatus.SUCCEEDED
    with pytest.raises(InvalidRecordError, match="cluster 'a'"):
        b.create_dirty(result("other", cluster_id="a"))
    with pytest.raises(InvalidIdError):
        stores(cluster_id="../etc")


def test_list_filters(store):
    store.create_dirty(result("old-ok", end=100.0))
    store.create_dirty(result("old-failed", JobStatus.FAILED, end=100.0))
    store.create_dirty(result("new-ok", end=5000.0))
    store.create_dirty(result("cancelled", JobStatus.CANCELLED, end=5000.0))
    for job_id in ("old-ok", "new-ok", "cancelled"):
        store.mark_clean(job_id)

    def ids(**kw):
        return [e.job_id for e in store.list(**kw).entries]

    assert ids() == ["cancelled", "new-ok", "old-failed", "old-ok"]
    assert ids(state="dirty") == ["old-failed"] and ids(state="clean") == ["cancelled", "new-ok", "old-ok"]
    assert ids(status="succeeded") == ["new-ok", "old-ok"] and ids(status=JobStatus.CANCELLED) == ["cancelled"]
    assert ids(ended_before=1000.0) == ["old-failed", "old-ok"]
    assert ids(state="clean", status="SUCCEEDED", ended_before=1000.0) == ["old-ok"]
    with pytest.raises(InvalidRecordError):
        store.list(state="done")
    with pytest.raises(InvalidRecordError):
        store.list(status="MAYBE")


def test_prune_by_age_keeps_dirty_and_recent_results(store):
    clock = FakeClock()
    day = 86400.0
    store.create_dirty(result("old-clean", end=clock.now()))
    store.create_dirty(result("old-dirty", end=clock.now()))
    store.mark_clean("old-clean")
    clock.advance(10 * day)
    store.create_dirty(result("recent", end=clock.now()))
    store.mark_clean("recent")
    clock.advance(25 * day)
    assert store.prune(30 * day, clock.now()) == ["old-clean"]
    assert store.get("old-clean") is None and store.get("old-dirty").dirty and store.get("recent").clean
    clock.advance(10 * day)
    assert store.prune(30 * day, clock.now()) == ["recent"]
    assert [e.job_id for e in store.list().entries] == ["old-dirty"], "dirty results are never pruned"
    with pytest.raises(InvalidRecordError):
        store.prune(-1, clock.now())


@pytest.mark.parametrize("job_id", [
    "ingest 2026 11 22", "naïve-日本", "x_DIRTY", "x_DIRTY.json", ".hidden", "...", "a%2Fb", "%", "-dash",
    "q?&=:*<>|\"'", "x" * 200, "CON", "trailing.", "tilde~inside", "emoji-🚀",
])
def test_unusual_job_ids_round_trip_without_escaping(stores, store, job_id):
    store.create_dirty(result(job_id))
    store.create_dirty(result("plain"))
    assert store.get(job_id).result.job_id == job_id
    assert sorted(e.job_id for e in store.list().entries) == sorted([job_id, "plain"])
    store.mark_clean(job_id)
    assert store.get(job_id).clean and store.get("plain").dirty
    assert [e.job_id for e in store.dirty_entries()] == ["plain"]
    if stores.files:
        files = names(store)
        assert len(files) == 2 and "plain_DIRTY.json" in files
        assert all("/" not in n and "\\" not in n and not n.startswith(".") for n in files), files
        assert all(len(n.encode()) <= 255 for n in files)
        if stores.kind == "s3":  # nothing landed outside the store's prefix
            bucket = store.base.root.split("/", 1)[0]
            layout = re.compile(rf"^{bucket}/jrs-\d+/[A-Za-z0-9._-]+/(quarantine/)?[^/]+$")
            stray = [p for p in store.base.fs.find(bucket) if not layout.match(p)]
            assert stray == [], stray
    assert store.delete(job_id) and store.get(job_id) is None


@pytest.mark.parametrize("job_id", ["../x", "..", ".", "a\\b", "x\x00y", "", " ", "x" * 201, "\n",
                                    "/abs", "a/../../b", "a/./b", "a//b", "trailing/"])
def test_hostile_job_ids_are_rejected_everywhere(stores, store, job_id):
    store.create_dirty(result("bystander"))
    with pytest.raises(InvalidIdError):
        result(job_id)
    for op in (store.get, store.mark_clean, store.delete):
        with pytest.raises(InvalidIdError):
            op(job_id)
    assert [e.job_id for e in store.list().entries] == ["bystander"]
    if stores.files:
        assert names(store) == ["bystander_DIRTY.json"]


UNREADABLE = {
    "partial": b'{"version": 1, "res',
    "not-json": b"not json",
    "empty": b"",
    "unknown-version": b'{"version": 9, "result": {}}',
    "no-version": b'{"result": {}}',
    "malformed": b'{"version": 1, "result": {"job_id": 3}}',
    "bad-status": orjson.dumps({"version": 1, "result": {**result("bad").to_dict(), "status": "DONE"}}),
    "wrong-job": orjson.dumps({"version": 1, "result": result("someone-else").to_dict()}),
}


@pytest.mark.parametrize("content", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_unreadable_files_name_the_file_and_can_be_quarantined(stores, store, content):
    needs_files(stores)
    store.create_dirty(result("good"))
    store.base.write_atomic(store.base.path("bad_DIRTY.json"), content)
    if b"someone-else" not in content:
        with pytest.raises(CorruptRecordError, match="bad_DIRTY.json") as info:
            store.get("bad")
        assert "quarantine" in str(info.value)
    listing = store.list()
    assert [e.job_id for e in listing.entries] == ["good"]
    assert len(listing.corrupt) == 1 and listing.corrupt[0][0].endswith("bad_DIRTY.json")
    with pytest.raises(JobResultExistsError, match="cannot be read|already has"):
        store.create_dirty(result("bad"))
    moved = store.quarantine("bad_DIRTY.json")
    assert len(moved) == 1 and "/quarantine/bad_DIRTY.json" in moved[0]
    assert store.list().corrupt == () and store.get("bad") is None
    assert [e.job_id for e in store.list().entries] == ["good"]


def test_quarantine_by_job_id_and_twice(stores, store):
    needs_files(stores)
    for _ in range(2):
        store.base.write_atomic(store.base.path("bad_DIRTY.json"), b"{oops")
        store.base.write_atomic(store.base.path("bad.json"), b"{oops")
        moved = store.quarantine("bad")  # both files of the job
        assert len(moved) == 2
    assert len(store.base.child("quarantine").listdir()) == 4, "a second quarantine does not overwrite the first"
    with pytest.raises(JobResultNotFoundError, match="no file or job"):
        store.quarantine("bad")
    with pytest.raises(InvalidIdError):
        store.quarantine("../x")


def test_quarantine_on_memory_is_a_clear_error(stores, store):
    if stores.files:
        pytest.skip("file stores quarantine")
    with pytest.raises(JobResultNotFoundError, match="in-memory"):
        store.quarantine("x")


def test_file_names_that_encode_no_job_id_are_reported(stores, store):
    needs_files(stores)
    store.create_dirty(result("good"))
    store.base.write_atomic(store.base.path("%zz_DIRTY.json"), result("x").to_json())
    store.base.write_atomic(store.base.path("ignored.txt"), b"not a result")
    store.base.write_atomic(store.base.path(".staged.tmp.json"), b"partial")
    listing = store.list()
    assert [e.job_id for e in listing.entries] == ["good"]
    assert [c[0].rsplit("/", 1)[-1] for c in listing.corrupt] == ["%zz_DIRTY.json"]


def test_a_corrupt_dirty_file_is_not_committed(stores, store):
    needs_files(stores)
    store.base.write_atomic(store.base.path("bad_DIRTY.json"), b"{oops")
    with pytest.raises(CorruptRecordError, match="bad_DIRTY.json"):
        store.mark_clean("bad")
    assert names(store) == ["bad_DIRTY.json"]


def test_stale_dirty_next_to_clean_is_resolved_by_the_clean_copy(stores, store):
    needs_files(stores)
    store.create_dirty(result())
    clean = store.mark_clean("job-1")
    # an object-store rename copied the file, then the process died before deleting the source
    store.base.write_atomic(store.base.path("job-1_DIRTY.json"), result().to_json())
    assert store.get("job-1").clean
    listing = store.list()
    assert [e.clean for e in listing.entries] == [True] and listing.stale == ("job-1",)
    assert store.dirty_entries() == [] and store.list(state="clean").stale == ("job-1",)
    with pytest.raises(JobResultExistsError):
        store.create_dirty(result())
    assert store.mark_clean("job-1") == clean  # the next commit (or recovery) removes the stale file
    assert names(store) == ["job-1.json"] and store.list().stale == ()


def test_many_threads_share_one_store(store):
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            store.create_dirty(result(f"t-{i}"))
            store.list()
            store.update_dirty(result(f"t-{i}").with_cleanup((StepState("delete_path", "/tmp/x0", "done", 1),)))
            store.mark_clean(f"t-{i}")
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    entries = store.list().entries
    assert len(entries) == 16 and all(e.clean and e.result.cleanup_done for e in entries)


# --- the record -----------------------------------------------------------------------------
def test_record_round_trips_through_versioned_json():
    r = JobResult(job_id="j", cluster_id="c", application_id=None, status="canceled", start_time=1,
                  end_time=2.5, spark_jobs=[SparkJobOutcome(1, "failed", "boom")],
                  failure=Failure.from_exception(ValueError("bad row"), "etl.py:3 in main"),
                  payload={"nested": [1, "two", None, True, 1.5]},
                  cleanup=[StepState("blob_job_dir", "j", "failed", 2, "E: x", 12.0)])
    assert r.status is JobStatus.CANCELLED and isinstance(r.spark_jobs, tuple) and r.start_time == 1.0
    data = r.to_json()
    doc = orjson.loads(data)
    assert list(doc) == ["version", "result"] and doc["version"] == 1
    assert doc["result"]["failure"] == {"type": "builtins.ValueError", "message": "bad row", "where": "etl.py:3 in main"}
    assert JobResult.from_json(data, "x") == r
    assert hash(r.spark_jobs[0]) == hash(SparkJobOutcome(1, "failed", "boom"))


def test_final_checkpoints_round_trip_and_older_records_read_as_none():
    chk = FinalCheckpoint("clicks", 7, "s3://bkt/chk/default/clicks/chk-7")
    r = result()
    with_chk = JobResult.from_dict({**r.to_dict(), "checkpoints": [chk.to_dict()]})
    assert with_chk.checkpoints == (chk,)
    assert JobResult.from_json(with_chk.to_json(), "x") == with_chk
    older = r.to_dict()
    del older["checkpoints"]  # written before results kept final checkpoints
    assert JobResult.from_dict(older).checkpoints == ()
    for bad, match in (({"state": "", "checkpoint_id": 1, "path": "p"}, "state"),
                       ({"state": "s", "checkpoint_id": -1, "path": "p"}, "checkpoint_id"),
                       ({"state": "s", "checkpoint_id": True, "path": "p"}, "checkpoint_id"),
                       ("nope", "final checkpoint")):
        with pytest.raises(InvalidRecordError, match=match):
            JobResult.from_dict({**r.to_dict(), "checkpoints": [bad]})


@pytest.mark.parametrize("change, match", [
    ({"status": "DONE"}, "status"),
    ({"start_time": -1}, "start_time"),
    ({"end_time": float("nan")}, "end_time"),
    ({"payload": {1, 2}}, "JSON value"),
    ({"payload": "x" * (1 << 20 + 1)}, "limit"),
    ({"spark_jobs": ("nope",)}, "SparkJobOutcome"),
    ({"application_id": 7}, "application_id"),
    ({"failure": {"type": "E"}}, "failure"),
    ({"cluster_id": "a/b"}, "cluster id"),
])
def test_record_validation(change, match):
    fields = dict(job_id="j", cluster_id="c", application_id=None, status="SUCCEEDED", start_time=1.0, end_time=2.0)
    with pytest.raises((InvalidRecordError, InvalidIdError), match=match):
        JobResult(**{**fields, **change})
    with pytest.raises(InvalidRecordError, match="state"):
        StepState("delete_path", "/x", state="maybe")
    with pytest.raises(InvalidRecordError):
        SparkJobOutcome(-1, "failed")
