"""The checkpoint coordinator's tests' way of running a batch without Spark: real RocksDB subtasks that
restore their base, count keys, snapshot, upload and ack; and what the counts must be afterwards."""

from __future__ import annotations

from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import open_subtask, restore_subtask_backend
from sparksteward.checkpoint.task.transfer import upload_snapshot
from sparksteward.errors import StorageError
from sparksteward.state.keygroups import key_group, subtask_for_key_group

M, P = 16, 2
KEYS = [f"user-{i}" for i in range(20_000)]


def run_batch(coord, storage, tmp_path, checkpoint_id, batch, *, ack=True, attempt="a", begin=True):
    """What one batch does on every subtask: restore the base, count, snapshot, upload, ack."""
    begun = coord.begin(checkpoint_id) if begin else coord.base(checkpoint_id)
    results = []
    p = coord.parallelism
    for i in range(p):
        work = tmp_path / f"work-{checkpoint_id}-{attempt}-{i}"
        cache = LocalFileCache(tmp_path / f"cache-{i}")
        b, _ = open_subtask(storage, begun.base, p, i, work, cache, max_parallelism=M)
        mine = [k for k in batch if subtask_for_key_group(M, p, key_group(k, M)) == i]
        s = b.value("count")
        s.put_many(mine, [(c or 0) + 1 for c in s.get_many(mine)])
        snap = b.snapshot(tmp_path / f"snap-{checkpoint_id}-{attempt}-{i}")
        b.close()
        r = upload_snapshot(storage, snap.path, i, b.key_groups, known=begun.known, cache=cache)
        results.append(r)
        if ack:
            coord.ack(checkpoint_id, r)
    return begun, results


def stored_counts(storage, meta, tmp_path, tag):
    out = {}
    for i in range(meta.parallelism):
        b, _ = restore_subtask_backend(storage, meta, i, tmp_path / f"read-{tag}-{i}", LocalFileCache(tmp_path / "rc"))
        out.update({k: b.value("count").get(k) for k in KEYS if key_group(k, M) in b.key_groups})
        b.close()
    return {k: v for k, v in out.items() if v is not None}


def expected_counts(batches):
    out = {}
    for batch in batches:
        for k in batch:
            out[k] = out.get(k, 0) + 1
    return out


BATCHES = [KEYS[:12_000], KEYS[::7], KEYS[5000:5100], KEYS[::3]]


class FailingHalfway(Duplicator):
    """The real duplication of the first half of the files, then a storage failure."""

    def duplicate(self, pairs):
        pairs = list(pairs)
        super().duplicate(pairs[: len(pairs) // 2])
        raise StorageError("injected: the store went away")
