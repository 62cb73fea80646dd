"""``steward state show|read|diff|bootstrap``: keyed state offline, without Spark (issue 39).

Each takes ``<url>``: a checkpoint dir with ``--state NAME`` (its retained checkpoints), or the URL
of one checkpoint (``chk-<N>``) or savepoint; ``--cluster-id`` as the applications' (default
``default``). Storage options come from ``--conf spark.steward.storage.options=JSON``, as for every
``steward`` command.

- ``show``: the checkpoints there, one line each (id, parallelism, max parallelism, key type,
  variables, size, files, processing time, watermark);
- ``read``: the entries of one variable (``--variable``, default the default value state;
  ``__timers__`` the timers) of a checkpoint (``--checkpoint N``, default the latest), decoded as
  declared, ``--expiry`` adds each entry's TTL expiry;
- ``diff``: the change feed of a variable from ``--from A`` to ``--checkpoint B`` (default the latest):
  upserts and deletes (:mod:`sparksteward.checkpoint.changes`);
- ``bootstrap``: write a savepoint at ``<url>`` from files (parquet, CSV or JSON lines), one per
  variable (``--data NAME=PATH``), declared by ``--declare`` (``NAME=value TYPE``, ``NAME=list TYPE``,
  ``NAME=map KEYTYPE -> TYPE``; ``--ttl NAME=DURATION``), at ``--parallelism`` and
  ``--max-parallelism``: the same savepoint ``Steward.write_savepoint`` writes from DataFrames, written
  by this process (for larger data, use Spark).

``--json`` prints JSON lines instead of a table; reads print a progress line on a terminal.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
from collections.abc import Iterator
from typing import Any

import orjson

from sparksteward.errors import StateError
from sparksteward.progress import TerminalProgress
from sparksteward.tables import table

__all__ = ["add_subcommands", "bootstrap_files"]


def _opts(args: argparse.Namespace) -> dict[str, Any]:
    from sparksteward.state_source import _options

    given = {"path": args.url, "state": args.state, "cluster_id": args.cluster_id,
             "checkpoint_id": getattr(args, "checkpoint", None), "variable": getattr(args, "variable", None),
             "expiry": "true" if getattr(args, "expiry", False) else None,
             "changes_from": getattr(args, "from_id", None)}
    return _options({k: None if v is None else str(v) for k, v in given.items()}, {})


def _print(rows: list[dict[str, Any]], as_json: bool, limit: int | None = None) -> None:
    rows = rows if limit is None else rows[:limit]
    if as_json:
        for r in rows:
            print(orjson.dumps(r, default=str).decode())
        return
    columns = list(rows[0]) if rows else []
    print(table([["-" if r[c] is None else str(r[c]) for c in columns] for r in rows], [c.upper() for c in columns])
          if rows else "(no rows)")


def _show(args: argparse.Namespace) -> int:
    from sparksteward.checkpoint.begun import time_of
    from sparksteward.state.declared import variables_of
    from sparksteward.state_source import _one, _records

    opts = _opts(args)
    records = _records(opts)[1] if opts["state"] else {(m := _one(opts)[1]).checkpoint_id: m}
    rows = []
    for cid, meta in sorted(records.items()):
        when = time_of(meta)
        rows.append({"checkpoint": cid, "parallelism": meta.parallelism, "max_parallelism": meta.max_parallelism,
                     "key_type": meta.key_type.value,
                     "variables": ",".join(f"{n}:{v.spec.kind}" for n, v in
                                           sorted(variables_of(meta.properties.get("states")).items())) or "-",
                     "mb": round(meta.size / (1 << 20), 2), "files": len(meta.files()),
                     "processing_time": None if when is None else _when(when.processing_ms),
                     "watermark": None if when is None or when.watermark_ms is None else _when(when.watermark_ms)})
    _print(rows, args.json)
    return 0


def _when(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat(timespec="milliseconds")


def _read(args: argparse.Namespace) -> int:
    from sparksteward.checkpoint.reader import read_variable
    from sparksteward.state_source import resolve

    opts = _opts(args)
    root, meta, _ = resolve(opts)
    storage = _storage(root, meta)
    with TerminalProgress(f"reading {meta.state} checkpoint {meta.checkpoint_id}", unit="subtasks") as progress:
        got = read_variable(storage, meta, opts["variable"], progress=progress, expiry=opts["expiry"])
    _print(got.slice(0, args.limit).to_pylist(), args.json)
    return 0


def _diff(args: argparse.Namespace) -> int:
    from sparksteward.checkpoint.changes import read_changes
    from sparksteward.state_source import resolve

    if not args.state:
        raise StateError("steward state diff needs the checkpoint dir and --state NAME: the two checkpoints are "
                         "found among the state's retained ones")
    opts = _opts(args)
    root, meta, older = resolve(opts)
    storage = _storage(root, meta)
    with TerminalProgress(f"diffing {meta.state} {older.checkpoint_id} -> {meta.checkpoint_id}",
                          unit="subtasks") as progress:
        got = read_changes(storage, older, meta, opts["variable"], progress=progress, expiry=opts["expiry"])
    _print(got.slice(0, args.limit).to_pylist(), args.json)
    return 0


def _storage(root: str, meta: Any) -> Any:
    from sparksteward.checkpoint.storage import CheckpointStorage
    from sparksteward.storage import open_location

    return CheckpointStorage(open_location(root), meta.state)


def _bootstrap(args: argparse.Namespace) -> int:
    specs = [_declaration(d, dict(_pairs(args.ttl, "--ttl"))) for d in args.declare]
    data = dict(_pairs(args.data, "--data"))
    url = bootstrap_files(args.url, state=args.state, specs=specs, files=data, parallelism=args.parallelism,
                          max_parallelism=args.max_parallelism)
    print(url)
    return 0


def _pairs(items: list[str] | None, flag: str) -> Iterator[tuple[str, str]]:
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise StateError(f"{flag} {item!r} must be NAME=VALUE")
        yield name.strip(), value.strip()


def _declaration(text: str, ttls: dict[str, str]) -> Any:
    from sparksteward.config import parse_duration
    from sparksteward.state.declared import list_state, map_state, value_state

    name, sep, rest = text.partition("=")
    kind, _, type_text = rest.strip().partition(" ")
    ttl = None
    if name.strip() in ttls:
        try:
            ttl = parse_duration(ttls[name.strip()])
        except ValueError:
            raise StateError(f"--ttl {name.strip()}={ttls[name.strip()]!r} is not a duration such as 30s or 1h") from None
    if not sep or kind not in ("value", "list", "map") or not type_text.strip():
        raise StateError(f"--declare {text!r} must be NAME=value TYPE, NAME=list TYPE or NAME=map KEYTYPE -> TYPE "
                         f"(types in Spark SQL, e.g. 'count=value bigint', 'seen=map string -> bigint')")
    if kind == "map":
        key_type, arrow, value_type = type_text.partition("->")
        if not arrow:
            raise StateError(f"--declare {text!r}: a map is declared as NAME=map KEYTYPE -> TYPE")
        return map_state(name.strip(), key_type.strip(), value_type.strip(), ttl=ttl)
    return (value_state if kind == "value" else list_state)(name.strip(), type_text.strip(), ttl=ttl)


def _load(path: str, name: str) -> Any:
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise StateError(f"--data {name}={path}: no such file")
    try:
        if path.endswith((".csv", ".csv.gz")):
            return pcsv.read_csv(path)
        if path.endswith((".json", ".jsonl", ".ndjson")):
            return pjson.read_json(path)
        return pq.read_table(path)
    except (OSError, ValueError, pa.ArrowException) as exc:  # pyarrow raises its own errors
        raise StateError(f"--data {name}={path} cannot be read as parquet, CSV or JSON lines: {exc}") from None


def bootstrap_files(url: str, *, state: str, specs: list[Any], files: dict[str, str], parallelism: int,
                    max_parallelism: int) -> str:
    """Write a savepoint at ``url`` from the files ``files`` (variable -> path), in this process."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_type

    from sparksteward.checkpoint.begun import CheckpointTime
    from sparksteward.ids import validate_id
    from sparksteward.state.declared import resolve, variables_of
    from sparksteward.state.keygroups import validate_parallelism
    from sparksteward.state_writer import _commit, _discard, _encoder, _write_partition, check_data, check_target
    from sparksteward.storage import open_location

    validate_id(state, "state name")
    validate_parallelism(parallelism, max_parallelism)
    record = resolve(None, specs, state=state)
    variables = variables_of(record)
    tables: dict[str, pa.Table] = {}
    for name, path in files.items():
        t = _load(path, name)
        var = variables.get(name)
        if var is not None:   # a file's types are what its reader guessed: cast to the declaration
            t = _cast(t, var, name, path)
            if var.spec.kind == "list" and "position" not in t.column_names:
                t = t.append_column("position", pa.array(range(t.num_rows), pa.int64()))
            if var.spec.ttl_ms is not None and "expires_ms" not in t.column_names:
                t = t.append_column("expires_ms", pa.nulls(t.num_rows, pa.int64()))
        tables[name] = t
    key_type = check_data(record, {n: {f.name: from_arrow_type(f.type).simpleString() for f in t.schema}
                                   for n, t in tables.items()})
    check_target(url, [])
    now = int(dt.datetime.now(dt.timezone.utc).timestamp() * 1000)
    rows = [b for n, t in tables.items() for b in _encoder(n, record if n in variables else None, key_type,
                                                             max_parallelism, parallelism, now)(iter(t.to_batches()))]
    loc = open_location(url)
    try:
        got = {}
        if rows:
            ordered = pa.Table.from_batches(rows).sort_by([("s", "ascending"), ("k", "ascending")])
            got = {s: _handle(h) for s, h in _write_partition(iter(ordered.to_batches()), state, url, key_type,
                                                                max_parallelism, parallelism, {})}
        _commit(loc, got, record, state, key_type, parallelism, max_parallelism,
                {"time": CheckpointTime(now).to_json(), "savepoint_of": "bootstrap"})
    except BaseException:
        _discard(loc)
        raise
    return loc.display(loc.path("_metadata"))


def _handle(text: str) -> Any:
    from sparksteward.checkpoint.records import SubtaskHandle

    return SubtaskHandle.from_json(orjson.loads(text))


def _cast(t: Any, var: Any, name: str, path: str) -> Any:
    import pyarrow as pa

    wanted = {"value": var.spec.type, "map_key": var.spec.key_type, "expires_ms": pa.int64(), "position": pa.int64()}
    for i, field in enumerate(t.schema):
        target = wanted.get(field.name)
        if target is not None and field.type != target:
            try:
                t = t.set_column(i, field.name, t.column(i).cast(target))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise StateError(f"--data {name}={path}: column {field.name!r} ({field.type}) cannot be read as "
                                 f"{target}, the declared type: {exc}") from None
    return t


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("state", help="keyed state offline: show, read, diff, bootstrap")
    cmds = p.add_subparsers(dest="state_command", required=True)

    def common(q: argparse.ArgumentParser, rows: bool = True) -> None:
        q.add_argument("url", help="a checkpoint dir (with --state), or a chk-<N> or savepoint URL")
        q.add_argument("--state", help="the state's name, when url is a checkpoint dir")
        q.add_argument("--cluster-id", default="default", help="the applications' spark.steward.cluster-id")
        q.add_argument("--json", action="store_true", help="JSON lines instead of a table")
        if rows:
            q.add_argument("--checkpoint", type=int, help="the checkpoint id (default: the latest)")
            q.add_argument("--variable", help="a declared variable (default: the default value state; __timers__)")
            q.add_argument("--expiry", action="store_true", help="add each entry's TTL expiry (expires_ms)")
            q.add_argument("--limit", type=int, default=None, help="print at most this many rows")

    q = cmds.add_parser("show", help="the checkpoints of a state, or one checkpoint or savepoint")
    common(q, rows=False)
    q.set_defaults(func=_show)
    q = cmds.add_parser("read", help="the entries of one variable of a checkpoint or savepoint")
    common(q)
    q.set_defaults(func=_read)
    q = cmds.add_parser("diff", help="what changed in one variable between two retained checkpoints")
    common(q)
    q.add_argument("--from", dest="from_id", type=int, required=True, help="the older checkpoint id")
    q.set_defaults(func=_diff)
    q = cmds.add_parser("bootstrap", help="write a savepoint from files, one per variable")
    q.add_argument("url", help="the new savepoint's URL (an empty or new directory)")
    q.add_argument("--state", required=True, help="the state's name")
    q.add_argument("--declare", action="append", required=True,
                   help="NAME=value TYPE | NAME=list TYPE | NAME=map KEYTYPE -> TYPE (repeat per variable)")
    q.add_argument("--ttl", action="append", help="NAME=DURATION: a TTL for a declared variable")
    q.add_argument("--data", action="append", required=True, help="NAME=PATH (parquet, .csv or .json lines)")
    q.add_argument("--parallelism", type=int, required=True)
    q.add_argument("--max-parallelism", type=int, default=128)
    q.set_defaults(func=_bootstrap)
