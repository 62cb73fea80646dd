"""Exactly-once through the layers, in one process: a batch whose user function raises on one subtask
is aborted and run again from the same base; the result equals a clean run and no file is left over.
(The Spark-level failures, an executor SIGKILL and a driver SIGKILL, come with the Spark integration.)"""

from __future__ import annotations

import pyarrow as pa
import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import open_subtask
from sparksteward.checkpoint.task.transfer import upload_snapshot
from sparksteward.state.keygroups import key_group, subtask_for_key_group
from sparksteward.state.runner import run_pandas

M, P = 32, 3
OUT = pa.schema([("user", pa.string()), ("clicks", pa.int64())])
BATCHES = [[f"u{(i * 7 + b) % 500}" for i in range(3000)] for b in range(4)]


class Boom(Exception):
    pass


def _update(fail_on=None):
    def update(key, rows, state):
        if key == fail_on:
            raise Boom(f"user function failed on {key}")
        import pandas as pd

        n = (state.get() or 0) + len(rows)
        state.update(n)
        return pd.DataFrame({"user": [key], "clicks": [n]})

    return update


def _batch(coord, storage, tmp_path, cid, users, attempt, fail_on=None):
    coord.begin(cid)
    for i in range(P):
        begun = coord.base(cid)
        b, _ = open_subtask(storage, begun.base, P, i, tmp_path / f"w-{cid}-{attempt}-{i}",
                            LocalFileCache(tmp_path / f"cache-{i}"), max_parallelism=M)
        try:
            mine = [u for u in users if subtask_for_key_group(M, P, key_group(u, M)) == i]
            rows = pa.table({"user": mine}).to_batches(max_chunksize=500)
            list(run_pandas(rows, "user", _update(fail_on), b, OUT))
            snap = b.snapshot(tmp_path / f"snap-{cid}-{attempt}-{i}")
        finally:
            b.close()
        coord.ack(cid, upload_snapshot(storage, snap.path, i, b.key_groups, known=begun.known))


def _final(storage, meta, tmp_path):
    out = {}
    for i in range(P):
        b, _ = open_subtask(storage, meta, P, i, tmp_path / f"read-{i}", LocalFileCache(tmp_path / "rc"),
                            max_parallelism=M)
        out.update({bytes(k): v for k, v in b.iter_raw()})
        b.close()
    return out


def test_a_failed_batch_is_aborted_rerun_and_equals_a_clean_run(tmp_path, store_url):
    clean_storage = CheckpointStorage.open(store_url, "clean")
    clean = CheckpointCoordinator(clean_storage, P, M)
    for cid, users in enumerate(BATCHES):
        _batch(clean, clean_storage, tmp_path / "clean", cid, users, "a")
        clean.complete(cid)

    storage = CheckpointStorage.open(store_url, "faulty")
    coord = CheckpointCoordinator(storage, P, M)
    for cid, users in enumerate(BATCHES):
        if cid == 2:  # the function raises on the last subtask: subtasks before it have acked
            victim = next(u for u in users if subtask_for_key_group(M, P, key_group(u, M)) == P - 1)
            with pytest.raises(Boom, match=f"failed on {victim}"):
                _batch(coord, storage, tmp_path / "f", cid, users, "a", fail_on=victim)
            assert coord.pending() == [2]
            coord.abort(2)
        _batch(coord, storage, tmp_path / "f", cid, users, "b")
        coord.complete(cid)
    assert _final(storage, coord.completed(3), tmp_path / "f") == _final(clean_storage, clean.completed(3),
                                                                         tmp_path / "clean")
    referenced = set().union(*(storage.read_metadata(c).physical_paths() for c in coord.retained()))
    assert storage.stored_files() == referenced  # the aborted attempt left nothing behind
