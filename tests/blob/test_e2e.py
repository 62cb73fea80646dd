"""st.broadcast and st.add_library end to end on local[2]."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from sparksteward import Steward

from tests.helpers import spark_session, wait_until


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return tmp_path_factory.mktemp("blob-state")


# its own session (not conftest's shared one): the teardown checks what spark.stop() leaves in its state dir
@pytest.fixture(scope="module")
def spark(state):
    with spark_session("local[2]", **{"spark.steward.state-dir": str(state)}) as session:
        yield session
    assert not list((state / "blob-local").iterdir()), "the driver agent deleted its local store"
    left = [p for p in (state / "ha").rglob("*") if p.is_file()]
    assert not left, f"blob files remain after spark.stop(): {left}"


def _cache_stats(spark):
    def probe(_):
        from sparksteward.worker import executor_connection

        return [executor_connection().request("blob.cache_stats")["stats"]]

    return spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()[0]


@pytest.mark.compat
def test_numpy_broadcast_is_zero_copy_in_workers(spark):
    st = Steward.get(spark)
    arr = np.arange(4_000_000, dtype=np.float64)  # 32 MB
    h = st.broadcast(arr)
    assert len(pickle.dumps(h)) < 1024
    assert h.value is arr

    def use(i):
        v = h.value
        return [(float(v[i * 1000]), v.flags.writeable, v.base is not None)]

    rows = spark.sparkContext.parallelize(range(4), 4).flatMap(use).collect()
    assert [r[0] for r in rows] == [0.0, 1000.0, 2000.0, 3000.0]
    assert all(not writeable and is_view for _, writeable, is_view in rows), "values are read-only views of the map"


def test_arrow_and_plain_objects(spark):
    st = Steward.get(spark)
    table = pa.table({"x": pa.array(np.arange(1000))})
    ht, ho = st.broadcast(table), st.broadcast({"a": [1, 2, 3]})
    got = spark.sparkContext.parallelize([0], 1).map(lambda _: (ht.value.num_rows, ho.value["a"][2])).collect()
    assert got == [(1000, 3)]


def test_same_content_twice_is_stored_and_shipped_once(spark):
    st = Steward.get(spark)
    before_server, before_cache = st.blobs.stats(), _cache_stats(spark)
    payload = np.full(100_000, 7, dtype=np.int32)
    h1, h2 = st.broadcast(payload), st.broadcast(payload.copy())
    assert h1.key == h2.key
    rdd = spark.sparkContext.parallelize(range(4), 4)
    assert rdd.map(lambda _: int(h1.value.sum() + h2.value.sum())).collect() == [1_400_000] * 4
    after_server, after_cache = st.blobs.stats(), _cache_stats(spark)
    assert after_server.get("uploads", 0) - before_server.get("uploads", 0) == 1
    assert after_server.get("dedup", 0) - before_server.get("dedup", 0) == 1
    assert after_cache.get("transfers", 0) - before_cache.get("transfers", 0) == 1


def _make_wheel(tmp_path: Path, value: int) -> Path:
    whl = tmp_path / f"stewlib_{value}" / "stewlib-1.0-py3-none-any.whl"
    whl.parent.mkdir()
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("stewlib/__init__.py", f"VALUE = {value}\n")
    return whl


@pytest.mark.compat
def test_add_library_is_importable_in_workers_and_shipped_once(spark, tmp_path):
    st = Steward.get(spark)
    whl = _make_wheel(tmp_path, 41)
    single = tmp_path / "stewsingle.py"
    single.write_text("def answer():\n    return 42\n")
    before = _cache_stats(spark)
    k1 = st.add_library(whl)
    k2 = st.add_library(whl)
    st.add_library(single)
    assert k1 == k2

    def use(_):
        import stewlib
        import stewsingle

        return [stewsingle.answer() == stewlib.VALUE + 1]

    assert spark.sparkContext.parallelize(range(4), 4).flatMap(use).collect() == [True] * 4
    after = _cache_stats(spark)
    fetched = sum(after.get(k, 0) - before.get(k, 0) for k in ("transfers", "ha_fetches"))
    assert fetched == 2, "one transfer (from HA or the server) per distinct library"


def test_job_blob_directory_is_gone_within_2s_of_the_job_end(spark, state):
    st = Steward.get(spark)
    with st.job("blob-scope") as job:
        h = st.broadcast(np.ones(1000))
        assert spark.sparkContext.parallelize([0], 1).map(lambda _: float(h.value.sum())).collect() == [1000.0]
        local = Path(st.blobs.incoming).parent / "blob-scope"
        assert local.is_dir()
    wait_until(lambda: not local.exists(), timeout=2, what="the job's local blob directory to go")
    assert job.entry.clean and not (state / "ha" / "default" / "blob" / "blob-scope").exists()


def test_bad_keys_and_job_ids_get_clear_errors(spark):
    from sparksteward.errors import InvalidIdError

    st = Steward.get(spark)
    with pytest.raises(InvalidIdError, match="blob key"):
        st.blobs.get_bytes("p-../../etc/passwd")
    with pytest.raises(InvalidIdError, match="job id"):
        st.blobs.get_bytes("t-" + "0" * 32, job_id="../x")
    with pytest.raises(Exception, match="incoming"):
        st.request("blob.put_path", path="/etc/passwd", job_id=None, type="t")
    assert st.health()["state"] == "running"


def test_add_jar_refuses_a_file_that_is_not_a_jar_by_name_before_uploading(spark, tmp_path):
    """Issue 40: st.add_jar("/etc/hostname") was accepted. A jar is a zip with a manifest or classes."""
    import zipfile

    from sparksteward.errors import InvalidIdError, InvalidRequestError

    st = Steward.get(spark)
    before = st.blobs.stats()
    text = tmp_path / "hostname"
    text.write_text("a-host\n")
    with pytest.raises(InvalidRequestError, match=rf"jar '{text}' is not a jar \(not a zip archive"):
        st.add_jar(text)
    notes = tmp_path / "notes.jar"
    with zipfile.ZipFile(notes, "w") as z:
        z.writestr("readme.txt", "no classes here")
    with pytest.raises(InvalidRequestError, match=rf"jar '{notes}' is a zip archive with neither "
                                                  r"META-INF/MANIFEST.MF nor classes \(1 entries\)"):
        st.add_jar(notes)
    with pytest.raises(InvalidIdError, match=r"jar '.*missing.jar' is not a file"):
        st.add_jar(tmp_path / "missing.jar")
    disguised = tmp_path / "disguised.jar"   # a .jar name that is a symlink to a text file
    disguised.symlink_to(text)
    with pytest.raises(InvalidRequestError, match=rf"jar '{disguised}' is not a jar"):
        st.add_jar(disguised)
    assert st.blobs.stats() == before   # nothing uploaded
