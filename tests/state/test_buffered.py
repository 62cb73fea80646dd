"""The per-key form's buffered writes (state/buffered.py): the current key reads its own writes of
every kind while they wait in one write batch, nothing is written when the function fails, and the
subtask's WAL is a fraction of what one record per update makes (ZSTD compresses a batch as a whole)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.declared import list_state, map_state, resolve, value_state
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.runner import KeyedStateAccess, KeyState, run_pandas
from sparksteward.state.snapshot import wal_bytes
from sparksteward.state.typed import TypedStates

M = 64
SPECS = [value_state("c", "bigint"), list_state("l", "bigint"), map_state("m", "string", "bigint")]


def _backend(path):
    return RocksDBStateBackend(path, KeyGroupRange(0, M), M, "string")


def _exercise(state: KeyState) -> tuple:
    """Writes and reads of every kind for one key, reading its own writes back."""
    lst, mp, val = state.list("l"), state.map("m"), state.value("c")
    lst.extend([1, 2, 3])
    assert lst.get() == [1, 2, 3]
    lst.clear()
    lst.append(4)
    mp.put_all({"x": 1, "y": 2})
    mp.remove("x")
    mp.put("z", 3)
    val.update((val.get() or 0) + 1)
    state.update({"seen": True})
    state.map("legacy").put("k", 1)
    return lst.get(), sorted(mp.items()), val.get(), state.get(), state.map("legacy").items()


def test_the_current_key_reads_its_own_writes_and_the_batch_lands_at_the_end(tmp_path):
    b = _backend(tmp_path / "s")
    typed = TypedStates(b, resolve(None, SPECS), 0, 1)
    access = KeyedStateAccess(b, states=typed)
    with b.buffered() as store:
        for key in ("a", "b"):
            store.next_key()
            assert _exercise(KeyState(access, key)) == ([4], [("y", 2), ("z", 3)], 1, {"seen": True}, [("k", 1)])
        assert b.db.get(typed.value("c")._prefix("a")) is None      # still in the write batch
    for key in ("a", "b"):
        assert KeyState(access, key).list("l").get() == [4] and KeyState(access, key).value("c").get() == 1
    b.close()


def test_a_key_reads_its_stored_entries_merged_with_its_buffered_writes_in_order(tmp_path):
    """Stored list elements then buffered appends (they follow each other), and map entries whose
    buffered puts and removes fall before, between and after the stored ones (a merge)."""
    b = _backend(tmp_path / "s")
    typed = TypedStates(b, resolve(None, SPECS), 0, 1)
    access = KeyedStateAccess(b, states=typed)
    with b.buffered() as store:
        store.next_key()
        first = KeyState(access, "a")
        first.list("l").extend([1, 2])
        first.map("m").put_all({"b": 1, "d": 2, "f": 3})
    with b.buffered() as store:
        store.next_key()
        again = KeyState(access, "a")
        again.list("l").extend([3, 4])
        assert again.list("l").get() == [1, 2, 3, 4]
        again.map("m").put_all({"a": 0, "c": 5, "g": 6})
        again.map("m").remove("d")
        assert again.map("m").items() == [("a", 0), ("b", 1), ("c", 5), ("f", 3), ("g", 6)]
        again.list("l").clear()
        again.list("l").append(9)
        assert again.list("l").get() == [9]
    assert KeyState(access, "a").list("l").get() == [9]
    b.close()


def test_nothing_is_written_when_the_function_fails(tmp_path):
    b = _backend(tmp_path / "s")
    access = KeyedStateAccess(b, states=TypedStates(b, resolve(None, SPECS), 0, 1))
    with pytest.raises(RuntimeError), b.buffered() as store:
        store.next_key()
        KeyState(access, "a").value("c").update(5)
        raise RuntimeError("the function failed")
    assert KeyState(access, "a").value("c").get() is None and list(b.iter_raw()) == []
    b.close()


@pytest.mark.parametrize("declared", [False, True])
def test_buffered_per_key_writes_make_a_fraction_of_the_wal(tmp_path, declared):
    keys = [f"user-{i}" for i in range(20_000)]
    rows = pa.record_batch({"k": keys, "v": list(range(20_000))})
    schema = pa.schema([("k", pa.string()), ("n", pa.int64())])

    def fn(key, frame, state):
        if declared:
            state.value("c").update(int(frame["v"].sum()))
        else:
            state.update({"n": len(frame), "s": int(frame["v"].sum())})
        return

    sizes = {}
    for mode in ("buffered", "one record per update"):
        b = _backend(tmp_path / mode)
        typed = TypedStates(b, resolve(None, SPECS), 0, 1)
        if mode == "buffered":
            list(run_pandas(iter([rows]), "k", fn, b, schema, states=typed))
        else:
            access = KeyedStateAccess(b, states=typed)
            import pandas as pd

            for k, v in zip(keys, range(20_000)):
                fn(k, pd.DataFrame({"v": [v]}), KeyState(access, k))
        b.close()
        sizes[mode] = wal_bytes(b.db_path)
    print(f"\nWAL of 20k per-key updates ({'declared bigint' if declared else 'JSON'}): {sizes}")
    assert sizes["buffered"] * 3 < sizes["one record per update"]
