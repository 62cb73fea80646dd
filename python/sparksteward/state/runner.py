"""Running a user function over one subtask's rows with its keyed state, in the Arrow form and in the
per-key pandas form. Spark-free: the Spark integration calls these inside ``mapInArrow``.

**Arrow form.** ``fn(keys: pyarrow.Array, rows: pyarrow.Table, state: KeyedStateAccess) ->
pyarrow.Table | None`` is called once per input batch (Arrow buffer). ``keys`` are the distinct keys of
``rows``, and ``state`` offers vectorized ``get_many(keys)``/``put_many(keys, values)``, plus named
value, map and list states.

**pandas form.** ``fn(key, rows: pandas.DataFrame, state: KeyState)`` is called **once per key per
batch** and returns its output rows: one row as a tuple in the schema's column order (or a dict by
column name), a list of rows, a pandas DataFrame, or None. A one-row DataFrame built per key costs
100 us or more beyond a row (its construction and the concatenation; ``benchmarks/bench_per_key_calls.py``),
which at one call per key is most of a small batch's time. It is called once for each distinct key of the subtask's
whole input, with every row of that key from every Arrow buffer, in arrival order. ``state.get()``/``update(v)``/``clear()``
(and ``state.map(name)``, ``state.list(name)``) are bound to that key. Spark's own per-key operators
(``applyInPandasWithState``, ``transformWithStateInPandas``) behave the same way, and so a sink such as
a MERGE sees one output row per key per batch, never an intermediate one. This requires the subtask's
input to be read before the key is called. :func:`run_pandas` buffers that input in memory up to
``spill_threshold`` bytes (``spark.steward.state.spill-threshold``). Past that, it spills sorted runs
to Arrow IPC files in the backend's working directory and merges them back, one key at a time
(:mod:`sparksteward.state.spill`). The files are deleted when the run ends, including on errors.
Memory is therefore bounded, except that **one key's rows must fit in memory**, because they reach
``fn`` as one DataFrame. Null keys are refused before any call. The order in which keys are called is
unspecified. Output rows are yielded in batches of at most ``max_output_rows`` rows (Spark's
``maxRecordsPerBatch``), as they come, and are never collected for the whole subtask.

*Aligned* input arrives in any order, so no key is called before the whole input has been read. With
an *unaligned* alignment (FLIP-76; ``key_group_ordered=True``), a subtask's input comes in key-group
order (:func:`sparksteward.checkpoint.unaligned.task_cut.merge_by_key_group`). The rows of one key group are
contiguous, but the keys inside a key group are interleaved. Every row of a key belongs to its key
group, so the keys of a key group are called once the next key group begins. This happens at the
buffer boundary where the cut checks its deadline. A straggler still processes only up to its cut, and
the rows from the cut on go to the channel state, never to ``fn``. Because the cut never splits a key
group, a key is either called with all its rows of the batch or deferred as a whole. The only thing
that changes is the lag: a key group's keys are called when the next key group begins, one Arrow
buffer late at most.

**Chunks form** (``form="chunks"``, decision 0028): ``fn(key, chunks, state)`` gets the key's rows as an
iterator of DataFrames of at most ``spark.steward.state.chunk-rows`` rows, still once per key per batch.
Aligned, the chunks are slices of the key's rows as above. Unaligned, a subtask's input comes in
content order (by key group, key, replayed rows first, then every column) and each chunk is read when
the function asks for it, so the cut checks its deadline between two chunks of one key: a hot key's
call sees a prefix of its rows and ends, and the rest of them come first in its call of the next batch.

Both forms return an iterator of ``pyarrow.RecordBatch`` in the declared output schema. Results are
cast to that schema (``mapInArrow`` does not cast), and a result that cannot be cast raises an error
that names the column.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparksteward.errors import StateEncodingError, StateError, StateFunctionError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.buffered import BufferedStore
from sparksteward.state.declared import DEFAULT_VARIABLE
from sparksteward.state.keygroups import key_group
from sparksteward.state.spill import KeyedRowBuffer
from sparksteward.state.timers import BoundTimers, Timers
from sparksteward.state.typed import BoundList, BoundMap, BoundValue, TypedList, TypedMap, TypedStates, TypedValue
from sparksteward.state.views import BoundListState, BoundMapState, BoundValueState, ListState, MapState, ValueState

__all__ = ["DEFAULT_OUTPUT_ROWS", "DEFAULT_SPILL_THRESHOLD", "DEFAULT_STATE", "KeyState", "KeyedStateAccess", "check_form",
           "run_arrow", "run_pandas"]

DEFAULT_STATE = DEFAULT_VARIABLE   # the default value state (declared.py)
#: default of ``spark.steward.state.spill-threshold``: the input a per-key task holds in memory
DEFAULT_SPILL_THRESHOLD = 64 << 20
#: default size of the per-key form's output batches (Spark's ``spark.sql.execution.arrow.maxRecordsPerBatch``)
DEFAULT_OUTPUT_ROWS = 10_000


def check_form(form: str) -> None:
    """Refuse an unknown ``form`` of a keyed state's function, naming the three."""
    if form not in ("pandas", "chunks", "arrow"):
        raise StateError(f"form={form!r} must be 'pandas' (fn(key, rows, state)), 'chunks' (fn(key, chunks, state), "
                         f"a key's rows as an iterator of DataFrames) or 'arrow' (fn(keys, rows, state))")


class KeyedStateAccess:
    """What an Arrow-form function gets: vectorized access to the subtask's keyed state. Declared
    variables (``states``) come as their typed views; an undeclared name gets an untyped (JSON) view.
    The default value state (``get_many``/``put_many``) is typed when declared
    (``value_state("value", type)``, decision 0027), JSON otherwise."""

    def __init__(self, backend: RocksDBStateBackend, default: str = DEFAULT_STATE,
                 states: TypedStates | None = None) -> None:
        self.backend = backend
        self.states = states
        self._default: TypedValue | ValueState = self.value(default)
        #: the subtask's timers (issue 38): ``register(keys, at, time=)``, ``delete(...)``, ``list(keys)``
        self.timers = Timers(backend, event_time=states is not None and states.event_time)

    def get_many(self, keys: Iterable[object]) -> Any:
        """Values of the default value state for ``keys``: declared, an Arrow array of its type (null
        where absent); untyped, a list (``None`` where absent)."""
        return self._default.get_many(keys)

    def put_many(self, keys: Iterable[object], values: Any) -> None:
        """Set values of the default value state in one write batch (``None`` clears)."""
        self._default.put_many(keys, values)

    @property
    def watermark_ms(self) -> int | None:
        """The batch's event-time watermark in epoch ms (None: the state has none yet; decision 0028):
        rows at or below it are late. The same in every attempt and delivery of the batch."""
        return None if self.states is None else self.states.watermark_ms

    @property
    def processing_time_ms(self) -> int | None:
        """The batch's processing time in epoch ms (TTL): the same in every attempt and delivery."""
        return None if self.states is None else self.states.now_ms

    def _declared(self, name: str) -> bool:
        return self.states is not None and name in self.states.variables

    def value(self, name: str) -> TypedValue | ValueState:
        return self.states.value(name) if self._declared(name) else self.backend.value(name)  # type: ignore[union-attr]

    def map(self, name: str) -> TypedMap | MapState:
        return self.states.map(name) if self._declared(name) else self.backend.map(name)  # type: ignore[union-attr]

    def list(self, name: str) -> TypedList | ListState:
        return self.states.list(name) if self._declared(name) else self.backend.list(name)  # type: ignore[union-attr]


class KeyState(BoundValueState):
    """What a per-key function gets: the default value state of one key, plus named states."""

    __slots__ = ("_access",)

    def __init__(self, access: KeyedStateAccess, key: object) -> None:
        super().__init__(access._default, key)   # a declared default: its typed get/update/clear per key
        self._access = access

    @property
    def key(self) -> object:
        return self._key

    @property
    def watermark_ms(self) -> int | None:
        """The batch's event-time watermark in epoch ms (None: none yet); see :class:`KeyedStateAccess`."""
        return self._access.watermark_ms

    @property
    def timers(self) -> BoundTimers:
        """This key's timers: ``register(at, time="processing"|"event")``, ``delete(at, time=)``, ``list()``."""
        return self._access.timers.bind(self._key)

    @property
    def processing_time_ms(self) -> int | None:
        """The batch's processing time in epoch ms (TTL)."""
        return self._access.processing_time_ms

    def value(self, name: str) -> BoundValue | BoundValueState:
        return self._access.value(name).bind(self._key)

    def map(self, name: str) -> BoundMap | BoundMapState:
        return self._access.map(name).bind(self._key)

    def list(self, name: str) -> BoundList | BoundListState:
        return self._access.list(name).bind(self._key)


def _conform(result: Any, schema: pa.Schema) -> pa.RecordBatch | None:
    if result is None:
        return None
    if isinstance(result, pa.RecordBatch):
        result = pa.Table.from_batches([result])
    if not isinstance(result, pa.Table):
        try:  # a pandas DataFrame
            result = pa.Table.from_pandas(result, preserve_index=False)
        except Exception as exc:
            raise StateFunctionError(f"the state function returned {type(result).__name__}; return a pyarrow Table "
                             f"(Arrow form) or a pandas DataFrame (pandas form), or None") from exc
    missing = [f.name for f in schema if f.name not in result.column_names]
    if missing:
        raise StateFunctionError(f"the state function's result lacks columns {missing} of the declared schema "
                         f"{schema}; it has {result.column_names}")
    columns = []
    for f in schema:
        col = result.column(f.name)
        try:
            columns.append(col.cast(f.type) if col.type != f.type else col)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise StateFunctionError(f"column {f.name!r} of the state function's result has type {col.type}, which "
                             f"cannot be cast to the declared {f.type}: {exc}") from exc
    table = pa.Table.from_arrays(columns, schema=schema).combine_chunks()
    return table.to_batches()[0] if table.num_rows else None


def _key_column(table: pa.Table, key: str) -> pa.ChunkedArray:
    if key not in table.column_names:
        raise StateEncodingError(f"key column {key!r} does not exist; the input has columns {table.column_names}")
    col = table.column(key)
    if col.null_count:
        raise StateEncodingError(f"key column {key!r} has {col.null_count} null values; filter or fill them first")
    return col


def run_arrow(batches: Iterable[pa.RecordBatch], key: str, fn: Callable[..., Any], backend: RocksDBStateBackend,
              schema: pa.Schema, states: TypedStates | None = None, *,
              max_input_bytes: int | None = None, counters: dict[str, int] | None = None) -> Iterator[pa.RecordBatch]:
    """Call ``fn(keys, rows, state)`` over the input; yield the results.

    With ``max_input_bytes``, ``rows`` holds all of the input, one call per subtask and batch, unless
    the input is larger: then each call takes the buffers that arrived until they reach that many
    bytes. So a key's rows normally reach one call, which reads and writes its state once. Without
    it (an unaligned subtask, whose cut must stop it between buffers), one call per Arrow buffer.
    ``counters["keys_touched"]``: the distinct keys of the input, once it is all read.
    """
    access = KeyedStateAccess(backend, states=states)
    held: list[pa.RecordBatch] = []
    seen: list[pa.Array] = []   # each call's distinct keys
    size = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        held.append(batch)
        size += batch.nbytes
        if max_input_bytes is None or size >= max_input_bytes:
            yield from _call_arrow(held, key, fn, access, schema, seen)
            held, size = [], 0
    if held:
        yield from _call_arrow(held, key, fn, access, schema, seen)
    if counters is not None:
        counters["keys_touched"] = _distinct(seen)


def _distinct(seen: list[pa.Array]) -> int:
    """How many distinct keys the calls' key arrays hold together (one call: its own)."""
    if len(seen) <= 1:
        return len(seen[0]) if seen else 0
    if all(a.type == seen[0].type for a in seen):
        return len(pc.unique(pa.concat_arrays(seen)))
    return len({k for a in seen for k in a.to_pylist()})   # calls of other schemas (replayed channel state)


def _call_arrow(held: list[pa.RecordBatch], key: str, fn: Callable[..., Any], access: KeyedStateAccess,
                schema: pa.Schema, seen: list[pa.Array]) -> Iterator[pa.RecordBatch]:
    """``fn`` over ``held`` as one table; buffers of another schema than the one before them (replayed
    channel state written by an earlier version of the query) start a call of their own. Each call's
    distinct keys are appended to ``seen``."""
    start = 0
    for i in range(1, len(held) + 1):
        if i < len(held) and held[i].schema.equals(held[start].schema, check_metadata=True):
            continue
        table = pa.Table.from_batches(held[start:i])
        keys = pc.unique(_key_column(table, key).combine_chunks())
        seen.append(keys)
        out = _conform(fn(keys, table, access), schema)
        if out is not None:
            yield out
        start = i


def run_pandas(batches: Iterable[pa.RecordBatch], key: str, fn: Callable[..., Any], backend: RocksDBStateBackend,
               schema: pa.Schema, states: TypedStates | None = None, *, spill_threshold: int = DEFAULT_SPILL_THRESHOLD,
               max_output_rows: int = DEFAULT_OUTPUT_ROWS, key_group_ordered: bool = False,
               counters: dict[str, int] | None = None, chunk_rows: int | None = None) -> Iterator[pa.RecordBatch]:
    """Call ``fn(key, rows, state)`` once per distinct key of ``batches``, with all of that key's rows.

    ``chunk_rows`` (``form="chunks"``): ``rows`` is an iterator of DataFrames of at most that many rows
    each. With ``key_group_ordered`` the input must then be in content order (a cut may fall inside a
    key: :mod:`sparksteward.checkpoint.unaligned.task_cut`), and each chunk is read from ``batches`` when
    the function asks for it, so the cut checks its deadline between two chunks of one key; the rows a
    function leaves unread belong to its call all the same.

    ``spill_threshold``: bytes of input held in memory before the rest spills to sorted runs under
    ``backend.directory`` (:class:`~sparksteward.state.spill.KeyedRowBuffer`); deleted at the end, on
    errors too. ``max_output_rows``: the most rows of one output batch. ``key_group_ordered``: the input
    comes in key-group order (an unaligned subtask's), so the keys of a key group are called as soon as
    a later key group begins instead of after the whole input. ``counters["keys_touched"]``: the distinct
    keys, that is the calls, once the input is all read.
    """
    access = KeyedStateAccess(backend, states=states)
    output = _Output(schema, max_output_rows)
    calls = [0]
    # one write batch for the subtask's writes (the current key reads its own): see state/buffered.py
    with KeyedRowBuffer(key, spill_threshold, backend.directory) as held, backend.buffered() as store:
        if key_group_ordered and chunk_rows:
            yield from _stream_per_key(batches, key, fn, access, output, store, calls)
        elif key_group_ordered:
            for _ in _complete_key_groups(batches, key, held, backend):
                for table in held.drain():
                    yield from _call_per_key(table, key, fn, access, output, store, calls, chunk_rows)
        else:
            for batch in batches:
                if batch.num_rows:
                    _key_column(pa.Table.from_batches([batch]), key)
                    held.add(batch)
        for table in held.drain():
            yield from _call_per_key(table, key, fn, access, output, store, calls, chunk_rows)
    if counters is not None:
        counters["keys_touched"] = calls[0]
    yield from output.flush()


def _complete_key_groups(batches: Iterable[pa.RecordBatch], key: str, held: KeyedRowBuffer,
                         backend: RocksDBStateBackend) -> Iterator[None]:
    """Add ``batches`` (in key-group order) to ``held``; yield whenever every key group it holds is
    complete, that is a later key group has begun (a key's rows are all in its key group)."""
    m, key_type = backend.max_parallelism, backend.key_type
    pending: int | None = None   # the key group of the rows held, which the next batch may continue
    for batch in batches:
        if batch.num_rows == 0:
            continue
        keys = _key_column(pa.Table.from_batches([batch]), key)

        def group(i: int, keys: pa.ChunkedArray = keys) -> int:
            return key_group(keys[i].as_py(), m, key_type)

        first, last = group(0), group(batch.num_rows - 1)
        if pending is not None and first < pending:
            raise StateError(f"the input of this subtask is not in key-group order (key group {first} after "
                             f"{pending}); an unaligned subtask's input must be (checkpoint.cut.merge_by_key_group)")
        if pending is not None and first != pending:
            yield
        if first != last:   # the first row of the last key group: rows before it complete what is held
            lo, hi = 1, batch.num_rows - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if group(mid) == last:
                    hi = mid
                else:
                    lo = mid + 1
            held.add(batch.slice(0, lo))
            yield
            batch = batch.slice(lo)
        held.add(batch)
        pending = last


def _runs(table: pa.Table | pa.RecordBatch, key: str) -> list[int]:
    """Where the runs of equal keys of ``table`` start, and its length."""
    n = table.num_rows
    starts = [0]
    if n > 1:
        keys = table.column(key)
        changed = pc.not_equal(keys.slice(1), keys.slice(0, n - 1)).to_numpy(zero_copy_only=False)
        starts.extend((np.flatnonzero(changed) + 1).tolist())
    starts.append(n)
    return starts


def _call_per_key(table: pa.Table, key: str, fn: Callable[..., Any], access: KeyedStateAccess,
                  output: _Output, store: BufferedStore, calls: list[int],
                  chunk_rows: int | None = None) -> Iterator[pa.RecordBatch]:
    """Call ``fn`` once per key of ``table`` (sorted by ``key``) with the key's rows as a DataFrame (with
    ``chunk_rows``: an iterator of DataFrames of at most that many rows); ``calls[0]`` counts the calls."""
    starts = _runs(table, key)
    frame = table.to_pandas()
    values = frame[key]
    rows_of = _row_slicer(frame)
    calls[0] += len(starts) - 1
    for start, end in zip(starts, starts[1:]):
        k = values.iat[start]
        store.next_key()
        rows = rows_of(start, end) if not chunk_rows else \
            (rows_of(at, min(end, at + chunk_rows)) for at in range(start, end, chunk_rows))
        result = fn(k, rows, KeyState(access, k))
        if result is not None:
            yield from output.add(result, k)


def _stream_per_key(batches: Iterable[pa.RecordBatch], key: str, fn: Callable[..., Any], access: KeyedStateAccess,
                    output: _Output, store: BufferedStore, calls: list[int]) -> Iterator[pa.RecordBatch]:
    """Call ``fn(key, chunks, state)`` once per run of a key in ``batches`` (a key's rows are contiguous),
    each chunk read from ``batches`` only when ``fn`` asks for it (the cut checks its deadline there)."""
    source = iter(batches)
    current: list[Any] = []   # the batch being read: [frame, rows_of, run starts, next run]
    failed: list[BaseException] = []   # the input's own error (a cut another attempt recorded), raised as is

    def load() -> bool:
        try:
            for batch in source:
                if batch.num_rows:
                    _key_column(pa.Table.from_batches([batch]), key)
                    frame = batch.to_pandas()
                    current[:] = [frame, _row_slicer(frame), _runs(batch, key), 0]
                    return True
        except BaseException as exc:   # raised inside the function's loop: not the function's failure
            failed.append(exc)
            raise
        current.clear()
        return False

    def key_at() -> Any:
        frame, _, starts, i = current
        return frame[key].iat[starts[i]]

    def chunks(k: Any) -> Iterator[Any]:
        while True:
            _, rows_of, starts, i = current
            current[3] = i + 1
            yield rows_of(starts[i], starts[i + 1])
            if current[3] < len(starts) - 1 or not load() or key_at() != k:
                return

    if not load():
        return
    while current:
        k = key_at()
        calls[0] += 1
        store.next_key()
        rows = chunks(k)
        try:
            result = fn(k, rows, KeyState(access, k))
            for _ in rows:   # the rows the function left unread: read past them
                pass
        except BaseException:
            if failed:
                raise failed[0] from None
            raise
        if failed:   # the function caught it
            raise failed[0]
        if result is not None:
            yield from output.add(result, k)


def _row_slicer(frame: Any) -> Callable[[int, int], Any]:
    """``rows(start, end)``: rows ``[start, end)`` of ``frame`` as a DataFrame of their own, indexed
    from 0, sharing the column data. pandas' block manager slices in about a third of the time of
    ``iloc`` plus a new index (``benchmarks/bench_per_key_calls.py``), which counts at one call per key;
    the public path serves a pandas without it."""
    import pandas as pd

    mgr = getattr(frame, "_mgr", None)
    from_mgr = getattr(type(frame), "_from_mgr", None)
    if mgr is None or from_mgr is None or not hasattr(mgr, "get_slice") or not hasattr(mgr, "set_axis"):
        def public(start: int, end: int) -> Any:
            rows = frame.iloc[start:end].copy(deep=False)   # a frame of its own (no SettingWithCopy on a write)
            rows.index = pd.RangeIndex(end - start)
            return rows
        return public

    def sliced(start: int, end: int) -> Any:
        part = mgr.get_slice(slice(start, end), axis=1)
        part.set_axis(1, pd.RangeIndex(end - start))
        return from_mgr(part, axes=part.axes)
    return sliced


class _Output:
    """The per-key function's results, as record batches of at most ``max_rows`` rows in the declared
    schema. Rows (a tuple in the schema's column order, a dict by column name, or a list of them) are
    gathered and converted column by column; DataFrames are collected and cast together."""

    def __init__(self, schema: pa.Schema, max_rows: int) -> None:
        import pandas as pd

        self._frame_type = pd.DataFrame   # looked up once, not on every key's call
        self.schema = schema
        self.max_rows = max(1, int(max_rows))
        self._names = schema.names
        self._frames: list[Any] = []
        self._tuples: list[tuple[Any, ...]] = []
        self._rows = 0

    def add(self, result: Any, key: object) -> Iterator[pa.RecordBatch]:
        """Take ``key``'s result: a row, a list of rows or a DataFrame; anything else, or a bad row, is
        refused naming the key."""
        if isinstance(result, tuple):
            self._tuples.append(self._row(result, key))
            self._rows += 1
        elif isinstance(result, (list, dict)):
            rows = result if isinstance(result, list) else [result]
            self._tuples.extend(self._row(r, key) for r in rows)
            self._rows += len(rows)
        elif isinstance(result, self._frame_type):
            if not len(result):
                return
            self._frames.append(result)
            self._rows += len(result)
        else:
            raise StateFunctionError(f"key {key!r}: the state function returned {type(result).__name__}; return a "
                                     f"row (a tuple in the schema's column order, or a dict), a list of rows, a "
                                     f"pandas DataFrame, or None")
        if self._rows >= self.max_rows:
            yield from self.flush()

    def _row(self, row: Any, key: object) -> tuple[Any, ...]:
        names = self._names
        if isinstance(row, tuple):
            if len(row) != len(names):
                raise StateFunctionError(f"key {key!r}: the state function returned a row of {len(row)} values "
                                         f"{row!r:.200}; the declared schema has {len(names)} columns {names}: "
                                         f"return one value per column, in that order")
            return row
        if isinstance(row, dict):
            missing = [n for n in names if n not in row]
            if missing:
                raise StateFunctionError(f"key {key!r}: the state function returned a row without columns "
                                         f"{missing} of the declared schema {names}; it has {list(row)[:20]}")
            return tuple(row[n] for n in names)
        raise StateFunctionError(f"key {key!r}: the state function returned a list holding {type(row).__name__}; "
                                 f"a list must hold rows (tuples in the order of {names} or dicts by column name)")

    def flush(self) -> Iterator[pa.RecordBatch]:
        import pandas as pd

        if self._tuples:
            tuples, self._tuples = self._tuples, []
            yield from self._sliced(self._from_rows(tuples))
        if self._frames:
            frames, self._frames = self._frames, []
            yield from self._sliced(_conform(pd.concat(frames, ignore_index=True), self.schema))
        self._rows = 0

    def _from_rows(self, rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
        columns = []
        for f, values in zip(self.schema, zip(*rows)):
            try:
                columns.append(pa.array(values, type=f.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError) as exc:
                bad = next((v for v in values if not _fits(v, f.type)), None)
                raise StateFunctionError(f"column {f.name!r} of the state function's rows cannot hold "
                                 f"{type(bad).__name__} {bad!r:.80} as the declared {f.type}: {exc}") from None
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)

    def _sliced(self, batch: pa.RecordBatch | None) -> Iterator[pa.RecordBatch]:
        if batch is not None:
            for offset in range(0, batch.num_rows, self.max_rows):
                yield batch.slice(offset, self.max_rows)


def _fits(value: Any, arrow_type: pa.DataType) -> bool:
    try:
        pa.array([value], type=arrow_type)
    except Exception:   # noqa: BLE001 - only to name the first value that does not fit
        return False
    return True
