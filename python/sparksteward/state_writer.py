"""Writing keyed state offline (issue 39): a savepoint bootstrapped from DataFrames, or derived from
another one with variables transformed, added or dropped and the parallelism or max parallelism
changed. The result is an ordinary savepoint: ``restore_from`` and ``spark.read.format("steward-state")``
read it, and nothing is ever written into a source.

**The DataFrames** have the columns a read of the variable gives (:mod:`sparksteward.state_source`):
``key, value`` for a value state, ``key, value`` (one row per element) for a list state, ``key,
map_key, value`` for a map state, ``key, time_domain, timestamp_ms`` for the timers
(``"__timers__"``); typed as declared, the key column of one type in all. Optional columns: ``expires_ms``
(a declared TTL's expiry in epoch ms; default: the savepoint's time plus the TTL) and, for a list,
``position`` (its elements' order; default: the DataFrame's order).

**How it runs.** Each DataFrame is encoded where it is (a ``mapInArrow`` per variable: the RocksDB key,
key group and subtask of every row, its value in the state's row encoding, its TTL index key), all
variables are routed to their subtask together and sorted by RocksDB key within it, and each subtask's
task writes its rows with RocksDB's SST writer (one SST per subtask, another past 256 MB), ingests them
into an empty DB (the bottom level: nothing is rewritten) and uploads its files to the target. The driver writes
``_metadata`` last: a target holds a whole savepoint or none, and a failed write deletes what it put
there. A key written twice in one variable (a value state's key, a map entry, a list position) is
refused by name.

**One writer per target.** Before any task runs, the driver creates ``_writing`` in the target
exclusively (a staged link locally, a conditional PUT on an object store): a second write to the same
target, from this application or another, is refused by name while the first runs, and neither ever
deletes a file of the other's. ``_writing`` goes after ``_metadata``; one left by a writer that died
names it and stays until the target is deleted.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import orjson

from sparksteward.errors import CheckpointError, StateError, StateSchemaError

__all__ = ["derive_savepoint", "write_savepoint"]

TIMERS = "__timers__"
_ROW_SCHEMA = "s int, k binary, v binary"
_KEY_TYPES = {"string": "string", "bigint": "long", "int": "int", "binary": "binary"}
WRITING = "_writing"   # the claim of the one write into a target


# --- checks on the driver ---------------------------------------------------------------------------
def _columns(name: str, kind: str) -> tuple[list[str], list[str]]:
    """The required and the optional columns of a DataFrame for variable ``name`` of ``kind``."""
    if name == TIMERS:
        return ["key", "time_domain", "timestamp_ms"], []
    required = ["key", "map_key", "value"] if kind == "map" else ["key", "value"]
    return required, (["expires_ms", "position"] if kind == "list" else ["expires_ms"])


def _spark_type(t: Any) -> Any:
    from pyspark.sql.pandas.types import from_arrow_type

    return from_arrow_type(t)


def check_data(record: Mapping[str, Any], data: Mapping[str, Mapping[str, str]]) -> str:
    """Refuse data that does not match the declarations ``record`` (before anything is written), naming
    the variable, the column and the fix; ``data`` maps each variable to its columns and their Spark
    SQL types (``simpleString``). Returns the key type they share."""
    from sparksteward.state.declared import variables_of

    variables = variables_of(record)
    key_type: str | None = None
    for name, fields in data.items():
        var = variables.get(name)
        if var is None and name != TIMERS:
            known = ", ".join(sorted(variables)) or "none"
            raise StateSchemaError(f"data for variable {name!r}, which is not declared (declared: {known}); declare "
                                   f"it in states=[...], or leave it out")
        kind = "timers" if var is None else var.spec.kind
        required, optional = _columns(name, kind)
        missing = [c for c in required if c not in fields]
        extra = [c for c in fields if c not in required and c not in optional]
        if missing or extra:
            raise StateSchemaError(f"the DataFrame for {name!r} ({kind}) has columns {list(fields)}; it needs "
                                   f"{required}" + (f" and may have {optional}" if optional else "") +
                                   (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else "") +
                                   ": select or rename them (a read of the variable has this shape)")
        kt = _KEY_TYPES.get(fields["key"])
        if kt is None:
            raise StateSchemaError(f"the DataFrame for {name!r}: key column is {fields['key']}; a key is "
                                   f"a string, bigint, int or binary: cast it")
        if key_type is not None and kt != key_type:
            raise StateSchemaError(f"the DataFrame for {name!r} has a {kt} key, another one a {key_type} key: one state "
                                   f"has one key type, cast them alike")
        key_type = kt
        wanted: dict[str, Any] = {"expires_ms": "bigint", "position": "bigint"}
        if var is None:
            wanted.update(time_domain="string", timestamp_ms="bigint")
        else:
            wanted["value"] = _spark_type(var.spec.type).simpleString()
            if var.spec.kind == "map":
                assert var.spec.key_type is not None
                wanted["map_key"] = _spark_type(var.spec.key_type).simpleString()
            if "expires_ms" in fields and var.spec.ttl_ms is None:
                raise StateSchemaError(f"the DataFrame for {name!r} has expires_ms, but {name!r} is declared without "
                                       f"a TTL: drop the column, or declare the variable with ttl=")
        for column, spark_type in wanted.items():
            if column in fields and fields[column] != spark_type:
                raise StateSchemaError(
                    f"the DataFrame for {name!r}: column {column!r} is {fields[column]} but must be "
                    f"{spark_type} (the declaration): cast it, e.g. df.withColumn({column!r}, "
                    f"df[{column!r}].cast({spark_type!r}))")
    if key_type is None:
        raise StateSchemaError("a savepoint is written from data for at least one variable: data={} is empty")
    return key_type


def check_target(url: str, avoid: Sequence[str]) -> None:
    """Refuse a target that holds anything, or is, contains or lies under one of ``avoid`` (checkpoint
    dirs, the source), naming the overlap; nothing is written."""
    from sparksteward.checkpoint.duplicate import overlaps, place
    from sparksteward.checkpoint.restore import _NOT_A_SAVEPOINT_NAME
    from sparksteward.checkpoint.storage import METADATA_FILE
    from sparksteward.storage import open_location

    last = url.rstrip("/").rsplit("/", 1)[-1]
    if _NOT_A_SAVEPOINT_NAME.match(last) or last == "restored":
        raise CheckpointError(f"savepoint {url!r} ends in {last!r}, which restore_from reads as a checkpoint of a "
                              f"state; nothing was written. Give it another last name, such as <state>-sp-1")
    target = place(url)
    for where in avoid:
        if overlaps(target, place(where)):
            raise CheckpointError(f"savepoint {url!r} overlaps {where}: a written savepoint must not be, contain or lie "
                                  f"under a checkpoint dir or its source; nothing was written. Pick a path outside them")
    for parent in _ancestors(url):   # a state's root holds its lease; a checkpoint or savepoint its record
        for marker in ("_lease", METADATA_FILE):
            if parent.exists(parent.path(marker)):
                raise CheckpointError(f"savepoint {url!r} lies inside {parent.url}, which holds a {marker} (a state's "
                                      f"root, a checkpoint or a savepoint); nothing was written. Pick a path outside "
                                      f"every checkpoint dir and savepoint")
    held = _files_under(open_location(url))
    if WRITING in held:
        raise CheckpointError(_claimed(url, open_location(url)))
    if held:
        raise CheckpointError(f"savepoint target {url!r} is not empty ({len(held)} files, e.g. {held[0]!r}); nothing "
                              f"was written. Write a savepoint into a new directory")


def _claimed(url: str, loc: Any) -> str:
    """The error for a target another write holds (what its ``_writing`` says of it)."""
    try:
        who = orjson.loads(loc.read_bytes(loc.path(WRITING)))
        by = f"by {who.get('host')} pid {who.get('pid')} since {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(who['started_ms'] / 1000))} UTC"
    except Exception:  # noqa: BLE001 - unreadable or gone meanwhile: the claim is still what refuses
        by = "by another writer"
    return (f"savepoint target {url!r} is being written {by} ({WRITING} is there); nothing was written. Wait for that "
            f"write or pick another target; if that writer died, delete {url} and write again")


def _claim(url: str, loc: Any) -> None:
    """Create the target's ``_writing`` exclusively, or refuse (another write holds it)."""
    import socket

    info = {"host": socket.gethostname(), "pid": os.getpid(), "started_ms": int(time.time() * 1000)}
    if not loc.create_exclusive(loc.path(WRITING), orjson.dumps(info)):
        raise CheckpointError(_claimed(url, loc))


# --- the tasks ----------------------------------------------------------------------------------------
class _Keys:
    """What :func:`~sparksteward.state.views.raw_keys` needs of a backend, over every key group."""

    def __init__(self, key_type: str, max_parallelism: int) -> None:
        from sparksteward.state.keygroups import KeyGroupRange, KeyType

        self.key_type = KeyType.parse(key_type)
        self.max_parallelism = max_parallelism
        self.key_groups = KeyGroupRange(0, max_parallelism)

    def owned_key(self, key: object) -> Any:
        from sparksteward.state.keygroups import key_bytes

        key_bytes(key, self.key_type)   # raises the error naming a key of the wrong type
        return None


def _encoder(name: str, var_json: Any, key_type: str, m: int, p: int, now_ms: int) -> Callable[[Iterator[Any]], Any]:
    """The ``mapInArrow`` function that turns a variable's rows into ``(subtask, RocksDB key, value)``."""

    def encode(batches: Iterator[Any]) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa

        from sparksteward.state.declared import variables_of
        from sparksteward.state.encoding import KIND_LIST, KIND_MAP, KIND_VALUE
        from sparksteward.state.keygroups import subtask_for_key_group
        from sparksteward.state.rows import RowCodec
        from sparksteward.state.timers import _OFFSET, _by_key_prefix, _by_time, _domain, timer_at
        from sparksteward.state.typed.ttl import KIND_EXPIRY, KIND_EXPIRY_EVENT, index_key
        from sparksteward.state.views import raw_keys, state_middle

        keys_of: Any = _Keys(key_type, m)
        var = None if var_json is None else variables_of(var_json)[name]
        subtask_of = [subtask_for_key_group(m, p, g) for g in range(m)]
        for batch in batches:
            if batch.num_rows == 0:
                continue
            key_col = batch.column("key")
            if key_col.null_count:
                raise StateError(f"variable {name!r}: the key column has {key_col.null_count} null values; a key "
                                 f"cannot be null: filter or fill them first")
            keys = key_col.to_pylist()
            if var is None:   # timers: two entries each, by time and by key
                raw = raw_keys(keys_of, b"", keys)
                out_k: list[bytes] = []
                for r, domain, at in zip(raw, batch.column("time_domain").to_pylist(),
                                         batch.column("timestamp_ms").to_pylist()):
                    group, kb = r[:2], r[6:]
                    if domain not in ("processing", "event") or at is None:
                        raise StateError(f"timers: time_domain {domain!r} / timestamp_ms {at!r}: a timer has the "
                                         f"domain 'processing' or 'event' and a time in epoch ms")
                    d, ms = _domain(domain), timer_at(at)
                    out_k += [_by_time(group, d, ms, kb), _by_key_prefix(group, kb) + d + (ms + _OFFSET).to_bytes(8, "big")]
                out_v = [b""] * len(out_k)
            else:
                kind = {"value": KIND_VALUE, "list": KIND_LIST, "map": KIND_MAP}[var.spec.kind]
                entries = raw_keys(keys_of, state_middle(kind, name), keys)
                if var.spec.kind == "map":
                    mks = batch.column("map_key")
                    if mks.null_count:
                        raise StateError(f"map state {name!r}: {mks.null_count} null map keys; a map key cannot be null")
                    entries = [e + mk for e, mk in zip(entries, RowCodec(name, var.spec.key_type).encode(mks))]
                elif var.spec.kind == "list":
                    pos = batch.column("position")
                    if pos.null_count or (len(pos) and pa.compute.min(pos).as_py() < 0):
                        raise StateError(f"list state {name!r}: position must be a non-negative bigint in every row")
                    entries = [e + q.to_bytes(8, "big") for e, q in zip(entries, pos.to_pylist())]
                expiry: Any = None
                if var.spec.ttl_ms is not None:
                    given = batch.column("expires_ms") if "expires_ms" in batch.schema.names else None
                    default = now_ms + var.spec.ttl_ms
                    expiry = (np.full(batch.num_rows, default, dtype=np.int64) if given is None
                              else np.asarray(given.fill_null(default).to_numpy(zero_copy_only=False), dtype=np.int64))
                out_v = var.codec().encode(batch.column("value"), expiry=expiry)
                out_k = list(entries)
                if expiry is not None:
                    index = KIND_EXPIRY_EVENT if var.spec.ttl_time == "event" else KIND_EXPIRY
                    out_k += [index_key(e, int(x), index) for e, x in zip(entries, expiry.tolist())]
                    out_v = [*out_v, *([b""] * len(entries))]
            s = [subtask_of[(k[0] << 8) | k[1]] for k in out_k]
            yield pa.RecordBatch.from_arrays([pa.array(s, pa.int32()), pa.array(out_k, pa.binary()),
                                              pa.array(out_v, pa.binary())], names=["s", "k", "v"])

    return encode


def _writer(state: str, url: str, key_type: str, m: int, p: int, storage_options: Mapping[str, Any],
            names: Mapping[bytes, str]) -> Callable[[Iterator[Any]], Any]:
    """The ``mapInArrow`` function of a subtask's partition: rows sorted by (subtask, key) into one SST per
    key group, ingested into an empty DB and uploaded; yields ``(subtask, handle JSON)``."""

    def write(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from sparksteward.storage import options_scope

        with options_scope(dict(storage_options)):
            for subtask, handle in _write_partition(batches, state, url, key_type, m, p, names):
                yield pa.RecordBatch.from_arrays([pa.array([subtask], pa.int32()), pa.array([handle], pa.string())],
                                                 names=["subtask", "handle"])

    return write


def _write_partition(batches: Iterator[Any], state: str, url: str, key_type: str, m: int, p: int,
                     names: Mapping[bytes, str]) -> Iterator[tuple[int, str]]:
    """Rows sorted by (subtask, key) into one SST per subtask (a new one past ``_SST_BYTES``), then
    :func:`_seal`. A key equal to the one before it (found per batch with Arrow) is refused by name."""
    import numpy as np
    import pyarrow.compute as pc
    import rocksdict

    from sparksteward.state.rocksdb_options import db_options

    tmp = tempfile.mkdtemp(prefix="steward-write-")
    try:
        current: int | None = None
        files: list[str] = []
        writer: Any = None
        size = 0
        last: bytes | None = None
        for batch in batches:
            n = batch.num_rows
            if n == 0:
                continue
            s_col, k_col = batch.column("s"), batch.column("k")
            same = pc.and_(pc.equal(k_col.slice(1), k_col.slice(0, n - 1)),
                           pc.equal(s_col.slice(1), s_col.slice(0, n - 1)))
            if pc.any(same).as_py():
                raise StateError(_twice(k_col[int(np.flatnonzero(same.to_numpy(zero_copy_only=False))[0])].as_py(),
                                        names, key_type))
            ss = s_col.to_numpy()
            cuts = [0, *(np.flatnonzero(ss[1:] != ss[:-1]) + 1).tolist(), n]
            ks, vs = k_col.to_pylist(), batch.column("v").to_pylist()
            for a, b in zip(cuts[:-1], cuts[1:]):
                s = int(ss[a])
                if s != current:
                    if current is not None:
                        if writer is not None:
                            writer.finish()
                        yield current, _seal(state, url, key_type, m, p, current, files, tmp)
                    current, files, writer, size, last = s, [], None, 0, None
                if last is not None and ks[a] == last:
                    raise StateError(_twice(last, names, key_type))
                for k, v in zip(ks[a:b], vs[a:b]):
                    if writer is None or size > _SST_BYTES:
                        if writer is not None:
                            writer.finish()
                        path = os.path.join(tmp, f"s{s}-{len(files)}.sst")
                        writer = rocksdict.SstFileWriter(options=db_options(create=False))
                        writer.open(path)
                        files.append(path)
                        size = 0
                    writer[k] = v
                    size += len(k) + len(v)
                last = ks[b - 1]
        if current is not None:
            if writer is not None:
                writer.finish()
            yield current, _seal(state, url, key_type, m, p, current, files, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: bytes of keys and values per SST the writer writes before it starts another
_SST_BYTES = 256 << 20


def _twice(k: bytes, names: Mapping[bytes, str], key_type: str) -> str:
    """The error of a RocksDB key written twice: which variable and key."""
    from sparksteward.state.encoding import split_key
    from sparksteward.state.keygroups import KeyType, decode_key

    try:
        _, _, name, kb, rest = split_key(k)
        what = {b"": ""}.get(rest, " (the same map key, or list position, twice)")
        return (f"variable {name!r} has key {decode_key(kb, KeyType.parse(key_type))!r} twice in the data{what}: "
                f"a savepoint holds one value per key; deduplicate the DataFrame first")
    except Exception:  # noqa: BLE001 - a timer's or an index key: name what it is
        return f"an entry was given twice in the data ({names.get(k[2:3], 'state')}): deduplicate the DataFrame first"


def _seal(state: str, url: str, key_type: str, m: int, p: int, subtask: int, files: list[str], tmp: str) -> str:
    """Ingest ``files`` into an empty DB of ``subtask``, snapshot it, upload it; its handle as JSON."""
    from sparksteward.checkpoint.storage import CheckpointStorage
    from sparksteward.checkpoint.task.transfer import upload_snapshot
    from sparksteward.state.backend import RocksDBStateBackend
    from sparksteward.state.keygroups import key_group_range
    from sparksteward.storage import open_location

    groups = key_group_range(m, p, subtask)
    work = os.path.join(tmp, f"db-{subtask}")
    backend = RocksDBStateBackend(work, groups, m, key_type)
    if files:
        backend.ingest(files, move=True)
    snap = backend.snapshot(os.path.join(tmp, f"snap-{subtask}"))
    backend.close()
    storage = CheckpointStorage(open_location(url), state)
    result = upload_snapshot(storage, snap.path, subtask, groups)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(snap.path, ignore_errors=True)
    return orjson.dumps(result.handle.to_json()).decode()


# --- the driver ---------------------------------------------------------------------------------------
def write_savepoint(spark: Any, url: str, *, state: str, states: Sequence[Any], data: Mapping[str, Any],
                    parallelism: int, max_parallelism: int, processing_ms: int | None = None,
                    watermark_ms: int | None = None, properties: Mapping[str, Any] | None = None,
                    avoid: Sequence[str] = (), source: str = "bootstrap") -> str:
    """Write a savepoint at ``url`` from ``data`` (variable name -> DataFrame) of a state declared by
    ``states``; return the URL of its ``_metadata`` (see the module docstring)."""
    from pyspark.sql import functions as F

    from sparksteward.checkpoint.begun import CheckpointTime
    from sparksteward.checkpoint.records import SubtaskHandle
    from sparksteward.checkpoint.storage import METADATA_FILE
    from sparksteward.ids import validate_id
    from sparksteward.state.declared import resolve, variables_of
    from sparksteward.state.keygroups import validate_parallelism
    from sparksteward.state_source import _session_defaults
    from sparksteward.storage import open_location, options_scope

    validate_id(state, "state name")
    validate_parallelism(parallelism, max_parallelism)
    record = resolve(None, states, state=state)
    key_type = check_data(record, {n: {f.name: f.dataType.simpleString() for f in df.schema.fields}
                                   for n, df in data.items()})
    session = _session_defaults(spark)
    storage_options = session["storage"]
    now = int(time.time() * 1000) if processing_ms is None else int(processing_ms)
    loc = open_location(url)
    with options_scope(storage_options):
        check_target(url, [*avoid, session["path"]])
    variables = variables_of(record)
    parts = []
    for name, df in data.items():
        var = variables.get(name)
        if var is not None and var.spec.kind == "list" and "position" not in df.columns:
            df = df.withColumn("position", F.monotonically_increasing_id())   # the DataFrame's order
        if "expires_ms" not in df.columns and var is not None and var.spec.ttl_ms is not None:
            df = df.withColumn("expires_ms", F.lit(None).cast("bigint"))
        var_json = None if var is None else record
        parts.append(df.mapInArrow(_encoder(name, var_json, key_type, max_parallelism, parallelism, now), _ROW_SCHEMA))
    rows = parts[0]
    for more in parts[1:]:
        rows = rows.unionByName(more)
    rows = _routed(rows, parallelism).sortWithinPartitions("s", "k")
    names = {b"t": "timers", b"u": "timers", b"x": "TTL index", b"y": "TTL index"}
    written = rows.mapInArrow(_writer(state, url, key_type, max_parallelism, parallelism, storage_options, names),
                              "subtask int, handle string")
    with options_scope(storage_options):
        _claim(url, loc)   # from here on the target's files are this call's
    try:
        with options_scope(storage_options):
            group = f"steward-write-savepoint-{os.getpid()}-{time.monotonic_ns()}"
            sc = spark.sparkContext
            before_group = sc.getLocalProperty("spark.jobGroup.id")
            sc.setJobGroup(group, f"write_savepoint {url}")
            try:
                got = {r.subtask: SubtaskHandle.from_json(orjson.loads(r.handle)) for r in written.collect()}
            except Exception as exc:
                from sparksteward.keyed_spark import as_ours, task_failure

                _await_tasks(sc, group)   # a task still uploading would write after the discard below
                failure = task_failure(exc)
                if failure is None:
                    raise
                raise as_ours(failure, exc) from None
            finally:
                sc.setLocalProperty("spark.jobGroup.id", before_group)
            _commit(loc, got, record, state, key_type, parallelism, max_parallelism,
                    {**dict(properties or {}), "time": CheckpointTime(now, watermark_ms).to_json(), "savepoint_of": source})
    except BaseException:
        with options_scope(storage_options):
            _discard(loc)
        raise
    return loc.display(loc.path(METADATA_FILE))


def _await_tasks(sc: Any, group: str, timeout: float = 120.0) -> None:
    """Wait until no task of job group ``group`` runs (a failed job's other tasks are being killed, and
    one may still upload), at most ``timeout`` seconds."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stages = [tracker.getStageInfo(s) for j in tracker.getJobIdsForGroup(group)
                  for s in (getattr(tracker.getJobInfo(j), "stageIds", None) or [])]
        if not any(st is not None and st.numActiveTasks > 0 for st in stages):
            return
        time.sleep(0.1)


def _commit(loc: Any, got: Mapping[int, Any], record: Mapping[str, Any], state: str, key_type: str, p: int, m: int,
            properties: Mapping[str, Any]) -> None:
    """Write the savepoint's ``_metadata`` at ``loc`` (last) over the subtasks' handles ``got`` (an empty
    DB uploaded here for each subtask no row went to), after deleting what no handle references."""
    from sparksteward.checkpoint.records import CheckpointMetadata
    from sparksteward.checkpoint.storage import METADATA_FILE
    from sparksteward.state.keygroups import KeyType

    url = loc.url
    handles = [got[i] if i in got else _empty(state, url, key_type, m, p, i) for i in range(p)]
    meta = CheckpointMetadata(state, 0, p, m, tuple(handles), key_type=KeyType.parse(key_type), created_at=time.time(),
                              properties={**properties, "states": dict(record)})
    _drop_unreferenced(loc, meta)
    loc.write_atomic(loc.path(METADATA_FILE), meta.to_bytes())   # a savepoint without it is none
    loc.delete(loc.path(WRITING))


def _routed(rows: Any, p: int) -> Any:
    from pyspark.sql import functions as F

    from sparksteward.routing import route_sql

    if hasattr(rows, "repartitionById"):
        return rows.repartitionById(p, "s")
    return rows.withColumn("__route", F.expr(route_sql("s", p))).repartition(p, "__route").drop("__route")


def _empty(state: str, url: str, key_type: str, m: int, p: int, subtask: int) -> Any:
    """The handle of a subtask no row went to: an empty DB, uploaded from the driver."""
    from sparksteward.checkpoint.records import SubtaskHandle

    tmp = tempfile.mkdtemp(prefix="steward-write-")
    try:
        return SubtaskHandle.from_json(orjson.loads(_seal(state, url, key_type, m, p, subtask, [], tmp)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ancestors(url: str) -> list[Any]:
    """The locations of the directories above ``url``, nearest first (up to the store's root)."""
    import posixpath

    from sparksteward.storage import open_location

    scheme, sep, rest = url.rstrip("/").rpartition("://")
    out = []
    path = rest
    while True:
        parent = posixpath.dirname(path)
        if not parent or parent == path or (scheme and scheme != "file" and "/" not in parent):
            break   # a bucket is not a directory of ours
        out.append(open_location(f"{scheme}{sep}{parent}"))
        path = parent
    return out


def _files_under(loc: Any) -> list[str]:
    """Every file under ``loc``, relative to it (none when it does not exist)."""
    root = loc.root.rstrip("/")
    try:
        found = loc.fs.find(root)
    except FileNotFoundError:
        return []
    return sorted(p[len(root) + 1:] for p in found if p.startswith(root + "/"))


def _drop_unreferenced(loc: Any, meta: Any) -> None:
    """Delete the files a failed or speculative task attempt uploaded that ``meta`` does not reference."""
    keep = {f.path for f in meta.files()} | {WRITING}
    for path in _files_under(loc):
        if path not in keep:
            loc.delete(loc.path(path))


def _discard(loc: Any) -> None:
    """Remove what a failed write put under the target (which held no file when it began), its claim last."""
    for path in _files_under(loc):
        if path != WRITING:
            loc.delete(loc.path(path))
    loc.delete(loc.path(WRITING))


def derive_savepoint(spark: Any, url: str, *, source: str, states: Sequence[Any] | None = None,
                     transform: Mapping[str, Callable[[Any], Any]] | None = None,
                     add: Mapping[str, Any] | None = None, drop: Sequence[str] = (),
                     parallelism: int | None = None, max_parallelism: int | None = None,
                     avoid: Sequence[str] = ()) -> str:
    """A new savepoint at ``url`` from the checkpoint or savepoint ``source``: every variable read (with
    its TTL expiries, lists in order, and the timers), ``transform[name](df)`` applied, ``add`` put in,
    ``drop`` left out, declared by ``states`` (default: the source's declarations, less the dropped),
    at ``parallelism`` and ``max_parallelism`` (default: the source's). The source is only read."""
    from pyspark.sql import functions as F

    from sparksteward.state.declared import DEFAULT_VARIABLE, StateSpec, variables_of
    from sparksteward.state_source import _one, _options, _session_defaults

    session = _session_defaults(spark)
    opts = _options({"path": source}, session)
    _, meta = _one(opts)
    declared = variables_of(meta.properties.get("states"))
    unknown = [n for n in [*drop, *(transform or {})] if n not in declared and n != TIMERS]
    if unknown:
        raise StateSchemaError(f"source {source!r} declares no variable {unknown[0]!r} (declared: "
                               f"{', '.join(sorted(declared)) or 'none'}): name one of them")
    if DEFAULT_VARIABLE not in declared and DEFAULT_VARIABLE not in drop and \
            not spark.read.format("steward-state").load(source).isEmpty():
        raise StateSchemaError(
            f"source {source!r} holds values of the undeclared default value state (JSON text), which a derived "
            f"savepoint cannot carry untyped: declare it in states= (value_state({DEFAULT_VARIABLE!r}, <type>)) and "
            f"add= its values parsed from a read of it, or leave it out with drop=[{DEFAULT_VARIABLE!r}]")
    specs = list(states) if states is not None else [v.spec for n, v in sorted(declared.items()) if n not in drop]
    if not all(isinstance(s, StateSpec) for s in specs):
        raise StateSchemaError("states= takes value_state(...), list_state(...) and map_state(...) declarations")
    data: dict[str, Any] = {}
    for name in [*sorted(declared), TIMERS]:
        if name in drop or (name != TIMERS and name not in {s.name for s in specs}):
            continue
        var = declared.get(name)
        reader = spark.read.format("steward-state").option("variable", name)
        if var is not None and var.spec.ttl_ms is not None:
            reader = reader.option("expiry", "true")
        df = reader.load(source)
        if var is not None and var.spec.kind == "list":   # the read gives each list in order
            df = df.withColumn("position", F.monotonically_increasing_id())
        if name in (transform or {}):
            df = transform[name](df)   # type: ignore[index]
        if name == TIMERS and df.isEmpty():
            continue
        data[name] = df
    data.update(add or {})
    props = {k: v for k, v in meta.properties.items() if k in ("event_time",)}
    when = meta.properties.get("time") or {}
    return write_savepoint(spark, url, state=meta.state, states=specs, data=data,
                           parallelism=parallelism or meta.parallelism,
                           max_parallelism=max_parallelism or meta.max_parallelism,
                           processing_ms=when.get("processing_ms"), watermark_ms=when.get("watermark_ms"),
                           properties=props, avoid=[*avoid, source], source=source)
