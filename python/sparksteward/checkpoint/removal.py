"""Removing a whole keyed state (``steward checkpoints rm``, :func:`remove_state`) and its garbage
(``steward checkpoints gc``, :func:`collect_garbage`).

The state root is ``<checkpoint-dir>/<cluster-id>/<state>``, both ids validated
(:func:`~sparksteward.ids.validate_id`), so it is one directory under the cluster's. The rules:

- **One writer.** The state's writer lease (:class:`~sparksteward.checkpoint.lease.StateLease`) is
  taken first, with a writer's rules: a holder that may be live (renewed within its ttl by the wall
  clock, or on this host and not provably dead) is refused at once, naming it; a silent holder on
  another host is watched for its ttl before it is taken over. The lease is renewed while the
  deletes run and checked before each one, so a writer that takes it over stops the removal.
- **Records first.** Every ``chk-<N>/`` and ``restored/`` directory goes before any data file (as
  :class:`~sparksteward.checkpoint.coordination.deleter.FileDeleter` deletes a record before its files), ``restored``
  and the oldest first: a crash half-way leaves the latest checkpoints whole, or no record at all and
  orphaned data files that a second ``rm`` (or ``gc``) deletes, never a ``_metadata`` naming a
  deleted file.
- **Only the state's own data files.** Data files under the root (``shared/<32 hex>``,
  ``merged/<32 hex>``, staged uploads of them) are deleted through
  :meth:`~sparksteward.checkpoint.storage.CheckpointStorage.delete_files`, which deletes nothing else,
  except those a record of another state references by absolute URL (a CLAIM restore took them
  over; that state deletes them once its checkpoints no longer need them). Every state of every
  cluster id in the checkpoint dir is read for such references, and nothing is deleted while one of
  their records is unreadable. Files this state claimed from another state lie outside its root and
  stay; any other entry stays too and is reported.
- **Never outside the root.** Locally, a root, ``shared/`` or ``merged/`` that is a symlink is refused,
  and a symlinked ``chk-<N>`` is unlinked, not followed (:meth:`~sparksteward.storage.Location.delete`).
- **The lease last.** Once every file is gone the lease record, still held, is deleted last and the
  empty directories are removed; if anything stays, the lease is released instead.

Readers are not fenced: a ``restore_from`` reading this state while it is removed fails on a missing
file, and deletes what it copied. States in other checkpoint dirs are not read: a CLAIM restore of
this state from another checkpoint dir is not seen.

**Garbage** is a data file or staged upload under ``shared/`` or ``merged/`` that no record of the
state references (:func:`find_orphans`). A live writer's uploads look like that until its checkpoint
completes, however old they are (a long batch, a retried partition), so :func:`collect_garbage`
follows the same lease rules as ``rm``: a writer that may be live is refused by name; otherwise gc
takes the state's lease before it lists, renews and checks it before every delete (a writer
starting meanwhile is refused, and one that takes the lease over stops gc), and releases it at the
end. Only files older than ``min_age`` go: a restore into a state that holds no lease yet (its
hard links are aged from their ctime) is spared by age.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sparksteward.checkpoint.duplicate import place
from sparksteward.checkpoint.lease import LEASE_FILE, LOCK_FILE, StateLease, read_lease
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.storage import MERGED_DIR, RESTORED, CheckpointStorage, checkpoint_dir_name, is_data_path
from sparksteward.errors import CheckpointError, CheckpointNotFoundError, StateLeaseError, StewardError
from sparksteward.ids import validate_id
from sparksteward.storage import Location, open_location

__all__ = ["Garbage", "Removal", "collect_garbage", "find_orphans", "read_records", "remove_state", "subdirs"]

_RECORD_DIR = re.compile(r"^(chk-\d+|restored)$")
#: the records of a pending checkpoint in the root (checkpoint/begun.py): they go with the checkpoint records
_PENDING_RECORDS = ("_begun",)


@dataclass
class Removal:
    """What :func:`remove_state` deleted (or would delete, for a dry run) and what it left."""

    url: str
    records: list[str] = field(default_factory=list)        # chk-<N> / restored directories
    files: list[str] = field(default_factory=list)          # data files of the root to delete
    deleted: int = 0                                        # of ``files``, those that existed when deleted
    kept: dict[str, list[str]] = field(default_factory=dict)   # data file -> the states referencing it
    claimed: int = 0       # files this state claimed from other states (outside its root: they stay)
    left: list[str] = field(default_factory=list)           # other entries under the root (they stay)
    removed: bool = False  # the root and its lease are gone


def subdirs(loc: Location) -> list[str]:
    """Names of the directories directly under ``loc``, sorted."""
    return sorted(posixpath.basename(i["name"].rstrip("/")) for i in loc.listdir() if i.get("type") == "directory")


def read_records(storage: CheckpointStorage) -> tuple[dict[int, CheckpointMetadata], list[str]]:
    """Every record of ``storage`` (``restored`` as :data:`RESTORED`) and the ones that could not be
    read, as ``"chk-<N>: why"``."""
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


def _referenced_elsewhere(top: Location, storage: CheckpointStorage, me: tuple[str, str]) -> dict[str, list[str]]:
    """Data paths under ``storage``'s root that a record of another state in ``top`` references."""
    root = place(storage.url) + "/"
    refs: dict[str, set[str]] = {}
    unreadable: list[str] = []
    for cluster in subdirs(top):
        for name in subdirs(top.child(cluster)):
            if (cluster, name) == me:
                continue
            records, bad = read_records(CheckpointStorage(top.child(cluster, name), name))
            unreadable += [f"{cluster}/{name}/{b}" for b in bad]
            for path in set().union(*(m.physical_paths() for m in records.values())):
                where = place(path) if "://" in path else ""
                if where.startswith(root):
                    refs.setdefault(where[len(root):], set()).add(f"{cluster}/{name}")
    if unreadable:
        raise CheckpointError(f"not deleting state {storage.state!r}: records of other states in {top.url} are "
                              f"unreadable, so whether they reference its files is unknown ({'; '.join(unreadable)}). "
                              f"Fix or move them first")
    return {p: sorted(s) for p, s in refs.items()}


class _HeldLease:
    """The removal's lease: renewed every ``ttl / 3`` as the deletes go, checked before each."""

    def __init__(self, lease: StateLease, monotonic: Callable[[], float]) -> None:
        self.lease = lease
        self._monotonic = monotonic
        self._renew_at = monotonic() + lease.ttl / 3

    def check(self) -> None:
        if self._monotonic() >= self._renew_at:
            self.lease.renew()
            self._renew_at = self._monotonic() + self.lease.ttl / 3
        self.lease.check()


def _refuse_live_writer(loc: Location, state: str, wall: Callable[[], float], notice: Callable[[str], None], *,
                        doing: str, command: str) -> None:
    """Refuse (``doing`` ...) while the lease record of ``loc`` says its writer may be live, naming it;
    tell ``notice`` when a silent holder will be watched before it is taken over."""
    record = read_lease(loc)
    if record is None or record.gone():
        return
    age = max(wall() - record.renewed, 0.0)
    if record.may_be_live(wall()):
        raise StateLeaseError(
            f"{doing} at {loc.url}: it is being written by {record.describe()} (lease renewed {age:.0f} s ago, ttl "
            f"{record.ttl:g} s). Stop that application first; if it died on another host, run {command} again once "
            f"its lease has expired ({record.ttl:g} s after its last renewal)")
    notice(f"the lease of state {state!r} was last renewed {age:.0f} s ago by {record.describe()}: watching it "
           f"for {record.ttl:g} s to make sure that writer stopped")


def _check_local_root(loc: Location, doing: str, command: str) -> None:
    if not loc.is_local:
        return
    for path in (loc.root, loc.path("shared"), loc.path(MERGED_DIR)):
        if os.path.islink(path):
            raise CheckpointError(f"{doing}: {path} is a symbolic link, and {command} deletes only the state's own "
                                  f"directory; replace the link by the directory it points to")
    if not os.path.isdir(loc.root):
        raise CheckpointError(f"{doing}: {loc.root} is not a directory")


def _existing_state(checkpoint_dir: str, state: str, cluster_id: str, doing: str) -> tuple[Location, CheckpointStorage]:
    """The checkpoint dir and the storage of ``state``; an error naming them when there is no such state."""
    validate_id(state, "state name")
    validate_id(cluster_id, "cluster id")
    top = open_location(checkpoint_dir)
    storage = CheckpointStorage(top.child(cluster_id, state), state)
    if not storage.location.exists(storage.location.root):
        raise CheckpointNotFoundError(f"no state {state!r} of cluster id {cluster_id!r} in {top.url}: {doing}. "
                                      f"`steward checkpoints ls {checkpoint_dir}` lists the states")
    return top, storage


def _take_lease(loc: Location, state: str, command: str, doing: str, lease_ttl: float,
                monotonic: Callable[[], float], wall: Callable[[], float],
                sleep: Callable[[float], None]) -> tuple[StateLease, _HeldLease]:
    """The state's writer lease, taken with a writer's rules (one that renewed while it was watched, or
    started meanwhile, wins), and its renewal as the deletes go."""
    lease = StateLease(loc, state, application=f"steward checkpoints {command} (pid {os.getpid()})", ttl=lease_ttl,
                       monotonic=monotonic, wall=wall, sleep=sleep)
    try:
        lease.acquire()
    except StateLeaseError as exc:
        raise StateLeaseError(f"{doing}: {exc}") from exc
    return lease, _HeldLease(lease, monotonic)


def _plan(storage: CheckpointStorage, refs: dict[str, list[str]]) -> Removal:
    """What removing ``storage`` deletes and leaves, as listed now."""
    loc = storage.location
    out = Removal(loc.url)
    records, _ = read_records(storage)
    out.claimed = len({p for m in records.values() for p in m.physical_paths() if "://" in p})
    entries = [posixpath.basename(i["name"].rstrip("/")) for i in loc.listdir()]
    out.records = sorted((e for e in entries if _RECORD_DIR.match(e)), key=_record_order)
    staged = storage.staged_files()
    found = storage.stored_files() | staged
    out.left = sorted([e for e in entries if not _RECORD_DIR.match(e)
                       and e not in ("shared", MERGED_DIR, LEASE_FILE, LOCK_FILE, *_PENDING_RECORDS)]
                      + [p for p in found if not is_data_path(p) and p not in staged])
    data = sorted(p for p in found if is_data_path(p) or p in staged)
    out.kept = {p: refs[p] for p in data if p in refs}
    out.files = [p for p in data if p not in refs]
    return out


def remove_state(checkpoint_dir: str, state: str, cluster_id: str = "default", *, lease_ttl: float = 60.0,
                 dry_run: bool = False, progress: Callable[[int, int], None] | None = None,
                 notice: Callable[[str], None] = lambda msg: None, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> Removal:
    """Delete the checkpoints of ``state`` (see the module docstring); return what was deleted.

    ``dry_run`` deletes nothing and takes no lease (a live writer is still refused). ``progress(done,
    total)`` is called after each data file; ``notice`` gets a line when the removal has to wait.
    Raises :class:`StateLeaseError` while a writer holds the state, :class:`CheckpointNotFoundError`
    when there is no such state.
    """
    doing = f"not deleting state {state!r}"
    top, storage = _existing_state(checkpoint_dir, state, cluster_id, "nothing to delete")
    loc = storage.location
    _check_local_root(loc, doing, "rm")
    _refuse_live_writer(loc, state, wall, notice, doing=doing, command="rm")
    if dry_run:
        return _plan(storage, _referenced_elsewhere(top, storage, (cluster_id, state)))

    lease, held = _take_lease(loc, state, "rm", doing, lease_ttl, monotonic, wall, sleep)
    holding = True
    out = Removal(loc.url)
    try:
        out = _plan(storage, _referenced_elsewhere(top, storage, (cluster_id, state)))   # no writer adds files now
        for name in out.records:
            held.check()
            loc.delete(loc.path(name), recursive=True)
        if storage.checkpoint_ids() or storage.has_restored():
            raise CheckpointError(f"state {state!r} at {loc.url} still has checkpoint records after they were "
                                  f"deleted; no data file was deleted. Run rm again")
        for name in _PENDING_RECORDS:
            held.check()
            loc.delete(loc.path(name))
        for done, path in enumerate(out.files, 1):
            held.check()
            out.deleted += storage.delete_files([path])
            if progress is not None:
                progress(done, len(out.files))
        if out.kept or out.left:
            return out
        held.check()
        loc.delete(loc.path(LOCK_FILE))
        loc.delete(loc.path(LEASE_FILE))   # held until here; nothing of the state is left
        holding = False
        if loc.is_local:
            for path in (loc.path("shared"), loc.path(MERGED_DIR), loc.root):
                with contextlib.suppress(OSError):   # a writer that started since keeps its files
                    os.rmdir(path)
        out.removed = True
        return out
    except StateLeaseError as exc:
        raise StateLeaseError(f"stopped deleting state {state!r} after {out.deleted} of {len(out.files)} data "
                              f"files (records are deleted before data files, so none names a deleted file): "
                              f"{exc}") from exc
    finally:
        if holding:
            lease.release()


def _record_order(name: str) -> int:
    """``restored`` first, then the oldest checkpoint: a crash between two record deletes leaves the
    latest checkpoints, as the coordinator's subsumption would, never an older state than the last."""
    return -1 if name == "restored" else int(name[4:])


def find_orphans(storage: CheckpointStorage, min_age: float, now: float) -> list[str]:
    """Relative paths under ``shared/`` and ``merged/`` that no retained checkpoint references and that
    entered the directory at least ``min_age`` seconds before ``now``. Not safe while a writer holds
    the state: its uploads are unreferenced until its checkpoint completes (:func:`collect_garbage`
    holds the lease)."""
    records, unreadable = read_records(storage)
    if unreadable:
        raise CheckpointError(f"not collecting garbage in {storage.url}: unreadable records "
                              f"({'; '.join(unreadable)}). Fix or move them first")
    referenced = set().union(*(m.physical_paths() for m in records.values())) if records else set()
    # when each file entered the directory (CheckpointStorage.file_times: a hard link's ctime counts;
    # a file without a timestamp never looks old)
    return sorted(rel for rel, entered in storage.file_times().items()
                  if rel not in referenced and (min_age <= 0 or now - entered >= min_age))


@dataclass
class Garbage:
    """What :func:`collect_garbage` found (or would delete, for a dry run) and deleted."""

    url: str
    files: list[str] = field(default_factory=list)   # orphaned data files and staged uploads
    deleted: int = 0                                  # of ``files``, those that existed when deleted


def collect_garbage(checkpoint_dir: str, state: str, cluster_id: str = "default", *, min_age: float,
                    lease_ttl: float = 60.0, dry_run: bool = False, notice: Callable[[str], None] = lambda msg: None,
                    monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                    sleep: Callable[[float], None] = time.sleep) -> Garbage:
    """Delete the orphans of ``state`` older than ``min_age`` seconds under its writer lease (see the
    module docstring); return what was found and deleted.

    ``dry_run`` deletes nothing and takes no lease (a live writer is still refused). Raises
    :class:`StateLeaseError` while a writer may hold the state, or when one takes it over during the
    deletes (nothing more is deleted then), :class:`CheckpointNotFoundError` when there is no such state.
    """
    doing = f"not collecting garbage in state {state!r}"
    _, storage = _existing_state(checkpoint_dir, state, cluster_id, "no garbage to collect")
    loc = storage.location
    _check_local_root(loc, doing, "gc")
    _refuse_live_writer(loc, state, wall, notice, command="gc",
                        doing=f"{doing} (a writer's uploads are unreferenced until its checkpoint completes)")
    if dry_run:
        return Garbage(loc.url, find_orphans(storage, min_age, wall()))
    lease, held = _take_lease(loc, state, "gc", doing, lease_ttl, monotonic, wall, sleep)
    out = Garbage(loc.url)
    try:
        out.files = find_orphans(storage, min_age, wall())   # listed under the lease: no writer adds files now
        for path in out.files:
            held.check()
            out.deleted += storage.delete_files([path])
        return out
    except StateLeaseError as exc:
        raise StateLeaseError(f"stopped collecting garbage in state {state!r} after {out.deleted} of "
                              f"{len(out.files)} orphaned files: {exc}") from exc
    finally:
        lease.release()
