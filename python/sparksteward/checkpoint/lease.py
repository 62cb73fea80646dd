"""One live writer per state root: the writer lease ``<state root>/_lease``.

Two writers on one state root (two applications with the same checkpoint dir and state name, a
zombie driver and its replacement) would sweep each other's uploads and write the same ``chk-N``
ids. The coordinator of a state therefore writes only while it holds this lease (decision 0013).

The record is versioned JSON::

    {"version": 1, "holder": <32 hex>, "application": ..., "hostname": ..., "boot_id": ..., "pid": ...,
     "start_time": ..., "pid_ns": ..., "since": <epoch s>, "renewed": <epoch s>, "ttl": <s>, "seq": <n>,
     "released": false}

**The store.** Every write of the record is conditional, so a store that ignores the conditions
would turn the lease into check-then-put. Before anything is written, :meth:`StateLease.acquire` has
the store probed (:func:`sparksteward.storage.probe_conditional_writes`, once per store and process)
and refuses one that does not honour them, naming it and the choices;
:attr:`StateLease.conditional_writes` keeps what the probe found, for the state's info.

**Acquire.** The record is created with a conditional write (``os.link`` of a staged file locally;
``PUT If-None-Match: *`` on S3). If one exists, its holder is another writer unless it is provably
gone, and only then is it taken over:

- it released the lease (a clean close marks the record ``released``);
- it ran on this host and its process is proven dead (:meth:`OwnerRecord.is_dead`);
- its record did not change for a whole ``ttl`` timed on this process's monotonic clock (its
  renewals stopped). The record's wall-clock ``renewed`` time only decides whether watching is worth
  it: a record renewed less than ``ttl`` ago by the wall clock is refused at once. Clock skew can
  make a dead holder look alive for longer, never an alive one dead.

A takeover is a compare-and-swap against the observed version (``If-Match`` on the ETag on object
stores; locally the bytes are compared under an ``flock`` of ``_lease.lock``), so of two contenders
only one wins.

**Hold.** :meth:`StateLease.renew` rewrites the record with the same compare-and-swap every
``ttl / 3`` (the driver agent's lease thread, one for all the states of an application). It raises
none of the store's errors, so one state's trouble never stops another's renewals. A failed swap
after which the record names another holder, or is gone (the state's folder was deleted), means the
lease is lost for good, logged once. Any other failure is a failed renewal: logged once until one
succeeds again, and named by :meth:`StateLease.check`, which raises :class:`StateLeaseError` once the
lease is lost, or when the last successful renewal started more than ``0.8 * ttl`` ago, so a holder
cut off from its store stops writing before anyone else may take over. :meth:`StateLease.info`
reports all of it.

Thread-safe: one lock guards the record and the renewal state.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Any, Protocol

import orjson
import xxhash

from sparksteward.errors import CorruptRecordError, StateLeaseError, StorageError
from sparksteward.owner import OwnerRecord
from sparksteward.storage import ConditionalWrites, Location, probe_conditional_writes

__all__ = ["LEASE_FILE", "LOCK_FILE", "CallerIsTheOnlyWriter", "Fence", "LeaseRecord", "StateLease", "held_error", "read_lease",
           "refuse_if_held"]

log = logging.getLogger("sparksteward.checkpoint.lease")

LEASE_FILE = "_lease"
LOCK_FILE = "_lease.lock"
_VERSION = 1
_VALID_FRACTION = 0.8   # a holder writes only within this fraction of ttl after its last renewal began
_MAX_RECORD = 1 << 16


class Fence(Protocol):
    """What a coordinator asks before it writes or deletes: may this process write the state now?"""

    def check(self) -> None:
        """Raise :class:`StateLeaseError` unless this process may write the state root now."""


class CallerIsTheOnlyWriter:
    """The null fence: the caller guarantees it is the only writer (a test, or a tool that holds the
    lease itself)."""

    def check(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """Who holds a state root, since when, and how long a silent holder keeps it."""

    holder: str
    application: str
    owner: OwnerRecord   # the holding process: host, boot id, pid, start time (validated there)
    since: float
    renewed: float
    ttl: float
    seq: int = 0
    released: bool = False

    def __post_init__(self) -> None:
        for name in ("holder", "application"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        if not isinstance(self.owner, OwnerRecord):
            raise ValueError(f"owner must be an OwnerRecord, not {self.owner!r}")
        for name in ("since", "renewed", "ttl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, not {value!r}")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
            raise ValueError(f"seq must be an integer >= 0, not {self.seq!r}")
        if not isinstance(self.released, bool):
            raise ValueError(f"released must be a boolean, not {self.released!r}")

    def to_bytes(self) -> bytes:
        return orjson.dumps({"version": _VERSION, **asdict(self)})

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> LeaseRecord:
        try:
            rec = orjson.loads(data)
            if not isinstance(rec, dict) or rec.get("version") != _VERSION:
                raise ValueError(f"unknown version {rec.get('version') if isinstance(rec, dict) else rec!r}")
            owner = rec["owner"]
            if not isinstance(owner, dict):
                raise ValueError(f"owner {owner!r} is not an object")
            return cls(rec["holder"], rec["application"],
                       OwnerRecord(owner["hostname"], owner["boot_id"], owner["pid"], owner["start_time"],
                                   owner.get("pid_ns", "")),
                       rec["since"], rec["renewed"], rec["ttl"], rec["seq"], rec["released"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CorruptRecordError(
                f"lease record {source} is unreadable ({exc}): if no application writes this state any more, "
                f"delete the file; otherwise stop the application that does") from exc

    def gone(self) -> bool:
        """The holder provably no longer writes: it released the lease, or it ran on this host and its
        process is dead."""
        return self.released or self.owner.is_dead()

    def may_be_live(self, now: float) -> bool:
        """The holder may still write (a point check, without watching the record): not gone, and it
        renewed within its ttl by the wall clock ``now`` or runs on this host."""
        return not self.gone() and (now - self.renewed < self.ttl or self.owner.hostname == socket.gethostname())

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"application {self.application} on host {self.owner.hostname} (pid {self.owner.pid}) since {since}"


def _version(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _read(loc: Location, path: str) -> tuple[bytes, str] | None:
    """The record's bytes and version (the ETag on object stores, a hash of the bytes locally), read
    consistently; None when there is no record."""
    for _ in range(5):
        if loc.is_local:
            try:
                data = loc.read_bytes(path)
            except FileNotFoundError:
                return None
            return data, _version(data)
        before = loc.version(path)
        if before is None:
            return None
        try:
            data = loc.read_bytes(path)
        except FileNotFoundError:
            continue
        if loc.version(path) == before:
            return data, before
    raise StorageError(f"lease record {loc.display(path)} kept changing while it was read")


def held_error(state: str, loc: Location, theirs: LeaseRecord, why: str) -> StateLeaseError:
    """The error of a state whose lease ``theirs`` holds, naming the holder and the ways out."""
    return StateLeaseError(
        f"keyed state {state!r} at {loc.url} is being written by {theirs.describe()}; {why}. One state "
        f"has one writer: a second one would delete the first one's files. Stop that application (its lease "
        f"is released when it stops), or, if it died, wait until its lease expires ({theirs.ttl:g} s without "
        f"renewal) and start again; to run both, give this one another state name or spark.steward.cluster-id")


def refuse_if_held(loc: Location, state: str, now: float | None = None) -> None:
    """Raise :class:`StateLeaseError` naming the holder when a writer may hold the lease of the state
    root ``loc`` (a point check that writes nothing: what opening a state checks before its first batch,
    which takes the lease for real)."""
    theirs = read_lease(loc)
    if theirs is not None and theirs.may_be_live(time.time() if now is None else now):
        age = (time.time() if now is None else now) - theirs.renewed
        raise held_error(state, loc, theirs, f"it renewed the lease {max(age, 0.0):.0f} s ago")


def read_lease(loc: Location) -> LeaseRecord | None:
    """The lease record of the state root ``loc``; None when no writer ever took it."""
    path = loc.path(LEASE_FILE)
    got = _read(loc, path)
    if got is None:
        return None
    if len(got[0]) > _MAX_RECORD:
        raise CorruptRecordError(f"lease record {loc.display(path)} is {len(got[0])} bytes, not a lease record: "
                                 f"delete it if no application writes this state any more")
    return LeaseRecord.from_bytes(got[0], loc.display(path))


class StateLease:
    """This process's hold on one state root (see the module docstring)."""

    def __init__(self, loc: Location, state: str, *, application: str, ttl: float,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, owner: OwnerRecord | None = None) -> None:
        if not ttl > 0:
            raise ValueError(f"lease ttl must be > 0, not {ttl!r}")
        self.loc = loc
        self.state = state
        self.application = application
        self.ttl = float(ttl)
        self.path = loc.path(LEASE_FILE)
        self._monotonic, self._wall, self._sleep = monotonic, wall, sleep
        self._owner = owner   # None: this process (tests pass another host's)
        self._lock = threading.Lock()
        self._record: LeaseRecord | None = None
        self._version: str | None = None
        self._valid_from: float | None = None   # monotonic start of the last successful write
        self._lost: str | None = None
        self._failure: str | None = None   # why the latest renewal failed; None once one succeeds
        self.took_over: LeaseRecord | None = None   # the expired holder this lease replaced
        self.conditional_writes: ConditionalWrites | None = None   # the store's probe, set by acquire

    # --- acquire -----------------------------------------------------------------------------
    def acquire(self) -> None:
        """Hold the lease or raise :class:`StateLeaseError` naming the live holder."""
        with self._lock:
            self._require_conditional_writes()
            me = self._owner or OwnerRecord.current()
            now = self._wall()
            mine = LeaseRecord(uuid.uuid4().hex, self.application, me, now, now, self.ttl)
            started = self._monotonic()
            data = mine.to_bytes()
            if self.loc.create_exclusive(self.path, data):
                self._hold(mine, started)
                return
            got = _read(self.loc, self.path)
            if got is None:   # released and deleted between the two calls: try once more
                if self.loc.create_exclusive(self.path, data):
                    self._hold(mine, started)
                    return
                got = _read(self.loc, self.path)
                if got is None:
                    raise StateLeaseError(f"cannot take the lease {self.loc.display(self.path)} of keyed state "
                                          f"{self.state!r}: it keeps appearing and disappearing")
            theirs = LeaseRecord.from_bytes(got[0], self.loc.display(self.path))
            version = self._expired_version(theirs, got[1])
            mine = replace(mine, seq=theirs.seq + 1)
            started = self._monotonic()
            if not self._swap(version, mine.to_bytes()):
                raise self._held_error(theirs, "it was taken by another writer at the same moment")
            self.took_over = theirs
            log.warning("keyed state %s: took over the lease of %s from %s (%s)", self.state, self.loc.url,
                        theirs.describe(), "released" if theirs.released else "expired")
            self._hold(mine, started)

    def _require_conditional_writes(self) -> None:
        """Refuse a store that does not honour conditional writes (probed once per store and process),
        before anything of the lease is written: on it a create or a swap would be a check-then-put."""
        probed = self.conditional_writes = probe_conditional_writes(self.loc)
        if not probed.honoured:
            raise StateLeaseError(
                f"keyed state {self.state!r} cannot be written at {self.loc.url}: that store does not honour "
                f"conditional writes ({probed.detail}). One state has one writer, and the writer lease that "
                f"makes sure of it needs a create-if-absent and a compare-and-swap that the store enforces; "
                f"without them a second application could delete this one's files. Put the checkpoints "
                f"(spark.steward.checkpoint.dir, or checkpoint_dir=) on a store that honours If-None-Match and "
                f"If-Match on PUT, such as AWS S3 or a recent MinIO, or on a local or NFS-mounted path")

    def _expired_version(self, theirs: LeaseRecord, version: str) -> str:
        """The version to swap against when ``theirs`` provably no longer holds the lease; else raise."""
        if theirs.gone():
            return version
        age = self._wall() - theirs.renewed
        if age < theirs.ttl:
            raise self._held_error(theirs, f"it renewed the lease {max(age, 0.0):.0f} s ago")
        # it looks stale by the wall clock: watch the record for a whole ttl on our own clock
        deadline = self._monotonic() + theirs.ttl
        while self._monotonic() < deadline:
            self._sleep(min(1.0, theirs.ttl / 10))
            got = _read(self.loc, self.path)
            if got is None or got[1] != version:
                raise self._held_error(theirs, "it renewed the lease while this application waited for it")
        return version

    def _held_error(self, theirs: LeaseRecord, why: str) -> StateLeaseError:
        return held_error(self.state, self.loc, theirs, why)

    def _hold(self, record: LeaseRecord, started: float) -> None:
        got = _read(self.loc, self.path)
        if got is None or got[0] != record.to_bytes():
            raise StateLeaseError(f"the lease {self.loc.display(self.path)} of keyed state {self.state!r} changed "
                                  f"right after it was written: another writer took it; stop that one first")
        self._record, self._version, self._valid_from, self._lost, self._failure = record, got[1], started, None, None
        log.info("keyed state %s: holding the writer lease of %s (ttl %g s)", self.state, self.loc.url, self.ttl)

    # --- compare-and-swap --------------------------------------------------------------------
    def _swap(self, version: str | None, data: bytes) -> bool:
        if not self.loc.is_local:
            return self.loc.replace_if(self.path, data, version)
        lock_path = self.loc.path(LOCK_FILE)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileNotFoundError:   # the state root was deleted, and the record with it
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            got = _read(self.loc, self.path)
            if got is None or got[1] != version:
                return False
            self.loc.write_atomic(self.path, data)
            return True
        finally:
            os.close(fd)   # releases the flock

    # --- hold --------------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        with self._lock:
            return self._record is not None and self._lost is None

    def renew(self) -> bool:
        """Rewrite the record (a new ``seq`` and ``renewed`` time); False once the lease is lost.

        Raises nothing the store raises (``OSError``, :class:`StorageError` among them), so that one
        state's trouble never stops the renewal of another's. A renewal the store fails is remembered
        and logged once until one succeeds again, and :meth:`check` names it when the lease runs out.
        A record another writer replaced, or that was deleted (with the state's folder, say), loses
        the lease for good, logged once.
        """
        with self._lock:
            if self._record is None or self._lost is not None:
                return False
            record = replace(self._record, renewed=self._wall(), seq=self._record.seq + 1)
            started = self._monotonic()
            try:
                swapped = self._swap(self._version, record.to_bytes())
            except OSError as exc:  # the store's trouble (StorageError is one), of any kind
                return self._settle(record, started, f"{type(exc).__name__}: {exc}")
            if not swapped:
                return self._settle(record, started, None)
            try:
                got = _read(self.loc, self.path)
            except OSError as exc:
                why = f"reading the lease record back failed: {type(exc).__name__}: {exc}"
                return self._settle(record, started, why)
            if got is None or got[0] != record.to_bytes():
                return self._lose("another writer replaced the lease record right after a renewal")
            return self._renewed(record, got[1], started)

    def _renewed(self, record: LeaseRecord, version: str, started: float) -> bool:
        self._record, self._version, self._valid_from = record, version, started
        if self._failure is not None:
            log.info("keyed state %s: renewed the lease of %s again", self.state, self.loc.url)
            self._failure = None
        return True

    def _settle(self, record: LeaseRecord, started: float, error: str | None) -> bool:
        """After the renewal to ``record`` did not swap (``error`` None) or failed with ``error``: read
        the record to tell a lost lease from a failed renewal. Called under the lock; False if the
        lease is lost."""
        assert self._record is not None
        try:
            got = _read(self.loc, self.path)
        except OSError as exc:  # the store cannot be read either: check() runs out on its own
            return self._failed(error or f"{type(exc).__name__}: {exc}")
        display = self.loc.display(self.path)
        if got is None:
            return self._lose(f"its lease record {display} was deleted (with the state's checkpoint folder, or by "
                              f"hand), so another application may take the state over")
        if got[0] == record.to_bytes():   # the renewal went through; only its answer was lost
            return self._renewed(record, got[1], started)
        try:
            theirs = LeaseRecord.from_bytes(got[0], display)
        except CorruptRecordError:
            return self._lose(f"its lease record {display} was overwritten with something that is not a lease")
        if theirs.holder != self._record.holder or theirs.released:
            return self._lose(f"another writer took the lease over: {theirs.describe()}")
        # still this lease's own record, at another version (an earlier write whose answer was lost)
        self._record, self._version = theirs, got[1]
        return self._failed(error or "the record was at another version of this application's own (a write whose "
                                     "answer was lost); the next renewal swaps against it")

    def _failed(self, why: str) -> bool:
        if self._failure is None:
            log.warning("keyed state %s: renewing the lease of %s failed: %s. Renewals go on; the state stops "
                        "writing if none succeeds within %g s", self.state, self.loc.url, why,
                        _VALID_FRACTION * self.ttl)
        self._failure = why
        return True

    def _lose(self, why: str) -> bool:
        self._lost = why
        log.error("keyed state %s: lost the writer lease of %s: %s; this application stops writing it",
                  self.state, self.loc.url, why)
        return False

    def check(self) -> None:
        """Raise :class:`StateLeaseError` unless this process may write the state root now."""
        with self._lock:
            problem = self._problem()
        if problem is not None:
            raise StateLeaseError(problem)

    def _problem(self) -> str | None:
        """Why this process may not write the state root now; None if it may. Called under the lock."""
        if self._record is None:
            return f"keyed state {self.state!r}: this application does not hold the writer lease of {self.loc.url}"
        if self._lost is not None:
            return (f"keyed state {self.state!r} at {self.loc.url} can no longer be written by this application: "
                    f"{self._lost}. Stop this application")
        assert self._valid_from is not None
        silent = self._monotonic() - self._valid_from
        if silent > _VALID_FRACTION * self.ttl:
            failed = f"; the last renewal failed: {self._failure}" if self._failure is not None else ""
            return (f"keyed state {self.state!r}: the writer lease of {self.loc.url} was last renewed {silent:.0f} s "
                    f"ago (ttl {self.ttl:g} s){failed}, so another application may take it over; this checkpoint is "
                    f"not written. Check that the checkpoint store is reachable")
        return None

    def info(self) -> dict[str, Any]:
        """This lease as a state's info reports it: whether it is held; ``problem``, why this process may
        not write the state now (None while it may); ``renewal_failed``, why the latest renewal failed
        (None once one succeeds); and ``conditional_writes``, the probe of the store."""
        with self._lock:
            probed = self.conditional_writes
            return {"held": self._record is not None and self._lost is None, "problem": self._problem(),
                    "renewal_failed": self._failure, "ttl": self.ttl,
                    "renewed_s_ago": None if self._valid_from is None else self._monotonic() - self._valid_from,
                    "conditional_writes": None if probed is None else probed.to_json()}

    def release(self) -> None:
        """Mark the record released (idempotent), so the next writer takes over at once."""
        with self._lock:
            if self._record is None or self._lost is not None:
                self._record = None
                return
            record = replace(self._record, renewed=self._wall(), seq=self._record.seq + 1, released=True)
            try:
                if not self._swap(self._version, record.to_bytes()):
                    log.warning("keyed state %s: the lease of %s was taken over before it was released",
                                self.state, self.loc.url)
            except (StorageError, OSError) as exc:
                log.warning("keyed state %s: releasing the lease of %s failed (it expires after %g s): %s",
                            self.state, self.loc.url, self.ttl, exc)
            self._record = None
