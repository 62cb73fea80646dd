"""``steward checkpoints ls|show|gc <dir>``: keyed-state checkpoints on any fsspec URL.

- ``ls``: every state under ``<dir>/<cluster-id>/``, with its retained checkpoints, size and files;
- ``show <state>``: one checkpoint (default: the latest) per subtask, or its ``_metadata`` as JSON,
  with the physical and logical files and bytes of the merged files (FLIP-306) that the retained
  checkpoints hold, and their space amplification;
- ``read <state> [variable]``: the entries of one state variable (default: the default value state)
  of a checkpoint, decoded with the declarations it recorded (``--limit`` rows, ``--json`` for JSON lines);
- ``gc <state>``: delete shared and merged files no retained checkpoint references and staged uploads left by a
  crash, if they entered the state's directory more than ``--min-age`` ago (default 1h, so uploads of a
  running query are never touched). A file's age counts from its latest timestamp: on a local store
  the later of mtime and ctime, since a hard link (a NO_CLAIM restore) keeps the source's old mtime
  but sets the ctime; on S3 its LastModified, which a CopyObject sets. A file without a timestamp is
  kept unless ``--min-age`` is 0. Nothing is deleted while any ``_metadata`` of the state is
  unreadable (it may be a newer version's).
"""

from __future__ import annotations

import argparse
import posixpath
import time

import orjson

from sparksteward.checkpoint.merging import space_stats
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.storage import RESTORED, CheckpointStorage, checkpoint_dir_name
from sparksteward.config import StewardConfig, parse_duration
from sparksteward.errors import CheckpointError, ConfigError, StewardError
from sparksteward.state.declared import variables_of
from sparksteward.storage import open_location
from sparksteward.tables import table

__all__ = ["add_subcommands", "find_orphans"]

MB = 1 << 20


def _records(storage: CheckpointStorage) -> tuple[dict[int, CheckpointMetadata], list[str]]:
    ids = storage.checkpoint_ids()
    if storage.has_restored():
        ids.insert(0, RESTORED)
    records, unreadable = {}, []
    for cid in ids:
        try:
            records[cid] = storage.read_metadata(cid)
        except StewardError as exc:
            unreadable.append(f"{checkpoint_dir_name(cid)}: {exc}")
    return records, unreadable


def find_orphans(storage: CheckpointStorage, min_age: float, now: float) -> list[str]:
    """Relative paths under ``shared/`` and ``merged/`` that no retained checkpoint references and that
    entered the directory at least ``min_age`` seconds before ``now``."""
    records, unreadable = _records(storage)
    if unreadable:
        raise CheckpointError(f"not collecting garbage in {storage.url}: unreadable records "
                              f"({'; '.join(unreadable)}). Fix or move them first")
    referenced = set().union(*(m.physical_paths() for m in records.values())) if records else set()
    # when each file entered the directory (CheckpointStorage.file_times: a hard link's ctime counts;
    # a file without a timestamp never looks old)
    return sorted(rel for rel, entered in storage.file_times().items()
                  if rel not in referenced and (min_age <= 0 or now - entered >= min_age))


def _base(args: argparse.Namespace):
    cluster = StewardConfig.from_conf({"spark.steward.cluster-id": args.cluster_id}).cluster_id
    return open_location(args.dir).child(cluster), cluster


def _ls(args: argparse.Namespace) -> int:
    base, _ = _base(args)
    rows = []
    for info in base.listdir():
        name = posixpath.basename(info["name"].rstrip("/"))
        if info.get("type") != "directory":
            continue
        storage = CheckpointStorage(base.child(name), name)
        records, unreadable = _records(storage)
        real = sorted(c for c in records if c != RESTORED)
        latest = records[real[-1]] if real else None
        shared = storage.stored_files()
        rows.append([name, ",".join(map(str, real)) or "-", latest.parallelism if latest else "-",
                     latest.max_parallelism if latest else "-",
                     f"{latest.size / MB:.1f}" if latest else "-", len(shared),
                     "yes" if RESTORED in records else "no", len(unreadable)])
    print(f"{len(rows)} state(s) in {base.url}")
    if rows:
        print(table(rows, ["STATE", "CHECKPOINTS", "P", "MAX P", "LATEST MB", "DATA FILES", "RESTORED",
                           "UNREADABLE"]))
    return 0


def _checkpoint(args: argparse.Namespace) -> tuple[CheckpointStorage, CheckpointMetadata]:
    """The state's storage and the checkpoint ``--id`` (default: the latest) of ``args``."""
    base, _ = _base(args)
    storage = CheckpointStorage(base.child(args.state), args.state)
    ids = storage.checkpoint_ids()
    if args.id is None and not ids:
        raise CheckpointError(f"state {args.state!r} has no completed checkpoint in {storage.url}")
    return storage, storage.read_metadata(ids[-1] if args.id is None else args.id)


def _show(args: argparse.Namespace) -> int:
    storage, meta = _checkpoint(args)
    if args.json:
        print(orjson.dumps(meta.to_json(), option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"state {meta.state!r} checkpoint {meta.checkpoint_id}: parallelism {meta.parallelism}, max "
          f"parallelism {meta.max_parallelism}, key type {meta.key_type.value}, {meta.size / MB:.2f} MB, "
          f"{len(meta.files())} files")
    print(table([[s.subtask, str(s.key_groups), len(s.files), sum(f.is_segment for f in s.files),
                  f"{s.size / MB:.2f}", len(s.channel_state), sum(f.length for f in s.channel_state)]
                 for s in meta.subtasks], ["SUBTASK", "KEY GROUPS", "FILES", "SEGMENTS", "MB", "CHANNEL STATE",
                                           "CHANNEL BYTES"]))
    variables = variables_of(meta.properties.get("states"))
    if variables:
        print(table([[n, v.spec.kind, str(v.spec.type) if v.spec.kind != "map" else f"{v.spec.key_type} -> {v.spec.type}",
                      v.version, "-" if v.spec.ttl_ms is None else f"{v.spec.ttl_ms / 1000:g} s ({v.spec.ttl_update})"]
                     for n, v in sorted(variables.items())], ["STATE VARIABLE", "KIND", "TYPE", "VERSION", "TTL"]))
    records, _ = _records(storage)
    one, retained = space_stats([meta]), space_stats(records.values())
    print(table([[label, sp.physical_files, f"{sp.physical_bytes / MB:.2f}", sp.logical_files,
                  f"{sp.logical_bytes / MB:.2f}", f"{sp.amplification:.2f}", sp.whole_files,
                  f"{sp.whole_bytes / MB:.2f}"]
                 for label, sp in ((f"checkpoint {meta.checkpoint_id}", one), (f"{len(records)} retained", retained))],
                ["FILE MERGING", "PHYSICAL", "PHYSICAL MB", "LOGICAL", "LOGICAL MB", "AMPLIFICATION", "WHOLE FILES",
                 "WHOLE MB"]))
    return 0


def _read(args: argparse.Namespace) -> int:
    from sparksteward.checkpoint.reader import read_variable

    storage, meta = _checkpoint(args)
    rows = read_variable(storage, meta, args.variable).slice(0, args.limit).to_pylist()
    if args.json:
        for r in rows:
            print(orjson.dumps(r, default=str).decode())
        return 0
    columns = list(rows[0]) if rows else ["key", "value"]
    print(table([[str(r[c]) for c in columns] for r in rows], [c.upper() for c in columns]))
    return 0


def _gc(args: argparse.Namespace) -> int:
    base, _ = _base(args)
    storage = CheckpointStorage(base.child(args.state), args.state)
    try:
        min_age = parse_duration(args.min_age)
    except ValueError:
        raise ConfigError(f"--min-age {args.min_age!r} is not a duration such as 30s, 10min or 1h") from None
    orphans = find_orphans(storage, min_age, time.time())
    if args.dry_run:
        print(f"{len(orphans)} orphaned file(s) in {storage.url} (dry run)")
        for p in orphans:
            print(p)
        return 0
    deleted = storage.delete_files(orphans)
    print(f"deleted {deleted} orphaned file(s) in {storage.url}")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoints", help="keyed-state checkpoints: ls, show, gc")
    cmds = p.add_subparsers(dest="checkpoints_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("dir", help="the checkpoint dir (spark.steward.checkpoint.dir): a path or fsspec URL")
        q.add_argument("--cluster-id", default="default")

    q = cmds.add_parser("ls", help="states with their checkpoints, sizes and file counts")
    common(q)
    q.set_defaults(func=_ls)
    q = cmds.add_parser("show", help="one checkpoint of a state, per subtask")
    common(q)
    q.add_argument("state")
    q.add_argument("--id", type=int, default=None, help="checkpoint id (default: the latest)")
    q.add_argument("--json", action="store_true", help="print the _metadata record")
    q.set_defaults(func=_show)
    q = cmds.add_parser("read", help="the entries of one state variable of a checkpoint")
    common(q)
    q.add_argument("state")
    q.add_argument("variable", nargs="?", default=None, help="a declared variable (default: the default value state)")
    q.add_argument("--id", type=int, default=None, help="checkpoint id (default: the latest)")
    q.add_argument("--limit", type=int, default=20, help="rows to print (default 20)")
    q.add_argument("--json", action="store_true", help="print JSON lines")
    q.set_defaults(func=_read)
    q = cmds.add_parser("gc", help="delete shared files no retained checkpoint references")
    common(q)
    q.add_argument("state")
    q.add_argument("--min-age", default="1h", help="only delete files older than this (default 1h)")
    q.add_argument("--dry-run", action="store_true")
    q.set_defaults(func=_gc)
