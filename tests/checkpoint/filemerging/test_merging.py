"""FLIP-306 checkpoint file merging (issue 9), without Spark: the executor agents' FileMerger, the
driver agent's reference counts and space control, over real sockets, real RocksDB and real stores
(file:// and moto's S3 server).

Must-shows covered here: 2 (reference counting over 50 checkpoints with num_retained 1 and 3),
4 (space amplification), 6 (across on file://, refused on s3://), and the object count of 1 with
two executor agents and 32 subtasks (the Spark run is in test_state_merging_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sparksteward.checkpoint.filemerging.file_merger import FileMerger, MergingMode, MergingOptions
from sparksteward.checkpoint.filemerging.space import choose_no_reuse, space_stats
from sparksteward.checkpoint.records import CheckpointMetadata, FileHandle, SubtaskHandle
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import ConfigError, StewardError
from sparksteward.state.keygroups import KeyGroupRange, key_group, subtask_for_key_group

from tests.helpers import wait_until
from tests.helpers.merging import M, MergingRig

pytestmark = pytest.mark.usefixtures("guarded_rmtree")  # deletes stay under tmp_path


# --- the executor's FileMerger ---------------------------------------------------------------------
def _files(tmp_path: Path, sizes: list[int]) -> list[Path]:
    out = []
    for i, n in enumerate(sizes):
        p = tmp_path / "src" / f"{i:06d}.sst"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes([i % 251]) * n)
        out.append(p)
    return out


def test_segments_of_many_subtasks_share_physical_files_rotated_at_max_size(tmp_path, store_url):
    from sparksteward.hashing import hash_file

    storage = CheckpointStorage.open(store_url, "s")
    opts = MergingOptions(max_file_size=100 << 10)
    merger = FileMerger(tmp_path / "staging")
    srcs = _files(tmp_path, [30 << 10] * 7)
    handles = [merger.append(storage.url, 5, opts, p.name, p, hash_file(p).hex(), put=storage.put_file)
               for p in srcs]
    physical = sorted({h.path for h in handles})
    assert len(physical) == 3  # 3 + 3 + 1 segments of 30 KB in files of at most 100 KB
    assert [h.offset for h in handles if h.path == handles[0].path] == [0, 30 << 10, 60 << 10]
    assert merger.pending() == [(storage.url, 5)]
    assert storage.merged_files() == set()  # nothing in the store before the seal
    sealed = merger.seal(storage.url, 5)
    assert sorted(f.path for f in sealed) == physical
    assert storage.merged_files() == set(physical)
    assert merger.pending() == [] and not any((tmp_path / "staging").iterdir())
    for h, src in zip(handles, srcs):  # every segment reads back byte for byte
        loc, path = storage.location_of(h.path)
        with loc.fs.open(path, "rb") as f:
            f.seek(h.offset)
            assert f.read(h.length) == src.read_bytes()
    merger.close()


def test_a_physical_file_of_empty_segments_is_still_written(tmp_path, store_url):
    """RocksDB snapshots hold empty files (a WAL of 0 bytes): a physical file with only those is
    still created in the store, or the checkpoint would reference a missing file."""
    storage = CheckpointStorage.open(store_url, "s")
    merger = FileMerger(tmp_path / "staging")
    (src,) = _files(tmp_path, [0])
    h = merger.append(storage.url, 1, MergingOptions(), "000008.log", src, "e" * 32, put=storage.put_file)
    assert (h.offset, h.length) == (0, 0)
    assert [f.size for f in merger.seal(storage.url, 1)] == [0]
    assert storage.merged_files() == {h.path}
    merger.close()


def test_a_discarded_checkpoint_leaves_no_staged_file(tmp_path):
    storage = CheckpointStorage.open(str(tmp_path / "chk"), "s")
    merger = FileMerger(tmp_path / "staging")
    (src,) = _files(tmp_path, [1000])
    merger.append(storage.url, 1, MergingOptions(), src.name, src, "0" * 32, put=storage.put_file)
    assert any((tmp_path / "staging").iterdir())
    assert merger.discard(storage.url, 1)
    assert not any((tmp_path / "staging").iterdir()) and merger.pending() == []
    assert storage.merged_files() == set()
    merger.close()


def test_across_appends_in_place_and_is_refused_on_object_stores(tmp_path, s3):
    storage = CheckpointStorage.open(str(tmp_path / "chk"), "s")
    opts = MergingOptions(mode="across")
    merger = FileMerger(tmp_path / "staging")
    a, b = _files(tmp_path, [1000, 2000])
    h1 = merger.append(storage.url, 1, opts, a.name, a, "0" * 32, put=storage.put_file, target=storage.local_target)
    assert merger.seal(storage.url, 1)[0].size == 1000
    h2 = merger.append(storage.url, 2, opts, b.name, b, "1" * 32, put=storage.put_file, target=storage.local_target)
    assert h2.path == h1.path and h2.offset == 1000  # checkpoint 2 appends to checkpoint 1's file
    assert merger.seal(storage.url, 2)[0].size == 3000
    assert Path(storage.local_target(h1.path)).stat().st_size == 3000
    assert merger.open_files() == [(storage.url, h1.path)]
    merger.close()
    with pytest.raises(ConfigError, match=r"mode 'across' needs a store that appends.*is an object store.*"
                                          r"file-merging.mode=within"):
        opts.check_store(s3.url("x"), is_local=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_file_size": 1000}, r"max-file-size=1000 must be at least 65536 bytes"),
    ({"mode": "sideways"}, r"mode 'sideways' is not valid: use 'within'"),
    ({"max_space_amplification": -1}, r"max-space-amplification=-1 must be a number >= 0"),
])
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MergingOptions(**kwargs)


def test_bad_config_values_are_named():
    from sparksteward.config import StewardConfig

    with pytest.raises(ConfigError, match=r"spark.steward.checkpoint.file-merging.mode.*within or across"):
        StewardConfig.from_conf({"spark.steward.checkpoint.file-merging.mode": "sideways"})
    with pytest.raises(ConfigError, match=r"file-merging.max-file-size.*at least 64k"):
        StewardConfig.from_conf({"spark.steward.checkpoint.file-merging.max-file-size": "1k"})


# --- space control ----------------------------------------------------------------------------------
def _meta(cid: int, segs: list[tuple[str, int, int]], sizes: dict[str, int]) -> CheckpointMetadata:
    files = [FileHandle(f"{i:06d}.sst", p, length, f"{i:032x}", offset) for i, (p, offset, length) in enumerate(segs)]
    files.append(FileHandle("CURRENT", "shared/" + "c" * 32, 16, "c" * 32))
    return CheckpointMetadata("s", cid, 1, 8, (SubtaskHandle(0, KeyGroupRange(0, 8), tuple(files)),),
                              properties={"merged": sizes})


def test_space_stats_and_the_most_wasteful_files_marked_no_reuse():
    sizes = {"merged/" + "a" * 32: 1000, "merged/" + "b" * 32: 1000, "merged/" + "c" * 32: 1000}
    meta = _meta(3, [("merged/" + "a" * 32, 0, 900), ("merged/" + "b" * 32, 0, 100), ("merged/" + "c" * 32, 0, 400)], sizes)
    stats = space_stats([meta])
    assert (stats.physical_files, stats.physical_bytes, stats.logical_bytes) == (3, 3000, 1400)
    assert stats.amplification == pytest.approx(3000 / 1400)
    assert choose_no_reuse([meta], 2.0) == {"merged/" + "b" * 32}  # 900 wasted: 2100 <= 2 * 1400 after it
    assert choose_no_reuse([meta], 1.0) == {"merged/" + "b" * 32, "merged/" + "c" * 32, "merged/" + "a" * 32}
    assert choose_no_reuse([meta], 3.0) == set()
    assert choose_no_reuse([meta], 0.5) == set()  # below 1: off
    # a segment two retained checkpoints share counts once
    assert space_stats([meta, _meta(4, [("merged/" + "a" * 32, 0, 900)], sizes)]).logical_bytes == 1400


# --- the agents, over sockets -----------------------------------------------------------------------
@pytest.mark.parametrize("num_retained", [1, 3])
def test_reference_counts_over_50_checkpoints(tmp_path, store_url, num_retained):
    """Must-show 2: the physical files in the dir are always exactly those the retained checkpoints
    reference, every retained checkpoint restores and opens, and gc finds nothing to collect. 50
    checkpoints on file://, 24 on moto's S3 (the same subsumption cycles over the wire, at suite cost)."""
    from sparksteward.checkpoint.cli import find_orphans

    count = 24 if "://" in store_url else 50

    rig = MergingRig(tmp_path, store_url, parallelism=4, num_retained=num_retained,
                     merging=MergingOptions(max_file_size=64 << 10))
    try:
        model: dict[str, int] = {}
        history: dict[int, dict[str, int]] = {}
        merged_seen: set[str] = set()
        for cid in range(count):
            delta = {f"k{(cid * 37 + i) % 400:04d}": cid + i for i in range(60)}
            for k, v in delta.items():
                model[k] = model.get(k, 0) + v
            history[cid] = dict(model)
            reply = rig.batch(cid, delta)
            stored = rig.storage.stored_files()
            merged_seen |= rig.storage.merged_files()
            assert stored == rig.referenced(), f"after checkpoint {cid}"
            assert rig.storage.staged_files() == set()
            retained = rig.storage.checkpoint_ids()
            assert retained[-1] == cid and len(retained) <= num_retained + 1
            assert reply["stats"]["merged_files_written"] >= 1
            if cid % 8 == 7 or cid == count - 1:  # nothing deleted early: every retained checkpoint opens
                for r in retained:
                    assert rig.values(rig.storage.read_metadata(r)) == history[r], f"checkpoint {r}"
        assert len(merged_seen) > len(rig.storage.merged_files())  # subsumed files were deleted
        assert find_orphans(rig.storage, 0.0, 1e12) == []
    finally:
        rig.close()


def test_space_amplification_stays_bounded_when_most_keys_change(tmp_path, capsys):
    """Must-show 4: rewriting most keys every batch, physical bytes stay at or below the configured
    amplification times the live bytes, plus one checkpoint's worth."""
    amp = 1.5
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=2, num_retained=1,
                     merging=MergingOptions(max_file_size=256 << 10, max_space_amplification=amp))
    try:
        rows = []
        for cid in range(25):
            delta = {f"k{i:05d}": 1 for i in range(2000) if (i + cid) % 10 != 0}  # 90% of the keys
            written = rig.batch(cid, delta)["stats"]["bytes_uploaded"]
            space = rig.dconn.request("state.info", name="s")["space"]
            rows.append((cid, space["physical_bytes"], space["logical_bytes"], written))
            assert space["physical_bytes"] <= space["logical_bytes"] * amp + written, rows[-1]
        with capsys.disabled():
            print("\ncheckpoint  physical B  live B  written B")
            for r in rows:
                print(f"{r[0]:>10}  {r[1]:>10}  {r[2]:>6}  {r[3]:>9}")
    finally:
        rig.close()


def test_space_control_rewrites_the_live_segments_of_wasteful_files(tmp_path):
    """Files marked no-reuse are not referenced by the next checkpoint (their live segments are
    written again), and they are deleted once the checkpoints referencing them are subsumed."""
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=1, executors=1,
                     merging=MergingOptions(max_file_size=1 << 20, max_space_amplification=1.0))
    try:
        rig.batch(0, {f"k{i:05d}": 1 for i in range(3000)})
        marked_any = False
        for cid in range(1, 6):
            marked = set(rig.dconn.request("state.info", name="s")["no_reuse"])
            rig.batch(cid, {f"k{i:05d}": 1 for i in range(10)})
            meta = rig.storage.read_metadata(cid)
            assert not (marked & meta.physical_paths()), f"checkpoint {cid} reused a no-reuse file"
            marked_any |= bool(marked)
        assert marked_any
        # with num_retained 1, a file marked before checkpoint N is gone once N+1 completes
        rig.batch(6, {"x": 1})
        rig.batch(7, {"y": 1})
        assert rig.storage.stored_files() == rig.referenced()
    finally:
        rig.close()


def test_a_checkpoint_of_32_subtasks_on_2_executors_writes_at_most_4_objects(tmp_path, s3):
    """The object count of must-show 1 at the agents' level: S3 PUTs per checkpoint, not partitions."""
    rig = MergingRig(tmp_path, s3.url("chk32"), parallelism=32, executors=2)
    try:
        rig.batch(0, {f"k{i:05d}": 1 for i in range(20_000)})
        for cid in range(1, 4):
            mark = s3.mark()
            stats = rig.batch(cid, {f"k{i:05d}": 1 for i in range(cid * 50, cid * 50 + 100)})["stats"]
            puts = [q for q in s3.requests_since(mark)
                    if q.op in ("PutObject", "CreateMultipartUpload", "CopyObject")]
            assert stats["objects_written"] <= 2 + 2, stats
            assert len({q.key for q in puts}) <= 2 + 2, [q.key for q in puts]
    finally:
        rig.close()


def test_across_mode_runs_on_file_and_is_refused_on_s3(tmp_path, s3):
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=2, executors=1,
                     merging=MergingOptions(mode=MergingMode.ACROSS))
    try:
        files = []
        model: dict[str, int] = {}
        for cid in range(6):
            delta = {f"k{cid}-{i}": i for i in range(20)}
            model.update(delta)
            rig.batch(cid, delta)
            files.append(rig.storage.merged_files())
            assert rig.storage.stored_files() >= rig.referenced() - {p for p in rig.referenced() if "://" in p}
        assert len(set().union(*files)) < 6  # checkpoints appended to the same physical files
        latest = rig.storage.read_metadata(rig.storage.checkpoint_ids()[-1])
        assert rig.values(latest) == model
    finally:
        rig.close()
    with pytest.raises(StewardError, match=r"mode 'across' needs a store that appends"):
        MergingRig(tmp_path / "s3", s3.url("across"), parallelism=2, executors=1,
                   merging=MergingOptions(mode=MergingMode.ACROSS))


def test_an_executor_agent_gone_before_its_seal_aborts_the_commit_promptly(tmp_path):
    """An agent holding merged files that stops polling (its executor was lost) does not hold
    commit for the whole commit timeout: it aborts once agent_timeout passes."""
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=2, executors=2, agent_timeout=2)
    try:
        rig.batch(0, {"a": 1, "b": 2})
        rig.dconn.request("state.begin", name="s", checkpoint_id=1)
        svc = rig.execs[1][1]
        svc.poller.close()  # the agent's poller dies with it; its merged files are never sealed
        k0, k1 = (next(f"k{i}" for i in range(1000) if subtask_for_key_group(M, 2, key_group(f"k{i}", M)) == s)
                  for s in (0, 1))
        rig.task(1, 0, {k0: 1}, executor=0)
        rig.task(1, 1, {k1: 1}, executor=1)
        with pytest.raises(StewardError, match=r"checkpoint 1 of keyed state 's' was aborted.*executor agents "
                                               r"\[.*\] hold merged checkpoint files it needs and have not "
                                               r"answered for 2 s"):
            rig.dconn.request("state.commit", name="s", checkpoint_id=1, wait=30)
        wait_until(lambda: not rig.execs[0][1].merger.pending(), timeout=10, what="the live agent discards")
        assert rig.storage.stored_files() == rig.referenced()
    finally:
        rig.close()


def test_show_prints_physical_and_logical_files_and_gc_collects_merged_orphans(tmp_path, store_url, capsys):
    from sparksteward.cli import main

    rig = MergingRig(tmp_path, store_url, parallelism=4, num_retained=2)
    try:
        for cid in range(3):
            rig.batch(cid, {f"k{i}": cid for i in range(cid * 30, cid * 30 + 200)})
        space = rig.dconn.request("state.info", name="s")["space"]
    finally:
        rig.close()
    capsys.readouterr()
    assert main(["checkpoints", "show", store_url, "s", "--cluster-id", "c1"]) == 0
    out = capsys.readouterr().out
    assert "FILE MERGING" in out and "AMPLIFICATION" in out and "SEGMENTS" in out
    row = next(line for line in out.splitlines() if "retained" in line).split()
    assert int(row[2]) == space["physical_files"] and int(row[4]) == space["logical_files"]
    # an orphan merged file (a crashed seal) is collected by gc, the referenced ones are not
    rig.storage.location.write_atomic(rig.storage.location.path("merged", "0" * 32), b"x" * 100)
    before = rig.storage.stored_files()
    assert main(["checkpoints", "gc", store_url, "s", "--cluster-id", "c1", "--min-age", "0s"]) == 0
    assert "deleted 1 orphaned file" in capsys.readouterr().out
    assert rig.storage.stored_files() == before - {"merged/" + "0" * 32} == rig.referenced()


def _deltas(n: int, seed: int) -> list[dict[str, int]]:
    import random

    rng = random.Random(seed)
    return [{f"u{rng.randrange(3000):05d}": rng.randrange(1, 9) for _ in range(800)} for _ in range(n)]


def test_restore_and_rescale_8_to_3_from_merged_equal_from_unmerged(tmp_path, store_url):
    """Must-show 5: a NO_CLAIM restore (duplicating physical files, not segments) and a rescale 8 -> 3
    from a merged checkpoint give the same state as from an unmerged one."""
    deltas = _deltas(6, 9)
    results = {}
    for label, merging in (("merged", MergingOptions()), ("whole", MergingOptions(enabled=False))):
        base = f"{store_url}/{label}"
        src = MergingRig(tmp_path / label, base, parallelism=8, merging=merging, name="src", num_retained=2)
        try:
            for cid in range(3):
                src.batch(cid, deltas[cid])
            chk = src.storage.url_of("chk-2")
            physical = {f.path for f in src.storage.read_metadata(2).files()}
            assert any(p.startswith("merged/") for p in physical) == (label == "merged")
            dst = MergingRig(tmp_path / f"{label}-dst", base, parallelism=3, merging=merging, name="dst", restore_from=chk)
            try:
                restore = dst.registered["restore"]
                assert restore["bytes_streamed"] == 0  # duplicated, not streamed
                assert restore["files"] == len(physical)  # one copy per physical file
                for cid in range(3, 6):
                    dst.batch(cid - 3, deltas[cid])
                restored = dst.values(dst.storage.read_metadata(2))
            finally:
                dst.close()
            src.rescale(3)  # continue the same state at parallelism 3
            for cid in range(3, 6):
                src.batch(cid, deltas[cid])
            rescaled = src.values(src.storage.read_metadata(5))
        finally:
            src.close()
        results[label] = (rescaled, restored)
    expected: dict[str, int] = {}
    for d in deltas:
        for k, v in d.items():
            expected[k] = expected.get(k, 0) + v
    assert results["merged"][0] == results["whole"][0] == expected
    assert results["merged"][1] == results["whole"][1] == expected


def test_hostile_merged_paths_from_a_peer_are_refused_by_name(tmp_path):
    """An ack or a seal naming a path outside merged/ (``..``, a nested path, a bare name) is refused
    before anything is recorded, so no later abort or subsumption can be pointed at it."""
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=1, executors=1)
    try:
        rig.batch(0, {"a": 1})
        rig.dconn.request("state.begin", name="s", checkpoint_id=1)
        handle = rig.storage.read_metadata(0).subtasks[0].to_json()
        for bad in ("merged/../../etc/passwd", "merged/a/b", "merged/" + "0" * 31, "shared/" + "0" * 32):
            with pytest.raises(StewardError, match=rf"\['{bad}'\] are not merged/ paths"):
                rig.dconn.request("state.ack", name="s", checkpoint_id=1, handle=handle, merged=[bad], agent="x",
                                 attempt="a")
            with pytest.raises(StewardError, match=rf"sealed files \['{bad}'\] are not merged/ paths"):
                rig.dconn.request("state.sealed", name="s", checkpoint_id=1, agent="x", attempt="a",
                                  files=[{"path": bad, "size": 1}])
        rig.dconn.request("state.abort", name="s", checkpoint_id=1)
        assert (tmp_path / "chk").is_dir() and rig.storage.stored_files() == rig.referenced()
    finally:
        rig.close()
