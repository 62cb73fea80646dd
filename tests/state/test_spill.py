"""KeyedRowBuffer: rows by key in memory, past the threshold in sorted runs merged back; every key's rows
in one table, in arrival order, and no file left behind."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from sparksteward.errors import StateError
from sparksteward.state.spill import KeyedRowBuffer


def _check(tables, rows):
    """Every table sorted by key, each key in one table only, with its rows in arrival order."""
    seen = {}
    for t in tables:
        keys = t.column("k").to_pylist()
        assert keys == sorted(keys)
        for k in set(keys):
            assert k not in seen, f"key {k!r} split over two tables"
        for k, seq in zip(keys, t.column("seq").to_pylist()):
            seen.setdefault(k, []).append(seq)
    expected = {}
    for seq, k in enumerate(rows):
        expected.setdefault(k, []).append(seq)
    assert seen == expected


@pytest.mark.parametrize("threshold", [1, 200, 3000, 1 << 20])
@pytest.mark.parametrize("kind", ["string", "long"])
def test_drain_groups_every_key_once_in_arrival_order(tmp_path, threshold, kind):
    rng = random.Random(threshold)
    keys = [rng.choice([0, 0, 0, rng.randrange(300)]) for _ in range(3000)]   # key 0: a quarter of the rows
    rows = [f"k{k:03d}" for k in keys] if kind == "string" else keys
    t = pa.table({"k": pa.array(rows, pa.string() if kind == "string" else pa.int64()), "seq": range(len(rows))})
    with KeyedRowBuffer("k", threshold, tmp_path) as buf:
        for b in t.to_batches(max_chunksize=37):
            buf.add(b)
        tables = list(buf.drain())
        assert (buf.runs_written > 5) == (threshold < 20000)
        _check(tables, rows)
        assert list(buf.drain()) == []   # drained: empty
        assert buf.directory is None or not any(buf.directory.iterdir())   # runs deleted once merged
    assert list(tmp_path.iterdir()) == []


def test_drain_again_after_more_rows_and_bad_inputs(tmp_path):
    with KeyedRowBuffer("k", 100, tmp_path) as buf:
        buf.add(pa.table({"k": ["b", "a"] * 20, "seq": range(40)}).to_batches()[0])
        _check(list(buf.drain()), ["b", "a"] * 20)
        strict = pa.schema([pa.field("k", pa.string(), nullable=False), ("seq", pa.int64())], metadata={"x": "y"})
        buf.add(pa.RecordBatch.from_pylist([{"k": "c", "seq": 0}, {"k": "a", "seq": 1}], schema=strict))
        _check(list(buf.drain()), ["c", "a"])
        with pytest.raises(StateError, match=r"different columns: \(k string, seq int64\) and \(k string\)"):
            buf.add(pa.table({"k": ["x"]}).to_batches()[0])
    with pytest.raises(StateError, match="spill threshold 0 must be a positive number of bytes"):
        KeyedRowBuffer("k", 0, tmp_path)
