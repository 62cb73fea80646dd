"""The change feed of keyed state (issue 39): what changed in one variable between two retained
checkpoints of a state, computed from the files the checkpoints hold, never by replaying the stream.

For each subtask of the newer checkpoint ``B`` the older ``A`` is restored beside it (at ``B``'s
parallelism when they differ) and a RocksDB key is a *candidate* when it may differ between them:

- **a key of a file ``B`` holds and ``A`` does not** (name and checksum: SSTs and kept WAL): those files
  are linked into a scratch dir and RocksDB's repair builds a DB of them alone, whose keys are read;
- **a key that may have been deleted**: a new file with deletions (point or range) covers a key range,
  whose keys of the variable in ``A`` are candidates (only that range, per key group);
- **a key of a file ``A`` holds and ``B`` does not** (a compaction may have dropped it with its
  tombstone);
- **a key whose TTL ran out between the two**: ``A``'s expiry index between ``A``'s clock and ``B``'s.

Each candidate is read in both; an entry is *present* in a checkpoint when it is stored there and alive
by that checkpoint's own clock (its processing time, or its watermark for event-time TTL). Present in
``B`` and absent or other bytes in ``A``: an ``upsert`` with ``B``'s value; present in ``A`` and absent
in ``B``: a ``delete`` with the value it had in ``A``. Equal bytes in both are no change. A TTL that an
on-read access renewed changes the stored bytes, so it is an upsert of the same value.

When the parallelism differs, file names say nothing (every subtask's files were rebuilt), so every key
of the variable in both is a candidate: correct, and as costly as reading both. A different max
parallelism moves every key to another key group and is refused.

Rows: the columns of :func:`~sparksteward.checkpoint.reader.variable_schema` for ``B``'s declaration,
then ``change_type`` (``upsert`` or ``delete``) and ``checkpoint_id`` (``B``'s), per subtask the upserts
then the deletes, each in key order.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import pyarrow as pa

from sparksteward.checkpoint.begun import time_of
from sparksteward.checkpoint.reader import (
    DEFAULT_STATE,
    TIMERS,
    _json_default,
    _variable,
    decode_entries,
    variable_schema,
)
from sparksteward.checkpoint.records import CheckpointMetadata, SubtaskHandle
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.cache import LocalFileCache
from sparksteward.checkpoint.task.subtask_restore import open_read_only, restore_subtask_backend
from sparksteward.errors import StateError
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.declared import variables_of
from sparksteward.state.encoding import KIND_LIST, KIND_MAP, KIND_VALUE
from sparksteward.state.timers import KIND_TIMER_BY_TIME
from sparksteward.state.typed import EXPIRY_KINDS, TypedStates
from sparksteward.state.views import _prefix_upper, state_middle

__all__ = ["changes_schema", "check_pair", "read_changes"]

_KINDS = {"value": KIND_VALUE, "list": KIND_LIST, "map": KIND_MAP}
_EXPIRY_AT = slice(3, 11)   # an expiry-index key: group (2) | kind (1) | expiry (8) | the entry's key without its group


def check_pair(older: CheckpointMetadata, newer: CheckpointMetadata) -> None:
    """Refuse a pair whose changes cannot be computed, naming both checkpoints and the fix."""
    if older.state != newer.state:
        raise StateError(f"changes are between two checkpoints of one state: checkpoint {older.checkpoint_id} is of "
                         f"state {older.state!r}, checkpoint {newer.checkpoint_id} of {newer.state!r}")
    if older.checkpoint_id >= newer.checkpoint_id:
        raise StateError(f"changes_from={older.checkpoint_id} must name a checkpoint older than checkpoint "
                         f"{newer.checkpoint_id} of state {newer.state!r}: pass the older one as changes_from")
    if older.max_parallelism != newer.max_parallelism:
        raise StateError(f"state {newer.state!r}: checkpoint {older.checkpoint_id} has max parallelism "
                         f"{older.max_parallelism} and checkpoint {newer.checkpoint_id} {newer.max_parallelism}, "
                         f"so every key lies in another key group and no change feed is computed across them; read "
                         f"both checkpoints and join them on the key instead")
    if older.key_type != newer.key_type:
        raise StateError(f"state {newer.state!r}: checkpoint {older.checkpoint_id} has key type "
                         f"{older.key_type.value} and checkpoint {newer.checkpoint_id} {newer.key_type.value}; "
                         f"no change feed is computed across a key type change")


def changes_schema(older: CheckpointMetadata, newer: CheckpointMetadata, variable: str | None,
                   expiry: bool = False) -> pa.Schema:
    """The columns :func:`read_changes` returns (see the module docstring)."""
    check_pair(older, newer)
    schema = variable_schema(newer, variable, expiry)
    return schema.append(pa.field("change_type", pa.string())).append(pa.field("checkpoint_id", pa.int64()))


def read_changes(storage: CheckpointStorage, older: CheckpointMetadata, newer: CheckpointMetadata,
                 variable: str | None = None, *, subtasks: Iterable[int] | None = None, expiry: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> pa.Table:
    """The changes of ``variable`` from ``older`` to ``newer`` (both of ``storage``'s state) in the given
    subtasks of ``newer`` (default all), as a table of :func:`changes_schema`."""
    schema = changes_schema(older, newer, variable, expiry)
    wanted = None if subtasks is None else set(subtasks)
    handles = [h for h in newer.subtasks if wanted is None or h.subtask in wanted]
    tmp = tempfile.mkdtemp(prefix="steward-changes-")
    tables: list[pa.Table] = []
    try:
        cache = LocalFileCache(f"{tmp}/cache")
        for done, handle in enumerate(handles, 1):
            tables.append(_subtask_changes(storage, older, newer, handle, variable, schema, Path(tmp), cache))
            if progress is not None:
                progress(done, len(handles))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _clock(meta: CheckpointMetadata) -> tuple[int, int | None]:
    """A checkpoint's processing time and watermark (a record from before times: when it completed)."""
    when = time_of(meta)
    if when is None:
        return int(meta.created_at * 1000), None
    return when.processing_ms, when.watermark_ms


def _middle(meta: CheckpointMetadata, variable: str | None) -> bytes:
    """What follows the key group in every RocksDB key of ``variable``."""
    if variable == TIMERS:
        return KIND_TIMER_BY_TIME
    if _json_default(meta, variable):
        return state_middle(KIND_VALUE, DEFAULT_STATE)
    var = _variable(meta, variable or DEFAULT_STATE)
    return state_middle(_KINDS[var.spec.kind], var.spec.name)


def _alive(backend: RocksDBStateBackend, meta: CheckpointMetadata, variable: str | None,
           middle: bytes) -> Callable[[bytes | None], bool] | None:
    """Whether a stored value of ``variable`` is present in ``meta`` (by its clock); None: the variable
    has no entries there (not declared, or declared of another kind)."""
    if variable == TIMERS or _json_default(meta, variable):
        return lambda v: v is not None
    name = variable or DEFAULT_STATE
    var = variables_of(meta.properties.get("states")).get(name)
    if var is None or state_middle(_KINDS[var.spec.kind], name) != middle:
        return None
    now, watermark = _clock(meta)
    view = TypedStates(backend, meta.properties.get("states"), now, 0, watermark)._view(name, var.spec.kind)
    return view._alive


def _subtask_changes(storage: CheckpointStorage, older: CheckpointMetadata, newer: CheckpointMetadata,
                     handle: SubtaskHandle, variable: str | None, schema: pa.Schema, tmp: Path,
                     cache: LocalFileCache) -> pa.Table:
    s = handle.subtask
    middle = _middle(newer, variable)
    before = next(h for h in older.subtasks if h.subtask == s) if older.parallelism == newer.parallelism else None
    b = open_read_only(storage, newer, handle, tmp / f"b{s}", cache)
    try:
        a = (open_read_only(storage, older, before, tmp / f"a{s}", cache) if before is not None else
             restore_subtask_backend(storage, older, s, tmp / f"a{s}", cache, parallelism=newer.parallelism)[0])
        try:
            keys = (_candidates(a, before, handle, cache, tmp / f"x{s}", older, newer, middle) if before is not None
                    else _every_key(a, middle) | _every_key(b, middle))
            return _diff(a, b, older, newer, variable, middle, sorted(keys), schema)
        finally:
            a.close()
    finally:
        b.close()


def _in_variable(keys: Iterable[bytes], middle: bytes) -> set[bytes]:
    n = 2 + len(middle)
    return {k for k in keys if k[2:n] == middle}


def _every_key(backend: RocksDBStateBackend, middle: bytes, lower: bytes = b"", upper: bytes | None = None) -> set[bytes]:
    """The keys of the variable ``middle`` in ``backend``'s key groups, within ``[lower, upper)``."""
    found: set[bytes] = set()
    groups = backend.key_groups
    first = max(groups.start, int.from_bytes(lower[:2].ljust(2, b"\0"), "big"))
    last = groups.stop - 1 if upper is None else min(groups.stop - 1, int.from_bytes(upper[:2], "big"))
    for g in range(first, last + 1):
        lo = g.to_bytes(2, "big") + middle
        hi = _prefix_upper(lo)
        lo, hi = max(lo, lower), hi if upper is None else min(hi, upper)
        if lo < hi:
            found.update(backend.keys_between(lo, hi))
    return found


def _candidates(a: RocksDBStateBackend, before: SubtaskHandle, after: SubtaskHandle, cache: LocalFileCache,
                scratch: Path, older: CheckpointMetadata, newer: CheckpointMetadata, middle: bytes) -> set[bytes]:
    """The keys of the variable that may differ between ``a`` (restored from ``before``) and the DB of
    ``after`` (see the module docstring)."""
    had = {f.name: f.checksum for f in before.files}
    has = {f.name: f.checksum for f in after.files}
    new = [f for f in after.files if _is_data(f.name) and had.get(f.name) != f.checksum]
    gone = [f for f in before.files if _is_data(f.name) and has.get(f.name) != f.checksum]
    keys: set[bytes] = set()
    for side, files in (("new", new), ("gone", gone)):
        for n, f in enumerate(files):
            found, deleted = _file_keys(f, cache, scratch / f"{side}{n}")
            keys |= _in_variable(found, middle)
            for lower, upper in deleted if side == "new" else ():   # what a tombstone there may have deleted
                keys |= _every_key(a, middle, lower, upper + b"\0")
    keys |= _expiring(a, middle, older, newer)
    return keys


def _is_data(name: str) -> bool:
    return name.endswith((".sst", ".log"))


def _file_keys(f: Any, cache: LocalFileCache, where: Path) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """The keys one file puts (its content from ``cache``, where the restores put it), and the key range
    it holds when it also deletes: a scratch DB of that file alone, built by RocksDB's repair (which also
    turns a WAL into a table), or, for an SST that a DB ingested (``SstFileWriter``'s, which repair
    refuses), by ingesting it into an empty DB."""
    import rocksdict

    from sparksteward.state.rocksdb_options import db_options, open_db

    path = cache.lookup(f.checksum)
    if path is None:   # the restores above fetched every file of both; a cache that lost one is a bug
        raise StateError(f"file {f.name} ({f.checksum}) is not in the local cache after its restore")
    where.mkdir(parents=True)
    if f.name.endswith(".sst"):
        os.link(path, where / f.name)
    else:   # a WAL is read (and may be rewritten) by the repair: never share the cache's inode
        shutil.copyfile(path, where / f.name)
    rocksdict.Rdict.repair(str(where), db_options(create=False))
    db = open_db(where, db_options(create=False), read_only=True)
    if f.name.endswith(".sst") and not db.live_files():   # repair set it aside (lost/): an ingested SST
        db.close()
        fresh = where.parent / f"{where.name}.ingested"
        db = open_db(fresh, db_options(create=True))
        opts = rocksdict.IngestExternalFileOptions()
        opts.set_move_files(False)
        db.ingest_external_file([str(path)], opts)
    try:
        deleted = [(m["start_key"], m["end_key"]) for m in db.live_files() if m["num_deletions"]]
        return cast(list[bytes], list(cast(Any, db.keys()))), deleted
    finally:
        db.close()


def _expiring(a: RocksDBStateBackend, middle: bytes, older: CheckpointMetadata, newer: CheckpointMetadata) -> set[bytes]:
    """Keys of ``a``'s expiry indexes whose expiry lies between the older clocks and the newer ones."""
    (now_a, wm_a), (now_b, wm_b) = _clock(older), _clock(newer)
    since = max(0, min(now_a, now_a if wm_a is None else wm_a))
    until = max(now_b, now_b if wm_b is None else wm_b) + 1
    found: set[bytes] = set()
    for g in range(a.key_groups.start, a.key_groups.stop):
        gb = g.to_bytes(2, "big")
        for kind in EXPIRY_KINDS:
            for k in a.keys_between(gb + kind + since.to_bytes(8, "big"), gb + kind + until.to_bytes(8, "big")):
                entry = gb + k[_EXPIRY_AT.stop:]
                if entry[2:2 + len(middle)] == middle:
                    found.add(entry)
    return found


def _diff(a: RocksDBStateBackend, b: RocksDBStateBackend, older: CheckpointMetadata, newer: CheckpointMetadata,
          variable: str | None, middle: bytes, keys: list[bytes], schema: pa.Schema) -> pa.Table:
    alive_b = _alive(b, newer, variable, middle)
    alive_a = _alive(a, older, variable, middle)
    assert alive_b is not None
    olds = _get_many(a, keys)
    news = _get_many(b, keys)
    upserts: list[tuple[bytes, bytes]] = []
    deletes: list[tuple[bytes, bytes]] = []
    for k, va, vb in zip(keys, olds, news):
        was = alive_a is not None and alive_a(va)
        if vb is not None and alive_b(vb):
            if not was or va != vb:
                upserts.append((k, vb))
        elif was and va is not None:
            deletes.append((k, va))
    cols = schema.names[:-2]
    expiry = "expires_ms" in cols
    now_b, now_a = _clock(newer)[0], _clock(older)[0]
    up = decode_entries(b, newer, variable, variable_schema(newer, variable, expiry), upserts, now_b, alive_only=False)
    parts = [_tagged(up, "upsert", newer.checkpoint_id, schema)]
    if deletes:
        old_schema = variable_schema(older, variable, expiry)
        gone = decode_entries(a, older, variable, old_schema, deletes, now_a, alive_only=False)
        try:
            gone = gone.cast(pa.schema([schema.field(n) for n in cols]))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise StateError(f"state {newer.state!r}: variable {variable or DEFAULT_STATE!r} is declared {old_schema} in "
                             f"checkpoint {older.checkpoint_id} and {schema} in checkpoint {newer.checkpoint_id}; its "
                             f"deleted entries cannot be shown as the new type ({exc}): diff checkpoints declared "
                             f"alike") from None
        parts.append(_tagged(gone, "delete", newer.checkpoint_id, schema))
    return pa.concat_tables(parts)


def _get_many(backend: RocksDBStateBackend, keys: list[bytes]) -> list[bytes | None]:
    found: Any = backend.db.get(cast(Any, keys)) if keys else []
    return cast(list[bytes | None], found)


def _tagged(table: pa.Table, change: str, checkpoint_id: int, schema: pa.Schema) -> pa.Table:
    n = table.num_rows
    columns = [*table.columns, pa.array([change] * n, pa.string()), pa.array([checkpoint_id] * n, pa.int64())]
    return pa.table(columns, schema=schema)
