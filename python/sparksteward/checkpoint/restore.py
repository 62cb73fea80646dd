"""Starting a state from another state's checkpoint (``restore_from``), and savepoints.

- **NO_CLAIM** (default, Flink's default too): the source's files are *duplicated* into this state's
  ``shared/`` by fast duplication (S3 CopyObject, local hard links), so no bytes pass through the
  process and the source stays untouched and owned by its state.
- **CLAIM**: nothing is copied; the restored record points at the source's files by absolute URL and
  this state takes ownership of them (and of the source's ``_metadata``): once later checkpoints
  subsume them, its coordinator deletes them (only files the claimed checkpoint listed, never anything
  else of the source). The source state must not be run again, and its other checkpoints may share
  claimed files (incremental checkpoints do), so they are not restorable afterwards either: claim
  only a state you are done with, as in Flink.
- **Savepoint**: a self-contained copy of a checkpoint at any URL (``<url>/_metadata`` and
  ``<url>/shared/...``), made by the same duplication, restorable elsewhere.

Either restore writes ``restored/_metadata`` in this state's directory (see
:data:`~sparksteward.checkpoint.storage.RESTORED`): the coordinator then uses it as the base of the
first checkpoint and counts its files, so later checkpoints never upload them again.

**Confined.** A record names only data files (``shared/<checksum>``, ``merged/<32 hex>``) of the
state root it was read from, and, by absolute URL, files of another state that it lists as claimed
(a CLAIM restore of that state came first). Anything else, a whole file not named by its checksum,
and a path that is not a data file are refused by name before anything is written. CLAIM takes over
only files under the source's root: files the source had claimed from a third state are duplicated
like NO_CLAIM, so this state never deletes them.

**A claim is not proof.** Whoever can write a record (a hand-made savepoint, a state root of one's
own) can list any other state's (or tenant's) objects as claimed, and the copy would read them with
this process's credentials. Nothing in the source can prove such a claim: its records are written by
the same hand. So restore_from reads outside the source's root only under roots its caller names
(``claimed_roots``); any other claimed URL is refused by name, with the root to name and the other
way: a savepoint of the source (``steward checkpoints savepoint``) holds copies of what it claimed.
A savepoint of the caller's own state (:func:`write_savepoint`) honours the claims of its records,
which its coordinator wrote and owns.

**One writer.** CLAIM is refused while the source state has a live writer: its ``_lease`` record
(:mod:`sparksteward.checkpoint.lease`) is not released and was renewed within its ttl, or its
holder runs on this host and is not provably dead. That writer would go on subsuming and deleting
the files this state now owns. NO_CLAIM copies, so it never needs the source's writer to stop.

**Nothing half-written.** Before anything is written, the source's record is read (not a checkpoint,
a newer version, another max parallelism or key type are refused), its paths are confined as above,
and every file it lists is checked to exist with its length (exactly, for whole files; one listing
per directory; no bytes are read). Files are copied first and the record last (``_metadata`` is the
commit marker); if a copy fails, only the files this call created are deleted again (a destination
file that was there before stays). Duplicated whole files keep their content address (their name is
the checksum the record states, and hard links and server-side copies preserve the bytes); every
duplicated segment of a merged file is read back and verified against its checksum. All bytes are
verified again where they are read: by the executors, when a task restores its subtask.

**Savepoint targets.** A savepoint is refused when its URL is, contains or lies under the source's
state root or checkpoint dir (``<checkpoint-dir>/<cluster-id>/<state>`` two levels up), or any other
checkpoint dir the caller names: a savepoint lives outside every checkpoint directory, so no copy or
clean-up can touch a live checkpoint's files.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from sparksteward.checkpoint.duplicate import Duplicator, overlaps, place
from sparksteward.checkpoint.filemerging.space import is_merged
from sparksteward.checkpoint.lease import read_lease
from sparksteward.checkpoint.records import (
    CheckpointMetadata,
    FileHandle,
    SubtaskHandle,
    check_max_parallelism,
    shared_path,
)
from sparksteward.checkpoint.storage import (
    MERGED_DIR,
    METADATA_FILE,
    RESTORED,
    CheckpointStorage,
    checkpoint_dir_name,
    open_checkpoint,
)
from sparksteward.enums import ParsedEnum
from sparksteward.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    StateEncodingError,
    StewardError,
)
from sparksteward.hashing import Hasher
from sparksteward.state.keygroups import KeyType
from sparksteward.storage import Location, open_location

__all__ = ["ClaimMode", "check_savepoint_target", "check_sources", "restore_from", "write_savepoint"]

log = logging.getLogger("sparksteward.checkpoint.restore")


class ClaimMode(ParsedEnum):
    NO_CLAIM = "no_claim"
    CLAIM = "claim"

    @classmethod
    def _refusal(cls, value: object) -> Exception:
        return CheckpointError(f"claim_mode={value!r} is not valid: use 'no_claim' or 'claim'")


def _map_files(meta: CheckpointMetadata, new_path) -> CheckpointMetadata:
    def one(f: FileHandle) -> FileHandle:
        return replace(f, path=new_path(f))

    subtasks = tuple(SubtaskHandle(s.subtask, s.key_groups, tuple(one(f) for f in s.files),
                                   tuple(one(f) for f in s.channel_state)) for s in meta.subtasks)
    return replace(meta, subtasks=subtasks)


def _claims(meta: CheckpointMetadata, *, own: bool) -> set[str]:
    """The absolute URLs ``meta`` records as claimed from another state: its ``claimed`` list (only
    URLs it references); for a record of the caller's own state (``own``), every absolute URL of a
    CLAIMed restored record too."""
    absolute = {p for p in meta.physical_paths() if "://" in p}
    if own and meta.properties.get("claim_mode") == ClaimMode.CLAIM.value and "restored_from" in meta.properties:
        return absolute
    listed = meta.properties.get("claimed")
    return absolute & set(listed) if isinstance(listed, list) else set()


def _data_path(f: FileHandle) -> str | None:
    """``f``'s physical file as ``shared/<checksum>`` or ``merged/<32 hex>`` (a relative path exactly, the
    last two components of a URL), or None if it is not a data file: a whole file is named by its
    checksum."""
    parts = f.path.split("://", 1)[-1].split("/")
    if f.is_relative and len(parts) != 2:
        return None
    rel = "/".join(parts[-2:])
    if is_merged(rel):
        return rel
    return rel if rel == shared_path(f.checksum) and f.offset == 0 else None


def _under_any(url: str, roots: Iterable[str] | None) -> bool:
    """``url`` lies under one of ``roots`` (None: anywhere), both compared in their :func:`place` form."""
    if roots is None:
        return True
    where = place(url)
    return any(where.startswith(place(r).rstrip("/") + "/") for r in roots)


def _confine(src: CheckpointStorage, meta: CheckpointMetadata, label: str, claimed: set[str],
             claimed_roots: Iterable[str] | None) -> dict[str, bool]:
    """Map every physical path of ``meta`` to True (under ``src``'s root) or False (claimed from another
    state, under one of ``claimed_roots``); refuse any other path, naming it. No I/O."""
    root = place(src.url)
    roots = None if claimed_roots is None else list(claimed_roots)
    inside: dict[str, bool] = {}
    for s in meta.subtasks:
        for f in (*s.files, *s.channel_state):   # every handle: two may name one path with two checksums
            what = f"file {f.name} of subtask {s.subtask} ({f.path})"
            if _data_path(f) is None:
                raise CheckpointError(
                    f"{label}: {what} is not a data file of a checkpoint (shared/<its checksum {f.checksum}> or "
                    f"merged/<32 hex>); nothing was written. The record was altered: pass an unaltered retained "
                    f"checkpoint or a savepoint")
            if f.is_relative:
                inside[f.path] = True
                continue
            parts = f.path.split("://", 1)[1].split("/")
            if any(p in ("", ".", "..") for p in parts[1:]):
                raise CheckpointError(f"{label}: {what} is not a plain URL (empty, . or .. components); nothing "
                                      f"was written. Pass an unaltered retained checkpoint or a savepoint")
            if posixpath.dirname(posixpath.dirname(place(f.path))) == root:
                inside[f.path] = True
            elif f.path in claimed and _under_any(f.path, roots):
                inside[f.path] = False
            elif f.path in claimed:
                theirs = f.path.rsplit("/", 2)[0]
                raise CheckpointError(
                    f"{label}: {what} lies outside the source's state root {src.url}, in {theirs}, which the record "
                    f"says its state claimed; a record can list any URL as claimed, and restoring would read it with "
                    f"this application's credentials, so files outside the source are read only under roots you "
                    f"name; nothing was written. If you trust this record, pass claimed_roots=[{theirs!r}]; or "
                    f"restore from a savepoint of the source (`steward checkpoints savepoint`), which holds copies "
                    f"of the files it claimed")
            else:
                raise CheckpointError(
                    f"{label}: {what} lies outside the source's state root {src.url}, and the record does not list "
                    f"it as claimed from another state; nothing was written. A checkpoint names only its own "
                    f"files and files its state claimed: pass an unaltered retained checkpoint or a savepoint")
    return inside


def check_sources(src: CheckpointStorage, meta: CheckpointMetadata, url: str, *, claimed: set[str] | None = None,
                  claimed_roots: Iterable[str] | None = (), label: str | None = None) -> dict[str, bool]:
    """Refuse a checkpoint that names a file outside its data files and ``claimed`` (default: the URLs
    the record lists as claimed) under ``claimed_roots`` (the roots the caller names; None: anywhere, for
    a record of the caller's own state), or whose files are missing or have another length than its
    record says (shorter, for segments of merged files), naming the first such file, ``url`` and the
    fix. Returns every physical path mapped to whether it lies under ``src``'s root. One listing per
    directory; no file is read."""
    label = label or f"restore_from={url!r}"
    inside = _confine(src, meta, label, _claims(meta, own=False) if claimed is None else claimed, claimed_roots)
    by_dir: dict[str, tuple[Location, str, list[tuple[FileHandle, str]]]] = {}
    for s in meta.subtasks:
        for f in (*s.files, *s.channel_state):
            loc, path = src.location_of(f.path)
            parent = posixpath.dirname(path.rstrip("/"))
            key = loc.display(parent)
            by_dir.setdefault(key, (loc, parent, []))[2].append((f, f"file {f.name} of subtask {s.subtask} "
                                                                    f"({loc.display(path)})"))
    for loc, parent, files in by_dir.values():
        sizes = {posixpath.basename(str(i["name"]).rstrip("/")): i.get("size") for i in loc.listdir(parent)}
        for f, what in files:
            base = posixpath.basename(src.location_of(f.path)[1])
            if base not in sizes:
                raise CheckpointNotFoundError(
                    f"{label}: {what} is missing, so the checkpoint is incomplete (deleted by hand, "
                    f"or claimed and subsumed by another state); nothing was restored. Pass another retained "
                    f"checkpoint or a savepoint")
            size = sizes[base]
            if isinstance(size, int) and (size < f.offset + f.length or (not f.is_segment and size != f.length)):
                raise CheckpointCorruptError(
                    f"{label}: {what} is corrupt: it has {size} bytes, its record says "
                    f"{f.offset + f.length}; nothing was restored. Pass another retained checkpoint or a savepoint")
    return inside


def _duplicate_into(src: CheckpointStorage, files: Iterable[FileHandle], dst: CheckpointStorage,
                    duplicator: Duplicator, label: str,
                    progress: Callable[[int, int], None] | None = None) -> set[str]:
    """Copy the physical files of ``files`` to ``dst`` (a file already there is copied again: only a
    fresh copy of the source is trusted): whole files to ``shared/<checksum>``, merged physical files
    (FLIP-306) once each to ``merged/<uuid>``, their segments keeping their offsets, and verified
    against their checksums. Returns the relative paths this call created. On a failure those files
    (and only those) are deleted. ``progress(done, total)`` counts the physical files copied."""
    files = list(files)
    pairs = {}
    for f in files:
        rel = _dest(f)
        pairs[rel] = (src.url_of(f.path), dst.url_of(rel))
    if not pairs:
        return set()
    before = _present(dst, pairs)
    created = set(pairs) - before
    if dst.location.is_local:
        dst.location.makedirs(dst.location.path("shared"))
        if any(is_merged(r) for r in pairs):
            dst.location.makedirs(dst.location.path(MERGED_DIR))
    try:
        if progress is None:
            duplicator.duplicate(list(pairs.values()))
        else:
            duplicator.duplicate(list(pairs.values()), progress=progress)
        _verify_segments(dst, [f for f in files if f.is_segment], label)
    except BaseException:
        _discard(dst, created)
        raise
    log.info("duplicated %d files into %s (%d new)", len(pairs), dst.url, len(created))
    return created


def _present(dst: CheckpointStorage, rels: Iterable[str]) -> set[str]:
    """Which of the relative paths ``rels`` exist under ``dst`` (one listing per directory)."""
    out: set[str] = set()
    for sub in sorted({posixpath.dirname(r) for r in rels}):
        out.update(posixpath.join(sub, posixpath.basename(str(i["name"]).rstrip("/")))
                   for i in dst.location.listdir(dst.location.path(sub)))
    return out & set(rels)


def _discard(dst: CheckpointStorage, created: set[str]) -> None:
    try:
        dst.delete_files(sorted(created))
    except StewardError as exc:  # the first error matters more; the sweep at start gets the rest
        log.warning("could not delete the files of a failed duplication into %s: %s", dst.url, exc)


def _verify_segments(dst: CheckpointStorage, segments: list[FileHandle], label: str) -> None:
    """Read every segment's bytes from its copy in ``dst`` and compare their xxh3-128 with its checksum."""
    by_file: dict[str, list[FileHandle]] = {}
    for f in segments:
        by_file.setdefault(_dest(f), []).append(f)
    for rel, segs in sorted(by_file.items()):
        loc, path = dst.location_of(rel)
        with loc.fs.open(path, "rb") as fin:
            for f in sorted(segs, key=lambda x: x.offset):
                fin.seek(f.offset)
                h, left = Hasher(), f.length
                while left:
                    chunk = fin.read(min(left, 4 << 20))
                    if not chunk:
                        break
                    h.update(chunk)
                    left -= len(chunk)
                if left or h.digest().hex() != f.checksum:
                    raise CheckpointCorruptError(
                        f"{label}: file {f.name} ({f.path}, {f.length} bytes at offset {f.offset}) does not match "
                        f"its checksum {f.checksum}; nothing was restored. Pass another retained checkpoint or a "
                        f"savepoint")


def _dest(f: FileHandle) -> str:
    """Where a duplicate of ``f``'s physical file goes, relative to the new root."""
    if f.is_segment:
        return posixpath.join(MERGED_DIR, posixpath.basename(f.path))
    return shared_path(f.checksum)


def _absolute(src: CheckpointStorage, f: FileHandle) -> str:
    url = src.url_of(f.path)
    return url if "://" in url else "file://" + os.path.abspath(url)


def restore_from(url: str, dst: CheckpointStorage, *, max_parallelism: int,
                 claim_mode: ClaimMode | str = ClaimMode.NO_CLAIM, key_type: KeyType | str | None = None,
                 duplicator: Duplicator | None = None, claimed_roots: Iterable[str] = ()) -> CheckpointMetadata:
    """Make the checkpoint or savepoint at ``url`` the starting point of the state stored in ``dst``.

    Writes ``restored/_metadata`` in ``dst`` and returns that record. A ``url`` that is not a
    checkpoint, a record of a newer version, a changed max parallelism or key type, a ``url`` inside
    ``dst``, a record naming files outside its state root that it does not list as claimed or that
    lie under none of ``claimed_roots`` (the other states' roots the caller trusts it to read),
    missing or truncated files, and a ``dst`` that has checkpoints of its own raise clear errors
    before anything is written. An earlier restored starting point of ``dst`` (restored, never
    checkpointed since) is replaced: its record is deleted before any file is copied.
    """
    mode = ClaimMode.parse(claim_mode)
    own = dst.checkpoint_ids()
    if own:
        raise CheckpointError(
            f"state {dst.state!r} ({dst.url}) already has checkpoints {own} of its own, so restore_from={url!r} "
            f"would discard them: a state continues from its latest checkpoint. Use a new state name (or delete "
            f"the state's directory) to start from {url!r}")
    src, meta = open_checkpoint(url)
    where, root = place(url), place(dst.url)
    if where == root or where.startswith(root + "/"):
        raise CheckpointError(f"restore_from={url!r} is inside the directory of state {dst.state!r} ({dst.url}) "
                              f"itself: a state continues from its own checkpoints without restore_from; pass "
                              f"another state's checkpoint or a savepoint")
    check_max_parallelism(meta, max_parallelism)
    if key_type is not None and meta.key_type is not KeyType.parse(key_type):
        raise StateEncodingError(
            f"restore_from={url!r} holds {meta.key_type.value} keys, but state {dst.state!r} has "
            f"{KeyType.parse(key_type).value} keys: cast the key column to {meta.key_type.value}, or restore "
            f"another checkpoint")
    inside = check_sources(src, meta, url, claimed_roots=claimed_roots)
    label = f"restore_from={url!r}"
    if mode is ClaimMode.CLAIM:
        _refuse_live_writer(src, label)
    props = {**meta.properties, "restored_from": url, "claim_mode": mode.value, "source_state": meta.state}
    props.pop("claimed", None)
    if dst.has_restored():
        log.info("state %s: replacing its restored starting point with %s", dst.state, url)
        dst.delete_checkpoint_dir(RESTORED)  # the record first: its files are orphans from here on
    dup = duplicator or Duplicator()
    if mode is ClaimMode.CLAIM:  # take over only files under the source's root; copy what it had claimed
        created = _duplicate_into(src, [f for f in meta.files() if not inside[f.path]], dst, dup, label)
        restored = _map_files(meta, lambda f: _absolute(src, f) if inside[f.path] else _dest(f))
        props["claimed_metadata"] = _metadata_url(url)
    else:
        created = _duplicate_into(src, meta.files(), dst, dup, label)
        restored = _map_files(meta, _dest)
    restored = replace(restored, state=dst.state, properties=props)
    try:
        dst.write_metadata(restored, as_id=RESTORED)
    except BaseException:
        _discard(dst, created)
        raise
    return restored


def _refuse_live_writer(src: CheckpointStorage, label: str) -> None:
    """CLAIM: refuse a source whose state root still has a live writer, naming it."""
    record = read_lease(src.location)
    if record is not None and record.may_be_live(time.time()):
        raise CheckpointError(
            f"{label} with claim_mode='claim': state {src.state!r} ({src.url}) still has a live writer, "
            f"{record.describe()}, which would go on subsuming and deleting the files this state would own; "
            f"nothing was written. Stop that application first (its lease is released when it stops, or expires "
            f"{record.ttl:g} s after its last renewal), or restore with claim_mode='no_claim', which copies")


def _metadata_url(url: str) -> str:
    """The absolute URL of the ``_metadata`` of the checkpoint or savepoint ``url`` names."""
    text = url.rstrip("/")
    if posixpath.basename(text) == METADATA_FILE:
        text = posixpath.dirname(text)
    loc = open_location(text)
    shown = loc.display(loc.path(METADATA_FILE))
    return shown if "://" in shown else "file://" + os.path.abspath(shown)


#: the last names ``open_checkpoint`` reads as a retained checkpoint, never a savepoint's
_NOT_A_SAVEPOINT_NAME = re.compile(r"^(chk-\d+|_metadata)$")


def check_savepoint_target(url: str, src: CheckpointStorage, checkpoint_dirs: Iterable[str] = ()) -> None:
    """Refuse a savepoint ``url`` that is, contains or lies under the state root of ``src``, its
    checkpoint dir (``src`` is ``<checkpoint-dir>/<cluster-id>/<state>``) or any of
    ``checkpoint_dirs``, naming the overlap and the fix; and one whose last name is ``chk-<N>`` or
    ``_metadata``, which ``restore_from`` would read as a retained checkpoint of a state (resolving the
    savepoint's files against its parent). No remote calls."""
    last = url.rstrip("/").rsplit("/", 1)[-1]
    if _NOT_A_SAVEPOINT_NAME.match(last):
        raise CheckpointError(f"savepoint {url!r} ends in {last!r}, which restore_from reads as a checkpoint "
                              f"directory or its record, not as a savepoint; nothing was written. Give it another "
                              f"last name, such as {src.state}-sp-1")
    target = place(url)
    root = place(src.url)
    checkpoint_dir = posixpath.dirname(posixpath.dirname(root))
    for what, where in [(f"the state root of {src.state!r}", root), ("its checkpoint dir", checkpoint_dir),
                        *(("the checkpoint dir", place(d)) for d in checkpoint_dirs)]:
        if overlaps(target, where):
            raise CheckpointError(
                f"savepoint {url!r} overlaps {what} ({where}): a savepoint target must not be, contain or lie under "
                f"a checkpoint directory, where copying into it or cleaning up after a failed copy could delete "
                f"live checkpoint files; nothing was written. Pick a path outside every checkpoint dir, such as "
                f"a savepoints/ directory next to it")


def write_savepoint(src: CheckpointStorage, meta: CheckpointMetadata, url: str,
                    duplicator: Duplicator | None = None, *, source: str | None = None,
                    checkpoint_dirs: Iterable[str] = (), progress: Callable[[int, int], None] | None = None) -> str:
    """Copy checkpoint ``meta`` of ``src`` to a self-contained savepoint at ``url``; return the URL of
    its ``_metadata``. Refuses a ``url`` that already holds a ``_metadata``, and one that overlaps a
    checkpoint directory (:func:`check_savepoint_target`; ``checkpoint_dirs`` names more of them).

    The files are duplicated first and ``_metadata`` is written last (atomically: the savepoint's
    commit marker); if anything fails, the files this call created are deleted again, so ``url``
    holds a whole savepoint or none. ``source`` (default ``chk-<N>/_metadata`` of ``src``) is
    recorded as ``savepoint_of``. ``progress(done, total)`` is called as the files are copied.
    """
    check_savepoint_target(url, src, checkpoint_dirs)
    loc = open_location(url)
    target = CheckpointStorage(loc, meta.state)
    meta_path = loc.path(METADATA_FILE)
    if loc.exists(meta_path):
        raise CheckpointError(f"savepoint {url!r} already exists ({loc.display(meta_path)}); pick a new path")
    of = source or src.url_of(posixpath.join(checkpoint_dir_name(meta.checkpoint_id), METADATA_FILE))
    label = f"savepoint {url!r} of {of}"
    check_sources(src, meta, of, claimed=_claims(meta, own=True), claimed_roots=None, label=label)
    created = _duplicate_into(src, meta.files(), target, duplicator or Duplicator(), label, progress)
    saved = _map_files(meta, _dest)
    props = {k: v for k, v in meta.properties.items() if k not in ("claimed", "claimed_metadata")}
    props["savepoint_of"] = of
    saved = replace(saved, properties=props)
    try:
        loc.write_atomic(meta_path, saved.to_bytes())  # last: a savepoint without _metadata is not one
    except BaseException:
        _discard(target, created)
        raise
    return loc.display(meta_path)
