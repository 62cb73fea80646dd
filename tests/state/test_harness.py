"""KeyedStateHarness (sparksteward.testing): the documented example runs as written; both forms over
value, list and map states; time advanced by the test expires state; a restart evolves or refuses a
declaration by name."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from sparksteward import list_state, map_state, value_state
from sparksteward.errors import StateSchemaError
from sparksteward.testing import KeyedStateHarness
from sparksteward.testing import harness as harness_module


def test_the_documented_example_runs_as_written(tmp_path):
    source = harness_module.__doc__.split("::\n", 1)[1].split("\n\n``restart", 1)[0]
    code = "\n".join(line[4:] for line in source.splitlines())
    scope: dict = {}
    exec(compile(code, "harness-example", "exec"), scope)   # noqa: S102 - our own docstring
    scope["test_counts_expire_after_an_hour"](tmp_path)   # its own asserts are the test


def count_and_collect(key, rows, state):
    n = (state.value("count").get() or 0) + len(rows)
    state.value("count").update(n)
    state.list("events").extend(int(v) for v in rows["v"])
    for v in rows["v"]:
        state.map("by_v").put(int(v), (state.map("by_v").get(int(v)) or 0) + 1)
    return pd.DataFrame({"k": [key], "n": [n], "events": [len(state.list("events").get())]})


def count_and_collect_arrow(keys, rows, state):
    counts = rows.group_by("k").aggregate([("v", "count")])
    n = pc.add(pc.fill_null(state.value("count").get_many(counts["k"]), 0), counts["v_count"])
    state.value("count").put_many(counts["k"], n)
    state.list("events").append_many(rows["k"], rows["v"])
    pairs = rows.group_by(["k", "v"]).aggregate([("v", "count")])
    old = pc.fill_null(state.map("by_v").get_many(pairs["k"], pairs["v"]), 0)
    state.map("by_v").put_many(pairs["k"], pairs["v"], pc.add(old, pairs["v_count"]))
    events = pc.list_value_length(state.list("events").get_many(counts["k"])).cast(pa.int64())
    return pa.table({"k": counts["k"], "n": n, "events": events})


SPECS = [value_state("count", "bigint", ttl=60), list_state("events", "bigint", ttl=60),
         map_state("by_v", "bigint", "bigint", ttl=60)]


@pytest.mark.parametrize("form", ["pandas", "arrow"])
def test_both_forms_keep_state_and_expire_it_when_time_moves(form):
    fn = count_and_collect if form == "pandas" else count_and_collect_arrow
    with KeyedStateHarness(fn, key="k", schema="k string, n bigint, events bigint", states=SPECS, form=form,
                           time=1_800_000_000_000) as h:
        first = h.process(pd.DataFrame({"k": ["a", "b", "a"], "v": [1, 2, 3]}))
        rows = first if form == "pandas" else first.to_pandas()
        assert sorted(map(tuple, rows.values.tolist())) == [("a", 2, 2), ("b", 1, 1)]
        h.advance(30)
        h.process([{"k": "a", "v": 4}])
        assert h.value("count").get("a") == 3 and h.list("events").get("a") == [1, 3, 4]
        assert sorted(h.map("by_v").items("a")) == [(1, 1), (3, 1), (4, 1)]
        h.advance(45)   # b's entries (t0 + 60 s) expired; a's list keeps its element written at t0 + 30 s
        assert h.value("count").get("b") is None and h.list("events").get("a") == [4]
        h.process([{"k": "c", "v": 5}])
        assert h.last_sweep is not None and h.last_sweep.deleted > 0
        h.value("count").update("z", 9)    # set state directly
        assert h.value("count").get("z") == 9


def test_a_restart_evolves_or_refuses_a_declaration_by_name():
    def last(key, rows, state):
        state.value("last").update({"v": int(rows["v"].iloc[-1]), "note": "n"})
        return

    with KeyedStateHarness(last, key="k", schema="k string",
                           states=[value_state("last", "v int, note string")]) as h:
        h.process([{"k": "a", "v": 1}])
        with pytest.raises(StateSchemaError, match="'last' cannot be read as declared: .* field 'v' changed from "
                                                   "int32 to string"):
            h.restart(states=[value_state("last", "v string")])
        h.restart(states=[value_state("last", "v bigint, extra double")])
        assert h.value("last").get("a") == {"v": 1, "extra": None}
        h.restart(states=[value_state("other", "bigint")])
        assert "last" in h.record["variables"]    # undeclared: kept
        before = h.entries()
        h.restart(delete_states=["last"])
        assert "last" not in h.record["variables"] and h.entries() == before - 1


def test_a_restart_with_the_same_arrow_declarations_keeps_their_versions():
    """Issue 35 item 13: map keys declared pa.timestamp("ms") and values declared pa.large_string()
    reopen with the same declarations (they were refused, or got a new version at every restart)."""
    import datetime as dt

    specs = [map_state("by_ts", pa.timestamp("ms"), pa.large_string()), value_state("s", pa.large_string()),
             list_state("l", pa.struct([("t", pa.timestamp("ms", tz="UTC")), ("b", pa.large_binary())]))]
    when = dt.datetime(2026, 11, 25, 12, 0, 1)

    def fn(key, rows, state):
        state.map("by_ts").put(when, "v")
        state.value("s").update("w")
        state.list("l").append({"t": when.replace(tzinfo=dt.timezone.utc), "b": b"x"})
        return

    with KeyedStateHarness(fn, key="k", schema="k string", states=specs) as h:
        h.process([{"k": "a"}])
        before = h.record
        h.restart(states=specs)
        h.restart(states=specs)
        assert h.record == before
        assert {n: v["current"] for n, v in h.record["variables"].items()} == {"by_ts": 1, "l": 1, "s": 1}
        assert h.map("by_ts").items("a") == [(when, "v")] and h.value("s").get("a") == "w"
        assert h.list("l").get("a") == [{"t": when.replace(tzinfo=dt.timezone.utc), "b": b"x"}]


def test_a_name_dropped_then_declared_anew_takes_a_new_version_and_starts_empty():
    """Issue 35 item 11 in the harness: a drop asked twice stays a drop, and the name declared again
    with another type never reuses the version its old bytes were written with."""
    def fn(key, rows, state):
        state.value("x").update("abcd")
        return

    with KeyedStateHarness(fn, key="k", schema="k string", states=[value_state("x", "string")]) as h:
        h.process([{"k": "a"}])
        h.restart(delete_states=["x"])
        h.restart(delete_states=["x"])
        assert h.entries() == 0 and h.record["dropped"] == []
        h.restart(states=[value_state("x", "bigint")])
        assert h.record["variables"]["x"]["current"] == 2 and h.value("x").get("a") is None
