"""The Arrow and per-key pandas forms over a real RocksDB subtask: results, state, casts and errors."""

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
