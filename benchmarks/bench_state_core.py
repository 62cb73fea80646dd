"""Keyed-state layers below Spark (issue 8): sync phase, incremental checkpoints, restore, rescale and
NO_CLAIM fast duplication, on 1M keys (``BENCH_KEYS``), without Spark.

- sync phase per subtask after a 1% update (p50, max): of a DB that stays open
  (``create_checkpoint``), and as a task takes it (close without a flush and link, decision 0012);
- incremental: bytes uploaded by the first checkpoint and by each next one after updating 1% of keys;
- restore: one subtask's files into a cold cache (download) and a warm one (hard links);
- rescale 8 -> 4 and 8 -> 3 -> 16 through ``rebuild_subtask`` (base DB + delete_range + SstFileWriter);
- NO_CLAIM restore of a retained checkpoint into another state dir: fast duplication vs downloading
  and re-uploading the same files, on file:// and on moto S3.

moto serves S3 from this process on loopback, so S3 numbers measure the client path, not a real
store. Single runs on a loaded 2-core machine: quote ratios measured side by side.
Run: ``python benchmarks/bench_state_core.py``; ``BENCH_DIR=/dev/shm`` puts every file on tmpfs (the sync
phase is mostly RocksDB's file creations and fsyncs, so this shows what the disk costs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.restore import restore_from
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import rebuild_subtask
from sparksteward.checkpoint.task.transfer import restore_subtask, upload_snapshot
from sparksteward.config import StewardConfig
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import key_group, key_group_range, subtask_for_key_group

KEYS = int(os.environ.get("BENCH_KEYS", "1000000"))
M, P = 128, 8
MB = 1 << 20
#: the default spark.steward.state.wal-flush-size (read through the config, a path every version has)
WAL_FLUSH_BYTES = StewardConfig.from_conf({}).state_wal_flush_size


def checkpoint(coord, storage, backends, cid, snaps, stats):
    begun = coord.begin(cid)
    sync = []
    uploaded = 0
    for i, b in enumerate(backends):
        snap = b.snapshot(snaps / f"{cid}-{i}", keep_open=True)  # long-lived DBs: create_checkpoint
        sync.append(snap.sync_ms)
        r = upload_snapshot(storage, snap.path, i, b.key_groups, known=begun.known)
        uploaded += r.bytes_uploaded
        coord.ack(cid, r)
        shutil.rmtree(snap.path)
    meta = coord.complete(cid)
    stats.append((cid, uploaded, sync))
    return meta


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="bench-state-", dir=os.environ.get("BENCH_DIR")))
    try:
        run(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root: Path) -> None:
    storage = CheckpointStorage.open(str(root / "chk"), "bench")
    coord = CheckpointCoordinator(storage, P, M)
    t = time.perf_counter()
    backends, by = load_subtasks(root, KEYS)
    load_s = time.perf_counter() - t
    print(f"load {KEYS:,} keys into {P} subtasks: {load_s:.1f} s ({KEYS / load_s:,.0f} keys/s, put_many)")

    stats: list = []
    meta = checkpoint(coord, storage, backends, 0, root / "snaps", stats)
    step = max(1, KEYS // 100)
    for cid in range(1, 6):
        t = time.perf_counter()
        for b, ks in zip(backends, by):
            upd = ks[(cid * 7919) % max(1, len(ks) - len(ks) // 100):][: len(ks) // 100]
            s = b.value("agg")
            old = s.get_many(upd)
            s.put_many(upd, [{"count": o["count"] + 1, "sum": o["sum"] + k} for o, k in zip(old, upd)])
        meta = checkpoint(coord, storage, backends, cid, root / "snaps", stats)
    sync_all = [ms for _, _, sync in stats[1:] for ms in sync]
    print(f"sync phase of a DB that stays open (create_checkpoint) after a 1% update, per subtask: p50 {statistics.median(sync_all):.1f} ms, "
          f"max {max(sync_all):.1f} ms (first, full: max {max(stats[0][2]):.1f} ms)")
    for cid, up, _ in stats:
        print(f"  checkpoint {cid}: uploaded {up / MB:8.2f} MB")
    total = meta.size
    print(f"state size {total / MB:.1f} MB in {len(meta.files())} files; ~{step:,} keys updated per checkpoint")
    for b in backends:
        b.close()

    meta = task_path(storage, coord, meta, by, root)

    # restore one subtask: cold (download) and warm (cache hit)
    cache = LocalFileCache(root / "cache")
    t = time.perf_counter()
    restore_subtask(storage, meta, meta.subtasks[0], root / "r-cold" / "db", cache)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    restore_subtask(storage, meta, meta.subtasks[0], root / "r-warm" / "db", cache)
    warm = time.perf_counter() - t
    print(f"restore subtask 0 ({meta.subtasks[0].size / MB:.1f} MB): cold {cold * 1000:.0f} ms, "
          f"warm (hard links) {warm * 1000:.0f} ms")

    # rescale
    for target in (4, 3):
        t = time.perf_counter()
        new = []
        for j in range(target):
            b, _ = rebuild_subtask(storage, meta, target, j, root / f"rs{target}-{j}", LocalFileCache(root / f"rc{target}"))
            new.append(b)
        el = time.perf_counter() - t
        print(f"rescale {P} -> {target}: {el:.2f} s for {KEYS:,} keys (all new subtasks, one process)")
        if target == 3:
            s3 = CheckpointStorage.open(str(root / "chk"), "bench3")
            c3 = CheckpointCoordinator(s3, 3, M)
            meta3 = checkpoint(c3, s3, new, 0, root / "snaps3", [])
            t = time.perf_counter()
            for j in range(16):
                b, _ = rebuild_subtask(s3, meta3, 16, j, root / f"rs16-{j}", LocalFileCache(root / "rc16"))
                b.close()
            print(f"rescale 3 -> 16: {time.perf_counter() - t:.2f} s")
        for b in new:
            b.close()

    # NO_CLAIM restore: fast duplication vs download + re-upload
    for label, url in (("file", str(root / "other")), ("s3", None)):
        if url is None:
            try:
                from sparksteward.testing.s3 import local_s3
            except ImportError:
                continue
            with local_s3() as s3:
                bench_duplication(label, storage, meta, s3.url("src"), s3.url("dst"), root)
        else:
            bench_duplication(label, storage, meta, None, url, root)


def task_path(storage, coord, meta, by, root: Path, rounds: int = 5):
    """The sync phase as a Spark task sees it: every subtask of every checkpoint restores the last
    completed checkpoint into a fresh working dir (hard links from the executor's cache, WAL files
    copied), updates 1% of its keys, and snapshots (``sync_ms``: close without a flush, link the files;
    decision 0012), while the executor agent's uploader (4 threads, as in the agent) uploads the
    previous subtasks' snapshots. One subtask at a time, as on a 1-core executor. Also times the open
    (restore excluded), which replays the WAL the previous snapshot kept."""
    from sparksteward.checkpoint.task.uploader import SnapshotUploader

    cache = LocalFileCache(root / "task-cache")
    sync, opened, wal = [], [], []
    with SnapshotUploader(4, cache=cache) as uploader:
        for _ in range(rounds):
            cid = meta.checkpoint_id + 1
            begun = coord.begin(cid)
            futs = []
            for i, ks in enumerate(by):
                work = root / "task" / f"{cid}-{i}"
                restore_subtask(storage, begun.base, begun.base.subtasks[i], work / "db", cache)
                t = time.perf_counter()
                b = RocksDBStateBackend(work, begun.base.subtasks[i].key_groups, M, "long", create=False)
                opened.append((time.perf_counter() - t) * 1000)
                wal.append(b.wal_bytes)
                upd = ks[(cid * 104729) % max(1, len(ks) - len(ks) // 100):][: len(ks) // 100]
                s = b.value("agg")
                old = s.get_many(upd)
                s.put_many(upd, [{"count": o["count"] + 1, "sum": o["sum"] + k} for o, k in zip(old, upd)])
                snap = b.snapshot(root / "task-snaps" / f"{cid}-{i}")
                sync.append(snap.sync_ms)
                b.close()
                shutil.rmtree(work)
                futs.append(uploader.submit(storage, cid, i, snap, known=begun.known,
                                            on_done=lambda c, res: coord.ack(c, res),
                                            fold_wal_above=WAL_FLUSH_BYTES))
            for f in futs:
                f.result()
            meta = coord.complete(cid)
    print(f"sync phase as a task sees it (restore, 1% update, snapshot; uploads running), per subtask: "
          f"p50 {statistics.median(sync):.1f} ms, max {max(sync):.1f} ms; the open before it (WAL replay of "
          f"p50 {statistics.median(wal) / MB:.2f} MB) p50 {statistics.median(opened):.1f} ms, max {max(opened):.1f} ms")
    return meta


def bench_duplication(label, local_storage, meta, src_url, dst_url, root) -> None:
    src = local_storage
    if src_url is not None:  # put the checkpoint on that store first
        src = CheckpointStorage.open(src_url, "bench")
        Duplicator().duplicate([(local_storage.url_of(p), src.url_of(p)) for p in meta.physical_paths()])
        src.write_metadata(meta)
    dst = CheckpointStorage.open(dst_url, "copy")
    dup = Duplicator()
    t = time.perf_counter()
    restore_from(src.url_of(f"chk-{meta.checkpoint_id}"), dst, max_parallelism=M, duplicator=dup)
    fast = time.perf_counter() - t
    slow_dst = CheckpointStorage.open(dst_url, "copy-slow")
    t = time.perf_counter()
    tmp = root / f"dl-{label}"
    tmp.mkdir()
    for p in meta.physical_paths():
        local = tmp / p.split("/")[-1]
        src.location.fs.get_file(src.location.path(*p.split("/")), str(local))
        slow_dst._put(local, p)
    slow = time.perf_counter() - t
    print(f"NO_CLAIM restore on {label} ({meta.size / MB:.0f} MB): fast duplication {fast:.2f} s, "
          f"{dup.bytes_streamed} B through the process; download + re-upload {slow:.2f} s "
          f"({slow / fast:.1f}x slower)")


def load_subtasks(root: Path, keys: int, prefix: str = "w") -> tuple[list[RocksDBStateBackend], list[list[int]]]:
    """``keys`` long keys, each with ``{"count": 1, "sum": k}``, in the DBs of the P subtasks that own them."""
    backends = [RocksDBStateBackend(root / f"{prefix}{i}", key_group_range(M, P, i), M, "long") for i in range(P)]
    by: list[list[int]] = [[] for _ in range(P)]
    for k in range(keys):
        by[subtask_for_key_group(M, P, key_group(k, M))].append(k)
    for b, ks in zip(backends, by):
        b.value("agg").put_many(ks, [{"count": 1, "sum": k} for k in ks])
    return backends, by


def best_of_duplication(src: CheckpointStorage, meta, dst_root: str, tmp: Path, rounds: int = 3) -> dict[str, float]:
    """NO_CLAIM restore of ``meta`` from ``src`` into new states under ``dst_root``: best of ``rounds``
    fast duplications (``restore_from``) against best of ``rounds`` downloads + re-uploads of the same
    physical files, ``_metadata`` written by both."""
    fast, slow, streamed = [], [], 0
    for r in range(rounds):
        dup = Duplicator()
        t = time.perf_counter()
        restore_from(src.url_of(f"chk-{meta.checkpoint_id}"), CheckpointStorage.open(dst_root, f"copy{r}"),
                     max_parallelism=M, duplicator=dup)
        fast.append(time.perf_counter() - t)
        streamed += dup.bytes_streamed
        slow_dst = CheckpointStorage.open(dst_root, f"copy-slow{r}")
        local_dir = tmp / f"download{r}"
        local_dir.mkdir(parents=True)
        t = time.perf_counter()
        for p in meta.physical_paths():
            local = local_dir / p.split("/")[-1]
            src.location.fs.get_file(src.location.path(*p.split("/")), str(local))
            slow_dst._put(local, p)
        slow_dst.write_metadata(meta)
        slow.append(time.perf_counter() - t)
    return {"fast": min(fast), "slow": min(slow), "streamed": streamed, "mb": meta.size / MB,
            "files": len(meta.physical_paths())}


def duplication_ratios(root: Path, keys: int = KEYS, rounds: int = 3) -> dict[str, dict[str, float]]:
    """:func:`best_of_duplication` of one checkpoint of ``keys`` keys (P subtasks), on file:// and on
    moto S3."""
    root.mkdir(parents=True, exist_ok=True)
    storage = CheckpointStorage.open(str(root / "dup-chk"), "bench")
    backends, _ = load_subtasks(root, keys, "dup-w")
    meta = checkpoint(CheckpointCoordinator(storage, P, M), storage, backends, 0, root / "dup-snaps", [])
    for b in backends:
        b.close()
    out: dict[str, dict[str, float]] = {}
    for label in ("file", "s3"):
        with contextlib.ExitStack() as stack:
            if label == "file":
                src, dst_root = storage, str(root / "dup-other")
            else:
                from sparksteward.testing.s3 import local_s3

                s3 = stack.enter_context(local_s3())
                src = CheckpointStorage.open(s3.url("src"), "bench")
                Duplicator().duplicate([(storage.url_of(p), src.url_of(p)) for p in meta.physical_paths()])
                src.write_metadata(meta)
                dst_root = s3.url("dst")
            out[label] = best_of_duplication(src, meta, dst_root, root / f"dup-dl-{label}", rounds)
    return out


if __name__ == "__main__":
    sys.exit(main())
