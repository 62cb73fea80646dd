"""A cut inside a hot key (issue 38 item 6, decision 0028): with ``form="chunks"`` the per-key function
reads a key's rows as an iterator of chunks, the unaligned cut checks its deadline between two chunks,
and every attempt (another arrival order and chunking, another clock) processes and defers the same
rows; the rest of the key comes first in its call of the next batch. Spark-free: the task's own input
pipeline (merge, cut, per-key runner) over a real RocksDB backend, a real coordinator and real
channel-state files."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from sparksteward.checkpoint.begun import Cut
from sparksteward.checkpoint.unaligned.channel_state import ChannelStateWriter, read_channel_state
from sparksteward.checkpoint.unaligned.task_cut import iter_cut, merge_by_key_group
from sparksteward.errors import CheckpointOrderError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange, key_group
from sparksteward.state.runner import run_pandas

from tests.checkpoint.unaligned.test_channel_state import Cuts

M = 16
SCHEMA = pa.schema([("k", pa.string()), ("n", pa.int64()), ("s", pa.int64())])


def _keys() -> tuple[str, list[str]]:
    """A hot key in key group 2 and ordinary keys in other key groups and in key group 2 too."""
    names = [f"u{i}" for i in range(200)]
    hot = next(k for k in names if key_group(k, M) == 2)
    return hot, [k for k in names if k != hot][:40]


def _input(seed: int, hot: str, ordinary: list[str], batch: int = 0, hot_rows: int = 600) -> list[pa.RecordBatch]:
    """One subtask's new rows (with the key-group column the task gets), shuffled and split at random
    points: another seed is another arrival order and chunking of the same rows. Some rows are equal in
    every column (interchangeable)."""
    rows = [(hot, (i * 7) % 50 + 1000 * batch) for i in range(hot_rows)]
    rows += [(ordinary[i % len(ordinary)], i % 13 + 1000 * batch) for i in range(300)]
    rnd = random.Random(seed)
    rnd.shuffle(rows)
    cuts = sorted(rnd.sample(range(1, len(rows)), 5))
    out = []
    for a, b in zip([0, *cuts], [*cuts, len(rows)]):
        part = rows[a:b]
        out.append(pa.RecordBatch.from_pydict({
            "k": [r[0] for r in part], "v": [r[1] for r in part],
            "kg": pa.array([key_group(r[0], M) for r in part], pa.int32())}))
    return out


class Recorder:
    """A ``form="chunks"`` count-and-sum that records, per call, the key and the rows it read."""

    def __init__(self, read_all: bool = True, swallow: bool = False) -> None:
        self.calls: list[tuple[str, list[int]]] = []
        self.read_all, self.swallow = read_all, swallow

    def __call__(self, key, chunks, state):
        seen: list[int] = []
        try:
            for chunk in chunks:
                seen.extend(int(v) for v in chunk["v"])
                if not self.read_all:
                    break
        except Exception:   # noqa: BLE001 - a function that catches everything must not hide a cut conflict
            if not self.swallow:
                raise
        self.calls.append((key, seen))
        cur = state.get() or [0, 0]
        cur = [cur[0] + len(seen), cur[1] + sum(seen)]
        state.update(cur)
        return key, cur[0], cur[1]


def _attempt(tmp_path, name: str, batches, cuts: Cuts, *, cut=None, deadline=None, replayed=(),
             fn=None, chunk_rows: int = 50, db=None):
    """One attempt of a subtask owning key groups [0, 16): merge in content order, cut, run."""
    fn = fn or Recorder()
    writer = ChannelStateWriter(tmp_path / f"{name}.channel")
    counters: dict[str, int] = {}
    merged = merge_by_key_group(replayed, batches, kg_column="kg", within=("k", chunk_rows),
                                key_groups=lambda b: pa.array([key_group(k, M) for k in b.column("k").to_pylist()],
                                                              pa.int32()))
    source = iter_cut(merged, kg_column="kg", start=0, stop=M, cut=cut, deadline_passed=deadline, propose=cuts,
                      writer=writer, counters=counters, within=True)
    backend = RocksDBStateBackend(db or tmp_path / f"{name}.db", KeyGroupRange(0, M), M,
                                  create=db is None or not db.exists())
    try:
        out = pa.Table.from_batches(list(run_pandas(source, "k", fn, backend, SCHEMA, key_group_ordered=True,
                                                    chunk_rows=chunk_rows)), schema=SCHEMA)
    finally:
        backend.close()
    stats = writer.close()
    deferred = list(read_channel_state(stats.path)) if stats is not None else []
    return fn, out, deferred, counters


def _after(n: int):
    """A deadline that passes after it was asked ``n`` times (n chunks read)."""
    asked = iter(range(n))
    return lambda: next(asked, None) is None


def _multiset(batches) -> list[tuple]:
    t = pa.Table.from_batches(batches) if batches else None
    return sorted(zip(t.column("k").to_pylist(), t.column("v").to_pylist())) if t is not None else []


def test_the_cut_falls_inside_a_hot_key_and_every_attempt_processes_the_same_rows(tmp_path):
    hot, ordinary = _keys()
    cuts = Cuts(tmp_path)
    first, out1, deferred1, c1 = _attempt(tmp_path, "a1", _input(1, hot, ordinary), cuts, deadline=_after(6))
    recorded = cuts.recorded
    hot_call = next(seen for k, seen in first.calls if k == hot)
    # inside key group 2, inside the hot key's call: it read a prefix of its rows, the rest deferred
    assert recorded.group == 2 and recorded.rows > 0, recorded
    assert 0 < len(hot_call) < 600
    assert [k for k, _ in first.calls].count(hot) == 1   # still one call per key per batch
    assert c1["rows_processed"] + c1["rows_deferred"] == 900 and c1["unaligned"] == 1
    assert all(key_group(k, M) >= 2 for k, _ in _multiset(deferred1))
    processed1 = sorted((k, v) for k, seen in first.calls for v in seen)

    # a retried attempt (another order and chunking) opens after the cut was recorded: follows it exactly
    second, out2, deferred2, _ = _attempt(tmp_path, "a2", _input(2, hot, ordinary), cuts, cut=recorded,
                                          chunk_rows=7)
    assert sorted((k, v) for k, seen in second.calls for v in seen) == processed1
    assert _multiset(deferred2) == _multiset(deferred1) and out2.sort_by("k") == out1.sort_by("k")
    # a speculative copy whose own deadline passed at once proposes earlier, gets the recorded cut, goes on to it
    third, out3, deferred3, _ = _attempt(tmp_path, "a3", _input(3, hot, ordinary), cuts, deadline=lambda: True,
                                         chunk_rows=13)
    assert sorted((k, v) for k, seen in third.calls for v in seen) == processed1
    assert _multiset(deferred3) == _multiset(deferred1)


def test_an_attempt_past_the_recorded_cut_fails_as_ours_even_when_the_function_catches_everything(tmp_path):
    """Another attempt cut the hot key after 10 of its rows; this one read 30 chunks of 50 rows before its
    deadline passed and it learned of that cut: it fails with our error, not as the function's, also when
    the function catches every exception around its loop."""
    hot, ordinary = _keys()
    cuts = Cuts(tmp_path)
    cuts(Cut(2, 10), False)
    for swallow in (False, True):
        with pytest.raises(CheckpointOrderError, match=r"cut its input at key group 2 \(after 10 of its rows\)"):
            _attempt(tmp_path, f"late-{swallow}", _input(1, hot, ordinary), cuts, deadline=_after(30),
                     fn=Recorder(swallow=swallow))


def test_the_rest_of_a_hot_key_comes_first_in_its_one_call_of_the_next_batch_and_the_state_is_exact(tmp_path):
    """Batch 0 cuts inside the hot key; batch 1 replays the rest of its rows before its new ones, in one
    call; a function that reads only its first chunk still consumes its call's rows; the final counts
    equal processing every row once."""
    hot, ordinary = _keys()
    db = tmp_path / "db"
    fn0 = Recorder()
    _, _, deferred, c0 = _attempt(tmp_path, "b0", _input(1, hot, ordinary, batch=0), Cuts(tmp_path),
                                  deadline=_after(6), fn=fn0, db=db)
    rest = [v for k, v in _multiset(deferred) if k == hot]
    assert rest and c0["rows_deferred"] == len(_multiset(deferred))
    fn1 = Recorder()
    _, out1, deferred1, c1 = _attempt(tmp_path, "b1", _input(2, hot, ordinary, batch=1), Cuts(tmp_path),
                                      deadline=lambda: False, replayed=deferred, fn=fn1, db=db)
    assert c1["rows_deferred"] == 0 and not deferred1
    hot_calls = [seen for k, seen in fn1.calls if k == hot]
    assert len(hot_calls) == 1 and sorted(hot_calls[0][:len(rest)]) == sorted(rest)   # the rest first
    assert all(v >= 1000 for v in hot_calls[0][len(rest):])                           # then the new rows
    every = _multiset(_input(1, hot, ordinary, batch=0)) + _multiset(_input(2, hot, ordinary, batch=1))
    expect: dict[str, list[int]] = {}
    for k, v in every:
        e = expect.setdefault(k, [0, 0])
        e[0], e[1] = e[0] + 1, e[1] + v
    got = {r["k"]: [r["n"], r["s"]] for r in out1.to_pylist()}
    assert got[hot] == expect[hot] and all(got[k] == expect[k] for k in got)

    # a function that reads one chunk and returns: the rest of its call's rows are consumed all the same
    lazy = Recorder(read_all=False)
    _, out, deferred2, c2 = _attempt(tmp_path, "lazy", _input(4, hot, ordinary), Cuts(tmp_path),
                                     deadline=lambda: False, fn=lazy)
    assert c2["rows_processed"] == 900 and not deferred2 and len(lazy.calls) == len({k for k, _ in lazy.calls})


def test_rows_of_types_arrow_cannot_sort_still_come_in_one_order(tmp_path):
    """A list column (which Arrow cannot sort) is ordered by its values' JSON: two arrival orders of the
    same rows merge into the same sequence."""
    rows = [("a", [i % 3, i]) for i in range(40)] + [("b", [1]) for _ in range(5)]

    def merged(seed):
        r = list(rows)
        random.Random(seed).shuffle(r)
        batch = pa.RecordBatch.from_pydict({"k": [x[0] for x in r], "l": pa.array([x[1] for x in r], pa.list_(pa.int64())),
                                            "kg": pa.array([0] * len(r), pa.int32())})
        out = pa.Table.from_batches(list(merge_by_key_group([], [batch], kg_column="kg", key_groups=None,  # type: ignore[arg-type]
                                                            within=("k", 8))))
        assert out.column_names == ["k", "l", "kg"] and max(b.num_rows for b in out.to_batches()) <= 8
        return out.column("k").to_pylist(), out.column("l").to_pylist()

    assert merged(1) == merged(2)


def test_the_harness_runs_the_chunks_form():
    from sparksteward.testing import KeyedStateHarness

    sizes: list[int] = []

    def fn(key, chunks, state):
        n = state.get() or 0
        for chunk in chunks:
            sizes.append(len(chunk))
            n += len(chunk)
        state.update(n)
        return key, n

    with KeyedStateHarness(fn, key="k", schema="k string, n bigint", form="chunks", chunk_rows=3) as h:
        out = h.process([{"k": "a"}] * 7 + [{"k": "b"}])
        assert sorted(map(tuple, out.itertuples(index=False))) == [("a", 7), ("b", 1)]
        assert sorted(sizes) == [1, 1, 3, 3]
