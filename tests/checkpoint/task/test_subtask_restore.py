"""Rescale without IngestDB: 8 -> 3 -> 16 keeps exactly the same key/value set, each new subtask reads
only the old DBs that overlap its key groups, and a changed max parallelism is refused."""

from __future__ import annotations

import time

import pytest
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import overlapping_subtasks, rebuild_subtask, restore_subtask_backend
from sparksteward.errors import CheckpointNotFoundError, ParallelismError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import key_group, key_group_range, subtask_for_key_group

from tests.helpers.state import checkpoint_backends

M = 128
N_KEYS = 300_000


def _initial(tmp_path, storage, parallelism):
    backends = [RocksDBStateBackend(tmp_path / f"w{parallelism}-{i}", key_group_range(M, parallelism, i), M, "long")
                for i in range(parallelism)]
    by_subtask: list[list[int]] = [[] for _ in range(parallelism)]
    for k in range(N_KEYS):
        by_subtask[subtask_for_key_group(M, parallelism, key_group(k, M))].append(k)
    for b, ks in zip(backends, by_subtask):
        b.value("sum").put_many(ks, [k * 3 for k in ks])
        b.map("m").put(ks[0], "first", ks[0])
    meta, _ = checkpoint_backends(storage, backends, 1, tmp_path / "snaps")
    for b in backends:
        b.close()
    return meta


def _rescale(tmp_path, storage, meta, parallelism, checkpoint_id):
    backends, stats = [], []
    for j in range(parallelism):
        cache = LocalFileCache(tmp_path / f"cache-{checkpoint_id}-{j}")  # one executor per subtask: honest counts
        b, st = rebuild_subtask(storage, meta, parallelism, j, tmp_path / f"w{checkpoint_id}-{j}", cache)
        backends.append(b)
        stats.append((st, set(cache.entries())))  # what was actually downloaded
    new_meta, _ = checkpoint_backends(storage, backends, checkpoint_id, tmp_path / "snaps")
    return backends, stats, new_meta


def _contents(backends):
    out = {}
    for b in backends:
        for k, v in b.iter_raw():
            assert k not in out
            out[k] = v
    return out


def test_rescale_8_to_3_to_16_keeps_every_key_and_reads_only_overlaps(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "sums")
    meta8 = _initial(tmp_path, storage, 8)
    original = {}
    for h in meta8.subtasks:  # the reference: every old DB, read in full
        b, _ = restore_subtask_backend(storage, meta8, h.subtask, tmp_path / f"ref-{h.subtask}",
                                       LocalFileCache(tmp_path / "ref-cache"))
        original.update(_contents([b]))
        b.close()
    assert sum(1 for k in original if k[2:3] == b"v") == N_KEYS

    meta = meta8
    for parallelism, checkpoint_id in ((3, 2), (16, 3)):   # 8 -> 3, then 3 -> 16
        t = time.perf_counter()
        backends, stats, new_meta = _rescale(tmp_path, storage, meta, parallelism, checkpoint_id)
        elapsed = time.perf_counter() - t
        print(f"\nrescale {meta.parallelism} -> {parallelism} of {N_KEYS} keys: {elapsed:.2f} s "
              f"(incl. checkpoint), per subtask {[round(s.seconds, 2) for s, _ in stats]}")
        for j, (st, downloaded) in enumerate(stats):
            new_range = key_group_range(M, parallelism, j)
            overlapping = {h.subtask for h, _ in overlapping_subtasks(meta, new_range)}
            assert {st.base, *st.ingested_from} == overlapping
            allowed = {f.path for h in meta.subtasks if h.subtask in overlapping for f in h.files}
            assert set(st.files_read) == allowed  # read every overlapping old DB, and nothing else
            # the bytes that came over the wire: exactly the overlapping DBs' files
            assert downloaded == {f.checksum for h in meta.subtasks if h.subtask in overlapping for f in h.files}
            others = {f.path for h in meta.subtasks if h.subtask not in overlapping for f in h.files} - allowed
            assert not set(st.files_read) & others
            assert st.files_downloaded <= len(allowed)
            # every key in the new DB belongs to it
            assert all(int.from_bytes(k[:2], "big") in new_range for k, _ in backends[j].iter_raw())
        assert _contents(backends) == original
        some_key = next(k for k in range(N_KEYS) if key_group(k, M) in backends[0].key_groups)
        assert backends[0].value("sum").get(some_key) == some_key * 3
        for b in backends:
            b.close()
        meta = new_meta


def test_changed_max_parallelism_is_refused(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "sums")
    b = RocksDBStateBackend(tmp_path / "w", key_group_range(M, 1, 0), M)
    b.value("s").update("k", 1)
    meta, _ = checkpoint_backends(storage, [b], 1, tmp_path / "snaps")
    b.close()
    with pytest.raises(ParallelismError, match=r"state 'sums' was checkpointed with max_parallelism=128 "
                                               r"\(checkpoint 1\) and cannot be restored with max_parallelism=256.*"
                                               r"Keep max_parallelism=128"):
        rebuild_subtask(storage, meta, 2, 0, tmp_path / "n", LocalFileCache(tmp_path / "c"), max_parallelism=256)
    assert not (tmp_path / "n").exists()
    with pytest.raises(ParallelismError, match="parallelism=200 is out of range"):
        rebuild_subtask(storage, meta, 200, 0, tmp_path / "n", LocalFileCache(tmp_path / "c"))


def test_a_failed_rescale_leaves_no_half_built_db(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "sums")
    backends = [RocksDBStateBackend(tmp_path / f"w{i}", key_group_range(M, 2, i), M) for i in range(2)]
    for b in backends:
        keys = [f"k{i}" for i in range(3000) if key_group(f"k{i}", M) in b.key_groups]
        b.value("s").put_many(keys, [1] * len(keys))
    meta, _ = checkpoint_backends(storage, backends, 1, tmp_path / "snaps")
    for b in backends:
        b.close()
    victim = next(f for f in meta.subtasks[1].files if f.name.endswith(".sst"))
    storage.delete_files([victim.path])  # the second DB to ingest is missing a file
    with pytest.raises(CheckpointNotFoundError, match=rf"{victim.name} .* subtask 1 is missing"):
        rebuild_subtask(storage, meta, 1, 0, tmp_path / "new", LocalFileCache(tmp_path / "c"))
    assert not (tmp_path / "new" / "db").exists()


def test_a_rescale_drops_expired_state_instead_of_copying_it(tmp_path):
    """P=4 -> 1 at a time when half of each subtask's TTL entries expired: the subtasks copied into the
    base leave the expired values, list elements, map entries and their index keys behind."""
    from sparksteward.state.declared import list_state, map_state, resolve, value_state
    from sparksteward.state.typed import TypedStates

    storage = CheckpointStorage.open(str(tmp_path / "chk"), "ttl", "c1")
    record = resolve(None, [value_state("c", "bigint", ttl=10), list_state("l", "bigint", ttl=10),
                            map_state("m", "bigint", "bigint", ttl=10)])
    t0 = 1_800_000_000_000
    backends = [RocksDBStateBackend(tmp_path / f"w4-{i}", key_group_range(M, 4, i), M, "long") for i in range(4)]
    expiring, living = {}, {}
    for i, b in enumerate(backends):
        mine = [k for k in range(4000) if key_group(k, M) in b.key_groups]
        expiring[i], living[i] = mine[::2], mine[1::2]
        for when, keys in ((t0, expiring[i]), (t0 + 8000, living[i])):   # expire at t0 + 10 s and t0 + 18 s
            st = TypedStates(b, record, when, 1)
            st.value("c").put_many(keys, keys)
            st.list("l").append_many(keys, keys)
            st.map("m").put_many(keys, keys, keys)
    meta, _ = checkpoint_backends(storage, backends, 1, tmp_path / "snaps")
    for b in backends:
        b.close()
    now = t0 + 12_000
    b, stats = rebuild_subtask(storage, meta, 1, 0, tmp_path / "w1", LocalFileCache(tmp_path / "cache"), now_ms=now)
    others = [i for i in range(4) if i != stats.base]
    assert stats.expired_dropped == 3 * sum(len(expiring[i]) for i in others)
    base_range = key_group_range(M, 4, stats.base)
    copied = sum(1 for k, _ in b.iter_raw() if int.from_bytes(k[:2], "big") not in base_range)
    assert copied == 6 * sum(len(living[i]) for i in others)   # 3 entries and 3 index keys per living key
    values = TypedStates(b, record, now, 2).value("c").get_many(list(range(4000))).to_pylist()
    assert sorted(k for k, v in enumerate(values) if v is not None) == sorted(k for ks in living.values() for k in ks)
    b.close()


def test_prepare_subtask_links_the_base_unopened_and_opens_only_to_rescale(tmp_path, store_url):
    """What the executor agent does at state.open: the same key groups as the base are its files,
    linked and not opened (the task replays the WAL once); a rescale opens the DB to change it. Either
    way the task's open finds every key of its range."""
    from sparksteward.checkpoint.task.subtask_restore import prepare_subtask

    storage = CheckpointStorage.open(store_url, "sums")
    backends = [RocksDBStateBackend(tmp_path / f"w{i}", key_group_range(M, 2, i), M, "long") for i in range(2)]
    for b in backends:
        keys = [k for k in range(5000) if key_group(k, M) in b.key_groups]
        b.value("s").put_many(keys, [k + 1 for k in keys])
    meta, _ = checkpoint_backends(storage, backends, 1, tmp_path / "snaps")
    for b in backends:
        b.close()

    same = prepare_subtask(storage, meta, 2, 1, tmp_path / "same", LocalFileCache(tmp_path / "c1"), max_parallelism=M,
                           key_type="long")
    assert same is not None and same.base == 1 and same.ingested_from == ()
    names = sorted(p.name for p in (tmp_path / "same" / "db").iterdir())
    assert names == sorted(f.name for f in meta.subtasks[1].files), "the DB was opened (RocksDB wrote files)"

    merged = prepare_subtask(storage, meta, 1, 0, tmp_path / "one", LocalFileCache(tmp_path / "c2"), max_parallelism=M,
                             key_type="long")
    assert merged is not None and len(merged.ingested_from) == 1
    for where, kg in (("same", key_group_range(M, 2, 1)), ("one", key_group_range(M, 1, 0))):
        with RocksDBStateBackend(tmp_path / where, kg, M, "long", create=False) as b:
            keys = [k for k in range(5000) if key_group(k, M) in kg]
            assert b.value("s").get_many(keys) == [k + 1 for k in keys]
    assert prepare_subtask(storage, None, 2, 0, tmp_path / "new", LocalFileCache(tmp_path / "c3"),
                           max_parallelism=M) is None
    with RocksDBStateBackend(tmp_path / "new", key_group_range(M, 2, 0), M, create=False) as b:
        assert b.value("s").get("k") is None
