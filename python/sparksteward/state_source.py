"""Reading keyed state offline with Spark (issue 39, first slice): two Python data sources over a
checkpoint directory, registered for a session by ``Steward.get(spark)``.

``spark.read.format("steward-state")`` reads one variable of one retained checkpoint or savepoint,
without the state being opened in the session, and never writes into the source::

    df = (spark.read.format("steward-state")
          .option("state", "clicks")
          .option("checkpoint_id", 12)             # default: the latest completed
          .option("variable", "recent")            # default: the default value state
          .load("s3://bucket/checkpoints"))        # the checkpoint dir (default spark.steward.checkpoint.dir)
    df = spark.read.format("steward-state").load("s3://bucket/savepoints/clicks-1")   # or a chk-<N> dir

``Steward.read_state(state, ...)`` / ``read_state(url=...)`` run the same checks in the caller first, so
bad input raises our error there rather than wrapped in Spark's.

Its rows are those of :mod:`sparksteward.checkpoint.reader`: ``key, value`` per key of a value state
(the default one as JSON text unless declared), per element of a list state, ``key, map_key, value`` per
entry of a map state, typed by the declarations the checkpoint recorded; ``variable="__timers__"``:
the registered timers, ``key, time_domain, timestamp_ms``. ``expiry=true``: a last column
``expires_ms``, each entry's TTL expiry in epoch ms on its TTL's clock (null without a TTL). Entries whose TTL expired at
the read's time (fixed when the read is planned) are left out. Each subtask of the checkpoint is
restored and decoded by a task on an executor (merged files with ranged reads), consecutive subtasks
grouped into ``partitions`` tasks (default: the session's default parallelism, at most one per subtask),
so a large state reads in parallel and never passes through the driver.

``spark.read.format("steward-state-metadata")`` lists a state's retained checkpoints: id, parallelism,
max parallelism, key type, the declared variables, bytes and files, the processing time and
watermark, and when it completed.

Options of both: ``state`` (none: the path is a checkpoint or savepoint), ``cluster_id`` (default: the registering session's
``spark.steward.cluster-id``) and the path; ``storage_options``, a JSON object of fsspec options per
protocol (as ``spark.steward.storage.options``), default the registering session's; ``partitions``
(``steward-state`` only, above). A bad path,
state, checkpoint id or variable is refused by name, listing what exists.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from sparksteward.errors import CheckpointNotFoundError, StateError

__all__ = ["METADATA_SCHEMA", "StateMetadataSource", "StateSource", "read_state", "register", "resolve"]

METADATA_SCHEMA = ("checkpoint_id long, parallelism int, max_parallelism int, key_type string, variables string, "
                   "size_bytes long, files int, processing_ms long, watermark_ms long, created_at double")


def _options(options: Any, session: dict[str, Any]) -> dict[str, Any]:
    """The source's options, checked: path, state, cluster id, checkpoint id, variable, storage options."""
    from sparksteward.ids import validate_id

    state = options.get("state")
    path = options.get("path") or (session.get("path") if state else None)
    if not path:
        raise StateError("a steward-state read needs a path: a checkpoint dir with .option('state', name) (default "
                         "dir: the session's spark.steward.checkpoint.dir), or a checkpoint (chk-<N>) or savepoint "
                         "URL: .load(url)")
    raw_id = options.get("checkpoint_id")
    try:
        checkpoint_id = None if raw_id in (None, "", "latest") else int(raw_id)
    except ValueError:
        raise StateError(f"option checkpoint_id={raw_id!r} is not a checkpoint id: pass an integer, or leave it out "
                         f"for the latest completed checkpoint") from None
    raw_from = options.get("changes_from")
    try:
        changes_from = None if raw_from in (None, "") else int(raw_from)
    except ValueError:
        raise StateError(f"option changes_from={raw_from!r} is not a checkpoint id: pass the id of a retained "
                         f"checkpoint older than checkpoint_id (steward-state-metadata lists them)") from None
    if changes_from is not None and not state:
        raise StateError("option changes_from needs the checkpoint dir and .option('state', name): the two "
                         "checkpoints are found among the state's retained ones")
    raw_parts = options.get("partitions")
    try:
        partitions = int(raw_parts) if raw_parts not in (None, "") else session.get("cores")
        if partitions is not None and partitions < 1:
            raise ValueError
    except ValueError:
        raise StateError(f"option partitions={raw_parts!r} is not a positive integer: pass how many tasks read the "
                         f"subtasks (default: the session's default parallelism)") from None
    storage = session.get("storage") or {}
    if options.get("storage_options"):
        try:
            storage = orjson.loads(options["storage_options"])
        except orjson.JSONDecodeError as exc:
            raise StateError(f"option storage_options is not a JSON object of fsspec options per protocol, such as "
                             f'{{"s3": {{"endpoint_url": "http://..."}}}}: {exc}') from None
        if not isinstance(storage, dict) or not all(isinstance(v, dict) for v in storage.values()):
            raise StateError(f"option storage_options={options['storage_options']!r} must map protocols to objects "
                             f'of options, such as {{"s3": {{"endpoint_url": "http://..."}}}}')
    return {"path": str(path), "state": None if not state else validate_id(str(state), "state name"),
            "cluster_id": validate_id(str(options.get("cluster_id") or session.get("cluster_id") or "default"),
                                      "cluster id"),
            "checkpoint_id": checkpoint_id, "variable": options.get("variable") or None, "storage": storage,
            "expiry": _flag(options.get("expiry"), "expiry"), "changes_from": changes_from, "partitions": partitions}


def _flag(raw: Any, name: str) -> bool:
    if raw in (None, "", "false", "False", False):
        return False
    if raw in ("true", "True", True):
        return True
    raise StateError(f"option {name}={raw!r} must be true or false")


def _records(opts: dict[str, Any]) -> tuple[Any, dict[int, Any]]:
    """The state's storage and its readable retained records (the restored starting point left out)."""
    from sparksteward.checkpoint.removal import read_records, subdirs
    from sparksteward.checkpoint.storage import RESTORED, CheckpointStorage
    from sparksteward.errors import StewardError
    from sparksteward.storage import open_location, options_scope

    with options_scope(opts["storage"]):
        storage = CheckpointStorage.open(opts["path"], opts["state"], opts["cluster_id"])
        records, unreadable = read_records(storage)
        records.pop(RESTORED, None)
        if not records:
            try:
                names = subdirs(open_location(opts["path"]).child(opts["cluster_id"]))
            except (OSError, StewardError):
                names = []
            bad = f"; unreadable records: {'; '.join(unreadable)}" if unreadable else ""
            raise CheckpointNotFoundError(
                f"state {opts['state']!r} has no completed checkpoint in {storage.url}{bad}. Pass the checkpoint dir "
                f"the application used (spark.steward.checkpoint.dir) and the state's name"
                + (f"; states of cluster id {opts['cluster_id']!r} there: {', '.join(names)}" if names else ""))
    return storage, records


def _one(opts: dict[str, Any]) -> tuple[Any, Any]:
    """A checkpoint (``chk-<N>``) or savepoint URL without a state name: its storage and record."""
    from sparksteward.checkpoint.storage import open_checkpoint
    from sparksteward.storage import options_scope

    with options_scope(opts["storage"]):
        try:
            storage, meta = open_checkpoint(opts["path"])
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"{opts['path']} holds no _metadata, so it is not a checkpoint (chk-<N>) or savepoint: pass one, or "
                f"a checkpoint dir with .option('state', name)") from None
    if opts["checkpoint_id"] not in (None, meta.checkpoint_id):
        raise StateError(f"{opts['path']} is checkpoint {meta.checkpoint_id} of state {meta.state!r}, not checkpoint "
                         f"{opts['checkpoint_id']}: leave checkpoint_id out, or pass the checkpoint dir and state")
    return storage, meta


def resolve(opts: dict[str, Any]) -> tuple[str, Any, Any]:
    """The state root URL, the checkpoint record a read of ``opts`` (checked by :func:`_options`) reads
    and, with ``changes_from``, the older record its changes are from (else None)."""
    if opts["state"] is None:
        storage, meta = _one(opts)
        return storage.url, meta, None
    storage, records = _records(opts)
    cid = opts["checkpoint_id"]
    meta = records[max(records)] if cid is None else _retained(opts, records, cid)
    older = None if opts["changes_from"] is None else _retained(opts, records, opts["changes_from"])
    if older is not None:
        from sparksteward.checkpoint.changes import check_pair

        check_pair(older, meta)
    return storage.url, meta, older


def _retained(opts: dict[str, Any], records: dict[int, Any], cid: int) -> Any:
    if cid not in records:
        raise CheckpointNotFoundError(f"state {opts['state']!r} has no retained checkpoint {cid}; retained: "
                                      f"{', '.join(map(str, sorted(records)))} (older ones were subsumed)")
    return records[cid]


class StateSource(DataSource):
    """``spark.read.format("steward-state")``: one variable of one checkpoint (see the module docstring)."""

    #: the storage options (``storage``) and cluster id of the session that registered the source
    session: dict[str, Any] = {}

    @classmethod
    def name(cls) -> str:
        return "steward-state"

    def _resolved(self) -> tuple[dict[str, Any], str, Any, Any]:
        """The options and the checkpoint, resolved once: the planner calls :meth:`schema`, then
        :meth:`reader` on this instance, and both must see the same checkpoint (a newer "latest" may
        declare other types) without reading the state's records twice."""
        if getattr(self, "_found", None) is None:
            opts = _options(self.options, self.session)
            self._found = (opts, *resolve(opts))
        return self._found

    def schema(self) -> Any:
        from pyspark.sql.pandas.types import from_arrow_schema

        from sparksteward.checkpoint.changes import changes_schema
        from sparksteward.checkpoint.reader import variable_schema

        opts, _, meta, older = self._resolved()
        if older is not None:
            return from_arrow_schema(changes_schema(older, meta, opts["variable"], opts["expiry"]))
        return from_arrow_schema(variable_schema(meta, opts["variable"], opts["expiry"]))

    def reader(self, schema: Any) -> DataSourceReader:
        opts, root, meta, older = self._resolved()
        return _StateReader(opts, root, meta.to_json(), int(time.time() * 1000),
                            None if older is None else older.to_json())


class _StateReader(DataSourceReader):
    def __init__(self, opts: dict[str, Any], root: str, meta_json: dict[str, Any], now_ms: int,
                 older_json: dict[str, Any] | None = None) -> None:
        self.opts, self.root, self.meta_json, self.now_ms = opts, root, meta_json, now_ms
        self.older_json = older_json

    def partitions(self) -> list[InputPartition]:
        """Consecutive subtasks per partition, as many partitions as the ``partitions`` option (at most one per
        subtask): a Python task costs a fixed 0.1-0.2 s on a small cluster, more than reading a subtask of
        125k keys, so one task per core reads faster than one per subtask."""
        n = len(self.meta_json["subtasks"])
        parts = min(n, self.opts.get("partitions") or n)
        return [InputPartition(tuple(range(n * i // parts, n * (i + 1) // parts))) for i in range(parts)]

    def read(self, partition: InputPartition) -> Any:
        """The partition's subtasks one by one, each restored into a scratch dir of this task's process and
        decoded."""
        from sparksteward.checkpoint.records import CheckpointMetadata
        from sparksteward.checkpoint.storage import CheckpointStorage
        from sparksteward.storage import open_location, options_scope

        indexes = partition.value if isinstance(partition.value, tuple) else (partition.value,)
        meta = CheckpointMetadata.from_bytes(orjson.dumps(self.meta_json), f"checkpoint of {self.root}")
        for index in indexes:
            with options_scope(self.opts["storage"]):
                storage = CheckpointStorage(open_location(self.root), meta.state)
                try:
                    table = self._table(storage, meta, index)
                except CheckpointNotFoundError as exc:
                    raise _subsumed(storage, meta, self.older_json, exc) from exc
            yield from table.to_batches(max_chunksize=65536)

    def _table(self, storage: Any, meta: Any, index: int) -> Any:
        """The rows of subtask ``meta.subtasks[index]``: its variable, or its changes since the older record."""
        from sparksteward.checkpoint.reader import read_variable
        from sparksteward.checkpoint.records import CheckpointMetadata

        subtasks = [meta.subtasks[index].subtask]
        if self.older_json is not None:   # the change feed from an older checkpoint to this one
            from sparksteward.checkpoint.changes import read_changes

            older = CheckpointMetadata.from_bytes(orjson.dumps(self.older_json), f"checkpoint of {self.root}")
            return read_changes(storage, older, meta, self.opts["variable"], subtasks=subtasks,
                                expiry=self.opts["expiry"])
        return read_variable(storage, meta, self.opts["variable"], subtasks=subtasks, now_ms=self.now_ms,
                             expiry=self.opts["expiry"])


def _subsumed(storage: Any, meta: Any, older_json: dict[str, Any] | None, exc: Exception) -> Exception:
    """``exc`` (a file of the read missing), named as a subsumption when the live writer has meanwhile
    removed a checkpoint the read was reading: the read's records were resolved when it was planned."""
    ids = [meta.checkpoint_id] + ([] if older_json is None else [int(older_json["checkpoint_id"])])
    try:
        retained = storage.checkpoint_ids()
    except Exception:  # noqa: BLE001 - the listing failed too: the file's own error says enough
        return exc
    gone = [i for i in ids if i not in retained]
    if not gone or meta.properties.get("savepoint_of") is not None:
        return exc
    return CheckpointNotFoundError(
        f"checkpoint {gone[0]} of state {meta.state!r} was subsumed by its live writer while this read ran (its files "
        f"were deleted; retained now: {', '.join(map(str, retained)) or 'none'}). Read again (the latest by default), "
        f"or keep more checkpoints with keyed_state(num_retained=...) or spark.steward.checkpoint.num-retained "
        f"(detail: {str(exc).split(': the checkpoint is incomplete')[0]})")


class StateMetadataSource(DataSource):
    """``spark.read.format("steward-state-metadata")``: a state's retained checkpoints, one row each."""

    session: dict[str, Any] = {}

    @classmethod
    def name(cls) -> str:
        return "steward-state-metadata"

    def schema(self) -> str:
        return METADATA_SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        from sparksteward.checkpoint.begun import time_of
        from sparksteward.state.declared import variables_of

        opts = _options(self.options, self.session)
        records = _records(opts)[1] if opts["state"] else {(meta := _one(opts)[1]).checkpoint_id: meta}
        rows = []
        for cid, meta in sorted(records.items()):
            when = time_of(meta)
            declared = {n: v.spec.kind for n, v in sorted(variables_of(meta.properties.get("states")).items())}
            rows.append((cid, meta.parallelism, meta.max_parallelism, meta.key_type.value,
                         orjson.dumps(declared).decode(), meta.size, len(meta.files()),
                         None if when is None else when.processing_ms, None if when is None else when.watermark_ms,
                         meta.created_at))
        return _Rows(rows)


class _Rows(DataSourceReader):
    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = rows

    def read(self, partition: InputPartition) -> Any:
        yield from self.rows


def register(spark: Any) -> None:
    """Register both sources for ``spark``, with its ``spark.steward.storage.options`` and
    ``spark.steward.cluster-id`` as their defaults (the subclasses carry them, so the planner and the
    tasks open the store as the agents do)."""
    session = _session_defaults(spark)
    for base in (StateSource, StateMetadataSource):
        # a class of its own, pickled by value with the session's defaults (cloudpickle: not importable by name)
        cls = type(base.__name__, (base,), {"session": session, "__module__": __name__,
                                           "__qualname__": f"{base.__name__}.<session>"})
        spark.dataSource.register(cls)


def _session_defaults(spark: Any) -> dict[str, Any]:
    """The storage options, cluster id and checkpoint dir of ``spark``'s conf, as its agents use them."""
    from sparksteward.checkpoint.coordination.driver_service import default_checkpoint_dir
    from sparksteward.config import StewardConfig, parse_setting
    from sparksteward.storage import OPTIONS_KEY

    conf = {k: v for k, v in spark.sparkContext.getConf().getAll() if k.startswith("spark.steward.")}
    cfg = StewardConfig.from_conf(conf, warn=False)
    return {"storage": parse_setting(OPTIONS_KEY, spark.conf.get(OPTIONS_KEY, None)) or {},
            "cluster_id": cfg.cluster_id, "path": default_checkpoint_dir(cfg),
            "cores": int(spark.sparkContext.defaultParallelism)}


def read_state(spark: Any, state: str | None = None, *, url: str | None = None, checkpoint_dir: str | None = None,
               checkpoint_id: int | None = None, variable: str | None = None, metadata: bool = False,
               expiry: bool = False, changes_from: int | None = None) -> Any:
    """``Steward.read_state``: the checks of the data source run here first, so bad input raises our
    error in the caller's process (not wrapped in Spark's), then the lazy DataFrame."""
    if (state is None) == (url is None) or (url is not None and checkpoint_dir is not None):
        raise StateError(f"read_state takes a state name (with checkpoint_dir, default the session's) or the url of a "
                         f"checkpoint (chk-<N>) or savepoint, one of them; got state={state!r}, url={url!r}, "
                         f"checkpoint_dir={checkpoint_dir!r}")
    session = _session_defaults(spark)
    given = {"path": url or checkpoint_dir, "state": state, "checkpoint_id": checkpoint_id, "variable": variable,
             "expiry": "true" if expiry else None, "changes_from": changes_from}
    opts = _options({k: None if v is None else str(v) for k, v in given.items()}, session)
    from sparksteward.checkpoint.reader import variable_schema

    if metadata and changes_from is not None:
        raise StateError("read_state: metadata=True lists the checkpoints; changes_from reads the changes of a "
                         "variable: pass one of them")
    _, meta, older = resolve(opts)
    if not metadata:
        variable_schema(meta, opts["variable"], opts["expiry"])
        if older is not None:
            from sparksteward.checkpoint.changes import changes_schema

            changes_schema(older, meta, opts["variable"], opts["expiry"])
        checkpoint_id = meta.checkpoint_id   # the one checked here, not a newer latest by the time Spark plans
    reader = spark.read.format("steward-state-metadata" if metadata else "steward-state")
    for name, value in (("state", state), ("checkpoint_id", checkpoint_id), ("variable", variable),
                        ("expiry", "true" if expiry else None), ("changes_from", changes_from),
                        ("partitions", session["cores"])):
        if value is not None and not (metadata and name != "state"):
            reader = reader.option(name, str(value))
    return reader.load(opts["path"])
