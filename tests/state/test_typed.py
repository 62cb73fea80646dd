"""Declared keyed states on a real RocksDB, without Spark (state/declared.py, state/typed.py): each kind
in both forms, TTL that never returns an expired entry and a sweep that removes them through the
expiry index, list appends and map puts whose cost does not grow with the collection, and schema
evolution that reads old versions and refuses what it cannot read, by name."""

from __future__ import annotations

import datetime as dt
import time

import pyarrow as pa
import pytest
from sparksteward.errors import StateBackendError, StateEncodingError, StateError, StateSchemaError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.declared import list_state, map_state, parse_ddl, resolve, value_state, variables_of
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.snapshot import wal_bytes
from sparksteward.state.typed import KIND_EXPIRY, TypedStates, drop_variables, sweep_expired

M = 128
T0 = 1_800_000_000_000   # a processing time in ms


@pytest.fixture
def backend(tmp_path):
    b = RocksDBStateBackend(tmp_path / "s", KeyGroupRange(0, M), M, "string")
    yield b
    b.close()


def _states(backend, specs, now=T0, batch=1, recorded=None):
    return TypedStates(backend, resolve(recorded, specs), now, batch)


def _index_keys(backend):
    return [k for k, _ in backend.iter_raw() if k[2:3] == KIND_EXPIRY]


def test_a_ddl_type_becomes_an_arrow_type():
    assert parse_ddl("bigint") == pa.int64()
    assert parse_ddl("ts timestamp, v double") == pa.struct([("ts", pa.timestamp("us", tz="UTC")), ("v", pa.float64())])
    assert parse_ddl("struct<a:int, `b c`: string NOT NULL>") == pa.struct(
        [("a", pa.int32()), pa.field("b c", pa.string(), nullable=False)])
    for bad, match in [("decimal(10,2)", "not a type state values support"), ("", "empty"), ("a int,", "expected"),
                       ("array<int>", "not a type")]:
        with pytest.raises(StateSchemaError, match=match):
            parse_ddl(bad)


def test_bulk_reads_and_writes_in_key_order_keep_the_callers_order(backend):
    """From 64 keys on, get_many and put_many go to RocksDB in key order (typed._key_order): the values
    still come back in the order of the keys asked, a null still deletes, of a key given twice the
    last value wins, and with TTL each entry keeps its own expiry."""
    import random

    rng = random.Random(7)
    names = [f"k{i:04d}" for i in range(400)]
    rng.shuffle(names)
    st = _states(backend, [value_state("n", "bigint"), value_state("t", "bigint", ttl=1)])
    n = st.value("n")
    n.put_many(pa.array(names[:300]), pa.array(range(300), pa.int64()))
    asked = names[100:400]   # 200 present, 100 never written, in the shuffled order
    assert n.get_many(pa.array(asked)).to_pylist() == [*range(100, 300), *[None] * 100]
    # a null deletes; of a key given twice (two positions apart in the batch) the last value wins
    keys = names[:200] + names[:50]
    values = [None if i % 3 == 0 else i for i in range(200)] + [-i for i in range(50)]
    n.put_many(pa.array(keys), pa.array(values, pa.int64()))
    want = {k: v for k, v in zip(keys, values)}
    assert n.get_many(pa.array(names[:200])).to_pylist() == [want[k] for k in names[:200]]
    assert n.get_many(pa.array(names[:50])).to_pylist() == [-i for i in range(50)]
    t = st.value("t")
    t.put_many(pa.array(names[:100]), pa.array(range(100), pa.int64()))
    later = _states(backend, [value_state("n", "bigint"), value_state("t", "bigint", ttl=1)], now=T0 + 600, batch=2)
    later.value("t").put_many(pa.array(names[50:150]), pa.array(range(50, 150), pa.int64()))
    expired = _states(backend, [value_state("n", "bigint"), value_state("t", "bigint", ttl=1)], now=T0 + 1200, batch=3)
    assert expired.value("t").get_many(pa.array(names[:150])).to_pylist() == [None] * 50 + list(range(50, 150))


def test_keys_joined_by_numpy_are_the_keys_one_key_at_a_time(backend):
    """The Arrow form's string keys are joined into RocksDB keys by numpy (typed._string_raw_keys):
    byte for byte what the per-key path builds, for keys of one length and of many, multi-byte and
    empty keys, a sliced array and a large_string one, and in the same key order."""
    from sparksteward.state.typed import _key_order, _raw_keys

    st = _states(backend, [value_state("n", "bigint")])
    n = st.value("n")
    cases = [
        pa.array([f"user-{i:07d}" for i in range(300)]),                     # one length
        pa.array([f"u{i}" for i in range(0, 3000, 7)]),                      # many lengths
        pa.array(["", "é", "日本語", "a" * 300, "", "z"] * 20),               # empty, multi-byte, long
        pa.array([f"k{i:05d}" for i in range(1000)]).slice(123, 400),       # a slice: offsets not from 0
        pa.array([f"wide-{i}" for i in range(200)], pa.large_string()),
    ]
    for keys in cases:
        want = [n._prefix(k) for k in keys.to_pylist()]
        raw = _raw_keys(n, keys)
        assert raw == want
        assert [raw[i] for i in _key_order(n, raw).tolist()] == sorted(want)
    n.put_many(cases[3], pa.array(range(400), pa.int64()))
    assert n.get_many(cases[3]).to_pylist() == list(range(400))


def test_a_large_bulk_put_goes_in_as_an_sst_and_reads_as_a_write_batch_would(tmp_path):
    """Decision 0023: in a task that flushes past task-flush-size, puts without a TTL of four times
    that many raw bytes go in as one ingested SST while the memtable is empty. They read as a write
    batch would: over older values in SSTs, the last of equal keys winning, under later writes, and
    after a snapshot and a restore. Smaller puts, and puts over a memtable that holds writes, go
    through the WAL; a backend without the threshold (the harness, reads) never ingests."""
    import shutil

    from tests.state.test_backend import _restore_copy

    b = RocksDBStateBackend(tmp_path / "s", KeyGroupRange(0, M), M, "string", flush_wal_above=1024)
    n = _states(b, [value_state("n", "bigint")]).value("n")
    keys = [f"k{i:05d}" for i in range(3000)]
    n.put_many(pa.array(keys[:50]), pa.array([-1] * 50, pa.int64()))   # 50 small puts: the WAL
    assert b.entries_ingested == 0
    b.db.flush(True)   # older values in an SST below, the memtable empty
    wal = wal_bytes(b.db_path)
    ssts = len(b.db.live_files())
    # 3,000 keys, the first 40 given again at the end: the last of equal keys wins
    n.put_many(pa.array(keys + keys[:40]), pa.array([*range(3000), *range(-40, 0)], pa.int64()))
    assert b.entries_ingested == 3000 and len(b.db.live_files()) == ssts + 1 and wal_bytes(b.db_path) == wal
    want = {k: i for i, k in enumerate(keys)} | {k: i - 40 for i, k in enumerate(keys[:40])}
    assert n.get_many(pa.array(keys)).to_pylist() == [want[k] for k in keys]
    n.update(keys[0], 77)   # a later write (the memtable) reads over the ingested SST
    want[keys[0]] = 77
    assert n.get(keys[0]) == 77
    n.put_many(pa.array(keys[100:]), pa.array(range(2900), pa.int64()))   # the memtable holds a write: the WAL
    assert b.entries_ingested == 3000 and wal_bytes(b.db_path) > wal
    want |= {k: i for i, k in enumerate(keys[100:])}
    snap = b.snapshot(tmp_path / "snap")
    _restore_copy(snap.path, tmp_path / "r")
    r = RocksDBStateBackend(tmp_path / "r", KeyGroupRange(0, M), M, "string", create=False)
    try:
        got = _states(r, [value_state("n", "bigint")]).value("n").get_many(pa.array(keys)).to_pylist()
        assert got == [want[k] for k in keys]
    finally:
        r.close()
    assert not list((tmp_path / "s").glob(".ingest-*")), "the SST it wrote is not left beside the DB"
    m = RocksDBStateBackend(tmp_path / "m", KeyGroupRange(0, M), M, "string", flush_wal_above=1024)
    try:   # a map state's bulk puts take the same way
        attrs = _states(m, [map_state("attrs", "string", "bigint")]).map("attrs")
        attrs.put_many(pa.array(keys[:1500] * 2), pa.array(["a"] * 1500 + ["b"] * 1500), pa.array(range(3000), pa.int64()))
        assert m.entries_ingested == 3000
        assert attrs.items("k00007") == [("a", 7), ("b", 1507)]
    finally:
        m.close()
    plain = RocksDBStateBackend(tmp_path / "plain", KeyGroupRange(0, M), M, "string")
    try:
        _states(plain, [value_state("n", "bigint")]).value("n").put_many(pa.array(keys), pa.array(range(3000), pa.int64()))
        assert plain.entries_ingested == 0
    finally:
        plain.close()
    shutil.rmtree(tmp_path / "s", ignore_errors=True)


def test_an_sst_that_cannot_be_written_leaves_the_db_as_it_was(tmp_path):
    """A caller that lies about the order (keys not strictly increasing) gets a StateBackendError that
    names the DB; nothing was ingested, nothing is left beside the DB, and the DB still takes writes."""
    b = RocksDBStateBackend(tmp_path / "s", KeyGroupRange(0, M), M, "string", flush_wal_above=1024)
    try:
        n = _states(b, [value_state("n", "bigint")]).value("n")
        keys = [n._prefix(f"k{i:03d}") for i in range(10)]
        with pytest.raises(StateBackendError, match=r"cannot write 10 entries into the state DB in .*/s/db as an SST"):
            b.ingest_sorted(keys[::-1], [b"x"] * 10)
        with pytest.raises(StateBackendError, match="as an SST"):
            b.ingest_sorted([keys[0], keys[0]], [b"x", b"y"])   # equal keys: not strictly increasing
        assert b.entries_ingested == 0 and list(b.iter_raw()) == []
        assert not list((tmp_path / "s").glob(".ingest-*"))
        n.update("k001", 5)
        assert n.get("k001") == 5
    finally:
        b.close()


def test_bad_declarations_are_refused_by_name():
    with pytest.raises(StateSchemaError, match="'value' is the default value state"):
        list_state("value", "bigint")   # the default is a value state; typed with value_state("value", ...)
    assert value_state("c", "bigint", ttl=5, ttl_time="event").ttl_time == "event"   # decision 0028
    with pytest.raises(StateSchemaError, match="ttl_time='wall' must be one of"):
        value_state("c", "bigint", ttl=5, ttl_time="wall")
    with pytest.raises(StateSchemaError, match="ttl=-1 must be positive"):
        list_state("l", "bigint", ttl=-1)
    with pytest.raises(StateSchemaError, match="ttl_update='sometimes'"):
        map_state("m", "string", "bigint", ttl=1, ttl_update="sometimes")
    with pytest.raises(StateSchemaError, match="declared twice"):
        resolve(None, [value_state("c", "bigint"), list_state("c", "bigint")])


def test_value_state_in_both_forms(backend):
    st = _states(backend, [value_state("count", "bigint"), value_state("last", "ts timestamp, v double, tag string")])
    count, last = st.value("count"), st.value("last")
    count.update("a", 5)
    assert count.get("a") == 5 and count.get("zz") is None
    when = dt.datetime(2026, 11, 25, 12, tzinfo=dt.timezone.utc)
    last.bind("a").update({"ts": when, "v": 1.5, "tag": None})
    assert last.bind("a").get() == {"ts": when, "v": 1.5, "tag": None}
    count.put_many(pa.array(["b", "c", "d"]), pa.array([1, None, 3], pa.int64()))
    got = count.get_many(["a", "b", "c", "d", "e"])
    assert got.type == pa.int64() and got.to_pylist() == [5, 1, None, 3, None]
    count.clear_many(["a"])
    assert count.get("a") is None
    with pytest.raises(StateError, match="'last' is a value state, not a list state"):
        st.list("last")
    with pytest.raises(StateError, match="'nope' is not declared; declared: count .value., last .value."):
        st.value("nope")
    with pytest.raises(StateEncodingError, match="does not fit state 'count' declared int64"):
        count.update("a", "five")


def test_list_state_appends_in_order_across_batches(backend):
    spec = [list_state("events", "n bigint, s string")]
    st = _states(backend, spec, batch=1)
    ev = st.list("events")
    ev.append("k", {"n": 1, "s": "a"})
    ev.extend("k", [{"n": 2, "s": "b"}, {"n": 3, "s": None}])
    ev.append_many(["j", "k", "j"], pa.array([{"n": 10, "s": "x"}, {"n": 4, "s": "d"}, {"n": 11, "s": "y"}],
                                             pa.struct([("n", pa.int64()), ("s", pa.string())])))
    st2 = _states(backend, spec, batch=2)   # a later batch appends after the earlier ones
    st2.list("events").append("k", {"n": 5, "s": "e"})
    assert [e["n"] for e in st2.list("events").get("k")] == [1, 2, 3, 4, 5]
    lists = st2.list("events").get_many(["j", "k", "none"])
    assert [[e["n"] for e in xs] for xs in lists.to_pylist()] == [[10, 11], [1, 2, 3, 4, 5], []]
    st2.list("events").update("k", [{"n": 9, "s": "z"}])
    assert st2.list("events").bind("k").get() == [{"n": 9, "s": "z"}]
    st2.list("events").clear_many(["j"])
    assert st2.list("events").get("j") == []


def test_map_state_in_both_forms(backend):
    st = _states(backend, [map_state("attrs", "string", "double")])
    m = st.map("attrs")
    m.put("k", "x", 1.0)
    m.bind("k").put_all({"y": 2.0, "z": None})
    assert m.get("k", "x") == 1.0 and m.contains("k", "y") and not m.contains("k", "z")
    assert sorted(m.items("k")) == [("x", 1.0), ("y", 2.0)]
    m.put_many(["k", "j"], ["z", "x"], pa.array([3.0, 4.0]))
    assert m.get_many(["k", "j", "j"], ["z", "x", "nope"]).to_pylist() == [3.0, 4.0, None]
    maps = m.items_many(["j", "k", "none"]).to_pylist()
    assert maps[0] == [("x", 4.0)] and sorted(maps[1]) == [("x", 1.0), ("y", 2.0), ("z", 3.0)] and maps[2] == []
    m.remove("k", "x")
    assert sorted(m.bind("k").keys()) == ["y", "z"]
    m.bind("k").clear()
    assert m.items("k") == []


def test_an_expired_entry_is_never_returned(backend):
    specs = [value_state("c", "bigint", ttl=5), list_state("l", "bigint", ttl=5), map_state("m", "int", "bigint", ttl=5)]
    st = _states(backend, specs, now=T0)
    st.value("c").update("k", 1)
    st.list("l").append("k", 1)
    st.map("m").put("k", 1, 1)
    later = _states(backend, specs, now=T0 + 3000, batch=2)
    later.list("l").append("k", 2)
    later.map("m").put("k", 2, 2)
    at_5s = _states(backend, specs, now=T0 + 5000, batch=3)     # the first entries expire at T0 + 5 s
    assert at_5s.value("c").get("k") is None and at_5s.value("c").get_many(["k"]).to_pylist() == [None]
    assert at_5s.list("l").get("k") == [2] and at_5s.list("l").get_many(["k"]).to_pylist() == [[2]]
    assert at_5s.map("m").items("k") == [(2, 2)] and not at_5s.map("m").contains("k", 1)
    assert at_5s.map("m").get_many(["k", "k"], [1, 2]).to_pylist() == [None, 2]


def test_get_many_over_arrow_keys_reads_what_get_reads(backend, tmp_path):
    specs = [value_state("c", "n bigint, s bigint", ttl=5), value_state("p", "bigint")]
    keys = pa.array([f"user-{i:05d}" for i in range(2000)])
    first = _states(backend, specs, now=T0)
    first.value("c").put_many(keys.slice(0, 1000), [{"n": i, "s": -i} for i in range(1000)])
    first.value("p").put_many(keys.slice(0, 1500), list(range(1500)))
    later = _states(backend, specs, now=T0 + 3000, batch=2)
    later.value("c").put_many(keys.slice(500, 1000), [{"n": i, "s": i} for i in range(1000)])
    at_5s = _states(backend, specs, now=T0 + 5000, batch=3)   # keys 0-499 expired, 1500-1999 never written
    for name in ("c", "p"):
        view = at_5s.value(name)
        assert view.get_many(keys).to_pylist() == [view.get(k) for k in keys.to_pylist()]
    got = at_5s.value("c").get_many(keys).to_pylist()
    assert got[:500] == [None] * 500 and got[500] == {"n": 0, "s": 0} and got[1500:] == [None] * 500
    assert at_5s.value("p").get_many(keys).to_pylist() == list(range(1500)) + [None] * 500
    one = RocksDBStateBackend(tmp_path / "one", KeyGroupRange(0, 1), M, "string")
    try:
        with pytest.raises(StateEncodingError, match="routed to the wrong subtask"):
            _states(one, specs).value("p").get_many(keys)
    finally:
        one.close()


def test_a_bulk_read_that_scans_reads_what_a_multi_get_and_the_model_read(tmp_path, monkeypatch):
    """A large get_many on a DB holding few entries per key asked for scans the variable's entries in each
    key group (arrow_keys.get_stored) instead of a multi-get: seeded random puts, deletes by null, values
    in SSTs and in the memtable, a key group deleted by range (as a rescale drops one), a variable whose
    name starts with another's, a TTL variable, absent and repeated keys: the scan, the multi-get and the
    test's own model agree for every read. Prints its seed."""
    import random

    from sparksteward.state.keygroups import key_group
    from sparksteward.state.typed import arrow_keys

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    b = RocksDBStateBackend(tmp_path / "s", KeyGroupRange(0, 16), 16, "string")
    specs = [value_state("n", "bigint"), value_state("n2", "bigint"), value_state("t", "bigint", ttl=5)]
    names = [f"user-{i:05d}" for i in range(3000)]
    model: dict[str, dict[str, int]] = {"n": {}, "n2": {}}
    written_t: dict[str, tuple[int, int]] = {}   # key -> (value, batch time)
    try:
        for batch in range(1, 7):
            now = T0 + batch * 2000
            st = _states(b, specs, now=now, batch=batch)
            for var in ("n", "n2"):
                keys = rng.sample(names, rng.randrange(200, 2500))
                values = [None if rng.random() < 0.1 else rng.randrange(1 << 40) for _ in keys]
                st.value(var).put_many(pa.array(keys), pa.array(values, pa.int64()))
                for k, v in zip(keys, values):
                    if v is None:
                        model[var].pop(k, None)
                    else:
                        model[var][k] = v
            tkeys = rng.sample(names, 500)
            st.value("t").put_many(pa.array(tkeys), pa.array(range(500), pa.int64()))
            written_t.update({k: (i, now) for i, k in enumerate(tkeys)})
            if batch == 3:
                b.db.flush()   # these in SSTs, the later ones in the memtable
            if batch == 4:   # key group 5 dropped by a range delete, as a rescale does
                b.db.delete_range(bytes([0, 5]), bytes([0, 6]))
                for var in model.values():
                    for k in [k for k in var if key_group(k, 16, "string") == 5]:
                        del var[k]
                written_t = {k: v for k, v in written_t.items() if key_group(k, 16, "string") != 5}
            now_read = now + 1000
            reader = _states(b, specs, now=now_read, batch=batch + 100)
            asked = rng.sample(names, 2000) + ["absent-key"] + rng.sample(names, 50)   # repeats
            want = {"n": [model["n"].get(k) for k in asked], "n2": [model["n2"].get(k) for k in asked],
                    "t": [written_t[k][0] if k in written_t and written_t[k][1] + 5000 > now_read else None
                          for k in asked]}
            for var in ("n", "n2", "t"):
                monkeypatch.setattr(arrow_keys, "_SCAN_FROM", 1 << 40)   # never scans
                multi = reader.value(var).get_many(pa.array(asked)).to_pylist()

                def no_multi_get(*a, **k):
                    raise AssertionError("the multi-get ran where the scan should")

                monkeypatch.setattr(arrow_keys, "_SCAN_FROM", 1)
                monkeypatch.setattr(arrow_keys, "_SCAN_RATIO", 1 << 40)   # always scans
                monkeypatch.setattr(arrow_keys, "key_order", no_multi_get)
                scanned = _states(b, specs, now=now_read, batch=batch + 100).value(var).get_many(
                    pa.array(asked)).to_pylist()
                monkeypatch.undo()
                assert scanned == multi == want[var], (seed, batch, var)
    finally:
        b.close()


def test_a_scan_that_finds_more_than_the_estimate_said_stops_and_multi_gets(backend, monkeypatch):
    """RocksDB's key estimate subtracts every delete, also of keys that were never there, so it can say a
    DB holds a fraction of what it does: the scan reads at most 4 entries per key asked, then the
    multi-get runs, and the values are the same."""
    from sparksteward.state.typed import arrow_keys

    specs = [value_state("n", "bigint")]
    keys = [f"user-{i:05d}" for i in range(12000)]
    _states(backend, specs).value("n").put_many(pa.array(keys), pa.array(range(12000), pa.int64()))
    absent = [f"gone-{i:05d}" for i in range(6000)]
    _states(backend, specs, batch=2).value("n").put_many(pa.array(absent), pa.nulls(6000, pa.int64()))
    backend.db.flush()
    held = backend.db.property_int_value("rocksdb.estimate-num-keys")
    asked = keys[::8]   # 1,500 keys: a scan budget of 6,000 entries, the estimate under it, 12,000 there
    assert held <= len(asked) * arrow_keys._SCAN_RATIO < 12000, held
    multi_gets = []
    real_order = arrow_keys.key_order
    monkeypatch.setattr(arrow_keys, "key_order", lambda view, raw: multi_gets.append(len(raw)) or real_order(view, raw))
    got = _states(backend, specs, batch=3).value("n").get_many(pa.array(asked)).to_pylist()
    assert got == list(range(0, 12000, 8)) and multi_gets == [1500]


def test_on_read_and_write_moves_the_expiry_on_a_read(backend):
    specs = [value_state("c", "bigint", ttl=5, ttl_update="on_read_and_write"), value_state("w", "bigint", ttl=5)]
    _states(backend, specs, now=T0).value("c").update("k", 1)
    _states(backend, specs, now=T0).value("w").update("k", 1)
    read = _states(backend, specs, now=T0 + 4000, batch=2)
    assert read.value("c").get("k") == 1 and read.value("w").get("k") == 1
    after = _states(backend, specs, now=T0 + 8000, batch=3)
    assert after.value("c").get("k") == 1          # the read at T0 + 4 s moved its expiry to T0 + 9 s
    assert after.value("w").get("k") is None       # on write only: expired at T0 + 5 s


def test_the_sweep_removes_what_expired_through_the_index(backend):
    specs = [value_state("c", "bigint", ttl=5), list_state("l", "bigint", ttl=5)]
    st = _states(backend, specs, now=T0)
    keys = [f"u{i}" for i in range(1000)]
    st.value("c").put_many(keys, pa.array(range(1000), pa.int64()))
    st.list("l").append_many(keys, pa.array(range(1000), pa.int64()))
    _states(backend, specs, now=T0 + 2000, batch=2).value("c").update("u7", 70)   # written again: lives on
    assert sweep_expired(backend, T0 + 4999).deleted == 0
    first = sweep_expired(backend, T0 + 5000, max_entries=500)
    assert first.deleted + first.stale == 500 and first.more
    rest = sweep_expired(backend, T0 + 5000, start=3)
    assert not rest.more and (first.deleted + rest.deleted, first.stale + rest.stale) == (1999, 1)
    left = [k for k, _ in backend.iter_raw()]
    assert len(left) == 2    # u7's value and its newer index key
    assert _states(backend, specs, now=T0 + 5000, batch=3).value("c").get("u7") == 70
    assert sweep_expired(backend, T0 + 7000).deleted == 1 and list(backend.iter_raw()) == []


def test_an_append_and_a_put_cost_the_same_into_a_large_collection(backend):
    specs = [list_state("l", "bigint"), map_state("m", "bigint", "bigint")]
    st = _states(backend, specs)
    st.list("l").append_many(["big"] * 100_000, pa.array(range(100_000), pa.int64()))
    st.map("m").put_many(["big"] * 100_000, pa.array(range(100_000), pa.int64()), pa.array(range(100_000), pa.int64()))
    st.list("l").extend("small", range(10))
    st.map("m").put_all("small", {i: i for i in range(10)})
    backend.db.flush()

    def timed(fn):
        best = float("inf")
        for _ in range(3):
            began = time.perf_counter()
            for i in range(2000):
                fn(i)
            best = min(best, time.perf_counter() - began)
        return best

    big_append = timed(lambda i: st.list("l").append("big", i))
    small_append = timed(lambda i: st.list("l").append("small", i))
    big_put = timed(lambda i: st.map("m").put("big", 200_000 + i, i))
    small_put = timed(lambda i: st.map("m").put("small", 200_000 + i, i))
    big_get = timed(lambda i: st.map("m").get("big", i * 37))
    small_get = timed(lambda i: st.map("m").get("small", i % 10))
    print(f"\n2000 appends: 100k-element list {big_append * 1000:.1f} ms, 10-element {small_append * 1000:.1f} ms; "
          f"puts: 100k-entry map {big_put * 1000:.1f} ms, 10-entry {small_put * 1000:.1f} ms; "
          f"gets {big_get * 1000:.1f} / {small_get * 1000:.1f} ms")
    assert big_append < 2 * small_append and big_put < 2 * small_put and big_get < 2 * small_get
    assert len(st.list("l").get("big")) == 106_000


def test_evolution_reads_old_versions_and_refuses_the_rest_by_name(backend):
    v1 = [value_state("s", "a bigint, b string"), value_state("n", "int")]
    rec1 = resolve(None, v1)
    TypedStates(backend, rec1, T0, 1).value("s").update("k", {"a": 1, "b": "x"})
    TypedStates(backend, rec1, T0, 1).value("n").update("k", 7)
    v2 = [value_state("s", "a bigint, c double"), value_state("n", "bigint")]    # drop b, add c, widen n
    rec2 = resolve(rec1, v2)
    assert {n: v["current"] for n, v in rec2["variables"].items()} == {"n": 2, "s": 2}
    st2 = TypedStates(backend, rec2, T0, 2)
    assert st2.value("s").get("k") == {"a": 1, "c": None} and st2.value("n").get("k") == 7
    st2.value("s").update("j", {"a": 2, "c": 0.5})
    assert st2.value("s").get_many(["k", "j"]).to_pylist() == [{"a": 1, "c": None}, {"a": 2, "c": 0.5}]
    assert resolve(rec2, v2) == {**rec2, "dropped": []}      # the same declaration keeps its version
    for bad, match in [
        (value_state("n", "int"), r"'n' cannot be read as declared: version 2 of its values has type int64 and the "
                                  r"new declaration int32"),
        (value_state("s", "a string, c double"), "field 'a' changed from int64 to string"),
        (list_state("s", "bigint"), "'s' was a value state and is now declared a list state"),
        (value_state("s", "a bigint, b bigint"), "version 1 of its values .* field 'b' changed from string to int64"),
    ]:
        with pytest.raises(StateSchemaError, match=match):
            resolve(rec2, [bad], state="counts")
    rec3 = resolve(rec2, [], delete=["s"])
    assert list(rec3["variables"]) == ["n"] and rec3["dropped"] == ["s"]
    assert drop_variables(backend, rec3["dropped"]) == 3 * M
    assert TypedStates(backend, rec2, T0, 3).value("s").get("j") is None
    assert variables_of(rec3)["n"].types == {1: pa.int32(), 2: pa.int64()}


def test_values_an_untyped_view_wrote_are_read_as_declared(backend):
    backend.value("c").update("k", 5)
    backend.list("l").update("k", [1, 2])
    backend.map("m").put("k", "x", 3)
    st = _states(backend, [value_state("c", "bigint"), list_state("l", "bigint"), map_state("m", "string", "bigint")],
                 batch=2)
    st.list("l").append("k", 3)
    assert st.value("c").get("k") == 5 and st.value("c").get_many(["k"]).to_pylist() == [5]
    assert st.list("l").get("k") == [1, 2, 3] and st.list("l").get_many(["k"]).to_pylist() == [[1, 2, 3]]
    assert st.map("m").items("k") == [("x", 3)]


def test_hostile_declarations_from_a_peer_are_refused_by_name():
    """What a client sends in state.register: malformed, deeply nested or oversized declarations get
    a StateSchemaError naming them, never a RecursionError or a KeyError from inside."""
    from sparksteward.state.declared import StateSpec

    deep: dict = {"struct": [{"name": "a", "type": "int64"}]}
    for _ in range(5000):
        deep = {"struct": [{"name": "a", "type": deep}]}
    for bad, match in [
        ({"name": "x", "kind": "value", "type": deep}, "not one this version reads"),
        ({"name": "x", "kind": "value", "type": {"struct": "nope"}}, "not one this version reads"),
        ({"name": "x", "kind": "value", "type": {"struct": [{"name": "a"}] * 2000}}, "not one this version reads"),
        ({"name": "x", "kind": "value"}, "malformed"),
        ({"name": "../x", "kind": "value", "type": "int64"}, "must be 1-100 letters"),
        ({"name": "x", "kind": "queue", "type": "int64"}, "kind 'queue' is not one of"),
        ({"name": "x", "kind": "value", "type": "int64", "ttl_ms": "soon"}, "malformed"),
        ("not an object", "must be an object"),
    ]:
        with pytest.raises(StateSchemaError, match=match):
            StateSpec.from_json(bad)
    with pytest.raises(StateSchemaError, match="format"):
        variables_of({"format": 99, "variables": {}})


def _names_in(backend):
    """The state names of every key in the DB, expiry-index keys included (by the entry they index)."""
    from sparksteward.state.encoding import split_key

    return [split_key(k[:2] + k[11:] if k[2:3] == KIND_EXPIRY else k)[2] for k, _ in backend.iter_raw()]


def test_a_dropped_name_declared_anew_never_reads_its_old_bytes(backend):
    """Issue 35 item 11: a drop stays pending in the record (through a second open with the same
    delete_states, an open without them, and what a checkpoint records) until the tasks that ran it
    completed a checkpoint; a name declared again after its drop takes the next schema version, and
    stored bytes of its old versions (a drop that has not run yet) read as absent, never as the new
    type: the string 'abcd' once came back as the bigint 7233733595238498308."""
    old = [value_state("x", "string"), list_state("l", "string"), map_state("m", "string", "string"),
           value_state("n", "bigint")]
    rec1 = resolve(None, old)
    st = TypedStates(backend, rec1, T0, 1)
    st.value("x").update("k", "abcd")
    st.list("l").append("k", "abcd")
    st.map("m").put("k", "abcd", "abcd")
    st.value("n").update("k", 1)
    rec2 = resolve(rec1, [], delete=["x", "l", "m"])
    assert rec2["dropped"] == ["l", "m", "x"] and list(rec2["variables"]) == ["n"]
    assert resolve(rec2, [], delete=["x", "l", "m"])["dropped"] == ["l", "m", "x"]   # a second open keeps it
    assert resolve(rec2, [value_state("n", "bigint")])["dropped"] == ["l", "m", "x"]   # so does an open without
    from sparksteward.state.declared import drops_ran, recorded_form

    kept = recorded_form(rec2)          # what a checkpoint records: the drops, still pending
    assert kept is not None and "dropped" not in kept
    assert resolve(kept, [])["dropped"] == ["l", "m", "x"]
    assert recorded_form(resolve(None, [], delete=["x"])) is None   # nothing declared, nothing to drop
    new = [value_state("x", "bigint"), list_state("l", "bigint"), map_state("m", "string", "bigint")]
    rec3 = resolve(kept, new)           # declared anew before the drop ran: the bytes are still there
    assert {n: v["current"] for n, v in rec3["variables"].items()} == {"l": 2, "m": 2, "n": 1, "x": 2}
    st3 = TypedStates(backend, rec3, T0, 2)
    x, lst, m = st3.value("x"), st3.list("l"), st3.map("m")
    assert x.get("k") is None and x.get_many(["k"]).to_pylist() == [None] and not x.bind("k").exists()
    assert lst.get("k") == [] and lst.get_many(["k"]).to_pylist() == [[]]
    assert m.get("k", "abcd") is None and not m.contains("k", "abcd") and m.items("k") == []
    assert m.get_many(["k"], ["abcd"]).to_pylist() == [None] and m.items_many(["k"]).to_pylist() == [[]]
    x.update("k", 5)
    lst.append("k", 7)
    m.put("k", "abcd", 9)
    assert x.get("k") == 5 and lst.get("k") == [7] and m.items("k") == [("abcd", 9)]
    assert x.get_many(["k"]).to_pylist() == [5] and lst.get_many(["k"]).to_pylist() == [[7]]
    # once the tasks that ran the drop completed a checkpoint: no longer pending, its versions stay taken
    done = drops_ran(rec2, {"x", "l", "m"})
    assert done["dropped"] == [] and resolve(recorded_form(done), [])["dropped"] == []
    assert drops_ran(rec2, {"x"})["dropped"] == ["l", "m"]
    again = resolve(recorded_form(done), [value_state("x", "double")])
    assert again["variables"]["x"]["current"] == 2 and again["dropped"] == []
    gone = resolve(again, [], delete=["x"])    # dropped twice: the versions of both lives stay taken
    assert resolve(recorded_form(drops_ran(gone, {"x"})), [value_state("x", "string")])["variables"]["x"][
        "current"] == 3
    with pytest.raises(StateSchemaError, match="both declared and in delete_states"):
        resolve(kept, [value_state("x", "bigint")], delete=["x"])


def test_a_drop_removes_the_variables_expiry_index_keys_too(backend):
    """Issue 35 item 15: dropping variables with a TTL (up to 100 years) deletes their expiry-index keys
    with their entries; another variable's index keys stay."""
    keys = [f"k{i:03d}" for i in range(80)]
    specs = [value_state("v", "bigint", ttl=dt.timedelta(days=100 * 365)), list_state("l", "bigint", ttl=3600),
             map_state("m", "string", "bigint", ttl=3600), value_state("kept", "bigint", ttl=3600)]
    rec = resolve(None, specs)
    st = TypedStates(backend, rec, T0, 1)
    st.value("v").put_many(keys, list(range(80)))
    st.value("v").update("one", 1)
    st.list("l").append_many(keys, list(range(80)))
    st.list("l").append("one", 1)
    st.map("m").put_many(keys, keys, list(range(80)))
    st.map("m").put("one", "a", 1)
    st.value("kept").put_many(keys, list(range(80)))
    assert len(_index_keys(backend)) == 4 * 81 - 1
    dropped = resolve(rec, [], delete=["v", "l", "m"])["dropped"]
    drop_variables(backend, dropped)
    assert sorted(set(_names_in(backend))) == ["kept"]
    assert len(_index_keys(backend)) == 80
    assert sweep_expired(backend, T0 + 10 * 3600_000).deleted == 80   # the kept variable still expires


#: every type a declaration accepts: each DDL name, the Arrow types typed values store, structs of them
_UNITS = ("s", "ms", "us", "ns")
_ACCEPTED = [
    *(parse_ddl(n) for n in ("boolean", "tinyint", "smallint", "int", "bigint", "float", "double", "string",
                             "binary", "date", "timestamp", "timestamp_ntz", "a int, b string NOT NULL")),
    pa.bool_(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.date32(),
    pa.string(), pa.large_string(), pa.binary(), pa.large_binary(),
    *(pa.timestamp(u, tz=tz) for u in _UNITS for tz in (None, "UTC", "Europe/Paris", "+01:00")),
    pa.struct([("t", pa.timestamp("ms")), ("s", pa.large_string()), pa.field("b", pa.large_binary(), nullable=False),
               ("z", pa.timestamp("ns", tz="Asia/Tokyo")), ("d", pa.date32()), ("f", pa.float32())]),
]


def _sample(t):
    """One value of type ``t`` that every unit holds exactly."""
    if pa.types.is_struct(t):
        return {f.name: _sample(f.type) for f in t}
    if pa.types.is_timestamp(t):
        return dt.datetime(2026, 11, 25, 12, 30, 1, tzinfo=dt.timezone.utc if t.tz else None)
    if pa.types.is_date(t):
        return dt.date(2026, 11, 25)
    if pa.types.is_boolean(t):
        return True
    if pa.types.is_integer(t):
        return 7
    if pa.types.is_floating(t):
        return 1.5
    return b"ab" if pa.types.is_binary(t) or pa.types.is_large_binary(t) else "ab"


def _accepted_with_pyspark():
    try:
        from pyspark.sql import types as T
    except ImportError:   # pragma: no cover - pyspark is a test dependency
        return []
    return [T.BooleanType(), T.ByteType(), T.ShortType(), T.IntegerType(), T.LongType(), T.FloatType(),
            T.DoubleType(), T.StringType(), T.BinaryType(), T.DateType(), T.TimestampType(), T.TimestampNTZType(),
            T.StructType([T.StructField("a", T.LongType()), T.StructField("t", T.TimestampType(), False)])]


def test_every_accepted_type_reopens_with_the_same_declaration_at_the_same_version(backend):
    """Issue 35 item 13: the record normalises a type (timestamps to microseconds, large strings to
    strings); opening again with the very same declaration, as objects or as the JSON a client sends,
    keeps every variable at its version for every type a declaration accepts (map keys included), and
    reads back what was written."""
    declared = [*_ACCEPTED, *_accepted_with_pyspark()]
    for i, t in enumerate(declared):
        specs = [value_state("v", t), list_state("l", t), map_state("m", t, t), map_state("mv", "string", t)]
        rec = resolve(None, specs)
        assert resolve(rec, specs) == rec, t
        assert resolve(rec, [s.to_json() for s in specs]) == rec, t
        assert resolve(resolve(rec, [value_state("other", "bigint")]), specs)["variables"] == {
            **rec["variables"], "other": resolve(None, [value_state("other", "bigint")])["variables"]["other"]}, t
        arrow = specs[0].type
        sample = pa.array([_sample(arrow)], arrow)
        key = f"t{i}"
        st = TypedStates(backend, rec, T0, i + 1)
        st.value("v").put_many([key], sample)
        st.map("m").put_many([key], sample, sample)
        reopened = TypedStates(backend, resolve(rec, specs), T0, i + 1)
        got = reopened.value("v").get_many([key])
        assert got.equals(sample.cast(got.type)), t
        assert reopened.map("m").get_many([key], sample).equals(got), t


def test_a_nullable_field_turned_not_null_is_refused_naming_the_variable_field_and_fix(backend):
    """Issue 35 item 14: old values may hold nulls in a nullable field, which a NOT NULL type would
    hand downstream as if it could not; the other way (NOT NULL to nullable) is accepted."""
    rec = resolve(None, [value_state("last", "v int, note string")])
    TypedStates(backend, rec, T0, 1).value("last").update("k", {"v": 1, "note": None})
    with pytest.raises(StateSchemaError, match=r"keyed state 'counts': state variable 'last' cannot be read as "
                                               r"declared: .*field 'note' was nullable and is now declared NOT NULL"
                                               r".*declare 'note' without NOT NULL"):
        resolve(rec, [value_state("last", "v int, note string NOT NULL")], state="counts")
    strict = resolve(None, [value_state("last", "v int NOT NULL")])
    loose = resolve(strict, [value_state("last", "v bigint")])
    assert loose["variables"]["last"]["current"] == 2


def test_the_default_value_state_declared_is_typed_in_both_forms_and_only_from_a_first_checkpoint(tmp_path):
    """Decision 0027: value_state("value", type) types the default (state.get()/update() per key,
    state.get_many/put_many in the Arrow form); a state whose checkpoints hold JSON defaults refuses it
    by name, and one typed from its first checkpoint keeps the type when reopened without declarations."""
    import pandas as pd
    import pyarrow.compute as pc
    from sparksteward.testing import KeyedStateHarness

    def per_key(key, rows, state):
        old = state.get()   # a dict of the declared struct, or None
        n = (old["n"] if old else 0) + len(rows)
        state.update({"n": n, "s": (old["s"] if old else 0) + int(rows["v"].sum())})
        return key, n

    def vectorized(keys, rows, state):
        g = rows.group_by("k").aggregate([("v", "count"), ("v", "sum")]).combine_chunks()
        old = state.get_many(g["k"])   # an Arrow struct array, null where absent
        assert old.type == pa.struct([("n", pa.int64()), ("s", pa.int64())])
        n = pc.add(pc.fill_null(pc.struct_field(old, "n"), 0), g["v_count"])
        s = pc.add(pc.fill_null(pc.struct_field(old, "s"), 0), g["v_sum"])
        state.put_many(g["k"], pa.StructArray.from_arrays([n.combine_chunks(), s.combine_chunks()], names=["n", "s"]))
        return pa.table({"k": g["k"], "n": n})

    batch = pd.DataFrame({"k": ["a", "b", "a"], "v": [1, 2, 3]})
    for form, fn in (("pandas", per_key), ("arrow", vectorized)):
        h = KeyedStateHarness(fn, key="k", schema="k string, n long", form=form, directory=tmp_path / form,
                              states=[value_state("value", "n bigint, s bigint")])
        for _ in range(2):
            out = h.process(batch)
        out = out if isinstance(out, pa.Table) else pa.Table.from_pandas(out)
        assert sorted(zip(out["k"].to_pylist(), out["n"].to_pylist())) == [("a", 4), ("b", 2)], form
        assert h.value("value").get_many(["a", "b", "c"]).to_pylist() == [{"n": 4, "s": 8}, {"n": 2, "s": 4}, None]
        h.restart()   # reopened without declarations: the record keeps the default typed
        assert h.value("value").get("a") == {"n": 4, "s": 8}

    recorded = resolve(None, [value_state("value", "bigint")])
    assert resolve(recorded, [], checkpointed=True) == recorded   # typed from its first checkpoint: stays typed
    with pytest.raises(StateSchemaError, match=r"keyed state 's': its default value state is untyped \(JSON\) in "
                                               r"the checkpoints it has"):
        resolve(None, [value_state("value", "bigint")], state="s", checkpointed=True)
    hand_edited = {**recorded, "variables": {"value": {**recorded["variables"]["value"], "kind": "list"}}}
    with pytest.raises(StateSchemaError, match="'value' is the default value state"):   # a record edited by hand
        resolve(hand_edited, [], checkpointed=True)
    with pytest.raises(StateSchemaError, match="default value state is untyped"):   # declared others before
        resolve(resolve(None, [value_state("c", "bigint")]), [value_state("value", "bigint")], checkpointed=True)


def test_put_many_of_a_struct_state_takes_a_table_of_its_fields(backend):
    st = _states(backend, [value_state("agg", "n bigint, s double")])
    agg = st.value("agg")
    agg.put_many(["a", "b"], pa.table({"s": [1.5, 2.0], "n": pa.chunked_array([[1], [2]]), "extra": [0, 0]}))
    assert agg.get_many(["a", "b"]).to_pylist() == [{"n": 1, "s": 1.5}, {"n": 2, "s": 2.0}]
    with pytest.raises(StateEncodingError, match=r"state 'agg' is declared .* lacks columns \['s'\]"):
        agg.put_many(["a"], pa.table({"n": [1]}))


def test_an_append_goes_after_elements_of_later_batches_and_never_replaces_one(backend):
    """A list restored from a savepoint of a state that ran more batches (or bootstrapped) holds elements
    of sequences above the appending batch's: appends go after them, one at a time and many at once,
    in the per-key and the Arrow paths alike (issue 39's review: they used to overwrite them)."""
    spec = [list_state("l", "bigint")]
    later = _states(backend, spec, batch=7).list("l")
    later.extend("a", [1, 2])
    later.append_many(["b", "b"], [5, 6])
    early = _states(backend, spec, batch=0).list("l")
    early.append("a", 3)
    early.extend("a", list(range(10, 20)))   # the Arrow column path
    early.append_many(["b", "c", "b"], [7, 8, 9])
    assert early.get("a") == [1, 2, 3, *range(10, 20)]
    assert early.get("b") == [5, 6, 7, 9] and early.get("c") == [8]
    again = _states(backend, spec, batch=1).list("l")   # a batch after it, still below batch 7's
    again.append("b", 10)
    assert again.get("b") == [5, 6, 7, 9, 10]
