"""sparksteward.windows in the harness: sessions and tumbling/sliding windows over out-of-order events
equal what a batch computation over the same (not late) events gives, each emitted once, when the
watermark passes its end."""

from __future__ import annotations

import random

import pandas as pd
from sparksteward.testing import KeyedStateHarness
from sparksteward.windows import sessions, windows

T = 1_800_000_000_000
MIN = 60_000


def _reference_sessions(events, gap):
    out = []
    for k, ts in events.groupby("k")["ms"]:
        ts = sorted(ts)
        start = last = ts[0]
        n = 0
        for t in ts:
            if t - last >= gap:
                out.append((k, start, last + gap, n))
                start, n = t, 0
            last, n = t, n + 1
        out.append((k, start, last + gap, n))
    return sorted(out)


def _run(w, events, delay, batches):
    got = []
    late = 0
    with KeyedStateHarness(w.fn, key="k", schema=w.schema.replace("`k` string", "k string"), states=w.states,
                           event_time="ts", watermark_delay=delay / 1000, on_timer=w.on_timer) as h:
        for part in batches:
            out = h.process(part.assign(ts=pd.to_datetime(part["ms"], unit="ms", utc=True))[["k", "ts"]])
            got += [(r.k, int(r.window_start.timestamp() * 1000), int(r.window_end.timestamp() * 1000), r.events)
                    for r in out.itertuples()]
            late += h.last_late_rows
        h.advance_watermark(T + 10 ** 9)   # the end of the stream: everything closes
        out = h.process()
        got += [(r.k, int(r.window_start.timestamp() * 1000), int(r.window_end.timestamp() * 1000), r.events)
                for r in out.itertuples()]
    assert late == 0, "the delay covers the disorder: no event is late"
    return sorted(got)


def _events(seed=7, n=400):
    """Events of three keys, delivered in batches of about 40, shuffled inside each batch, and the last
    5 minutes of each batch delivered with the next one: out of order, but within the 10-minute delay."""
    rnd = random.Random(seed)
    rows = []
    t = T
    for _ in range(n):
        t += rnd.choice([MIN, 5 * MIN, 45 * MIN])
        rows.append((rnd.choice("abc"), t))
    df = pd.DataFrame(rows, columns=["k", "ms"])
    parts = [df.iloc[i:i + 40] for i in range(0, len(df), 40)]
    for i in range(len(parts) - 1):
        moved = parts[i]["ms"] > parts[i]["ms"].max() - 5 * MIN
        parts[i + 1] = pd.concat([parts[i][moved], parts[i + 1]])
        parts[i] = parts[i][~moved]
    return df, [p.sample(frac=1, random_state=i) for i, p in enumerate(parts)]


def test_sessions_over_out_of_order_events_equal_the_batch_sessions():
    events, parts = _events()
    w = sessions(key="k", time="ts", gap=30 * 60)
    assert _run(w, events, 10 * MIN, parts) == _reference_sessions(events, 30 * MIN)


def test_tumbling_and_sliding_windows_equal_the_batch_counts():
    events, parts = _events(seed=3)
    for size, slide in ((60, None), (60, 20)):
        w = windows(key="k", time="ts", size=size * 60, slide=None if slide is None else slide * 60)
        step = (slide or size) * MIN
        expected = {}
        for k, t in events[["k", "ms"]].itertuples(index=False):
            start = t - t % step
            while start > t - size * MIN:
                expected[(k, start, start + size * MIN)] = expected.get((k, start, start + size * MIN), 0) + 1
                start -= step
        assert _run(w, events, 10 * MIN, parts) == sorted((k, s, e, n) for (k, s, e), n in expected.items())


def test_bad_durations_are_refused_by_name():
    import pytest
    from sparksteward.errors import StateError

    with pytest.raises(StateError, match="gap='30m' must be seconds"):
        sessions(key="k", time="ts", gap="30m")
    with pytest.raises(StateError, match="size=0 must be positive"):
        windows(key="k", time="ts", size=0)
    with pytest.raises(StateError, match="allowed_lateness=-1 must be at least 0"):
        windows(key="k", time="ts", size=60, allowed_lateness=-1)
