"""Timers in Spark (issue 38 slice 2, decision 0028), on local-cluster[2,1,1024]: event-time timers registered
by 40 keys fire once each, after the input, for keys with and without input, across rescales
(8 -> 3 -> 5) between registration and firing; a deleted timer never fires; a re-delivered batch, a
re-run after the commit and a retried task emit a timer's output as one run would."""

from __future__ import annotations

import datetime as dt
import uuid

import pandas as pd
import pyarrow as pa
import pytest
from sparksteward import Steward

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

T = 1_800_000_000_000
OUT = "k string, what string, at long"


def arm(key, rows, state):
    if (rows["v"] == -1).any():   # cancel: delete every timer of the key
        for t in state.timers.list():
            state.timers.delete(t.at, t.time)
        return pd.DataFrame({"k": [key], "what": ["cancelled"], "at": [len(state.timers.list())]})
    at = int(rows["ts"].max().timestamp() * 1000) + 10_000
    state.timers.register(at, time="event")
    return None


def fired(key, timers, state):
    from pyspark import TaskContext

    if key == "k30" and TaskContext.get().attemptNumber() == 0:
        raise RuntimeError("the first attempt of k30's timer fails on purpose")
    return pd.DataFrame({"k": [key] * len(timers), "what": ["fired"] * len(timers), "at": [t.at for t in timers]})


def _df(spark, rows):
    return spark.createDataFrame(
        [(k, dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc), v) for k, ms, v in rows],
        "k string, ts timestamp, v long")


def test_event_timers_fire_once_across_rescales_redeliveries_reruns_and_retries(cluster_spark):
    spark = cluster_spark
    st = Steward.get(spark)
    name = f"tm{uuid.uuid4().hex[:6]}"

    def opened(p):
        return st.keyed_state(name, key="k", parallelism=p, max_parallelism=32, event_time="ts")

    def run(ks, cid, rows, commit=True):
        out = sorted((r.k, r.what, r.at) for r in ks.apply(_df(spark, rows), arm, OUT, cid, on_timer=fired).collect())
        if commit:
            ks.commit(cid, wait=60)
        return out

    emitted = []
    ks = opened(8)
    assert run(ks, 0, [(f"k{i}", T + 1000 * i, 1) for i in range(40)]) == []   # timers at T + 10 s + i s
    assert ks.report(checkpoint_id=0)["timers_fired"] == 0

    ks = opened(3)   # rescaled; this batch runs at watermark T + 39 s: k0..k29 due, k0..k4 cancel first
    cancel = [(f"k{i}", T + 40_000, -1) for i in range(5)]
    first = run(ks, 1, cancel, commit=False)
    ks.abort(1)      # the sink failed: the batch is delivered again
    assert run(ks, 1, cancel) == first
    expected = sorted([(f"k{i}", "cancelled", 0) for i in range(5)] +
                      [(f"k{i}", "fired", T + 10_000 + 1000 * i) for i in range(5, 30)])
    assert first == expected
    assert run(ks, 1, cancel) == first   # a re-run after the commit: the same rows, the first result kept
    assert ks.report(checkpoint_id=1)["timers_fired"] == 25
    emitted += first

    ks = opened(5)   # rescaled again; at T + 40 s k30's timer is due: its first attempt fails, the retry fires it
    emitted += run(ks, 2, [("z", T + 100_000, 1)])
    emitted += run(ks, 3, [])   # no input at all: at T + 100 s, k31..k39 fire
    emitted += run(ks, 4, [])   # at T + 100 s again: nothing left but z's (T + 110 s)
    fired_keys = [k for k, what, _ in emitted if what == "fired"]
    assert sorted(fired_keys) == sorted(f"k{i}" for i in range(5, 40)), "every timer fires exactly once"
    assert ks.report(checkpoint_id=3)["timers_fired"] == 9 and ks.report(checkpoint_id=4)["timers_fired"] == 0


def test_the_arrow_form_fires_processing_timers_for_keys_without_input(cluster_spark):
    spark = cluster_spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"tma{uuid.uuid4().hex[:6]}", key="k", parallelism=4, max_parallelism=16)

    def arm_all(keys, rows, state):
        state.timers.register(keys, state.processing_time_ms)   # due at once: fires in this batch

    def fired_all(keys, expired, state):
        return pa.table({"k": expired.column("key"), "n": pa.array([len(keys)] * expired.num_rows, pa.int64())})

    df = spark.createDataFrame([(f"u{i}",) for i in range(30)], "k string")
    out = ks.apply_arrow(df, arm_all, "k string, n long", 0, on_timer=fired_all).collect()
    ks.commit(0, wait=60)
    assert sorted(r.k for r in out) == sorted(f"u{i}" for i in range(30))
    assert sum(1 for r in out if r.n > 0) == 30
    empty = spark.createDataFrame([], "k string")
    assert ks.apply_arrow(empty, arm_all, "k string, n long", 1, on_timer=fired_all).collect() == []
    ks.commit(1, wait=60)
    # the fired timers went with range deletes: a rescale's restore (4 -> 3) brings none of them back
    ks = st.keyed_state(ks.name, key="k", parallelism=3, max_parallelism=16)
    assert ks.apply_arrow(empty, arm_all, "k string, n long", 2, on_timer=fired_all).collect() == []
    ks.commit(2, wait=60)


def test_processing_timers_fire_on_an_idle_stream_within_the_stated_bound(cluster_spark, tmp_path):
    """A streaming query whose source goes idle after one file: the keys' processing-time timers (due 2 s
    after their batch) fire through the same sink within idle_timers + a poll + one empty batch, under a
    checkpoint id of their own that the query's next batch skips; the watcher ends with the query."""
    import json
    import time

    spark = cluster_spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"tmi{uuid.uuid4().hex[:6]}", key="k", parallelism=2, max_parallelism=16)
    source = tmp_path / "in"
    source.mkdir()
    written: list[tuple[int, str, str, int, float]] = []   # (checkpoint id, key, what, due at, written at)

    def arm_soon(key, rows, state):
        state.timers.register(state.processing_time_ms + 2000)
        return pd.DataFrame({"k": [key], "what": ["seen"], "at": [0]})

    def close(key, timers, state):
        return pd.DataFrame({"k": [key], "what": ["fired"], "at": [timers[0].at]})

    def sink(out, cid):
        rows = out.collect()
        now = time.time()
        written.extend((cid, r.k, r.what, r.at, now) for r in rows)

    def wait_for(pred, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline and not pred():
            time.sleep(0.2)

    run = ks.process(arm_soon, OUT, sink, on_timer=close, idle_timers=2.0)
    (source / "0.json").write_text("\n".join(json.dumps({"k": k, "v": 1}) for k in ("a", "b")))
    q = (spark.readStream.schema("k string, v long").json(str(source)).writeStream.foreachBatch(run)
         .option("checkpointLocation", str(tmp_path / "chk")).trigger(processingTime="500 milliseconds").start())
    try:
        wait_for(lambda: sum(1 for w in written if w[2] == "fired") >= 2, 90)
        wait_for(lambda: ks.idle_timers.fired >= 1, 60)   # counted once drain() returned, after its sink
        fired = [w for w in written if w[2] == "fired"]
        assert sorted(w[1] for w in fired) == ["a", "b"], written
        assert ks.idle_timers.fired >= 1 and len({w[0] for w in fired}) == 1
        report = ks.report(checkpoint_id=fired[0][0])
        assert report["timers_fired"] == 2 and "next_timer_ms" not in report   # none left
        # the bound: from the later of the time a timer is due and the query's last batch, idle_timers
        # (2 s) plus a poll (0.5 s) plus one empty batch (generously 15 s on a loaded machine)
        batch_end = max(w[4] for w in written if w[2] == "seen") * 1000
        late_ms = [w[4] * 1000 - max(w[3], batch_end) for w in fired]
        print(f"idle timers fired {[round(w[4] * 1000 - w[3]) for w in fired]} ms after they were due, "
              f"{[round(x) for x in late_ms]} ms after the later of that and the last batch's sink")
        assert all(x <= 17_500 for x in late_ms), late_ms
        (source / "1.json").write_text(json.dumps({"k": "c", "v": 1}))
        wait_for(lambda: any(w[1] == "c" for w in written), 60)
        ids = sorted({w[0] for w in written})
        assert len(ids) == 3 and ids[1] == fired[0][0] and ids[2] > ids[1], written   # batch 1 skips the drain's id
    finally:
        q.stop()
    wait_for(lambda: not ks.idle_timers.alive, 10)
    assert not ks.idle_timers.alive


def test_timers_and_the_watermark_survive_a_restart_of_the_driver_agent(cluster_spark):
    """The driver agent is SIGKILLed between registration and firing: the shim restarts it, the state
    registers again, and the next batch runs with the watermark the last checkpoint left and fires every
    due timer once."""
    import signal

    from tests.helpers import agent_processes, wait_until

    spark = cluster_spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"tmr{uuid.uuid4().hex[:6]}", key="k", parallelism=2, max_parallelism=16,
                        event_time="ts", watermark_delay=5)
    rows = [(f"k{i}", T + 1000 * i, 1) for i in range(10)]   # timers at T + 10 s + i s; max event T + 9 s
    assert ks.apply(_df(spark, rows), arm, OUT, 0, on_timer=fired).collect() == []
    ks.commit(0, wait=60)
    (old,) = [p for p in agent_processes() if any("agents.driver" in c for c in p.cmdline())]
    old.send_signal(signal.SIGKILL)
    wait_until(lambda: [p for p in agent_processes() if any("agents.driver" in c for c in p.cmdline())
                        and p.pid != old.pid], timeout=60, what="the shim to restart the driver agent")

    def answers():
        try:
            st.health()
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    wait_until(answers, timeout=60, what="the new driver agent to answer")
    got = ks.apply(_df(spark, [("z", T + 30_000, 1)]), arm, OUT, 1, on_timer=fired).collect()
    ks.commit(1, wait=60)
    assert got == [] and ks.report(checkpoint_id=1)["watermark_ms"] == T + 4_000   # T + 9 s - 5 s
    got = sorted((r.k, r.at) for r in ks.apply(_df(spark, []), arm, OUT, 2, on_timer=fired).collect())
    ks.commit(2, wait=60)
    assert got == [(f"k{i}", T + 10_000 + 1000 * i) for i in range(10)]   # at T + 25 s: each fires once
    assert ks.report(checkpoint_id=2)["watermark_ms"] == T + 25_000


def test_an_initial_state_applies_once_across_a_failed_first_batch_and_is_refused_after(cluster_spark):
    """initial_state(df, fn) bootstraps values and timers in the first batch: the batch fails after its
    output was written (aborted), its re-delivery starts from empty again and applies it once, as does a
    re-run after the commit (the same rows); after the first checkpoint the call is refused by name."""
    from sparksteward.errors import StateError

    spark = cluster_spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"tmn{uuid.uuid4().hex[:6]}", key="k", parallelism=3, max_parallelism=16)
    history = spark.createDataFrame([(f"u{i}", i) for i in range(50)], "k string, n long")

    def init(key, rows, state):
        state.update(int(rows["n"].sum()))
        if key in ("u3", "u4"):
            state.timers.register(0)   # due at once: fires in the first batch

    def add(key, rows, state):
        state.update((state.get() or 0) + len(rows))
        return pd.DataFrame({"k": [key], "what": ["row"], "at": [state.get()]})

    def remind(key, timers, state):
        return pd.DataFrame({"k": [key], "what": ["timer"], "at": [state.get()]})

    ks.initial_state(history, init)
    batch = spark.createDataFrame([("u1",), ("u3",), ("x",)], "k string")
    first = sorted((r.k, r.what, r.at) for r in ks.apply(batch, add, OUT, 0, on_timer=remind).collect())
    assert first == [("u1", "row", 2), ("u3", "row", 4), ("u3", "timer", 4), ("u4", "timer", 4), ("x", "row", 1)]
    ks.abort(0)   # the sink failed
    again = sorted((r.k, r.what, r.at) for r in ks.apply(batch, add, OUT, 0, on_timer=remind).collect())
    ks.commit(0, wait=60)
    assert again == first and ks.report(checkpoint_id=0)["initial_rows"] == 50
    rerun = sorted((r.k, r.what, r.at) for r in ks.apply(batch, add, OUT, 0, on_timer=remind).collect())
    ks.commit(0, wait=60)   # the driver died after the commit: the re-run from empty applies it again
    assert rerun == first
    values = {r.key: int(r.value) for r in ks.read().collect()}
    assert values == {**{f"u{i}": i for i in range(50)}, "u1": 2, "u3": 4, "x": 1}
    with pytest.raises(StateError, match=r"initial_state of keyed state 'tmn\w+': the state has a checkpoint "
                                         r"already \(0\)"):
        ks.initial_state(history, init)
    assert ks.apply(batch, add, OUT, 1).count() == 3   # no initial state in later batches
    ks.commit(1, wait=60)
    assert {r.key: int(r.value) for r in ks.read().collect()}["u1"] == 3


@pytest.mark.compat
def test_session_windows_emit_timestamps_through_spark(cluster_spark):
    """sparksteward.windows on Spark: an output schema with timestamp columns (zoned as each pyspark's
    mapInArrow wants them), sessions emitted once the watermark passes their end."""
    from sparksteward.windows import sessions

    spark = cluster_spark
    st = Steward.get(spark)
    s = sessions(key="k", time="ts", gap=60)
    ks = st.keyed_state(f"tms{uuid.uuid4().hex[:6]}", key="k", parallelism=2, max_parallelism=16, event_time="ts",
                        states=s.states)
    first = _df(spark, [("a", T, 1), ("a", T + 30_000, 1), ("b", T + 100_000, 1)])
    assert ks.apply(first, s.fn, s.schema, 0, on_timer=s.on_timer).collect() == []
    ks.commit(0, wait=60)
    rows = ks.apply(_df(spark, [("c", T + 200_000, 1)]), s.fn, s.schema, 1, on_timer=s.on_timer).collect()
    ks.commit(1, wait=60)   # ran at watermark T + 100 s: a's session (T .. T + 90 s) is due
    rows += ks.apply(_df(spark, []), s.fn, s.schema, 2, on_timer=s.on_timer).collect()   # at T + 200 s: b's
    ks.commit(2, wait=60)
    got = sorted((r.k, r.window_start, r.window_end, r.events) for r in rows)

    def local(ms):   # how pyspark hands a timestamp to Python: naive, in the process's time zone
        return dt.datetime.fromtimestamp(ms / 1000)

    assert got == [("a", local(T), local(T + 90_000), 2), ("b", local(T + 100_000), local(T + 160_000), 1)]


def test_event_timers_the_last_rows_made_due_fire_on_an_idle_stream(cluster_spark, tmp_path):
    """Gap found by the timers benchmark: Spark runs a no-data batch after its input stops and fires the
    event-time timers the last rows' watermark passes; so does the idle watcher. One file: a at T, b at
    T + 100 s, each arming a timer 10 s after its row; the watermark the file moves (T + 100 s, delay 0)
    passes a's timer, not b's: a fires on the idle stream, b does not, and the report says what is left."""
    import json
    import time

    spark = cluster_spark
    st = Steward.get(spark)
    ks = st.keyed_state(f"tme{uuid.uuid4().hex[:6]}", key="k", parallelism=2, max_parallelism=16,
                        event_time="ts", watermark_delay=0)
    source = tmp_path / "in"
    source.mkdir()
    written: list[tuple[int, str, str, int]] = []

    def arm(key, rows, state):
        state.timers.register(int(rows["ts"].max().timestamp() * 1000) + 10_000, time="event")
        return pd.DataFrame({"k": [key], "what": ["seen"], "at": [0]})

    def close(key, timers, state):
        return pd.DataFrame({"k": [key], "what": ["fired"], "at": [timers[0].at]})

    def sink(out, cid):
        written.extend((cid, r.k, r.what, r.at) for r in out.collect())

    run = ks.process(arm, OUT, sink, on_timer=close, idle_timers=1.0)
    (source / "0.json").write_text("\n".join(json.dumps({"k": k, "ts": (T + ms) / 1000})
                                             for k, ms in (("a", 0), ("b", 100_000))))
    q = (spark.readStream.schema("k string, ts double").json(str(source))
         .selectExpr("k", "timestamp_seconds(ts) AS ts").writeStream.foreachBatch(run)
         .option("checkpointLocation", str(tmp_path / "chk")).trigger(processingTime="500 milliseconds").start())
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not any(w[2] == "fired" for w in written):
            time.sleep(0.2)
        while time.time() < deadline and ks.idle_timers.fired < 1:   # counted once drain() returned
            time.sleep(0.2)
        time.sleep(3)   # a second idle drain would fire b too early: none may come
        fired = [w for w in written if w[2] == "fired"]
        assert [(w[1], w[3]) for w in fired] == [("a", T + 10_000)], written
        report = ks.report(checkpoint_id=fired[0][0])
        assert report["watermark_ms"] == T + 100_000 and report["next_event_timer_ms"] == T + 110_000
        assert ks.idle_timers.fired == 1
    finally:
        q.stop()


@pytest.mark.soak   # an application of its own, 65 s: make soak
def test_timers_registered_by_one_application_fire_once_in_the_next_at_another_parallelism(cluster_spark, tmp_path):
    """Must-show 1, a restart between registration and firing by a new Spark application: an application of
    its own (local[2], parallelism 8) registers 40 keys' event-time timers, commits and is SIGKILLed; this
    one opens the state at parallelism 3, runs with the watermark the dead one's checkpoint left, and fires
    every timer exactly once (k30's first attempt fails on purpose: its retry fires it)."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers.timers_app import KEYS

    root = Path(__file__).resolve().parents[2]
    name, chk = f"tma{uuid.uuid4().hex[:6]}", str(tmp_path / "chk")
    env = {**__import__("os").environ, "PYTHONPATH": str(root) + __import__("os").pathsep
           + __import__("os").environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "tests.helpers.timers_app", "--checkpoint-dir", chk,
                           "--state-dir", str(tmp_path / "app-state"), "--name", name], cwd=root, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == -9 and "committed 0 in " in done.stdout, done.stderr[-3000:]
    spark = cluster_spark
    ks = Steward.get(spark).keyed_state(name, key="k", parallelism=3, max_parallelism=16, checkpoint_dir=chk,
                                        event_time="ts", watermark_delay=5)
    first = sorted((r.k, r.at) for r in ks.apply(_df(spark, [("z", T + 60_000, 1)]), arm, OUT, 1,
                                                 on_timer=fired).collect())
    ks.commit(1, wait=60)
    watermark = T + (KEYS - 1) * 1000 - 5000   # the dead application's largest event time minus the delay
    assert ks.report(checkpoint_id=1)["watermark_ms"] == watermark
    assert first == sorted((f"k{i}", T + 10_000 + 1000 * i) for i in range(KEYS) if T + 10_000 + 1000 * i <= watermark)
    then = sorted((r.k, r.at) for r in ks.apply(_df(spark, []), arm, OUT, 2, on_timer=fired).collect())
    ks.commit(2, wait=60)
    assert sorted(first + then) == sorted((f"k{i}", T + 10_000 + 1000 * i) for i in range(KEYS))   # each once
    assert ks.apply(_df(spark, []), arm, OUT, 3, on_timer=fired).collect() == []
    ks.commit(3, wait=60)
