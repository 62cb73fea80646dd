"""The change feed (issue 39, :mod:`sparksteward.checkpoint.changes`) against the difference of two full
reads, on real RocksDB subtasks checkpointed to file:// storage (S3: tests/keyed_state/test_changes_spark.py): seeded rounds of puts,
deletes, list and map edits, compactions, TTL expiry with and without a sweep, kept WALs, and rescales;
every pair of retained checkpoints is compared. The seed is printed; ``STEWARD_SEED`` replays one."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
from sparksteward.checkpoint.begun import CheckpointTime
from sparksteward.checkpoint.changes import changes_schema, read_changes
from sparksteward.checkpoint.reader import read_variable
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import open_subtask
from sparksteward.checkpoint.task.transfer import upload_snapshot
from sparksteward.errors import StateError
from sparksteward.state.declared import list_state, map_state, resolve, value_state
from sparksteward.state.typed import TypedStates
from sparksteward.state.typed.ttl import sweep_expired

M = 32
T0 = 1_700_000_000_000
SPECS = [value_state("v", "bigint", ttl=10.0), list_state("l", "string"), map_state("m", "string", "bigint")]
KEYS = [f"k{i}" for i in range(300)]


def _round(storage, base, cid, p, now, rnd, tmp, m=M):
    """One checkpoint: every subtask restores ``base`` (rescaling to ``p``), edits, snapshots (WAL kept
    or flushed), uploads; the record carries the declarations and the processing time."""
    record = resolve(None, SPECS)
    handles = []
    for i in range(p):
        b, _ = open_subtask(storage, base, p, i, tmp / f"w{cid}-{i}", LocalFileCache(tmp / f"c{i}"), max_parallelism=m)
        st = TypedStates(b, record, now, cid, None)
        mine = [k for k in KEYS if _owns(b, k, m)]
        idle = rnd.random() < 0.3   # no write: its files stay, and only the clock expires values
        for k in rnd.sample(mine, 0 if idle else min(len(mine), rnd.randrange(5, 40))):
            op = rnd.random()
            if op < 0.35:
                st.value("v").update(k, rnd.randrange(1000))
            elif op < 0.45:
                st.value("v").clear(k)
            elif op < 0.6:
                st.list("l").append(k, f"e{rnd.randrange(100)}")
            elif op < 0.65:
                st.list("l").clear(k)
            elif op < 0.85:
                st.map("m").put(k, f"mk{rnd.randrange(5)}", rnd.randrange(100))
            else:
                st.map("m").remove(k, f"mk{rnd.randrange(5)}")
        if not idle and rnd.random() < 0.3:
            sweep_expired(b, now)
        if not idle and rnd.random() < 0.25:
            b.db.compact_range(None, None)
        snap = b.snapshot(tmp / f"s{cid}-{i}", keep_open=rnd.random() < 0.5)
        b.close()
        handles.append(upload_snapshot(storage, snap.path, i, b.key_groups).handle)
    meta = CheckpointMetadata(storage.state, cid, p, m, tuple(handles),
                              properties={"states": record, "time": CheckpointTime(now).to_json()})
    storage.write_metadata(meta)
    return meta


def _owns(b, key, m):
    from sparksteward.state.keygroups import key_group

    return key_group(key, m) in b.key_groups


def _applied(a, up, down, width):
    """``a`` (rows) with the feed applied: keyed by the first ``width`` columns (value and map states),
    or as a multiset (list elements)."""
    from collections import Counter

    if width is None:
        return Counter(a) - Counter(down) + Counter(up)
    out = {r[:width]: r for r in a}
    for r in down:
        out.pop(r[:width], None)
    out.update({r[:width]: r for r in up})
    return Counter(out.values())


def test_the_change_feed_is_the_difference_of_two_full_reads(tmp_path):
    # chosen here, not as a parameter: pytest-xdist's processes must collect the same test ids
    seed = int(os.environ.get("STEWARD_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (STEWARD_SEED={seed} replays it)")
    rnd = random.Random(seed)
    storage = CheckpointStorage.open(f"file://{tmp_path}/chk", "feed")   # on S3: the Spark tests
    metas, base, now = [], None, T0
    for cid in range(7):
        p = rnd.choice([2, 2, 2, 3]) if cid else 2
        now += rnd.randrange(0, 8000)   # TTL 10 s: some values expire between checkpoints untouched
        base = _round(storage, base, cid, p, now, rnd, tmp_path)
        metas.append(base)
    checked = 0
    for older, newer in [(metas[i], metas[j]) for i in range(len(metas)) for j in range(i + 1, len(metas))
                         if j - i <= 2]:
        for variable in ("v", "l", "m"):
            at_a = read_variable(storage, older, variable, now_ms=older.properties["time"]["processing_ms"])
            at_b = read_variable(storage, newer, variable, now_ms=newer.properties["time"]["processing_ms"])
            feed = read_changes(storage, older, newer, variable)
            assert feed.schema == changes_schema(older, newer, variable)
            assert set(feed.column("checkpoint_id").to_pylist()) <= {newer.checkpoint_id}
            a = [tuple(r.values()) for r in at_a.to_pylist()]
            b = [tuple(r.values()) for r in at_b.to_pylist()]
            rows = feed.to_pylist()
            up = [tuple(r[c] for c in at_b.column_names) for r in rows if r["change_type"] == "upsert"]
            down = [tuple(r[c] for c in at_a.column_names) for r in rows if r["change_type"] == "delete"]
            what = (f"seed {seed}, {variable} from {older.checkpoint_id} (P={older.parallelism}) to "
                    f"{newer.checkpoint_id} (P={newer.parallelism})")
            width = {"v": 1, "m": 2, "l": None}[variable]
            assert _applied(a, up, down, width) == Counter(b), what
            assert not Counter(down) - Counter(a) and not Counter(up) - Counter(b), what   # nothing made up
            if width is not None:   # a delete only for an entry B does not hold
                assert not {r[:width] for r in down} & {r[:width] for r in b}, what
            checked += 1
    assert checked == 3 * 11


def test_a_pair_that_has_no_change_feed_is_refused_by_name(tmp_path):
    storage = CheckpointStorage.open(f"file://{tmp_path}/chk", "feed")
    rnd = random.Random(1)
    m0 = _round(storage, None, 0, 2, T0, rnd, tmp_path)
    m1 = _round(storage, m0, 1, 2, T0 + 1, rnd, tmp_path)
    with pytest.raises(StateError, match="changes_from=1 must name a checkpoint older than checkpoint 0"):
        changes_schema(m1, m0, "v")
    with pytest.raises(StateError, match="no declared variable 'nope'"):
        changes_schema(m0, m1, "nope")
    other = _round(CheckpointStorage.open(f"file://{tmp_path}/chk2", "feed"), None, 2, 2, T0, rnd, tmp_path / "o", m=64)
    with pytest.raises(StateError, match="max parallelism 32 and checkpoint 2 64.*join them on the key"):
        changes_schema(m0, other, "v")
