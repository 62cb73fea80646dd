"""Content checksums: xxh3-128 of bytes and files, as blobs and checkpoint files are addressed by."""

from __future__ import annotations

from pathlib import Path

import xxhash

__all__ = ["Hasher", "hash_bytes", "hash_file"]

_CHUNK = 4 << 20


class Hasher:
    """Incremental xxh3-128."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


def hash_bytes(data: bytes | memoryview) -> bytes:
    """The xxh3-128 digest of ``data``."""
    return xxhash.xxh3_128_digest(data)


def hash_file(path: str | Path) -> bytes:
    """The xxh3-128 digest of a file's content, read in 4 MiB chunks."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.digest()
