"""Reading one state variable of a completed checkpoint, without the user's code: the rows behind
``KeyedState.read()`` (driver or distributed) and ``steward checkpoints read``.

Each subtask is restored into a scratch dir of the calling process and its entries of the variable are
decoded with the declarations the checkpoint recorded (``properties.states``):

=================  ==============================================================
variable           columns
=================  ==============================================================
``None``           ``key``, ``value``: the default value state, as JSON text (its declared type when it is declared)
a value state      ``key``, ``value`` (the declared type)
a list state       ``key``, ``value``: one row per element, in list order
a map state        ``key``, ``map_key``, ``value``
``"__timers__"``   ``key``, ``time_domain`` (``processing`` or ``event``), ``timestamp_ms``: the
                   registered timers (:data:`TIMERS`), in key-group, domain, time order
=================  ==============================================================

An entry whose TTL expired at ``now_ms`` (default: now) is not returned, as a batch would not see it.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from sparksteward.checkpoint.begun import time_of
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import open_read_only
from sparksteward.errors import StateError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.declared import DEFAULT_VARIABLE as DEFAULT_STATE
from sparksteward.state.declared import variables_of
from sparksteward.state.encoding import KIND_LIST, KIND_MAP, KIND_VALUE, decode_value, split_key
from sparksteward.state.keygroups import KeyType, decode_key
from sparksteward.state.rows import expired, expiry_of
from sparksteward.state.timers import KIND_TIMER_BY_TIME, TIMER_KINDS, parse_by_time
from sparksteward.state.typed import EXPIRY_KINDS, TypedMap, TypedStates

__all__ = ["DEFAULT_STATE", "TIMERS", "decode_entries", "read_variable", "variable_schema"]

#: the name that reads a checkpoint's registered timers instead of a variable (reserved: no declared
#: variable may have it, state/declared.py)
TIMERS = "__timers__"

_KEY_ARROW = {KeyType.STRING: pa.string(), KeyType.LONG: pa.int64(), KeyType.INT: pa.int32(),
              KeyType.BINARY: pa.binary()}
_KINDS = {"value": KIND_VALUE, "list": KIND_LIST, "map": KIND_MAP}


def _json_default(meta: CheckpointMetadata, variable: str | None) -> bool:
    """``variable`` is the default value state and ``meta`` does not declare it: its values are JSON."""
    return (variable is None or variable == DEFAULT_STATE) and DEFAULT_STATE not in variables_of(
        meta.properties.get("states"))


def variable_schema(meta: CheckpointMetadata, variable: str | None, expiry: bool = False) -> pa.Schema:
    """The columns :func:`read_variable` returns for ``variable`` of ``meta`` (see the module docstring);
    ``expiry``: a last column ``expires_ms`` (a declared variable's entries only)."""
    schema = _schema(meta, variable)
    if expiry:
        if variable == TIMERS or _json_default(meta, variable):
            raise StateError(f"expiry: {'the timers' if variable == TIMERS else 'the undeclared default value state'} "
                             f"of state {meta.state!r} have no TTL; read a declared variable with expiry")
        schema = schema.append(pa.field("expires_ms", pa.int64()))
    return schema


def _schema(meta: CheckpointMetadata, variable: str | None) -> pa.Schema:
    key = pa.field("key", _KEY_ARROW[meta.key_type])
    if variable == TIMERS:
        return pa.schema([key, pa.field("time_domain", pa.string()), pa.field("timestamp_ms", pa.int64())])
    if _json_default(meta, variable):
        return pa.schema([key, pa.field("value", pa.string())])
    var = _variable(meta, variable or DEFAULT_STATE)
    if var.spec.kind == "map":
        assert var.spec.key_type is not None
        return pa.schema([key, pa.field("map_key", var.spec.key_type), pa.field("value", var.spec.type)])
    return pa.schema([key, pa.field("value", var.spec.type)])


def _variable(meta: CheckpointMetadata, variable: str) -> Any:
    variables = variables_of(meta.properties.get("states"))
    if variable not in variables:
        known = ", ".join(f"{n} ({v.spec.kind})" for n, v in sorted(variables.items())) or "none"
        raise StateError(f"state {meta.state!r} checkpoint {meta.checkpoint_id} has no declared variable "
                         f"{variable!r}; declared: {known} (the default value state is read with no variable)")
    return variables[variable]


def read_variable(storage: CheckpointStorage, meta: CheckpointMetadata, variable: str | None = None, *,
                  subtasks: Iterable[int] | None = None, now_ms: int | None = None,
                  progress: Callable[[int, int], None] | None = None, expiry: bool = False) -> pa.Table:
    """Every entry of ``variable`` (None: the default value state) in the given ``subtasks`` (default
    all) of ``meta``, alive at ``now_ms``, as a table of :func:`variable_schema` (with ``expiry``: the
    entries' expiry in ``expires_ms``, null without a TTL).

    ``progress(done, total)`` is called after each subtask is restored and read."""
    schema = variable_schema(meta, variable, expiry)
    wanted = None if subtasks is None else set(subtasks)
    handles = [h for h in meta.subtasks if wanted is None or h.subtask in wanted]
    now = int(time.time() * 1000) if now_ms is None else now_ms
    tmp = tempfile.mkdtemp(prefix="steward-read-")
    tables: list[pa.Table] = []
    try:
        cache = LocalFileCache(f"{tmp}/cache")
        for done, handle in enumerate(handles, 1):
            backend = open_read_only(storage, meta, handle, f"{tmp}/s{handle.subtask}", cache)
            try:
                tables.append(_read_subtask(backend, meta, variable, schema, now))
            finally:
                backend.close()
            if progress is not None:
                progress(done, len(handles))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _decode_key(kt: KeyType) -> Any:
    return lambda b: decode_key(b, kt)


def _read_subtask(backend: RocksDBStateBackend, meta: CheckpointMetadata, variable: str | None, schema: pa.Schema,
                  now: int) -> pa.Table:
    fast = _value_rows(backend, meta, variable, schema, now)
    return fast if fast is not None else decode_entries(backend, meta, variable, schema, backend.iter_raw(), now)


_KEY_NUMPY = {KeyType.LONG: "<i8", KeyType.INT: "<i4"}


def _value_rows(backend: RocksDBStateBackend, meta: CheckpointMetadata, variable: str | None, schema: pa.Schema,
                now: int) -> pa.Table | None:
    """A declared value state's rows, as :func:`decode_entries` gives them but without a Python step per
    entry beyond the iteration: only the variable's keys are read (its prefix in each key group), and
    the keys are decoded as one Arrow column. None for the other variables (they take the general path)."""
    import pyarrow.compute as pc

    from sparksteward.state.views import state_middle, variable_entries

    if variable == TIMERS or _json_default(meta, variable):
        return None
    name = variable or DEFAULT_STATE
    var = _variable(meta, name)
    if var.spec.kind != "value":
        return None
    when = time_of(meta)
    view = TypedStates(backend, meta.properties.get("states"), now, 0, when.watermark_ms if when else None)._view(
        name, "value")
    middle = state_middle(KIND_VALUE, name)
    raw_keys: list[bytes] = []
    stored: list[bytes] = []
    add_key: Callable[[Any], None] = raw_keys.append   # the loop below is most of a read's time
    add_value: Callable[[Any], None] = stored.append
    for entries in variable_entries(backend.db, backend.key_groups, middle):
        for k, v in entries:
            add_key(k)
            add_value(v)
    if view.ttl is not None:   # what expired at the read's clock is not returned
        clock = view._now
        alive = [i for i, v in enumerate(stored) if not expired(v, clock)]
        if len(alive) < len(stored):
            raw_keys = [raw_keys[i] for i in alive]
            stored = [stored[i] for i in alive]
    if not raw_keys:
        return schema.empty_table()
    key_bytes = pc.binary_slice(pa.array(raw_keys, pa.binary()), 2 + len(middle) + 4, 1 << 30)   # (no stop: fails)
    kt = meta.key_type
    if kt is KeyType.STRING:
        keys: pa.Array = key_bytes.cast(pa.string())
    elif kt is KeyType.BINARY:
        keys = key_bytes
    else:
        joined = b"".join(key_bytes.to_pylist()) if len(key_bytes) else b""
        keys = pa.array(np.frombuffer(joined, dtype=_KEY_NUMPY[kt]), _KEY_ARROW[kt])
    columns = [keys, view._decode_column(stored)]
    if "expires_ms" in schema.names:
        columns.append(pa.array([expiry_of(v) for v in stored], pa.int64()))
    return pa.table(columns, schema=schema)


def decode_entries(backend: RocksDBStateBackend, meta: CheckpointMetadata, variable: str | None, schema: pa.Schema,
                   pairs: Iterable[tuple[bytes, bytes]], now: int, *, alive_only: bool = True) -> pa.Table:
    """The rows of ``variable`` (a table of ``schema``, :func:`variable_schema`) among the stored
    ``(key, value)`` ``pairs`` of ``backend`` (a subtask of ``meta``), in their order; entries of other
    variables are skipped, and so (``alive_only``) are those whose TTL expired at ``now``."""
    decode_key = _decode_key(meta.key_type)
    keys: list[Any] = []
    if variable == TIMERS:
        domains, times = [], []
        for raw_key, _ in pairs:
            if raw_key[2:3] == KIND_TIMER_BY_TIME:
                raw, timer = parse_by_time(raw_key)
                keys.append(decode_key(raw))
                domains.append(timer.time)
                times.append(timer.at)
        return pa.table([pa.array(keys, schema.field(0).type), pa.array(domains, pa.string()),
                         pa.array(times, pa.int64())], schema=schema)
    if _json_default(meta, variable):
        values: list[Any] = []
        for raw_key, raw_value in pairs:
            if raw_key[2:3] in EXPIRY_KINDS or raw_key[2:3] in TIMER_KINDS:
                continue
            _, kind, name, kb, _ = split_key(raw_key)
            if kind == KIND_VALUE and name == DEFAULT_STATE:
                keys.append(decode_key(kb))
                values.append(orjson.dumps(decode_value(raw_value)).decode())
        return pa.table([pa.array(keys, schema.field(0).type), pa.array(values, pa.string())], schema=schema)
    variable = variable or DEFAULT_STATE   # declared (typed) default
    var = _variable(meta, variable)
    when = time_of(meta)
    states = TypedStates(backend, meta.properties.get("states"), now, 0, when.watermark_ms if when else None)
    view = states._view(variable, var.spec.kind)
    now = view._now   # event-time TTL: the checkpoint's watermark
    kind = _KINDS[var.spec.kind]
    stored: list[bytes] = []
    map_keys: list[Any] = []
    for raw_key, raw_value in pairs:
        if raw_key[2:3] != kind:
            continue
        _, _, name, kb, rest = split_key(raw_key)
        if name != variable or (alive_only and expired(raw_value, now)):
            continue
        if kind == KIND_LIST and not rest:   # a whole untyped list written before the declaration
            for v in view._legacy_list(raw_value):
                keys.append(decode_key(kb))
                stored.append(view.codec.encode_py(v, 0 if view.codec.ttl else None))
            continue
        keys.append(decode_key(kb))
        stored.append(raw_value)
        if kind == KIND_MAP:
            assert isinstance(view, TypedMap)
            map_keys.append(view._map_key(rest))
    columns = [pa.array(keys, schema.field(0).type)]
    if kind == KIND_MAP:
        columns.append(pa.array(map_keys, schema.field("map_key").type))
    columns.append(view._decode_column(stored))
    if "expires_ms" in schema.names:
        columns.append(pa.array([expiry_of(v) for v in stored], pa.int64()))
    return pa.table(columns, schema=schema)
