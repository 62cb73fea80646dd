"""``KeyedStateHarness``: run a keyed-state function batch by batch without Spark, for unit tests.

It runs the code a Spark task runs (:func:`~sparksteward.state.runner.run_pandas` or
:func:`~sparksteward.state.runner.run_arrow` over a RocksDB backend, the typed views of the declared
states at the batch's processing time, then the TTL sweep), on one subtask that owns every key group.
Time only moves when the test moves it::

    from datetime import timedelta
    import pandas as pd
    from sparksteward import list_state, value_state
    from sparksteward.testing import KeyedStateHarness

    def count(key, rows, state):
        n = (state.value("count").get() or 0) + len(rows)
        state.value("count").update(n)
        state.list("seen").extend(rows["v"].tolist())
        return pd.DataFrame({"k": [key], "n": [n]})

    def test_counts_expire_after_an_hour(tmp_path):
        with KeyedStateHarness(count, key="k", schema="k string, n bigint", directory=tmp_path,
                               states=[value_state("count", "bigint", ttl=timedelta(hours=1)),
                                       list_state("seen", "bigint")]) as h:
            assert h.process(pd.DataFrame({"k": ["a", "a"], "v": [1, 2]}))["n"].tolist() == [2]
            h.advance(timedelta(minutes=59))
            assert h.process(pd.DataFrame({"k": ["a"], "v": [3]}))["n"].tolist() == [3]
            h.advance(timedelta(hours=2))
            assert h.value("count").get("a") is None        # expired
            assert h.list("seen").get("a") == [1, 2, 3]      # no TTL

``restart(states=...)`` snapshots the DB and opens it again with new declarations, checked like a
restore (an accepted evolution, or :class:`~sparksteward.errors.StateSchemaError`).

With ``event_time="ts"`` (and ``watermark_delay``, ``late``) each batch runs with a watermark as in
Spark (:mod:`sparksteward.state.event_time`): the largest event time of the batches before it minus
the delay, never going back; ``advance_watermark(to)`` moves it on by hand, ``watermark_ms`` shows
it and ``last_late_rows`` counts the late rows of the last batch.

With ``on_timer``, each batch fires the timers due at its processing time and watermark after the
input, as a task does (:mod:`sparksteward.state.firing`); ``process()`` with no rows runs a batch
without input (timers only), ``timers(key)`` lists a key's timers and ``last_fired`` counts the last
batch's fired timers. ``initial_state(rows, fn)`` bootstraps the state before the first batch's input.
"""

from __future__ import annotations

import builtins
import datetime as dt
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from sparksteward.errors import StateError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.declared import StateSpec, drops_ran, parse_ddl, resolve
from sparksteward.state.event_time import EventTime, judge
from sparksteward.state.firing import fire
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.runner import DEFAULT_SPILL_THRESHOLD, check_form, run_arrow, run_pandas
from sparksteward.state.timers import Timer, Timers
from sparksteward.state.typed import (
    SweepStats,
    TypedList,
    TypedMap,
    TypedStates,
    TypedValue,
    drop_variables,
    sweep_both,
)

__all__ = ["KeyedStateHarness"]


class KeyedStateHarness:
    """One keyed state and its function, fed by the test (see the module docstring).

    Parameters
    ----------
    fn
        ``fn(key, rows, state)`` (``form="pandas"``), ``fn(key, chunks, state)`` (``form="chunks"``: an
        iterator of DataFrames of at most ``chunk_rows`` rows) or ``fn(keys, rows, state)`` (``form="arrow"``).
    key, schema
        The key column and the output schema (a DDL field list like ``"k string, n bigint"``, or a
        ``pyarrow.Schema``).
    states
        The declared state variables (``value_state``, ``list_state``, ``map_state``).
    key_type
        ``"string"``, ``"long"``, ``"int"`` or ``"binary"``, as the key column's Spark type.
    time
        The first batch's processing time: a ``datetime`` or epoch milliseconds (default: now).
    directory
        Where the DB lives (default: a temporary directory, removed by :meth:`close`).
    event_time, watermark_delay, late
        The event-time column, the watermark delay (seconds or a timedelta) and what happens to late
        rows (``"drop"`` or ``"keep"``), as in ``Steward.keyed_state``.
    on_timer
        The timer callback, as in ``KeyedState.process``.
    """

    def __init__(self, fn: Callable[..., Any], *, key: str, schema: str | pa.Schema,
                 states: Sequence[StateSpec] = (), form: str = "pandas", key_type: str = "string",
                 max_parallelism: int = 128, time: dt.datetime | int | None = None,
                 directory: str | Path | None = None, event_time: str | None = None,
                 watermark_delay: dt.timedelta | float = 0, late: str = "drop",
                 on_timer: Callable[..., Any] | None = None, chunk_rows: int = 1000) -> None:
        check_form(form)
        self.fn, self.key, self.form, self.chunk_rows = fn, key, form, chunk_rows
        self.schema = _schema(schema)
        self._tmp = None if directory is not None else tempfile.mkdtemp(prefix="steward-harness-")
        self.directory = Path(directory if directory is not None else self._tmp)  # type: ignore[arg-type]
        self.record = resolve(None, states)
        self.now_ms = _ms(time) if time is not None else int(_now() * 1000)
        self.batch = 0
        self._generation = 0
        self._backend = RocksDBStateBackend(self._db_dir(), KeyGroupRange(0, max_parallelism), max_parallelism,
                                            key_type)
        #: what the last batch's sweep removed
        self.last_sweep: SweepStats | None = None
        self.event_time = None if event_time is None else EventTime.of(event_time, watermark_delay, late)
        #: the next batch's event-time watermark in epoch ms (None: none yet)
        self.watermark_ms: int | None = None
        #: the late rows of the last batch (dropped, or handed over flagged)
        self.last_late_rows = 0
        self.on_timer = on_timer
        self._initial: tuple[Any, Callable[..., Any]] | None = None
        #: the timers the last batch fired
        self.last_fired = 0

    def _db_dir(self) -> Path:
        return self.directory / f"db-{self._generation}"

    # --- time -------------------------------------------------------------------------------------
    def advance(self, by: dt.timedelta | float) -> int:
        """Move processing time forward by ``by`` (a timedelta or seconds); returns it in ms."""
        seconds = by.total_seconds() if isinstance(by, dt.timedelta) else float(by)
        if seconds < 0:
            raise StateError(f"advance({by!r}): processing time only moves forward")
        self.now_ms += round(seconds * 1000)
        return self.now_ms

    def advance_watermark(self, to: dt.datetime | int) -> int | None:
        """Move the watermark forward to ``to`` (a datetime or epoch ms) by hand, as if a batch had seen an
        event that late plus the delay; a ``to`` behind it changes nothing (it never goes back)."""
        ms = _ms(to)
        self.watermark_ms = ms if self.watermark_ms is None else max(self.watermark_ms, ms)
        return self.watermark_ms

    # --- batches ----------------------------------------------------------------------------------
    def initial_state(self, rows: Any, fn: Callable[..., Any]) -> None:
        """Run ``fn`` over ``rows`` (as the batch function: per key, or the Arrow form's once) before the
        first batch's input, writing state and timers; refused once a batch ran."""
        if self.batch:
            raise StateError(f"initial_state: {self.batch} batches ran already; an initial state bootstraps the first")
        self._initial = (_table(rows), fn)

    def process(self, rows: Any = None) -> Any:
        """Run one batch over ``rows`` (a pandas DataFrame, a pyarrow Table or RecordBatch, or a list
        of dicts) at the current processing time; return the output (pandas in the pandas form, a
        pyarrow Table in the Arrow form)."""
        self.batch += 1
        states = self._states()
        counters: dict[str, Any] = {}
        batches: Iterator[pa.RecordBatch] = iter(() if rows is None else _table(rows).to_batches())
        if self._initial is not None:   # before the first batch's input, as its task does
            table, init = self._initial
            runner = run_arrow if self.form == "arrow" else run_pandas
            for _ in runner(table.to_batches(), self.key, init, self._backend, pa.schema([]), states=states):
                raise StateError("the initial state function writes state and timers and returns nothing")
            self._initial = None
        if self.event_time is not None:
            batches = judge(batches, self.event_time, self.watermark_ms, counters)
        if self.form != "arrow":
            out = list(run_pandas(batches, self.key, self.fn, self._backend, self.schema, states=states,
                                  chunk_rows=self.chunk_rows if self.form == "chunks" else None))
        else:   # as a Spark task calls it: once with all of the batch's rows (up to the spill threshold)
            out = list(run_arrow(batches, self.key, self.fn, self._backend, self.schema, states=states,
                                 max_input_bytes=DEFAULT_SPILL_THRESHOLD))
        if self.on_timer is not None:
            out.extend(fire(self.on_timer, "arrow" if self.form == "arrow" else "pandas", self._backend, states, self.schema, counters))
        self.last_fired = int(counters.get("timers_fired", 0))
        self.last_late_rows = int(counters.get("late_rows", 0))
        if self.event_time is not None and counters.get("max_event_ms") is not None:
            self.advance_watermark(counters["max_event_ms"] - self.event_time.delay_ms)
        swept = sweep_both(states, self.batch)
        if swept is not None:
            self.last_sweep = swept
        result = pa.Table.from_batches(out, schema=self.schema)
        return result if self.form == "arrow" else result.to_pandas()

    def _states(self) -> TypedStates:
        return TypedStates(self._backend, self.record, self.now_ms, self.batch, self.watermark_ms,
                           event_time=self.event_time is not None)

    # --- state ------------------------------------------------------------------------------------
    def value(self, name: str) -> TypedValue:
        """The declared value state ``name`` at the current time: ``get(key)``, ``update(key, v)``, ..."""
        return self._states().value(name)

    def list(self, name: str) -> TypedList:
        return self._states().list(name)

    def map(self, name: str) -> TypedMap:
        return self._states().map(name)

    def timers(self, key: object) -> builtins.list[Timer]:
        """The timers ``key`` has registered, earliest first."""
        return Timers(self._backend, event_time=True).bind(key).list()

    def entries(self) -> int:
        """How many RocksDB entries the state holds (values, elements, map entries, expiry index keys)."""
        return sum(1 for _ in self._backend.iter_raw())

    def restart(self, states: Sequence[StateSpec] | None = None, delete_states: Sequence[str] = ()) -> None:
        """Snapshot the DB and open the snapshot again, as a restore does; with ``states``, the new
        declarations are resolved against the old ones (evolution, or StateSchemaError by name), and
        ``delete_states`` are dropped with their entries (and expiry-index keys); a name declared again
        after its drop starts at a new schema version."""
        record = self.record if states is None and not delete_states else resolve(self.record, states or (),
                                                                                 delete_states, checkpointed=True)
        snap = self._backend.snapshot(self.directory / f"snap-{self._generation}")
        self._generation += 1
        shutil.copytree(snap.path, self._db_dir() / "db")
        old = self._backend
        self._backend = RocksDBStateBackend(self._db_dir(), old.key_groups, old.max_parallelism, old.key_type,
                                            create=False)
        if record.get("dropped"):   # the next batch's task runs the drops, and its checkpoint completes
            drop_variables(self._backend, record["dropped"])
        self.record = drops_ran(record, record.get("dropped") or ())

    def close(self) -> None:
        self._backend.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> KeyedStateHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _now() -> float:
    return time.time()


def _ms(t: dt.datetime | int) -> int:
    if isinstance(t, dt.datetime):
        return round((t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp() * 1000)
    return int(t)


def _schema(schema: str | pa.Schema) -> pa.Schema:
    if isinstance(schema, pa.Schema):
        return schema
    t = parse_ddl(schema)
    if not pa.types.is_struct(t):
        raise StateError(f"schema {schema!r} must be a field list like 'k string, n bigint'")
    return pa.schema(list(t))


def _table(rows: Any) -> pa.Table:
    if isinstance(rows, pa.Table):
        return rows
    if isinstance(rows, pa.RecordBatch):
        return pa.Table.from_batches([rows])
    if isinstance(rows, list):
        return pa.Table.from_pylist(rows)
    try:
        return pa.Table.from_pandas(rows, preserve_index=False)
    except Exception as exc:  # noqa: BLE001 - name what was given
        raise StateError(f"process() takes a pandas DataFrame, a pyarrow Table or a list of dicts, not "
                         f"{type(rows).__name__}") from exc
