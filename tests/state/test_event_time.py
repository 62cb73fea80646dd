"""Event time without Spark (state/event_time.py, decision 0028): what a task does with each input batch
(late rows at or below the watermark dropped and counted, or flagged; the largest event time counted
over every row; timestamps of any unit and zone, dates and epoch ms), the bad inputs refused by name,
and the harness's watermark that advances as Spark's does and never goes back."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pandas as pd
import pyarrow as pa
import pytest
from sparksteward.checkpoint.begun import CheckpointTime, advanced_watermark
from sparksteward.errors import StateEncodingError, StateError
from sparksteward.state.event_time import LATE_COLUMN, EventTime, event_ms, judge
from sparksteward.testing import KeyedStateHarness

T = 1_800_000_000_000   # an event time in ms


def _batch(ms: list[int | None], keys: list[str] | None = None) -> pa.RecordBatch:
    ts = pa.array([None if m is None else m * 1000 for m in ms], pa.timestamp("us", "UTC"))
    return pa.record_batch([pa.array(keys or [f"k{i}" for i in range(len(ms))]), ts], names=["k", "ts"])


def test_late_rows_are_those_at_or_below_the_watermark_dropped_and_counted():
    counters: dict = {}
    out = list(judge(iter([_batch([T - 1, T, T + 1, None]), _batch([T - 5])]), EventTime("ts"), T, counters))
    kept = pa.Table.from_batches(out)
    assert kept.column("k").to_pylist() == ["k2", "k3"]       # T-1 and T are late; a null is never late
    assert counters == {"late_rows": 3, "max_event_ms": T + 1}   # late rows count towards the largest too


def test_late_rows_kept_are_flagged_and_without_a_watermark_nothing_is_late():
    counters: dict = {}
    out = list(judge(iter([_batch([T - 1, T + 1])]), EventTime("ts", late="keep"), T, counters))
    assert out[0].column(LATE_COLUMN).to_pylist() == [True, False]
    assert counters["late_rows"] == 1
    first: dict = {}
    out = list(judge(iter([_batch([1, 2])]), EventTime("ts"), None, first))
    assert out[0].num_rows == 2 and first == {"late_rows": 0, "max_event_ms": 2}


@pytest.mark.parametrize("array, expected", [
    (pa.array([T * 1_000_000], pa.timestamp("ns")), T),
    (pa.array([T // 1000], pa.timestamp("s", "Europe/Paris")), T),
    (pa.array([dt.date(2027, 1, 15)], pa.date32()), 1_800_000_000_000 - 1_800_000_000_000 % 86_400_000),
    (pa.array([T], pa.int64()), T),
])
def test_event_times_of_every_supported_type_are_epoch_ms(array, expected):
    batch = pa.record_batch([array], names=["ts"])
    if pa.types.is_date(array.type):
        expected = int(pd.Timestamp(array[0].as_py()).timestamp() * 1000)
    assert event_ms(batch, "ts").to_pylist() == [expected]


def test_a_missing_or_timeless_event_column_and_bad_options_are_refused_by_name():
    with pytest.raises(StateEncodingError, match="event-time column 'when' is not in the input"):
        list(judge(iter([_batch([T])]), EventTime("when"), None, {}))
    text = pa.record_batch([pa.array(["x"]), pa.array(["2027-01-01"])], names=["k", "ts"])
    with pytest.raises(StateEncodingError, match="'ts' is string: it must be a timestamp"):
        list(judge(iter([text]), EventTime("ts"), None, {}))
    with pytest.raises(StateError, match="watermark_delay='10m' must be seconds"):
        EventTime.of("ts", "10m")
    with pytest.raises(StateError, match="watermark_delay=-1 must be between"):
        EventTime.of("ts", -1)
    with pytest.raises(StateError, match="late='emit' must be 'drop'"):
        EventTime.of("ts", 0, "emit")
    with pytest.raises(StateError, match="event_time='' must name"):
        EventTime.of("", 0)
    assert EventTime.of("ts", dt.timedelta(minutes=10)).delay_ms == 600_000


def _meta(max_event_ms):   # advanced_watermark reads a completed record's properties only
    return SimpleNamespace(properties={"base": None} if max_event_ms is None else {"max_event_ms": max_event_ms})


def test_the_checkpoint_time_chooses_a_watermark_that_never_goes_back():
    assert advanced_watermark(_meta(T), 1000) == T - 1000
    assert advanced_watermark(_meta(None), 1000) is None and advanced_watermark(_meta(T), None) is None
    assert advanced_watermark(_meta("9"), 0) is None and advanced_watermark(_meta(1 << 60), 0) is None   # hostile
    before = CheckpointTime(T, T - 500)
    chosen = CheckpointTime.choose(T / 1000 - 10, [before, None], advanced=T - 1000)   # clock and events behind
    assert chosen == CheckpointTime(T, T - 500)
    assert CheckpointTime.choose(T / 1000, [before], advanced=T + 7).watermark_ms == T + 7
    assert CheckpointTime.choose(T / 1000).watermark_ms is None
    assert CheckpointTime.from_json(chosen.to_json()) == chosen
    assert CheckpointTime.from_json({"processing_ms": T}).watermark_ms is None   # a record from before watermarks
    with pytest.raises(ValueError, match="watermark_ms"):
        CheckpointTime(T, "soon")


def _count(key, rows, state):
    n = (state.get() or 0) + len(rows)
    state.update(n)
    late = int(rows[LATE_COLUMN].sum()) if LATE_COLUMN in rows else 0
    return pd.DataFrame({"k": [key], "n": [n], "wm": [state.watermark_ms if state.watermark_ms is not None else -1],
                         "late": [late]})


def test_the_harness_watermark_follows_the_batches_before_and_drops_late_rows():
    schema = "k string, n bigint, wm bigint, late bigint"
    with KeyedStateHarness(_count, key="k", schema=schema, event_time="ts", watermark_delay=10) as h:
        out = h.process(pd.DataFrame({"k": ["a", "a"], "ts": pd.to_datetime([T, T + 30_000], unit="ms", utc=True)}))
        assert out["wm"].tolist() == [-1] and out["n"].tolist() == [2]   # the first batch has no watermark
        assert h.watermark_ms == T + 20_000
        out = h.process(pd.DataFrame({"k": ["a", "a", "b"],
                                      "ts": pd.to_datetime([T + 20_000, T + 20_001, T + 5], unit="ms", utc=True)}))
        assert out.sort_values("k")["n"].tolist() == [3]                   # T+20000 and T+5 were late
        assert out["wm"].tolist() == [T + 20_000] and h.last_late_rows == 2
        assert h.watermark_ms == T + 20_000                                # T+20001-10s is behind: kept
        h.advance_watermark(T)                                             # backwards: nothing changes
        assert h.advance_watermark(T + 60_000) == T + 60_000


def test_the_harness_hands_late_rows_over_flagged_in_the_arrow_form_too():
    def fn(keys, rows, state):
        return pa.table({"k": ["all"], "late": [sum(rows.column(LATE_COLUMN).to_pylist())],
                         "wm": [state.watermark_ms or -1], "now": [state.processing_time_ms]})

    with KeyedStateHarness(fn, key="k", schema="k string, late bigint, wm bigint, now bigint", form="arrow",
                           event_time="ts", late="keep", time=T) as h:
        h.advance_watermark(T)
        out = h.process([{"k": "a", "ts": T - 1}, {"k": "b", "ts": T + 1}])
        assert out.to_pylist() == [{"k": "all", "late": 1, "wm": T, "now": T}]
        assert h.last_late_rows == 1 and h.watermark_ms == T + 1


def _last_seen(key, rows, state):
    state.value("last").update(int(rows["v"].max()))
    state.value("hits").update((state.value("hits").get() or 0) + len(rows))
    return


def test_event_time_ttl_expires_by_the_watermark_never_by_the_processing_time():
    """Processing time runs far ahead of the events (a replay of old data): the event-time variable
    expires only as the watermark passes its entries' expiry, the processing-time one only by the
    clock; before the first watermark an entry is stamped by the processing time (it lives at least
    its TTL) and nothing expires; each clock's sweep removes only its own."""
    from sparksteward import value_state

    now = T + 10 ** 10
    states = [value_state("last", "bigint", ttl=60, ttl_time="event"), value_state("hits", "bigint", ttl=3600)]

    def rows(k, ms, v=1):
        return pd.DataFrame({"k": [k], "ts": pd.to_datetime([ms], unit="ms", utc=True), "v": [v]})

    with KeyedStateHarness(_last_seen, key="k", schema="k string", states=states, time=now, event_time="ts") as h:
        h.process(rows("a", T))                        # no watermark yet: stamped now + 60 s
        h.process(rows("b", T + 30_000))               # runs at watermark T: stamped T + 60 s
        h.process(rows("c", T + 59_000))               # runs at T + 30 s
        assert h.watermark_ms == T + 59_000 and h.value("last").get("b") == 1 and h.last_sweep.deleted == 0
        h.process(rows("c", T + 120_000, 2))           # runs at T + 59 s: b is alive in it
        assert h.watermark_ms == T + 120_000 and h.last_sweep.deleted == 0
        assert h.value("last").get("b") is None        # at the next watermark b's T + 60 s has passed
        h.process(rows("c", T + 121_000, 3))           # runs at T + 120 s: its sweep removes b
        assert h.last_sweep.deleted == 1
        assert h.value("last").get("a") == 1            # stamped by the processing time, far ahead
        assert h.value("last").get("c") == 3 and h.value("hits").get("b") == 1   # hits: processing TTL
        h.advance(dt.timedelta(hours=2))
        h.process(rows("d", T + 122_000))
        assert h.value("hits").get("b") is None and h.value("last").get("a") == 1
        assert h.last_sweep.deleted == 3               # hits of a, b and c by the clock; none of 'last'


def test_the_restore_clock_leaves_out_only_what_expired_on_both_clocks():
    from sparksteward.state.typed import restore_clock

    event = {"variables": {"last": {"ttl_ms": 60_000, "ttl_time": "event"}}}
    processing = {"variables": {"hits": {"ttl_ms": 60_000, "ttl_time": "processing"}}}
    assert restore_clock(T, None, processing) == T and restore_clock(T, None, None) == T
    assert restore_clock(T, None, event) is None                 # no watermark: nothing is left out
    assert restore_clock(T, T - 5, event) == T - 5 and restore_clock(T, T + 5, event) == T
