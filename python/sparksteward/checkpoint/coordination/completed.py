"""CompletedCheckpoints: the retained completed checkpoints of one keyed state and the reference
counts of their files (Flink's ``CompletedCheckpointStore`` with its ``SharedStateRegistry``), owned
by its :class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator`.

- **Loading.** :meth:`load` reads every ``chk-N/_metadata`` (and ``restored/_metadata``, kept as
  checkpoint ``RESTORED``, -1) and counts the physical files each references, the absolute URLs
  this state took over with CLAIM, and the durable size of each merged file. The coordinator then
  sweeps every data file none of them references (orphans of a crashed upload or subsumption),
  unless a record could not be read: then nothing is swept, so the files of a newer version's
  checkpoint are never touched.
- **Retention.** :meth:`subsume` keeps the ``num_retained`` newest, the pinned ones (a savepoint
  copies them) and whatever the coordinator names (the bases of pending checkpoints and of a
  possible re-run). A dropped checkpoint's record is deleted first, then the files whose count
  reached zero, after the record (:class:`~sparksteward.checkpoint.coordination.deleter.FileDeleter`): a crash in
  between leaves orphans, never a record pointing at deleted files.
- **Deleting.** :meth:`delete_unreferenced` deletes only what no retained record and no in-flight ack
  needs: data files of this state's root, and absolute URLs only if this state claimed them; nothing
  without the writer lease.
- **Claimed files.** Absolute-URL files come from a CLAIMed checkpoint of another state
  (``restored/_metadata`` with ``claim_mode: claim``); this state owns exactly the files that record
  lists. Every checkpoint that still references some of them records them in its ``claimed``
  property, so ownership survives the subsumption of ``restored/`` and a restart. When the restored
  record is subsumed, the source's ``_metadata`` it claimed is deleted (a record never points at
  deleted files); when the last retained checkpoint referencing a claimed file is subsumed, the file
  is deleted. Any other absolute URL is never deleted here. A crash between the two leaves claimed
  files behind (they are outside this state's directory, so the start-up sweep does not see them).
- **Space (FLIP-306).** :meth:`control_space` marks the most wasteful merged files no-reuse, so the
  next checkpoint writes their live segments again (:meth:`known` leaves them out), and the old
  files go with the checkpoints that reference them.

Not thread-safe: the coordinator's lock guards it (its deleter shares that lock).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from sparksteward.checkpoint.coordination.deleter import FileDeleter
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.checkpoint.filemerging.space import SpaceStats, choose_no_reuse, physical_sizes, space_stats
from sparksteward.checkpoint.lease import Fence
from sparksteward.checkpoint.records import CheckpointMetadata, check_max_parallelism
from sparksteward.checkpoint.storage import DATA_PATH_FORMS, RESTORED, CheckpointStorage, is_data_path
from sparksteward.errors import CheckpointError, StateEncodingError, StewardError
from sparksteward.state.keygroups import KeyType

__all__ = ["CompletedCheckpoints", "check_compatible", "claimed_by"]

log = logging.getLogger("sparksteward.checkpoint.coordination.completed")


class CompletedCheckpoints:
    """Retained completed checkpoints and their files' reference counts (see the module docstring)."""

    def __init__(self, storage: CheckpointStorage, deleter: FileDeleter, lease: Fence, *, num_retained: int,
                 merging: MergingOptions) -> None:
        if isinstance(num_retained, bool) or not isinstance(num_retained, int) or num_retained < 1:
            raise CheckpointError(f"num_retained={num_retained!r} must be an int >= 1")
        self.storage = storage
        self.deleter = deleter
        self.lease = lease
        self.num_retained = num_retained
        self.merging = merging
        self.records: dict[int, CheckpointMetadata] = {}
        self.refs: Counter[str] = Counter()
        self.claimed: set[str] = set()        # absolute URLs this state owns (CLAIM)
        self.pins: Counter[int] = Counter()   # checkpoints a savepoint is copying
        self.sizes: dict[str, int] = {}       # merged physical path -> durable size (from records and seals)
        self.no_reuse: set[str] = set()       # merged files whose live segments the next checkpoint rewrites

    def load(self, check: Callable[[CheckpointMetadata], None]) -> list[int]:
        """Read the records in the checkpoint dir (each passes ``check``); return the unreadable ids,
        whose files are kept (a newer version may have written them)."""
        unreadable = []
        ids = self.storage.checkpoint_ids()
        if self.storage.has_restored():  # the restore_from starting point, kept as checkpoint RESTORED (-1)
            ids.insert(0, RESTORED)
        for cid in ids:
            try:
                meta = self.storage.read_metadata(cid)
            except StewardError as exc:
                log.warning("checkpoint %d of %s is unreadable, keeping its files: %s", cid, self.storage.state, exc)
                unreadable.append(cid)
                continue
            check(meta)
            self.add(meta, cid)
            self.claimed.update(claimed_by(meta))
            self.sizes.update(physical_sizes([meta]))
        return unreadable

    # --- queries -----------------------------------------------------------------------------------
    @property
    def last(self) -> int | None:
        """The newest completed checkpoint (not the restored starting point)."""
        return max((c for c in self.records if c != RESTORED), default=None)

    def get(self, checkpoint_id: int | None) -> CheckpointMetadata | None:
        return self.records.get(checkpoint_id) if checkpoint_id is not None else None

    def record(self, checkpoint_id: int) -> CheckpointMetadata:
        """Retained checkpoint ``checkpoint_id``'s record (a clear error if it is not retained)."""
        try:
            return self.records[checkpoint_id]
        except KeyError:
            raise CheckpointError(f"checkpoint {checkpoint_id} of state {self.storage.state!r} is not a retained "
                                  f"completed checkpoint (retained: {sorted(self.records)})") from None

    def pin(self, checkpoint_id: int) -> CheckpointMetadata:
        """Keep retained checkpoint ``checkpoint_id`` (and its files) until :meth:`unpin`; return it."""
        meta = self.record(checkpoint_id)
        self.pins[checkpoint_id] += 1
        return meta

    def unpin(self, checkpoint_id: int) -> None:
        """One :meth:`pin` of ``checkpoint_id`` ended (the next :meth:`subsume` may drop it)."""
        self.pins[checkpoint_id] -= 1
        if self.pins[checkpoint_id] <= 0:
            del self.pins[checkpoint_id]

    def newest_before(self, checkpoint_id: int) -> int | None:
        return max((c for c in self.records if c < checkpoint_id), default=None)

    def known(self, base: CheckpointMetadata | None) -> dict[str, tuple[str, int]]:
        """checksum -> (path, offset) of the files of ``base`` the next checkpoint may reuse."""
        if base is None:
            return {}
        return {f.checksum: (f.path, f.offset) for f in base.files() if f.path not in self.no_reuse}

    def sweep(self, ages: Mapping[str, float], now: float, grace: float, held: set[str],
              skip: Callable[[], bool]) -> int:
        """Delete the files of ``ages`` (path -> modification time) no retained checkpoint references
        that are older than ``grace`` and not ``held`` (open ``across`` files); return how many. Only
        under a held lease, and not when ``skip()`` (something is pending)."""
        try:
            self.lease.check()
        except CheckpointError as exc:
            log.warning("not sweeping orphans of %s: %s", self.storage.state, exc)
            return 0
        if skip():
            return 0
        orphans = sorted(p for p, t in ages.items() if self.refs[p] <= 0 and now - t >= grace and p not in held)
        if orphans:
            self.deleter.delete_files(orphans)
        return len(orphans)

    def missing(self, referenced: set[str]) -> list[str]:
        """Those of the files a new record references that are not in the store. Every file no retained
        checkpoint holds yet must be there before a record names it, whoever deleted it (this state's
        deleter after a lost attempt's late ack, a tool, an operator): one check per new file (and per
        file the deleter once deleted); the files of retained checkpoints were checked when those completed."""
        once_deleted = self.deleter.deleted_among(referenced)
        new = {p for p in referenced if self.refs[p] <= 0 and "://" not in p} | set(once_deleted)
        missing = self.storage.missing(new)
        for p in once_deleted:
            if p not in missing:
                self.deleter.seen(p)
        return missing

    def space(self) -> SpaceStats:
        """Physical against live bytes of the retained checkpoints' merged files."""
        return space_stats(list(self.records.values()))

    # --- changes -----------------------------------------------------------------------------------
    def add(self, meta: CheckpointMetadata, checkpoint_id: int | None = None) -> None:
        """Retain ``meta`` as checkpoint ``checkpoint_id`` (default: its own id; the restored starting
        point is kept as ``RESTORED``)."""
        self.records[meta.checkpoint_id if checkpoint_id is None else checkpoint_id] = meta
        self.refs.update(meta.physical_paths())

    def sealed(self, sizes: dict[str, int]) -> None:
        """Merged files are durable up to ``sizes`` (a seal of a checkpoint about to complete)."""
        for p, size in sizes.items():
            self.sizes[p] = max(self.sizes.get(p, 0), size)

    def subsume(self, keep: set[int], in_flight: set[str]) -> None:
        """Drop every retained checkpoint beyond the ``num_retained`` newest, the pinned ones and
        ``keep``; delete its record, then its files nothing references any more."""
        keep = keep | set(sorted(self.records)[-self.num_retained:]) | set(self.pins)
        for cid in sorted(self.records):
            if cid in keep:
                continue
            meta = self.records.pop(cid)
            claimed_record = cid == RESTORED and meta.properties.get("claim_mode") == "claim"
            record = self.deleter.delete_record(cid, meta if claimed_record else None)  # the files wait for it
            self.refs.subtract(meta.physical_paths())
            gone = [p for p in meta.physical_paths() if self.refs[p] <= 0]
            for p in gone:
                del self.refs[p]
                self.sizes.pop(p, None)
            self.delete_unreferenced(gone, in_flight, after=record)
            log.info("subsumed checkpoint %d of %s", cid, self.storage.state)

    def delete_unreferenced(self, paths: Iterable[str], in_flight: set[str], after: int | None = None) -> int:
        """Delete what no retained checkpoint and nothing ``in_flight`` (pending acks, open ``across``
        files) needs among ``paths``: data files of this root, and absolute URLs only if this state
        claimed them. Nothing without the writer lease: another writer may hold the state now. The
        data files go through the deleter (after the record job ``after``, if given); returns how many."""
        paths = list(paths)
        try:
            self.lease.check()
        except CheckpointError as exc:
            log.warning("not deleting %d files of %s: %s", len(paths), self.storage.state, exc)
            return 0
        unused = [p for p in paths if self.refs[p] <= 0 and p not in in_flight]
        foreign = sorted(p for p in unused if not is_data_path(p) and "://" not in p)
        if foreign:
            log.error("not deleting %s of %s: only data files (%s) are deleted", foreign, self.storage.state,
                      DATA_PATH_FORMS)
        doomed = sorted(p for p in unused if is_data_path(p))
        if doomed:
            self.deleter.delete_files(doomed, after=after)
        n = len(doomed)
        claimed = sorted(p for p in unused if "://" in p and p in self.claimed)
        if claimed:
            n += self.storage.delete_claimed(claimed)
            self.claimed.difference_update(claimed)
            log.info("deleted %d claimed files of %s no retained checkpoint references", len(claimed),
                     self.storage.state)
        return n

    def control_space(self) -> None:
        """Mark the merged files whose waste passes ``max_space_amplification`` no-reuse."""
        chosen = choose_no_reuse(self.records.values(), self.merging.max_space_amplification) \
            if self.merging.enabled else set()
        if chosen - self.no_reuse:   # DEBUG when the files to rewrite are small (tiny batches)
            moved = sum(physical_sizes(self.records.values()).get(p, 0) for p in chosen - self.no_reuse)
            log.log(logging.INFO if moved >= 1 << 20 else logging.DEBUG,
                    "space control of %s: %d merged files marked no-reuse (%s)", self.storage.state,
                    len(chosen), self.space().to_json())
        self.no_reuse = chosen


def check_compatible(meta: CheckpointMetadata, max_parallelism: int, key_type: KeyType) -> None:
    """Refuse a record the state cannot continue from: another max parallelism, or another key type."""
    check_max_parallelism(meta, max_parallelism)
    if meta.key_type is not key_type:
        raise StateEncodingError(
            f"state {meta.state!r} was checkpointed with {meta.key_type.value} keys (checkpoint "
            f"{meta.checkpoint_id}) and cannot continue with {key_type.value} keys: cast the key column "
            f"to {meta.key_type.value}, or start a new state")


def claimed_by(meta: CheckpointMetadata) -> set[str]:
    """The absolute URLs a record says this state owns: every file of a CLAIMed restored record, and
    the ``claimed`` list of a later checkpoint (only URLs the record itself references)."""
    absolute = {p for p in meta.physical_paths() if "://" in p}
    if meta.properties.get("claim_mode") == "claim" and "restored_from" in meta.properties:
        return absolute
    listed = meta.properties.get("claimed")
    return absolute & set(listed) if isinstance(listed, list) else set()
