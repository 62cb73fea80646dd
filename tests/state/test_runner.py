"""The Arrow and per-key pandas forms over a real RocksDB subtask: results, state, casts and errors; the
pandas form calls once per key with all of its rows, spills past its threshold without leaving files, and
yields bounded output batches."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from sparksteward.errors import StateEncodingError, StateError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.runner import run_arrow, run_pandas

M = 8
OUT = pa.schema([("user", pa.string()), ("clicks", pa.int64())])


def _batches(users):
    t = pa.table({"user": users, "page": [f"/p{i % 3}" for i in range(len(users))]})
    return t.to_batches(max_chunksize=4) + [pa.RecordBatch.from_pylist([], schema=t.schema)]


@pytest.fixture
def backend(tmp_path):
    with RocksDBStateBackend(tmp_path / "w", KeyGroupRange(0, M), M) as b:
        yield b


def count_pandas(key, rows, state):
    n = (state.get() or 0) + len(rows)
    state.update(n)
    state.map("pages").put(rows["page"].iloc[0], True)
    state.list("seen").add(len(rows))
    return pd.DataFrame({"user": [key], "clicks": [n]})


def count_arrow(keys, rows, state):
    counts = rows.group_by("user").aggregate([("user", "count")])
    users = counts.column("user")
    old = state.get_many(users)
    new = [(o or 0) + c for o, c in zip(old, counts.column("user_count").to_pylist())]
    state.put_many(users, new)
    return pa.table({"user": users, "clicks": pa.array(new, pa.int32())})  # cast to int64 by the runner


def test_pandas_form_counts_per_key(backend):
    users = ["a", "b", "a", "c", "a", "b", "d", "a", "c"]
    out = pa.Table.from_batches(list(run_pandas(_batches(users), "user", count_pandas, backend, OUT)), schema=OUT)
    last = {u: c for u, c in zip(out.column("user").to_pylist(), out.column("clicks").to_pylist())}
    assert last == {"a": 4, "b": 2, "c": 2, "d": 1}
    v = backend.value("value")
    assert v.get("a") == 4 and backend.map("pages").keys("a") and backend.list("seen").get("a")
    assert sum(backend.list("seen").get("a")) == 4


def test_arrow_form_and_pandas_form_agree(tmp_path, backend):
    users = [f"u{i % 37}" for i in range(1000)]
    arrow_out = pa.Table.from_batches(list(run_arrow(_batches(users), "user", count_arrow, backend, OUT)), schema=OUT)
    assert arrow_out.schema == OUT
    with RocksDBStateBackend(tmp_path / "w2", KeyGroupRange(0, M), M) as b2:
        list(run_pandas(_batches(users), "user", count_pandas, b2, OUT))
        assert {f"u{i}": b2.value("value").get(f"u{i}") for i in range(37)} == \
            {f"u{i}": backend.value("value").get(f"u{i}") for i in range(37)}
    assert pc.max(arrow_out.column("clicks")).as_py() == 28  # 1000 rows over 37 keys: 28 or 27 each


def test_long_keys_arrive_as_numpy_scalars_and_work(tmp_path):
    with RocksDBStateBackend(tmp_path / "w", KeyGroupRange(0, M), M, "long") as b:
        t = pa.table({"id": pa.array([1, 2, 1], pa.int64())})
        schema = pa.schema([("id", pa.int64()), ("n", pa.int64())])

        def fn(key, rows, state):
            state.update((state.get() or 0) + len(rows))
            return pd.DataFrame({"id": [key], "n": [state.get()]})

        out = pa.Table.from_batches(list(run_pandas(t.to_batches(), "id", fn, b, schema)))
        assert sorted(out.to_pylist(), key=lambda r: r["id"]) == [{"id": 1, "n": 2}, {"id": 2, "n": 1}]


def test_bad_inputs_are_named(backend):
    with pytest.raises(StateEncodingError, match=r"key column 'usr' does not exist; the input has columns "
                                                 r"\['user', 'page'\]"):
        list(run_pandas(_batches(["a"]), "usr", count_pandas, backend, OUT))
    with pytest.raises(StateError, match=r"lacks columns \['clicks'\]"):
        list(run_arrow(_batches(["a"]), "user", lambda k, r, s: pa.table({"user": ["a"]}), backend, OUT))
    with pytest.raises(StateError, match=r"column 'clicks' .* has type string, which cannot be cast"):
        list(run_arrow(_batches(["a"]), "user", lambda k, r, s: pa.table({"user": ["a"], "clicks": ["x"]}),
                       backend, OUT))
    nulls = pa.table({"user": ["a", None], "page": ["x", "y"]}).to_batches()
    with pytest.raises(StateEncodingError, match="key column 'user' has 1 null values"):
        list(run_pandas(nulls, "user", count_pandas, backend, OUT))

    def boom(key, rows, state):
        state.update(object())

    with pytest.raises(StateEncodingError, match="cannot be encoded"):
        list(run_pandas(_batches(["a"]), "user", boom, backend, OUT))


def test_the_per_key_form_returns_rows_as_tuples_dicts_or_lists_of_them_beside_dataframes(backend):
    def rows_out(key, rows, state):
        n = (state.get() or 0) + len(rows)
        state.update(n)
        return {"a": (key, n), "b": {"clicks": n, "user": key, "extra": 1}, "c": [(key, n), (key, -n)],
                "d": pd.DataFrame({"user": [key], "clicks": [n]}), "e": None, "f": []}[key]

    out = pa.Table.from_batches(list(run_pandas(_batches(list("abcdefab")), "user", rows_out, backend, OUT)),
                                schema=OUT)
    assert sorted(zip(out.column("user").to_pylist(), out.column("clicks").to_pylist())) == [
        ("a", 2), ("b", 2), ("c", -1), ("c", 1), ("d", 1)]


@pytest.mark.parametrize(("result", "message"), [
    (("a",), r"^key 'a': the state function returned a row of 1 values \('a',\); the declared schema has 2 "
             r"columns \['user', 'clicks'\]: return one value per column, in that order$"),
    ({"user": "a"}, r"^key 'a': the state function returned a row without columns \['clicks'\] of the declared "
                    r"schema \['user', 'clicks'\]; it has \['user'\]$"),
    (["a"], r"^key 'a': the state function returned a list holding str; a list must hold rows"),
    (("a", "many"), r"^column 'clicks' of the state function's rows cannot hold str 'many' as the declared int64"),
    (("a", 1 << 70), r"^column 'clicks' of the state function's rows cannot hold int 1180591620717411303424 as the "
                     r"declared int64"),
])
def test_a_bad_row_is_named_with_its_key_or_column(backend, result, message):
    with pytest.raises(StateError, match=message):
        list(run_pandas(_batches(["a"]), "user", lambda k, r, s: result, backend, OUT))


def test_rows_of_a_key_are_a_frame_of_their_own(backend):
    """A function that writes into its rows changes neither another key's rows nor raises a warning."""
    import warnings

    seen = {}

    def scribble(key, rows, state):
        seen[key] = rows["page"].tolist()
        rows["page"] = "changed"
        rows["new"] = 1
        assert list(rows.index) == list(range(len(rows)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(run_pandas(_batches(["a", "b", "a", "b"]), "user", scribble, backend, OUT))
    assert seen == {"a": ["/p0", "/p2"], "b": ["/p1", "/p0"]}


# --- the pandas form: once per key per batch, bounded memory --------------------------------------------


def _recording(calls, out_rows=1):
    """A per-key function that records (key, row numbers) of each call and returns ``out_rows`` rows."""
    def fn(key, rows, state):
        calls.append((key, rows["seq"].tolist()))
        state.update((state.get() or 0) + len(rows))
        return pd.DataFrame({"user": [key] * out_rows, "clicks": [state.get()] * out_rows})

    return fn


def _seq_batches(users, size=4):
    t = pa.table({"user": users, "seq": list(range(len(users)))})
    return t.to_batches(max_chunksize=size)


def _spill_files(backend):
    return sorted(p.name for p in backend.directory.glob("spill-*/*")) + \
        sorted(p.name for p in backend.directory.glob("spill-*"))


def test_pandas_form_calls_each_key_once_with_all_its_rows_of_every_buffer(backend):
    users = ["hot" if i % 3 else f"u{i % 7}" for i in range(300)]   # "hot" in every one of 75 buffers
    calls = []
    counters: dict[str, int] = {}
    out = pa.Table.from_batches(list(run_pandas(_seq_batches(users), "user", _recording(calls), backend, OUT,
                                                counters=counters)), schema=OUT)
    assert sorted(k for k, _ in calls) == sorted(set(users))   # one call per key
    assert counters == {"keys_touched": len(set(users))}
    for k, seq in calls:
        assert seq == [i for i, u in enumerate(users) if u == k]   # every row, in arrival order
    assert sorted(out.to_pylist(), key=lambda r: r["user"]) == \
        sorted(({"user": u, "clicks": users.count(u)} for u in set(users)), key=lambda r: r["user"])
    assert backend.value("value").get("hot") == 200


def test_the_arrow_form_takes_the_buffers_in_calls_of_at_most_max_input_bytes(backend):
    users = ["hot" if i % 3 else f"u{i % 7}" for i in range(300)]   # 75 buffers of 4 rows
    calls: list[int] = []

    def counting(keys, rows, state):
        calls.append(rows.num_rows)
        return count_arrow(keys, rows, state)

    counters: dict[str, int] = {}
    out = pa.Table.from_batches(list(run_arrow(_batches(users), "user", counting, backend, OUT,
                                               max_input_bytes=1 << 20, counters=counters)), schema=OUT)
    assert calls == [300]   # all of it in one call: one output row per key
    assert counters == {"keys_touched": len(set(users))}
    assert sorted(out.to_pylist(), key=lambda r: r["user"]) == \
        sorted(({"user": u, "clicks": users.count(u)} for u in set(users)), key=lambda r: r["user"])
    per_buffer = _batches(users)[0].nbytes
    calls.clear()
    list(run_arrow(_batches(users), "user", counting, backend, OUT, max_input_bytes=10 * per_buffer,
                   counters=counters))
    assert calls == [40] * 7 + [20]   # cut once the held buffers reach the bound
    assert counters == {"keys_touched": len(set(users))}   # a key of several calls counts once
    calls.clear()
    list(run_arrow(_batches(users), "user", counting, backend, OUT, counters=counters))
    assert calls == [4] * 75   # without a bound (an unaligned subtask): per buffer
    assert counters == {"keys_touched": len(set(users))}
    assert backend.value("value").get("hot") == 3 * 200


def test_buffers_of_another_schema_start_a_call_of_their_own(backend):
    users = ["a", "b", "a", "c"]
    first = _batches(users)[0]
    other = pa.table({"user": ["a", "d"], "page": ["/x", "/y"]},
                     schema=pa.schema([("user", pa.string()), ("page", pa.string())],
                                      metadata={b"from": b"an older query"})).to_batches()[0]
    calls: list[int] = []

    def counting(keys, rows, state):
        calls.append(rows.num_rows)
        return count_arrow(keys, rows, state)

    wide = pa.table({"user": pa.array(["a", "e"], pa.large_string())}).to_batches()[0]   # another key type
    counters: dict[str, int] = {}
    list(run_arrow([first, first, other, first, wide], "user", counting, backend, OUT, max_input_bytes=1 << 20,
                   counters=counters))
    assert calls == [8, 2, 4, 2]
    assert counters == {"keys_touched": 5}   # a to d, and e of the large_string call: each key once
    assert backend.value("value").get("a") == 2 + 2 + 1 + 2 + 1


def test_a_null_key_in_a_later_buffer_fails_before_any_call(backend):
    t = pa.table({"user": ["a"] * 8 + [None], "seq": list(range(9))})
    calls = []
    with pytest.raises(StateEncodingError, match="key column 'user' has 1 null values"):
        list(run_pandas(t.to_batches(max_chunksize=4), "user", _recording(calls), backend, OUT))
    assert calls == []


def test_spilling_gives_the_same_calls_and_leaves_no_files(tmp_path, backend):
    users = [("hot" if i % 2 else f"u{(i * 7) % 113}") for i in range(2000)]
    in_memory = []
    with RocksDBStateBackend(tmp_path / "w2", KeyGroupRange(0, M), M) as b2:
        list(run_pandas(_seq_batches(users, 50), "user", _recording(in_memory), b2, OUT))
    spilled, seen_files = [], []

    def fn(key, rows, state):
        seen_files.extend(_spill_files(backend))
        return _recording(spilled)(key, rows, state)

    out = list(run_pandas(_seq_batches(users, 50), "user", fn, backend, OUT, spill_threshold=2048))
    assert len([f for f in set(seen_files) if f.endswith(".arrow")]) > 10   # it did spill, to many runs
    assert sorted(spilled) == sorted(in_memory) and len(spilled) == len(set(users))
    assert sum(b.num_rows for b in out) == len(set(users))
    assert {u: backend.value("value").get(u) for u in set(users)} == {u: users.count(u) for u in set(users)}
    assert _spill_files(backend) == []


def test_spill_files_are_deleted_when_the_function_raises_or_the_output_is_dropped(backend):
    users = [f"u{i % 50}" for i in range(1000)]

    def boom(key, rows, state):
        assert _spill_files(backend)
        raise RuntimeError(f"user function failed on {key}")

    with pytest.raises(RuntimeError, match="user function failed"):
        list(run_pandas(_seq_batches(users, 20), "user", boom, backend, OUT, spill_threshold=1024))
    assert _spill_files(backend) == []
    out = run_pandas(_seq_batches(users, 20), "user", _recording([]), backend, OUT, spill_threshold=1024,
                     max_output_rows=1)
    next(out)
    assert _spill_files(backend)
    out.close()   # the consumer stops early (a task killed mid-output)
    assert _spill_files(backend) == []


def test_output_batches_are_bounded(backend):
    users = [f"u{i % 23}" for i in range(500)]
    calls = []
    out = list(run_pandas(_seq_batches(users, 100), "user", _recording(calls, out_rows=12), backend, OUT,
                          max_output_rows=5))
    assert len(calls) == 23 and sum(b.num_rows for b in out) == 23 * 12
    assert max(b.num_rows for b in out) == 5 and all(b.schema == OUT for b in out)


def test_key_group_ordered_input_calls_a_key_group_once_the_next_begins(backend):
    from sparksteward.state.keygroups import key_group

    users = sorted((f"u{i % 40}" for i in range(400)), key=lambda u: key_group(u, M))   # stable: interleaved keys
    pulled, calls = [0], []
    called_at = {}

    def source():
        for b in _seq_batches(users, 16):
            pulled[0] += 1
            yield b

    def fn(key, rows, state):
        called_at[key] = pulled[0]
        return _recording(calls)(key, rows, state)

    list(run_pandas(source(), "user", fn, backend, OUT, key_group_ordered=True))
    assert sorted(k for k, _ in calls) == sorted(set(users))
    for k, seq in calls:
        assert seq == [i for i, u in enumerate(users) if u == k]
    first = min(set(users), key=lambda u: key_group(u, M))
    assert called_at[first] < pulled[0]   # called before the whole input was read (the cut's deadline runs)
    backwards = _seq_batches(list(reversed(users)), 16)
    with pytest.raises(StateError, match="not in key-group order"):
        list(run_pandas(iter(backwards), "user", _recording([]), backend, OUT, key_group_ordered=True))


def test_batches_with_other_columns_are_refused_by_name(backend):
    a = pa.table({"user": ["a"], "seq": [1]}).to_batches()
    b = pa.table({"user": ["a"], "seq": ["x"]}).to_batches()
    with pytest.raises(StateError, match=r"different columns: \(user string, seq int64\) and \(user string, seq string\)"):
        list(run_pandas(a + b, "user", _recording([]), backend, OUT))


def test_the_default_spill_threshold_is_the_configs():
    from sparksteward.config import StewardConfig
    from sparksteward.state.runner import DEFAULT_SPILL_THRESHOLD

    assert StewardConfig().state_spill_threshold == StewardConfig.from_conf({}).state_spill_threshold == \
        DEFAULT_SPILL_THRESHOLD
