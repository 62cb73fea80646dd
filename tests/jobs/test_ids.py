"""Job ids: validation, the file-name encoding and Spark job tags (issue 7 items 16 and 17)."""

from __future__ import annotations

import os

import pytest
from sparksteward.agents.driver import _scoped_jobs
from sparksteward.errors import CorruptRecordError, InvalidIdError
from sparksteward.ids import job_id_from_filename, job_id_to_filename, validate_id, validate_job_id
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import JobResult
from sparksteward.jobscope import job_tag


def result(job_id: str) -> JobResult:
    return JobResult(job_id=job_id, cluster_id="default", application_id=None, status="SUCCEEDED",
                     start_time=1.0, end_time=2.0)


@pytest.mark.parametrize("bad", ["x\n", "abc\n", "a\nb"])
def test_validate_id_refuses_a_trailing_newline(bad):
    with pytest.raises(InvalidIdError):
        validate_id(bad, "cluster id")


@pytest.mark.parametrize("job_id", ["a,b", "x,,y", ",", "daily/2026-11-22,retry", "Ünïcode,Çase"])
def test_ids_with_commas_are_attributed_through_their_spark_tag(job_id):
    tag = job_tag(job_id)
    assert "," not in tag, "Spark joins job tags with commas"
    # what the driver agent's listener does with a job_start event's tags; SparkSession tags carry a prefix
    assert _scoped_jobs([tag]) == [job_id]
    assert _scoped_jobs(["etl", f"spark-session-u-thread-t-{tag}"]) == [job_id]


@pytest.mark.parametrize("job_id", ["daily/2026-11-22", "a/b/c", "team/etl/ingest 1", "x/.y", "x/..y"])
def test_ids_with_slashes_are_accepted_and_round_trip(tmp_path, job_id):
    assert validate_job_id(job_id) == job_id
    stem = job_id_to_filename(job_id)
    assert "/" not in stem and job_id_from_filename(stem) == job_id
    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    store.create_dirty(result(job_id))
    assert store.get(job_id).job_id == job_id
    assert [e.job_id for e in store.list().entries] == [job_id]
    assert [n for n in os.listdir(tmp_path / "jrs" / "default") if not n.startswith(".")] == [stem + "_DIRTY.json"]


@pytest.mark.parametrize("job_id, rule", [
    ("", "empty"), (".", "directory"), ("..", "directory"), ("a/../b", "segment"), ("../x", "segment"),
    ("x/..", "segment"), ("./x", "segment"), ("a/./b", "segment"),
])
def test_ids_that_are_empty_or_dot_segments_are_refused(job_id, rule):
    with pytest.raises(InvalidIdError, match=rule):
        validate_job_id(job_id)
    with pytest.raises(InvalidIdError):
        job_id_to_filename(job_id)


@pytest.mark.parametrize("stem", ["%2E", "%2E%2E", "a%2F..%2Fb", "%2F", "%2E%2Fx"])
def test_file_names_that_decode_to_dot_segments_are_refused(stem):
    with pytest.raises(InvalidIdError):
        job_id_from_filename(stem)


@pytest.mark.parametrize("job_id", ["日" * 100, "é" * 200, "x" * 200, "🚀" * 100, "Äb/" * 66 + "x"])
def test_long_non_ascii_ids_get_a_bounded_file_name(tmp_path, job_id):
    stem = job_id_to_filename(job_id)
    assert len(stem.encode()) <= 120
    # a blob job directory with a key inside, and a JobResultStore entry, both work
    blob_dir = tmp_path / "blob" / stem
    blob_dir.mkdir(parents=True)
    (blob_dir / ("t-" + "0" * 64)).write_bytes(b"x")
    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    store.create_dirty(result(job_id))
    store.create_dirty(result(job_id[:-1] + "z"))  # same prefix, another id: another file
    assert store.get(job_id).job_id == job_id
    assert sorted(e.job_id for e in store.list().entries) == sorted([job_id, job_id[:-1] + "z"])
    store.mark_clean(job_id)
    assert store.get(job_id).clean
    assert store.delete(job_id) and store.get(job_id) is None


def test_ids_differing_only_in_case_get_case_unique_file_names():
    names = {job_id_to_filename(i).lower() for i in ["ingest", "Ingest", "INGEST", "inGest", "x_DIRTY", "x_dirty"]}
    assert len(names) == 6


def test_a_case_insensitive_name_collision_does_not_return_the_wrong_record(tmp_path):
    """On a case-insensitive store, the file of one id may be what the name of another resolves to.

    Simulated here: the file written for ``abc`` is placed under the name ``ABC`` would use."""
    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    store.create_dirty(result("abc"))
    folder = tmp_path / "jrs" / "default"
    os.link(folder / f"{job_id_to_filename('abc')}_DIRTY.json", folder / f"{job_id_to_filename('ABC')}_DIRTY.json")
    with pytest.raises(CorruptRecordError, match="holds job 'abc'"):
        store.get("ABC")
    assert store.get("abc").job_id == "abc"
    listing = store.list()
    assert [e.job_id for e in listing.entries] == ["abc"] and len(listing.corrupt) == 1
