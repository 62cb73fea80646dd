"""The executor's local cache of checkpoint files, addressed by content (xxh3-128).

A subtask that lands on an executor which already holds some of its files (from an earlier restore or
its own upload) hard-links them instead of downloading them again. Entries are read-only files
``<root>/<checksum>``; every lookup re-hashes the entry (xxh3 runs at several GB/s), so a damaged
entry is dropped and fetched again rather than restored. Downloads of one checksum are single-flight:
concurrent callers wait for the first. Past ``max_bytes`` the least recently used entries are evicted,
except the newest and any held by :meth:`pinned` (a caller between a fetch and its hard link).

Thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from sparksteward.hashing import Hasher, hash_file

__all__ = ["LocalFileCache"]

log = logging.getLogger("sparksteward.checkpoint.task.cache")
_CHUNK = 4 << 20


class LocalFileCache:
    """Content-addressed files under ``root`` (created if missing; owned by the executor agent)."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Lock] = {}
        self._pins: dict[str, int] = {}   # checksum -> holders of pinned()
        found = []
        for p in self.root.iterdir():
            if p.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()  # a download cut short by a crash
                continue
            st = p.stat()
            found.append((st.st_mtime, p.name, st.st_size))
        self._lru: OrderedDict[str, int] = OrderedDict((name, size) for _, name, size in sorted(found))
        self._total = sum(self._lru.values())   # kept with _lru: a long stream's cache holds many entries

    @property
    def size(self) -> int:
        with self._lock:
            return self._total

    def _touch(self, checksum: str, size: int | None = None) -> None:
        with self._lock:
            if size is not None:
                self._total += size - self._lru.get(checksum, 0)
                self._lru[checksum] = size
            if checksum in self._lru:
                self._lru.move_to_end(checksum)
            if self.max_bytes is None:
                return
            total = self._total
            if total <= self.max_bytes:
                return
            for victim in list(self._lru)[:-1]:   # never the newest
                if total <= self.max_bytes:
                    break
                if victim in self._pins:
                    continue
                vsize = self._lru.pop(victim)
                self._total -= vsize
                with contextlib.suppress(FileNotFoundError):
                    self.path(victim).unlink()
                total -= vsize
                log.debug("evicted %s (%d bytes) from the checkpoint file cache", victim, vsize)

    @contextlib.contextmanager
    def pinned(self, checksum: str) -> Iterator[None]:
        """Keep ``checksum``'s entry from eviction while the block runs (it may exceed ``max_bytes``)."""
        with self._lock:
            self._pins[checksum] = self._pins.get(checksum, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._pins.pop(checksum) - 1
                if left:
                    self._pins[checksum] = left

    def path(self, checksum: str) -> Path:
        return self.root / checksum

    def lookup(self, checksum: str) -> Path | None:
        """The verified cached file for ``checksum``, or None (a damaged entry is deleted)."""
        p = self.path(checksum)
        if not p.exists():
            return None
        if hash_file(p).hex() != checksum:
            log.warning("cached checkpoint file %s does not match its checksum; dropping it", p)
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            with self._lock:
                self._total -= self._lru.pop(checksum, 0)
            return None
        self._touch(checksum, p.stat().st_size)
        return p

    def adopt(self, local: Path, checksum: str) -> None:
        """Add an immutable local file (an SST we just uploaded) by hard link; best effort."""
        p = self.path(checksum)
        if p.exists():
            return
        try:
            os.link(local, p)
            self._touch(checksum, p.stat().st_size)
        except FileExistsError:
            pass
        except OSError as exc:  # another file system: not worth a copy
            log.debug("cannot link %s into the cache: %s", local, exc)

    def fetch(self, checksum: str, open_source: Callable[[], BinaryIO], length: int,
              on_mismatch: Callable[[str], Exception]) -> tuple[Path, bool, int]:
        """The cached file for ``checksum``, downloading it with ``open_source`` if it is missing.

        ``open_source()`` returns a readable positioned at the logical file's first byte; exactly
        ``length`` bytes are read. Returns ``(path, cache hit, bytes downloaded)``. A digest that does not match
        raises ``on_mismatch(actual hex)`` and keeps nothing.
        """
        hit = self.lookup(checksum)
        if hit is not None:
            return hit, True, 0
        with self._lock:
            gate = self._inflight.setdefault(checksum, threading.Lock())
        with gate:
            hit = self.lookup(checksum)
            if hit is not None:
                return hit, True, 0
            try:
                return self.path(checksum), False, self._download(checksum, open_source, length, on_mismatch)
            finally:
                with self._lock:
                    self._inflight.pop(checksum, None)

    def _download(self, checksum: str, open_source: Callable[[], BinaryIO], length: int,
                  on_mismatch: Callable[[str], Exception]) -> int:
        tmp = self.root / f".{checksum}.{uuid.uuid4().hex[:8]}.tmp"
        h = Hasher()
        size = 0
        try:
            with open_source() as src, open(tmp, "wb") as out:
                remaining = length
                while remaining > 0:
                    chunk = src.read(min(_CHUNK, remaining))
                    if not chunk:
                        break
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                    remaining -= len(chunk)
            actual = h.digest().hex()
            if size != length or actual != checksum:
                raise on_mismatch(actual if size == length else f"{size} of {length} bytes")
            os.chmod(tmp, 0o444)
            os.replace(tmp, self.path(checksum))
            self._touch(checksum, size)
            return size
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def entries(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith("."))
