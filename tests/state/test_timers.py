"""Timers without Spark (state/timers.py, state/firing.py, decision 0028), on a real RocksDB through the
harness: processing-time and event-time timers fire after the input for keys with and without input,
once; deletion and listing; a timer a callback registers at the batch's time fires in the next batch,
never in a loop; the due ones are found by a range scan, whatever the number of keys; the Arrow form
gets all of a subtask's fired timers in one table; bad calls are refused by name."""

from __future__ import annotations

import datetime as dt

import pandas as pd
import pyarrow as pa
import pytest
from sparksteward import value_state
from sparksteward.errors import StateError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.timers import Timer, Timers, due
from sparksteward.testing import KeyedStateHarness

T = 1_800_000_000_000
GAP = 30 * 60_000   # a session closes 30 minutes after the key's last row


def count_and_arm(key, rows, state):
    n = (state.get() or 0) + len(rows)
    state.update(n)
    for t in state.timers.list():
        state.timers.delete(t.at, t.time)
    state.timers.register(state.processing_time_ms + GAP)


def close(key, timers, state):
    n = state.get()
    state.clear()
    return pd.DataFrame({"k": [key], "n": [n], "at": [timers[0].at]})


def test_processing_time_timers_fire_for_keys_without_input_once_and_after_deletes():
    with KeyedStateHarness(count_and_arm, key="k", schema="k string, n bigint, at bigint", time=T,
                           on_timer=close) as h:
        assert h.process(pd.DataFrame({"k": ["a", "a", "b"]})).empty
        assert h.timers("a") == [Timer("processing", T + GAP)]
        h.advance(dt.timedelta(minutes=20))
        h.process(pd.DataFrame({"k": ["b"]}))          # b's timer moves to T + 20 + 30 minutes
        assert h.timers("b") == [Timer("processing", T + 50 * 60_000)]
        h.advance(dt.timedelta(minutes=10))             # T + 30 min: a's timer is due, a has no input
        out = h.process()
        assert out.to_dict("records") == [{"k": "a", "n": 2, "at": T + GAP}] and h.last_fired == 1
        assert h.timers("a") == []
        assert h.process().empty and h.last_fired == 0  # fired once
        h.advance(dt.timedelta(minutes=20))
        assert h.process().to_dict("records") == [{"k": "b", "n": 2, "at": T + 50 * 60_000}]


def test_a_timer_registered_by_its_callback_at_the_batch_time_fires_in_the_next_batch():
    def again(key, timers, state):
        state.timers.register(state.processing_time_ms)   # due now: next batch, not this one
        return pd.DataFrame({"k": [key], "n": [len(timers)]})

    def arm(key, rows, state):
        state.timers.register(T)
        state.timers.register(T - 5)

    with KeyedStateHarness(arm, key="k", schema="k string, n bigint", time=T, on_timer=again) as h:
        out = h.process(pd.DataFrame({"k": ["x"]}))     # registered during the input: due at once
        assert out.to_dict("records") == [{"k": "x", "n": 2}]
        assert h.process().to_dict("records") == [{"k": "x", "n": 1}]
        assert h.process().to_dict("records") == [{"k": "x", "n": 1}]


def test_event_time_timers_fire_when_the_watermark_passes_and_are_refused_without_event_time():
    def arm(key, rows, state):
        state.timers.register(int(rows["ts"].max().timestamp() * 1000) + 10_000, time="event")

    def fired(key, timers, state):
        return pd.DataFrame({"k": [key], "at": [timers[0].at], "wm": [state.watermark_ms]})

    with KeyedStateHarness(arm, key="k", schema="k string, at bigint, wm bigint", event_time="ts",
                           on_timer=fired) as h:
        h.process(pd.DataFrame({"k": ["a"], "ts": pd.to_datetime([T], unit="ms", utc=True)}))
        h.process(pd.DataFrame({"k": ["b"], "ts": pd.to_datetime([T + 9_000], unit="ms", utc=True)}))
        assert h.last_fired == 0                                   # watermark T: a's T + 10 s not yet
        out = h.process(pd.DataFrame({"k": ["c"], "ts": pd.to_datetime([T + 10_000], unit="ms", utc=True)}))
        assert out.empty                                           # this batch ran at watermark T + 9 s
        out = h.process()                                          # at T + 10 s: a's fires, b's not
        assert out.to_dict("records") == [{"k": "a", "at": T + 10_000, "wm": T + 10_000}]

    with KeyedStateHarness(arm, key="k", schema="k string") as h, \
            pytest.raises(StateError, match="open it with event_time=<column>"):
        h.process(pd.DataFrame({"k": ["a"], "ts": pd.to_datetime([T], unit="ms", utc=True)}))


def test_the_arrow_form_gets_every_fired_timer_of_the_subtask_in_one_table():
    calls = []

    def arm(keys, rows, state):
        state.timers.register(keys, T + 1)
        state.timers.register(keys.slice(0, 1), pa.array([T + 2], pa.int64()))
        state.put_many(keys, [1] * len(keys))

    def fired(keys, expired, state):
        calls.append(expired.num_rows)
        return pa.table({"k": expired.column("key"), "at": expired.column("at"),
                         "n": state.get_many(expired.column("key"))})

    with KeyedStateHarness(arm, key="k", schema="k string, at bigint, n bigint", form="arrow", time=T,
                           on_timer=fired, states=[value_state("value", "bigint")]) as h:
        h.process(pa.table({"k": ["a", "b", "c"]}))
        h.advance(0.002)
        out = h.process()
        assert calls == [4]
        assert sorted(zip(out.column("k").to_pylist(), out.column("at").to_pylist())) == \
            [("a", T + 1), ("a", T + 2), ("b", T + 1), ("c", T + 1)]
        assert out.column("n").to_pylist() == [1, 1, 1, 1]
        assert h.process().num_rows == 0 and calls == [4]


def test_due_timers_are_found_by_a_range_scan_not_a_scan_of_the_keys(tmp_path):
    """100k keys with timers far ahead and 3 due: due() reads only the due ones (their key groups' ranges)."""
    b = RocksDBStateBackend(tmp_path / "db", KeyGroupRange(0, 16), 16, "long")
    try:
        timers = Timers(b)
        keys = list(range(100_000))
        timers.register(keys, T + 10 ** 9)
        timers.register([7, 70_000, 99_999], T - 1)
        timers.register([5], dt.datetime.fromtimestamp(T / 1000, tz=dt.timezone.utc))
        found = sorted((t.at, raw) for _, raw, t in due(b, T, None))
        assert [a for a, _ in found] == [T - 1] * 3 + [T]
        assert timers.list([5, 6]).to_pylist() == [{"key": 5, "time": "processing", "at": T},
                                                   {"key": 5, "time": "processing", "at": T + 10 ** 9},
                                                   {"key": 6, "time": "processing", "at": T + 10 ** 9}]
        with pytest.raises(StateError, match="timer time='wall' must be 'processing'"):
            timers.register([1], T, time="wall")
        with pytest.raises(StateError, match="timer at='soon' must be epoch milliseconds"):
            timers.register([1], "soon")
        with pytest.raises(StateError, match="2 keys but 3 times"):
            timers.register([1, 2], [T, T, T])
    finally:
        b.close()


def test_the_harness_bootstraps_an_initial_state_with_timers_before_the_first_batch():
    def init(key, rows, state):
        state.update(int(rows["n"].sum()))
        state.timers.register(T + 1000)

    def add(key, rows, state):
        state.update((state.get() or 0) + len(rows))
        return pd.DataFrame({"k": [key], "n": [state.get()], "at": [0]})

    with KeyedStateHarness(add, key="k", schema="k string, n bigint, at bigint", time=T, on_timer=close) as h:
        h.initial_state(pd.DataFrame({"k": ["a", "a", "b"], "n": [5, 6, 7]}), init)
        out = h.process(pd.DataFrame({"k": ["a"]}))
        assert out.to_dict("records") == [{"k": "a", "n": 12, "at": 0}]
        h.advance(1)
        assert sorted(map(tuple, h.process()[["k", "n"]].values.tolist())) == [("a", 12), ("b", 7)]
        with pytest.raises(StateError, match="2 batches ran already"):
            h.initial_state(pd.DataFrame({"k": ["c"], "n": [1]}), init)


def test_a_key_whose_state_ttl_expires_loses_its_timers_but_a_timer_due_first_fires():
    """Issue 38: timers are dropped with their key when TTL expires it. ``a`` expires with a timer an hour
    away (dropped, never fires); ``b``'s timer is due in the batch its state expires in (it fires first,
    then goes); ``c`` also has a variable without TTL, so it keeps its timer."""
    states = [value_state("seen", "bigint", ttl=60), value_state("forever", "bigint")]

    def arm(key, rows, state):
        state.value("seen").update(len(rows))
        if key == "c":
            state.value("forever").update(1)
        state.timers.register(state.processing_time_ms + (90_000 if key == "b" else 3_600_000))

    def fired(key, timers, state):
        return pd.DataFrame({"k": [key], "at": [timers[0].at]})

    with KeyedStateHarness(arm, key="k", schema="k string, at bigint", states=states, time=T,
                           on_timer=fired) as h:
        h.process(pd.DataFrame({"k": ["a", "b", "c"]}))
        h.advance(dt.timedelta(seconds=30))
        assert h.process().empty and h.last_sweep.timers_dropped == 0   # nothing expired yet
        h.advance(dt.timedelta(seconds=70))   # T + 100 s: all three 'seen' expired, b's timer (T + 90 s) due
        assert h.process().to_dict("records") == [{"k": "b", "at": T + 90_000}]
        assert h.last_sweep.deleted == 3 and h.last_sweep.timers_dropped == 1   # a's; b's fired already
        assert h.timers("a") == [] and h.timers("b") == []
        assert h.timers("c") == [Timer("processing", T + 3_600_000)]
        h.advance(dt.timedelta(hours=1))
        assert h.process().to_dict("records") == [{"k": "c", "at": T + 3_600_000}]   # a fires nothing


@pytest.mark.parametrize("key_type", ["long", "int", "string", "binary"])
def test_the_vectorized_firing_decodes_every_key_type_and_holds_the_keys_it_is_told_to(tmp_path, key_type):
    """The Arrow form's firing (one listing per key group and domain, a range delete of what fired): keys of
    every type come back as they were registered; a held key (its rows deferred by an unaligned cut) keeps
    its due timer, which fires in a later batch; the rest fire once and are gone, later ones stay."""
    from sparksteward.state.firing import fire
    from sparksteward.state.typed import TypedStates

    make = {"long": lambda i: i - 2, "int": lambda i: i, "string": lambda i: f"k{i}é", "binary": lambda i: b"\x00%d" % i}
    keys = [make[key_type](i) for i in range(40)]
    b = RocksDBStateBackend(tmp_path / "db", KeyGroupRange(0, 16), 16, key_type)
    seen = []

    def on_timer(ks, expired, state):
        seen.append(expired.to_pylist())

    try:
        timers = Timers(b, event_time=True)
        timers.register(keys, T - 5)
        timers.register(keys[:10], T - 3, time="event")
        timers.register(keys[:4], T + 1000)   # not due
        states = TypedStates(b, None, T, 1, T, event_time=True)
        counters = {}
        list(fire(on_timer, "arrow", b, states, pa.schema([]), counters, held=lambda: {keys[0]}))
        fired = seen.pop()
        assert counters["timers_fired"] == len(fired) == 40 - 1 + 10 - 1
        assert sorted((r["key"], r["time"], r["at"]) for r in fired) == sorted(
            [(k, "processing", T - 5) for k in keys[1:]] + [(k, "event", T - 3) for k in keys[1:10]])
        assert sorted(t.at for t in timers.bind(keys[0]).list()) == [T - 5, T - 3, T + 1000]   # held
        assert [t.at for t in timers.bind(keys[1]).list()] == [T + 1000]
        assert sorted(t.at for _, _, t in due(b, T, T)) == [T - 5, T - 3]   # only the held key's are left due
        list(fire(on_timer, "arrow", b, TypedStates(b, None, T, 2, T, event_time=True), pa.schema([]), counters))
        assert sorted((r["key"], r["at"]) for r in seen.pop()) == [(keys[0], T - 5), (keys[0], T - 3)]
        list(fire(on_timer, "arrow", b, TypedStates(b, None, T, 3, T, event_time=True), pa.schema([]), counters))
        assert not seen and counters["timers_fired"] == 0 and [t.at for t in timers.bind(keys[3]).list()] == [T + 1000]
    finally:
        b.close()


def test_a_by_time_key_parses_back_to_its_key_and_timer():
    """The offline reader's decoding (``__timers__``) of the stored by-time key, both domains."""
    from sparksteward.state.timers import Timer, _by_time, _domain, parse_by_time

    for time_, at in (("processing", 1_764_000_000_123), ("event", -5), ("event", 0)):
        assert parse_by_time(_by_time(b"\x00\x07", _domain(time_), at, b"user-1")) == (b"user-1", Timer(time_, at))
