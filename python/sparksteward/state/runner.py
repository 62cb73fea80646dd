"""Running a user function over one subtask's rows with its keyed state: the Arrow form, and the
per-key pandas form built on it. Spark-free: the Spark integration calls these inside ``mapInArrow``.

**Arrow form.** ``fn(keys: pyarrow.Array, rows: pyarrow.Table, state: KeyedStateAccess) ->
pyarrow.Table | None`` is called once per input batch; ``keys`` are the distinct keys of ``rows``, and
``state`` offers vectorized ``get_many(keys)``/``put_many(keys, values)`` (and named value, map and
list states).

**pandas form.** ``fn(key, rows: pandas.DataFrame, state: KeyState) -> pandas.DataFrame | None`` is
called once per distinct key of each batch, with ``state.get()``/``update(v)``/``clear()`` (and
``state.map(name)``, ``state.list(name)``) bound to that key.

Both return an iterator of ``pyarrow.RecordBatch`` in the declared output schema. Results are cast to
that schema (``mapInArrow`` does not cast) and a result that cannot be cast raises an error naming
the column.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sparksteward.errors import StateEncodingError, StateError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.typed import BoundList, BoundMap, BoundValue, TypedList, TypedMap, TypedStates, TypedValue
from sparksteward.state.views import BoundListState, BoundMapState, BoundValueState, ListState, MapState, ValueState

__all__ = ["DEFAULT_STATE", "KeyState", "KeyedStateAccess", "run_arrow", "run_pandas"]

DEFAULT_STATE = "value"


class KeyedStateAccess:
    """What an Arrow-form function gets: vectorized access to the subtask's keyed state. Declared
    variables (``states``) come as their typed views; an undeclared name gets an untyped (JSON) view."""

    def __init__(self, backend: RocksDBStateBackend, default: str = DEFAULT_STATE,
                 states: TypedStates | None = None) -> None:
        self.backend = backend
        self._default = backend.value(default)
        self.states = states

    def get_many(self, keys: Iterable[object]) -> list[Any]:
        """Values of the default value state for ``keys`` (``None`` where absent)."""
        return self._default.get_many(keys)

    def put_many(self, keys: Iterable[object], values: Iterable[object]) -> None:
        """Set values of the default value state in one write batch (``None`` clears)."""
        self._default.put_many(keys, values)

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
        super().__init__(access._default, key)
        self._access = access

    @property
    def key(self) -> object:
        return self._key

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
            raise StateError(f"the state function returned {type(result).__name__}; return a pyarrow Table "
                             f"(Arrow form) or a pandas DataFrame (pandas form), or None") from exc
    missing = [f.name for f in schema if f.name not in result.column_names]
    if missing:
        raise StateError(f"the state function's result lacks columns {missing} of the declared schema "
                         f"{schema}; it has {result.column_names}")
    columns = []
    for f in schema:
        col = result.column(f.name)
        try:
            columns.append(col.cast(f.type) if col.type != f.type else col)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise StateError(f"column {f.name!r} of the state function's result has type {col.type}, which "
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
              schema: pa.Schema, states: TypedStates | None = None) -> Iterator[pa.RecordBatch]:
    """Call ``fn(keys, rows, state)`` for every non-empty input batch; yield the results."""
    access = KeyedStateAccess(backend, states=states)
    for batch in batches:
        if batch.num_rows == 0:
            continue
        table = pa.Table.from_batches([batch])
        keys = pc.unique(_key_column(table, key).combine_chunks())
        out = _conform(fn(keys, table, access), schema)
        if out is not None:
            yield out


def run_pandas(batches: Iterable[pa.RecordBatch], key: str, fn: Callable[..., Any], backend: RocksDBStateBackend,
               schema: pa.Schema, states: TypedStates | None = None) -> Iterator[pa.RecordBatch]:
    """Call ``fn(key, rows, state)`` once per distinct key of each batch (built on :func:`run_arrow`)."""

    def per_batch(keys: pa.Array, rows: pa.Table, access: KeyedStateAccess) -> pa.Table | None:
        frame = rows.to_pandas()
        outs = []
        for k, group in frame.groupby(key, sort=False):
            res = fn(k, group.reset_index(drop=True), KeyState(access, k))
            if res is not None and len(res):
                outs.append(res)
        if not outs:
            return None
        import pandas as pd

        return pa.Table.from_pandas(pd.concat(outs, ignore_index=True), preserve_index=False)

    return run_arrow(batches, key, per_batch, backend, schema, states)
