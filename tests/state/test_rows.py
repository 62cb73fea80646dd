"""Typed state values (state/rows.py): every supported type round-trips through a whole column and
one value at a time, nulls inside a struct survive, expiries ride along, and schema evolution accepts
add, drop and widen and refuses the rest by name."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pytest
from sparksteward.errors import StateEncodingError
from sparksteward.state.rows import TAG_TYPED, RowCodec, evolve, expiry_of, tag_of

EVENT = pa.struct([("ts", pa.timestamp("us")), ("v", pa.float64()), ("n", pa.int32()), ("ok", pa.bool_()),
                   ("tag", pa.string()), ("blob", pa.binary()), ("day", pa.date32())])


def _rows(n: int) -> list[dict]:
    base = dt.datetime(2026, 11, 25, 12, 0, 0)
    return [{"ts": base + dt.timedelta(microseconds=7 * i), "v": i / 3, "n": -i if i % 5 else None, "ok": i % 2 == 0,
             "tag": None if i % 7 == 0 else f"t{i}é", "blob": bytes([i % 256]) * (i % 4), "day": dt.date(2026, 1, 1)}
            for i in range(n)]


@pytest.mark.parametrize("dtype, values", [
    (pa.int64(), [0, 1, -(2 ** 63), 2 ** 63 - 1]),
    (pa.float64(), [0.0, -1.5, 1e300]),
    (pa.string(), ["", "a", "ünï", "x" * 1000]),
    (pa.bool_(), [True, False]),
    (pa.int8(), [-128, 127]),
    (EVENT, _rows(50)),
])
def test_a_column_round_trips(dtype, values):
    codec = RowCodec("s", dtype)
    rows = codec.encode(pa.array(values, type=dtype))
    assert all(tag_of(r) == (TAG_TYPED, 1) for r in rows)
    decoded, expiries = codec.decode(rows)
    assert decoded.to_pylist() == values and expiries is None
    assert [codec.decode_one(codec.encode_one(v)) for v in values[:5]] == values[:5]
    assert [codec.decode_py(codec.encode_py(v))[0] for v in values[:5]] == values[:5]   # the per-key path


def test_fixed_width_values_are_compact_and_carry_their_expiry():
    codec = RowCodec("count", pa.int64(), ttl=True)
    rows = codec.encode(pa.array([5, 6, 7], type=pa.int64()), expiry=np.array([10, 20, 30]))
    assert {len(r) for r in rows} == {1 + 2 + 8 + 1 + 8}
    assert [expiry_of(r) for r in rows] == [10, 20, 30]
    values, expiries = codec.decode(rows)
    assert values.to_pylist() == [5, 6, 7] and expiries.tolist() == [10, 20, 30]
    with pytest.raises(StateEncodingError, match="has a TTL"):
        codec.encode(pa.array([1], type=pa.int64()))


def test_many_numbers_decode_in_one_pass_or_fall_back():
    """decode_many_py: the per-key list read's fast path agrees with decode_py, and declines (None)
    rows it cannot take, so the caller decodes those one by one."""
    for ttl, dtype, values in ((True, pa.int64(), [5, 0, -7]), (False, pa.float64(), [0.5, -0.0, 1e300]),
                               (False, pa.int8(), [-128, 127, 3])):
        codec = RowCodec("l", dtype, ttl=ttl)
        rows = codec.encode(pa.array(values, type=dtype), expiry=np.array([10, 20, 30]) if ttl else None)
        assert codec.decode_many_py(rows) == values == [codec.decode_py(r)[0] for r in rows]
    codec = RowCodec("l", pa.int64())
    rows = codec.encode(pa.array([1, 2], type=pa.int64()))
    assert codec.decode_many_py(rows[:1] + [bytes([TAG_TYPED, 2, 0]) + rows[1][3:]]) is None   # another version
    assert codec.decode_many_py(rows + [rows[0] + b"x"]) is None                                   # another length
    assert RowCodec("s", pa.string()).decode_many_py(RowCodec("s", pa.string()).encode(pa.array(["a"]))) is None


def test_bad_values_and_types_are_refused_by_name():
    with pytest.raises(StateEncodingError, match="a null value cannot be stored"):
        RowCodec("s", pa.int64()).encode(pa.array([1, None], type=pa.int64()))
    with pytest.raises(StateEncodingError, match="does not fit state 'c' declared int64"):
        RowCodec("c", pa.int64()).encode_one("seven")
    with pytest.raises(StateEncodingError, match="field 'xs' of state 's' has type list"):
        RowCodec("s", pa.struct([("xs", pa.list_(pa.int64()))]))
    with pytest.raises(StateEncodingError, match="not typed values of version 2"):
        RowCodec("s", pa.int64(), version=2).decode(RowCodec("s", pa.int64()).encode(pa.array([1])))


def test_evolution_accepts_add_drop_and_widen():
    old = RowCodec("e", pa.struct([("a", pa.int32()), ("b", pa.string()), ("c", pa.float32())]), version=1)
    new = RowCodec("e", pa.struct([("a", pa.int64()), ("c", pa.float64()), ("d", pa.string())]), version=2)
    assert evolve(old.dtype, new.dtype) is None
    assert evolve(pa.struct([pa.field("a", pa.int32(), nullable=False)]), pa.struct([("a", pa.int64())])) is None
    values, _ = old.decode(old.encode(pa.array([{"a": 1, "b": "x", "c": 0.5}], type=old.dtype)))
    assert old.project(values, new).to_pylist() == [{"a": 1, "c": 0.5, "d": None}]


@pytest.mark.parametrize("old, new, message", [
    (pa.int64(), pa.int32(), "changed from int64 to int32"),
    (pa.int64(), pa.string(), "changed from int64 to string"),
    (pa.struct([("a", pa.int64())]), pa.int64(), "a struct and a single value"),
    (pa.struct([("a", pa.int64())]), pa.struct([("a", pa.int64()), pa.field("b", pa.int64(), nullable=False)]),
     "added as NOT NULL"),
    (pa.struct([("a", pa.int64()), ("b", pa.string())]),
     pa.struct([("a", pa.int64()), pa.field("b", pa.string(), nullable=False)]),
     "field 'b' was nullable and is now declared NOT NULL"),
    (pa.struct([("a", pa.int32())]), pa.struct([pa.field("a", pa.int64(), nullable=False)]),
     "field 'a' was nullable and is now declared NOT NULL"),
])
def test_evolution_refuses_the_rest_by_name(old, new, message):
    assert message in evolve(old, new)


def test_a_sliced_column_and_corrupt_rows():
    dtype = pa.struct([("n", pa.int64()), ("s", pa.string()), ("b", pa.binary())])
    values = pa.array([{"n": i, "s": None if i % 3 == 0 else "é" * i, "b": b"x" * (i % 5)} for i in range(20)],
                      type=dtype)
    codec = RowCodec("s", dtype)
    sliced = values.slice(7, 9)
    rows = codec.encode(sliced)
    assert codec.decode(rows)[0].to_pylist() == sliced.to_pylist()
    with pytest.raises(StateEncodingError, match="do not match the lengths they record"):
        codec.decode([rows[0], rows[1][:-1]])
    with pytest.raises(StateEncodingError, match="shorter than the fixed part"):
        codec.decode([rows[0][:5]])
    bad = bytearray(rows[3])   # n=10: s is ten "é", b is empty
    bad[-3] = 0xff   # inside the UTF-8 text of field s
    with pytest.raises(StateEncodingError, match="field 's' is corrupt|field 'b'"):
        codec.decode([bytes(bad)])
