"""``steward checkpoints ls|show|read|gc|rm|savepoint``: keyed-state checkpoints on any fsspec URL.

- ``ls [dir]``: every state under ``<dir>/<cluster-id>/``, with its retained checkpoints, size and files.
  ``dir`` defaults to the embedded checkpoint dir, ``<state-dir>/checkpoints`` (the default of
  ``spark.steward.checkpoint.dir``); a dir that does not exist (or, on an object store, holds nothing)
  is an error, and so is a cluster id of which it holds no states while it holds others';
- ``show <state>``: one checkpoint (default: the latest) per subtask, or its ``_metadata`` as JSON,
  with the physical and logical files and bytes of the merged files (FLIP-306) that the retained
  checkpoints hold, and their space amplification;
- ``read <state> [variable]``: the entries of one state variable (default: the default value state)
  of a checkpoint, decoded with the declarations it recorded (``--limit`` rows, ``--json`` for JSON lines).
  Each subtask is restored into a scratch dir first; on a terminal, a progress line on stderr counts them;
- ``gc <state>``: delete shared and merged files no retained checkpoint references and staged uploads left by a
  crash, if they entered the state's directory more than ``--min-age`` ago (default 1h), under the state's
  writer lease (:func:`~sparksteward.checkpoint.removal.collect_garbage`): refused while a writer may hold
  it, naming the writer, since its uploads are unreferenced until its checkpoint completes, however old
  they are; a writer starting during gc is refused, and one that takes the lease over stops it (``--dry-run``
  takes no lease, but refuses a live writer too). A file's age counts from its latest timestamp: on a local store
  the later of mtime and ctime, since a hard link (a NO_CLAIM restore) keeps the source's old mtime
  but sets the ctime; on S3 its LastModified, which a CopyObject sets. A file without a timestamp is
  kept unless ``--min-age`` is 0. Nothing is deleted while any ``_metadata`` of the state is
  unreadable (it may be a newer version's);
- ``rm <state>``: delete a whole state (:func:`~sparksteward.checkpoint.removal.remove_state`): refused
  while a writer holds its lease; records first, then its own data files, except those another state
  claimed; ``--dry-run`` lists them. On a terminal, a progress line on stderr counts the deletes;
- ``savepoint [dir] <state> <url>``: copy a completed checkpoint (``--checkpoint N``, default: the
  latest, or the restored starting point of a state that has none) to a self-contained savepoint at
  ``url`` (:func:`~sparksteward.checkpoint.restore.write_savepoint`: S3 CopyObject or hard links
  where the stores allow, ``_metadata`` last) and print its ``_metadata`` URL; ``dir`` defaults as
  ``ls``'s. A ``url`` ending in ``chk-<N>`` or ``_metadata`` is refused (``restore_from`` would
  read it as a checkpoint of another state root). Refused while a writer may hold the state's lease
  (its coordinator subsumes checkpoints and deletes their files; ``ks.savepoint(url)`` in that
  application pins the checkpoint instead). A writer that starts during the copy keeps the
  checkpoint until newer ones subsume it, and a file that goes missing fails the copy, which deletes
  what it wrote: ``url`` holds a whole savepoint or none. On a terminal, a progress line on stderr
  counts the copied files.

Every ``<dir>`` but ``ls``'s and ``savepoint``'s is required; a state name must be a valid id
(:func:`~sparksteward.ids.validate_id`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

import orjson

from sparksteward.checkpoint.coordination.driver_service import default_checkpoint_dir
from sparksteward.checkpoint.duplicate import Duplicator
from sparksteward.checkpoint.filemerging.space import space_stats
from sparksteward.checkpoint.lease import read_lease
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.removal import Removal, collect_garbage, find_orphans, read_records, remove_state, subdirs
from sparksteward.checkpoint.restore import write_savepoint
from sparksteward.checkpoint.storage import RESTORED, CheckpointStorage
from sparksteward.config import StewardConfig, parse_duration
from sparksteward.errors import CheckpointError, CheckpointNotFoundError, ConfigError, StateLeaseError
from sparksteward.ids import validate_id
from sparksteward.progress import TerminalProgress
from sparksteward.state.declared import variables_of
from sparksteward.storage import Location, open_location
from sparksteward.tables import table

__all__ = ["add_subcommands", "find_orphans"]

MB = 1 << 20


def _config(args: argparse.Namespace) -> StewardConfig:
    return StewardConfig.from_conf({"spark.steward.cluster-id": args.cluster_id})


def _storage(args: argparse.Namespace) -> CheckpointStorage:
    cluster = _config(args).cluster_id
    return CheckpointStorage(open_location(args.dir).child(cluster, validate_id(args.state, "state name")),
                             args.state)


def _ls_base(args: argparse.Namespace) -> Location | None:
    """``<dir>/<cluster-id>`` of ``ls``; an error naming a given dir that does not exist, and None
    (nothing written there yet) for the default dir."""
    cfg = _config(args)
    top = open_location(args.dir or default_checkpoint_dir(cfg))
    given = "" if args.dir else (" (the default checkpoint dir, <state-dir>/checkpoints: none was given)")
    if not args.dir and not top.exists(top.root):   # a fresh machine: no application wrote one here yet
        print(f"0 state(s): no checkpoints yet in {top.url}{given}, which no application on this machine has "
              f"written. Pass the dir your applications use (spark.steward.checkpoint.dir) as `steward "
              f"checkpoints ls <dir>`")
        return None
    if not top.exists(top.root):
        missing = "does not exist" if top.is_local else "holds nothing (no state is stored there: none was written, " \
                                                        "or all were removed)"
        raise CheckpointNotFoundError(f"checkpoint dir {top.url}{given} {missing}: pass the dir your applications "
                                      f"use (spark.steward.checkpoint.dir), as `steward checkpoints ls <dir>`")
    if top.is_local and not os.path.isdir(top.root):
        raise CheckpointNotFoundError(f"checkpoint dir {top.url}{given} is not a directory: pass the dir your "
                                      f"applications use (spark.steward.checkpoint.dir)")
    base = top.child(cfg.cluster_id)
    found = subdirs(top)
    if found and cfg.cluster_id not in found:
        raise CheckpointNotFoundError(f"checkpoint dir {top.url}{given} holds no states of cluster id "
                                      f"{cfg.cluster_id!r} (no {cfg.cluster_id!r} directory); its directories are "
                                      f"{', '.join(map(repr, found))}: pass the applications' cluster id with "
                                      f"--cluster-id, or the checkpoint dir itself if this is one cluster's dir")
    return base


def _ls(args: argparse.Namespace) -> int:
    base = _ls_base(args)
    if base is None:
        return 0
    rows = []
    for name in subdirs(base):
        storage = CheckpointStorage(base.child(name), name)
        records, unreadable = read_records(storage)
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
    storage = _storage(args)
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
    records, _ = read_records(storage)
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
    what = "restored starting point" if meta.checkpoint_id == RESTORED else f"checkpoint {meta.checkpoint_id}"
    with TerminalProgress(f"restoring {args.state} {what}", unit="subtasks") as progress:
        rows = read_variable(storage, meta, args.variable, progress=progress).slice(0, args.limit).to_pylist()
    if args.json:
        for r in rows:
            print(orjson.dumps(r, default=str).decode())
        return 0
    columns = list(rows[0]) if rows else ["key", "value"]
    print(table([[str(r[c]) for c in columns] for r in rows], [c.upper() for c in columns]))
    return 0


def _gc(args: argparse.Namespace) -> int:
    cfg = _config(args)
    try:
        min_age = parse_duration(args.min_age)
    except ValueError:
        raise ConfigError(f"--min-age {args.min_age!r} is not a duration such as 30s, 10min or 1h") from None
    with _lease_said_once():
        out = collect_garbage(args.dir, validate_id(args.state, "state name"), cfg.cluster_id, min_age=min_age,
                              lease_ttl=cfg.checkpoint_lease_timeout, dry_run=args.dry_run, notice=_notice)
    if args.dry_run:
        print(f"{len(out.files)} orphaned file(s) in {out.url} (dry run)")
        for p in out.files:
            print(p)
        return 0
    print(f"deleted {out.deleted} orphaned file(s) in {out.url}")
    return 0


def _notice(msg: str) -> None:
    print(msg, file=sys.stderr)


@contextlib.contextmanager
def _lease_said_once() -> Iterator[None]:
    """Taking a lease over is said by the command's notice, once: the lease's own log stays quiet."""
    lease_log = logging.getLogger("sparksteward.checkpoint.lease")
    level = lease_log.level
    lease_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lease_log.setLevel(level)


def _print_removal(out: Removal, state: str, dry_run: bool) -> None:
    verb = "would delete" if dry_run else "deleted"
    count = len(out.files) if dry_run else out.deleted
    print(f"{verb} state {state!r} in {out.url}: {len(out.records)} checkpoint record(s)"
          f"{' (' + ', '.join(out.records) + ')' if out.records else ''}, {count} data file(s)")
    if dry_run:
        for path in out.files:
            print(path)
    if out.kept:
        holders = sorted({h for hs in out.kept.values() for h in hs})
        print(f"kept {len(out.kept)} data file(s) that other states took over with a CLAIM restore "
              f"({', '.join(holders)}): they delete them once their checkpoints no longer need them")
    if out.claimed:
        print(f"{out.claimed} file(s) this state claimed from other states lie outside its directory and stay "
              f"(`steward checkpoints gc` of their state collects them)")
    if out.left:
        print(f"left {len(out.left)} entr{'y' if len(out.left) == 1 else 'ies'} that are not checkpoint files "
              f"under {out.url}: {', '.join(out.left)}; delete them by hand if they are not needed")


def _rm(args: argparse.Namespace) -> int:
    cfg = _config(args)
    with _lease_said_once(), TerminalProgress(f"deleting the data files of {args.state}") as progress:
        out = remove_state(args.dir, args.state, cfg.cluster_id, lease_ttl=cfg.checkpoint_lease_timeout,
                           dry_run=args.dry_run, progress=progress, notice=_notice)
    _print_removal(out, args.state, args.dry_run)
    return 0


def _savepoint(args: argparse.Namespace) -> int:
    cfg = _config(args)
    default = default_checkpoint_dir(cfg)
    top = open_location(args.dir or default)
    storage = CheckpointStorage(top.child(cfg.cluster_id, validate_id(args.state, "state name")), args.state)
    loc = storage.location
    if not loc.exists(loc.root):
        given = "" if args.dir else " (the default checkpoint dir: none was given)"
        raise CheckpointNotFoundError(f"no state {args.state!r} of cluster id {cfg.cluster_id!r} in {top.url}{given}: "
                                      f"nothing to save. `steward checkpoints ls {top.url}` lists the states")
    record = read_lease(loc)
    if record is not None and record.may_be_live(time.time()):
        raise StateLeaseError(
            f"not taking a savepoint of state {args.state!r} at {loc.url}: it is being written by "
            f"{record.describe()}, which subsumes checkpoints and deletes their files while they would be "
            f"copied. Take it in that application with ks.savepoint(url), which keeps the checkpoint until the "
            f"copy is done, or stop the application first (its lease is released when it stops, or expires "
            f"{record.ttl:g} s after its last renewal)")
    ids = storage.checkpoint_ids()
    cid = args.checkpoint if args.checkpoint is not None else (
        ids[-1] if ids else (RESTORED if storage.has_restored() else None))
    if cid is None:
        raise CheckpointError(f"state {args.state!r} has no completed checkpoint in {storage.url}: nothing to save; "
                              f"`steward checkpoints ls {top.url}` lists the states and their checkpoints")
    meta = storage.read_metadata(cid)
    dup = Duplicator()
    what = "restored starting point" if cid == RESTORED else f"checkpoint {cid}"
    with TerminalProgress(f"copying {args.state} {what}") as progress:
        path = write_savepoint(storage, meta, args.url, dup, source=loc.display(storage.metadata_path(cid)),
                               checkpoint_dirs=[default], progress=progress)
    print(path if "://" in path else "file://" + os.path.abspath(path))
    print(f"saved state {args.state!r} {what} ({len({f.path for f in meta.files()})} files, {meta.size / MB:.1f} "
          f"MB: {dup.stats.server_side} copied on the server, {dup.stats.linked} linked, "
          f"{dup.stats.bytes_streamed} bytes streamed)", file=sys.stderr)
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoints", help="keyed-state checkpoints: ls, show, read, gc, rm, savepoint")
    cmds = p.add_subparsers(dest="checkpoints_command", required=True)

    def common(q: argparse.ArgumentParser, nargs: str | None = None) -> None:
        q.add_argument("dir", nargs=nargs, help="the checkpoint dir (spark.steward.checkpoint.dir): a path or fsspec "
                                                "URL" + (" (default: <state-dir>/checkpoints)" if nargs else ""))
        q.add_argument("--cluster-id", default="default")

    q = cmds.add_parser("ls", help="states with their checkpoints, sizes and file counts")
    common(q, nargs="?")
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
    q = cmds.add_parser("rm", help="delete a state's checkpoints and files (refused while a writer holds it)")
    common(q)
    q.add_argument("state")
    q.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    q.set_defaults(func=_rm)
    q = cmds.add_parser("savepoint", help="copy a completed checkpoint to a self-contained savepoint at a URL")
    common(q, nargs="?")
    q.add_argument("state")
    q.add_argument("url", help="where the savepoint goes, outside every checkpoint dir: a path or fsspec URL")
    q.add_argument("--checkpoint", type=int, default=None, help="checkpoint id (default: the latest)")
    q.set_defaults(func=_savepoint)
