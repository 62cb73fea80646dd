"""One JobResultStore contract, run against memory, file:// and s3:// (moto's server on 127.0.0.1)."""

from __future__ import annotations

import pytest

from sparksteward.errors import CorruptRecordError, InvalidIdError, JobResultExistsError, JobResultNotFoundError
from sparksteward.jobs.result import JobResult, JobStatus, StepState, encode_result
from sparksteward.jobs.store import FileSystemJobResultStore, InMemoryJobResultStore
from sparksteward.testing.s3 import local_s3


@pytest.fixture(scope="module")
def s3():
    with local_s3() as server:
        yield server


_counter = iter(range(10**6))


@pytest.fixture(params=["memory", "file", "s3"])
def make_store(request, tmp_path):
    url = {"memory": "", "file": str(tmp_path / "jrs"),
           "s3": request.getfixturevalue("s3").url(f"jrs-{next(_counter)}") if request.param == "s3" else ""}[request.param]

    def make(delete_on_commit: bool = False, cluster_id: str = "default"):
        if request.param == "memory":
            return InMemoryJobResultStore(cluster_id, delete_on_commit)
        return FileSystemJobResultStore(url, cluster_id, delete_on_commit)

    make.kind = request.param
    return make


def result(job_id: str = "job-1", status: JobStatus = JobStatus.SUCCEEDED, end: float = 2000.0) -> JobResult:
    return JobResult(job_id=job_id, cluster_id="default", application_id="app-1", status=status,
                     start_time=1000.0, end_time=end, payload={"rows": 3},
                     cleanup=(StepState("delete_path", "/tmp/x"),))


def test_missing_store_dir_lists_empty_and_gets_none(make_store):
    store = make_store()
    assert store.list().entries == [] and store.get("job-1") is None


def test_create_is_dirty_and_readable(make_store):
    store = make_store()
    entry = store.create_dirty(result())
    assert not entry.clean
    got = store.get("job-1")
    assert got is not None and not got.clean and got.result == result()
    assert [e.job_id for e in store.list().entries] == ["job-1"]


def test_duplicate_create_is_refused_dirty_or_clean(make_store):
    store = make_store()
    store.create_dirty(result())
    with pytest.raises(JobResultExistsError, match="job-1"):
        store.create_dirty(result(status=JobStatus.FAILED))
    store.mark_clean("job-1")
    with pytest.raises(JobResultExistsError, match="clean"):
        store.create_dirty(result())


def test_update_dirty_then_clean_twice(make_store):
    store = make_store()
    store.create_dirty(result())
    updated = result().with_cleanup((StepState("delete_path", "/tmp/x", "done", 1),))
    store.update_dirty(updated)
    assert store.get("job-1").result.cleanup[0].state == "done"
    first = store.mark_clean("job-1")
    second = store.mark_clean("job-1")
    assert first.clean and second.clean and first.result == second.result == updated
    with pytest.raises(JobResultNotFoundError):
        store.update_dirty(updated)


def test_clean_of_a_missing_entry_is_an_error(make_store):
    with pytest.raises(JobResultNotFoundError, match="nope"):
        make_store().mark_clean("nope")


def test_delete_on_commit(make_store):
    store = make_store(delete_on_commit=True)
    store.create_dirty(result())
    assert store.mark_clean("job-1") is None
    assert store.get("job-1") is None and store.list().entries == []


def test_cluster_ids_are_namespaces(make_store):
    if make_store.kind == "memory":
        pytest.skip("an in-memory store is one namespace by construction")
    a = make_store(cluster_id="a")
    a.create_dirty(result())
    b = make_store(cluster_id="b")
    assert b.get("job-1") is None and b.list().entries == []
    assert make_store(cluster_id="a").get("job-1") is not None


@pytest.mark.parametrize("job_id", ["ingest 2026/11", "naïve-日本", "x_DIRTY", ".hidden", "a%2Fb", "-dash", "q?&=:"])
def test_unusual_job_ids_round_trip_without_escaping(make_store, job_id):
    if "/" in job_id:
        with pytest.raises(InvalidIdError):
            make_store().create_dirty(result(job_id))
        return
    store = make_store()
    store.create_dirty(result(job_id))
    store.create_dirty(result("plain"))
    assert store.get(job_id).result.job_id == job_id
    assert sorted(e.job_id for e in store.list().entries) == sorted([job_id, "plain"])
    store.mark_clean(job_id)
    assert store.get(job_id).clean and not store.get("plain").clean
    if make_store.kind != "memory":
        names = [i["name"].rsplit("/", 1)[-1] for i in store.base.listdir()]
        assert all("/" not in n and not n.startswith(".") for n in names), names


@pytest.mark.parametrize("job_id", ["../x", "a/b", "..", ".", "a\\b", "x\x00y", "", " ", "x" * 201, "\n"])
def test_hostile_job_ids_are_rejected(make_store, job_id):
    store = make_store()
    with pytest.raises(InvalidIdError):
        store.create_dirty(result(job_id))
    with pytest.raises(InvalidIdError):
        store.get(job_id)


@pytest.mark.parametrize("content", [b"{\"version\": 1, \"res", b"not json", b"{\"version\": 9, \"result\": {}}",
                                     b"{\"version\": 1, \"result\": {\"job_id\": 3}}", b""])
def test_unreadable_files_name_the_file_and_can_be_quarantined(make_store, content):
    if make_store.kind == "memory":
        pytest.skip("an in-memory store has no files")
    store = make_store()
    store.create_dirty(result("good"))
    path = store.base.path("bad_DIRTY.json")
    store.base.write_atomic(path, content)
    with pytest.raises(CorruptRecordError, match="bad_DIRTY.json"):
        store.get("bad")
    listing = store.list()
    assert [e.job_id for e in listing.entries] == ["good"]
    assert len(listing.corrupt) == 1 and "bad_DIRTY.json" in listing.corrupt[0][0]
    moved = store.quarantine("bad_DIRTY.json")
    assert "quarantine" in moved and store.list().corrupt == [] and store.get("bad") is None


def test_stale_dirty_next_to_clean_is_resolved_by_the_clean_copy(make_store):
    if make_store.kind == "memory":
        pytest.skip("only a file store can be interrupted mid-rename")
    store = make_store()
    store.create_dirty(result())
    clean = store.mark_clean("job-1")
    store.base.write_atomic(store.base.path("job-1_DIRTY.json"), encode_result(result()))  # copy done, delete lost
    assert store.get("job-1").clean
    assert [e.clean for e in store.list().entries] == [True]
    assert store.mark_clean("job-1") == clean
    assert not store.base.exists(store.base.path("job-1_DIRTY.json"))
