"""restore_from, CLAIM and savepoints through the Spark API, on moto's S3 server (issue 8, must-show 3),
and the bad-input cases about stored checkpoints. Real local[2] Spark, real agents, a real S3 wire
endpoint whose request log counts every byte that crosses it. Run under the Spark lock."""

from __future__ import annotations

import orjson
import pytest
from sparksteward import Steward
from sparksteward.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ParallelismError

from tests.helpers import spark_session
from tests.helpers.keyed import SCHEMA, count_sum, make_batches, reference, state_of
from tests.helpers.restore import CLUSTER, DATA_OPS, checksums, listing, metadata, object_bytes, puts_under, root

pytestmark = pytest.mark.slow

P, M = 3, 16


# its own session: the cluster id "rs" names the S3 paths the tests read
@pytest.fixture(scope="module")
def spark(s3, tmp_path_factory):
    conf = {"spark.steward.state-dir": str(tmp_path_factory.mktemp("restore-state")),
            "spark.steward.storage.options": s3.storage_options(),
            "spark.steward.cluster-id": CLUSTER}
    with spark_session("local[2]", **conf) as session:
        yield session


@pytest.fixture(scope="module")
def st(spark):
    return Steward.get(spark)


@pytest.fixture(scope="module")
def batches():
    return make_batches(11, count=6, rows=400, keys=60)


def make_source(spark, st, s3, batches, name: str):
    """State ``name`` on S3 with checkpoints 0, 1, 2 (chk-1 and chk-2 retained)."""
    ks = st.keyed_state(name, key="k", parallelism=P, max_parallelism=M, checkpoint_dir=s3.url("chk"), file_merging=False,
                        num_retained=2)
    for i in range(3):
        ks.apply(spark.createDataFrame(batches[i]), count_sum, SCHEMA, checkpoint_id=i).collect()
        ks.commit(i, wait=60)
    assert ks.info()["retained"] == [1, 2]
    return ks


@pytest.fixture(scope="module")
def source(spark, st, s3, batches):
    return make_source(spark, st, s3, batches, "src")


# --- must show 3 ----------------------------------------------------------------------------------
def test_no_claim_restore_moves_no_bytes_and_the_next_checkpoint_uploads_only_new_files(spark, st, s3, source,
                                                                                       batches):
    src_url = root(s3, "chk", "src") + "/chk-1"
    src_before = listing(s3, root(s3, "chk", "src"))
    restored_sums = checksums(metadata(s3, src_url))

    mark = s3.mark()
    ks = st.keyed_state("copy", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=s3.url("other"), file_merging=False,
                        restore_from=src_url)
    during = s3.requests_since(mark)
    copies = [r for r in during if r.op == "CopyObject"]
    print(f"\nNO_CLAIM restore of {len(restored_sums)} files: {len(copies)} CopyObject, "
          f"{object_bytes(during)} object bytes through any process, {len(during)} requests")
    assert object_bytes(during) == 0, [r for r in during if r.op in DATA_OPS]
    assert {r.key.split("/")[-1] for r in copies} == restored_sums
    assert all(r.copy_source.split("/")[-1] in restored_sums and "/chk/rs/src/shared/" in r.copy_source
               for r in copies)
    assert ks.restore_info["action"] == "restored" and ks.restore_info["bytes_streamed"] == 0
    assert ks.restore_info["copied_server_side"] == len(restored_sums)

    # the next checkpoint: only files the restored checkpoint lacks are uploaded
    mark = s3.mark()
    ks.apply(spark.createDataFrame(batches[3]), count_sum, SCHEMA, checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    during = s3.requests_since(mark)
    dst = root(s3, "other", "copy")
    uploaded = puts_under(during, dst.split("/", 3)[3] + "/shared/")
    chk0 = metadata(s3, dst + "/chk-0")
    new = checksums(chk0) - restored_sums
    reused = checksums(chk0) & restored_sums
    print(f"next checkpoint: uploaded {len(uploaded)} new files ({sum(uploaded.values())} B), reused "
          f"{len(reused)} restored files; the executors read {object_bytes([r for r in during if r.op == 'GetObject'])}"
          f" B to restore their subtasks")
    assert reused, "a 1-batch update keeps some restored files"
    assert set(uploaded) == new and not set(uploaded) & restored_sums
    assert state_of(ks) == reference([*batches[:2], batches[3]])
    assert listing(s3, root(s3, "chk", "src")) == src_before  # NO_CLAIM: the source is untouched


def test_claim_restore_copies_nothing_and_later_deletes_only_claimed_files(spark, st, s3, batches):
    make_source(spark, st, s3, batches, "claimed")  # CLAIM takes the source over: not the shared one
    src_root = root(s3, "chk", "claimed")
    with pytest.raises(CheckpointError, match="still has a live writer"):   # its writer is this application
        st.keyed_state("claimer", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=s3.url("third"),
                       file_merging=False, restore_from=src_root + "/chk-2", claim_mode="claim", num_retained=1)
    lease = orjson.loads(s3.filesystem().cat_file(src_root + "/_lease"))   # as if the source's writer stopped
    s3.filesystem().pipe_file(src_root + "/_lease", orjson.dumps({**lease, "released": True}))
    src_url = src_root + "/chk-2"
    claimed = checksums(metadata(s3, src_url))
    chk1 = metadata(s3, src_root + "/chk-1")
    outside = checksums(chk1) - claimed  # files of the source that chk-2 does not list
    src_before = listing(s3, src_root)

    mark = s3.mark()
    ks = st.keyed_state("claimer", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=s3.url("third"), file_merging=False,
                        restore_from=src_url, claim_mode="claim", num_retained=1)
    during = s3.requests_since(mark)
    assert [r for r in during if r.op == "CopyObject"] == []
    assert [r.key for r in during if r.op == "PutObject" and not r.key.endswith("/_lease")] == \
        [f"third/{CLUSTER}/claimer/restored/_metadata"]
    assert object_bytes(during) == 0
    assert ks.restore_info["action"] == "restored" and ks.restore_info["claim_mode"] == "claim"

    dst = root(s3, "third", "claimer")
    expected = list(batches[:3])
    for i, b in enumerate(batches[3:6]):
        mark = s3.mark()
        ks.apply(spark.createDataFrame(b), count_sum, SCHEMA, checkpoint_id=i).collect()
        ks.commit(i, wait=60)
        expected.append(b)
        during = s3.requests_since(mark)
        uploaded = puts_under(during, dst.split("/", 3)[3] + "/shared/")
        assert not set(uploaded) & claimed, "a claimed file is never uploaded again"
        assert [r for r in during if r.op == "CopyObject"] == []
        assert state_of(ks) == reference(expected)

    # `restored` was subsumed: the claimed record is gone, and every claimed file no retained checkpoint
    # references with it; nothing else of the source was touched
    src_after = listing(s3, src_root)
    gone = set(src_before) - set(src_after)
    assert f"{src_root.split('://')[1]}/chk-2/_metadata" in gone
    assert {p.split("/")[-1] for p in gone if "/shared/" in p} <= claimed
    assert {p.split("/")[-1] for p in gone if "/shared/" in p}, "claimed files no longer referenced are deleted"
    assert f"{src_root.split('://')[1]}/chk-1/_metadata" in src_after
    assert outside <= {p.split("/")[-1] for p in src_after}
    info = ks.info()
    still = {f["path"] for s in info["latest"]["subtasks"] for f in s["files"] if "://" in f["path"]}
    assert all(s3.filesystem().exists(p) for p in still)


def test_savepoint_is_self_contained_and_restorable_elsewhere(spark, st, s3, source, batches):
    url = s3.url("savepoints", "src-1")
    mark = s3.mark()
    assert source.savepoint(url) == url
    during = s3.requests_since(mark)
    assert object_bytes(during) == 0 and [r for r in during if r.op == "CopyObject"]
    sp = metadata(s3, url)
    assert sp["checkpoint_id"] == 2 and all(f["path"].startswith("shared/") for s in sp["subtasks"]
                                             for f in s["files"])
    assert {p.split("/")[-1] for p in listing(s3, url + "/shared")} == checksums(sp)
    with pytest.raises(CheckpointError, match=r"savepoint 's3://.*/savepoints/src-1' already exists"):
        source.savepoint(url)
    ks = st.keyed_state("fromsp", key="k", parallelism=2, max_parallelism=M, checkpoint_dir=s3.url("sp-use"), file_merging=False,
                        restore_from=url)  # another parallelism too: the first apply rescales 3 -> 2
    ks.apply(spark.createDataFrame(batches[3]), count_sum, SCHEMA, checkpoint_id=0).collect()
    ks.commit(0, wait=60)
    assert state_of(ks) == reference([*batches[:3], batches[3]])


# --- bad input ------------------------------------------------------------------------------------
def test_restore_from_that_is_not_a_checkpoint(st, s3, source):
    bad = root(s3, "chk", "src") + "/shared"
    with pytest.raises(CheckpointNotFoundError, match=r"restore_from='s3://.*/src/shared' is not a checkpoint: "
                                                      r"s3://.*/src/shared/_metadata does not exist. Pass a retained "
                                                      r"checkpoint directory .* or a savepoint directory"):
        st.keyed_state("bad1", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=s3.url("bad"),
                       restore_from=bad)
    with pytest.raises(CheckpointError, match=r"claim_mode='steal' is not valid: use 'no_claim' or 'claim'"):
        st.keyed_state("bad1", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=s3.url("bad"),
                       restore_from=root(s3, "chk", "src") + "/chk-2", claim_mode="steal")
    assert listing(s3, s3.url("bad")) == {}


def _copy_savepoint(source, s3, name: str) -> str:
    url = s3.url("savepoints", name)
    source.savepoint(url)
    return url


def test_a_checkpoint_of_a_newer_version_is_refused(st, s3, source):
    url = _copy_savepoint(source, s3, "newer")
    doc = metadata(s3, url)
    doc["version"] = 7
    s3.filesystem().pipe_file(url + "/_metadata", orjson.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match=r"s3://.*/savepoints/newer/_metadata was written by a newer "
                                                     r"spark-steward \(metadata version 7; this one reads up to 1\): "
                                                     r"upgrade spark-steward to restore it"):
        st.keyed_state("bad2", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=s3.url("bad"),
                       restore_from=url)
    assert listing(s3, s3.url("bad")) == {}


def test_a_missing_file_is_refused_before_anything_is_written(st, s3, source):
    url = _copy_savepoint(source, s3, "missing")
    victim = metadata(s3, url)["subtasks"][2]["files"][0]
    s3.filesystem().rm(f"{url}/{victim['path']}")
    for mode in ("no_claim", "claim"):
        with pytest.raises(CheckpointNotFoundError,
                           match=rf"restore_from='s3://.*/missing': file {victim['name']} of subtask 2 "
                                 rf"\(s3://.*/missing/shared/{victim['checksum']}\) is missing.*nothing was restored. "
                                 rf"Pass another retained checkpoint or a savepoint"):
            st.keyed_state(f"bad3{mode.replace('_', '')}", key="k", parallelism=P, max_parallelism=M,
                           checkpoint_dir=s3.url("bad"), restore_from=url, claim_mode=mode)
    assert listing(s3, s3.url("bad")) == {}


def _previous_run(s3, tmp_path, checkpoint_dir: str, name: str, max_parallelism: int = 16) -> str:
    """Checkpoint 0 of state ``name`` written by another application (the layers below Spark, in this
    process), so no executor of this application has its files cached; returns its ``chk-0`` URL."""
    from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
    from sparksteward.checkpoint.storage import CheckpointStorage

    from tests.helpers.checkpoint import BATCHES, run_batch

    storage = CheckpointStorage.open(s3.url(checkpoint_dir), name, CLUSTER)
    coord = CheckpointCoordinator(storage, 2, max_parallelism)
    run_batch(coord, storage, tmp_path, 0, BATCHES[2])
    coord.complete(0)
    return storage.url_of("chk-0")


def test_a_corrupt_file_fails_the_task_with_our_message_and_the_checkpoint_is_aborted(spark, st, s3, tmp_path,
                                                                                      batches):
    url = _previous_run(s3, tmp_path, "elsewhere", "corrupt")
    meta = metadata(s3, url)
    victim = max((f for s in meta["subtasks"] for f in s["files"] if f["name"].endswith((".sst", ".log"))),
                 key=lambda f: f["length"])  # the largest data file: an SST or a WAL (decision 0012)
    obj = root(s3, "elsewhere", "corrupt") + "/" + victim["path"]
    s3.filesystem().pipe_file(obj, b"\0" * victim["length"])  # same size, other bytes
    ks = st.keyed_state("bad4", key="k", parallelism=P, max_parallelism=M, checkpoint_dir=s3.url("bad4"),
                        restore_from=url)  # sizes match: only reading the bytes can tell
    with pytest.raises(Exception) as failed:
        ks.apply(spark.createDataFrame(batches[3]), count_sum, SCHEMA, checkpoint_id=0).collect()
    message = str(failed.value)
    assert "CheckpointCorruptError" in message
    assert (f"file {victim['name']} " in message and f"expected checksum {victim['checksum']}" in message
            and f"It was restored from {url}: start the state again with restore_from= another retained "
                "checkpoint or a savepoint" in message), message[:3000]
    with pytest.raises(CheckpointError, match="cannot complete: subtasks .* have not acked"):
        ks.commit(0, wait=1)
    left = listing(s3, root(s3, "bad4", "bad4"))
    assert left and not [p for p in left if "/chk-" in p], "no checkpoint was completed"
    assert ks.info()["pending"] == []


def test_changing_max_parallelism_of_an_existing_state_is_refused(spark, st, s3, tmp_path, batches):
    _previous_run(s3, tmp_path, "prev", "mp")  # the state's previous run left checkpoint 0, max_parallelism 16
    before = listing(s3, s3.url("prev"))
    with pytest.raises(ParallelismError, match=r"Changing max_parallelism is refused: state 'mp' was checkpointed "
                                               r"with max_parallelism=16 \(checkpoint 0\) and cannot be restored "
                                               r"with max_parallelism=32.*Keep max_parallelism=16"):
        st.keyed_state("mp", key="k", parallelism=2, max_parallelism=32, checkpoint_dir=s3.url("prev"))
    assert listing(s3, s3.url("prev")) == before
    # the same max parallelism continues, and a restore_from given to a state with checkpoints is ignored
    ks = st.keyed_state("mp", key="k", parallelism=4, max_parallelism=16, checkpoint_dir=s3.url("prev"),
                        restore_from=root(s3, "chk", "src") + "/chk-2")
    assert ks.restore_info["action"] == "ignored" and "already has checkpoint 0 of its own" in ks.restore_info["note"]
    assert ks.info()["last_completed"] == 0 and ks.info()["restored"] is False


def test_the_state_source_reads_any_retained_checkpoint_on_s3_with_the_sessions_options(spark, st, s3, source,
                                                                                        batches):
    """Issue 39: ``spark.read.format("steward-state")`` over the S3 checkpoint dir opens the store with the
    registering session's storage options and cluster id (none given to the read), reads each retained
    checkpoint (the default value state, JSON text) and writes nothing there."""
    def files():   # the live writer of "src" (this application) renews its _lease: the reads' doing is the rest
        return {p: n for p, n in listing(s3, root(s3, "chk", "src")).items() if not p.endswith("/_lease")}

    before = files()
    for cid in (1, 2):
        df = spark.read.format("steward-state").option("state", "src").option("checkpoint_id", cid).load(s3.url("chk"))
        assert df.rdd.getNumPartitions() == min(P, 2)   # local[2]: at most one task per core
        got = {r.key: orjson.loads(r.value) for r in df.collect()}
        assert {k: (v["n"], v["s"]) for k, v in got.items()} == reference(batches[:cid + 1])
    assert files() == before
