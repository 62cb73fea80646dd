"""BlobClient: low-level put/get/delete of permanent and transient blobs against a BlobServer.

``st.blobs`` is one, bound to the user's driver. Puts from the same host go through
``blob.put_path`` (the file is written straight into the server's incoming directory and linked into
place: no bytes cross a socket); ``put_bytes`` streams. ``get_to_file`` verifies the stream's
checksum and renames a complete copy into place only.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparksteward.blob.key import BlobKey, BlobType
from sparksteward.blob.messages import (
    BlobAcquireRequest,
    BlobDeleteJobRequest,
    BlobGetRequest,
    BlobInfoRequest,
    BlobListRequest,
    BlobPutPathRequest,
    BlobPutRequest,
    BlobReleaseRequest,
    BlobStatsRequest,
)
from sparksteward.blob.store import verified_copy
from sparksteward.errors import ChecksumMismatchError, ProtocolError, StewardError
from sparksteward.hashing import hash_bytes
from sparksteward.wire import Connection, RawReader
from sparksteward.wire.messages import Message, ask, read_reply

__all__ = ["BlobClient"]


class BlobClient:
    """Blob operations over ``conn()`` (a callable returning this thread's Connection).

    ``ask(request) -> reply`` sends the small control requests (typed, :mod:`sparksteward.blob.messages`);
    :class:`~sparksteward.client.Steward` passes its own, which retries only idempotent ops. Streams use
    ``conn()`` directly; a stream that fails part-way leaves its connection marked broken, so the next
    ``conn()`` opens a new one.
    """

    def __init__(self, conn: Callable[[], Connection], ask: Callable[[Message], Any] | None = None) -> None:
        self._conn = conn
        self._ask_fn = ask
        self._incoming: str | None = None

    def _ask(self, request: Message) -> Any:
        if self._ask_fn is not None:
            return self._ask_fn(request)
        return ask(self._conn(), request)

    @property
    def incoming(self) -> str:
        """The server's incoming directory (same host only)."""
        if self._incoming is None:
            self._incoming = self._ask(BlobInfoRequest()).incoming
        return self._incoming

    def staging_file(self) -> tuple[int, str]:
        """A new file in the server's incoming directory: ``(fd, path)``; hand it to ``put_path``."""
        return tempfile.mkstemp(prefix="put-", dir=self.incoming)

    def put_path(self, path: str, job_id: str | None = None, *, permanent: bool = False,
                 move: bool = True) -> BlobKey:
        """Store a file that is already in :attr:`incoming` (same host: no copy through a socket)."""
        btype = BlobType.PERMANENT if permanent else BlobType.TRANSIENT
        return self._ask(BlobPutPathRequest(str(path), job_id, btype, move)).key

    def _put(self, size: int, job_id: str | None, permanent: bool,
             send_body: Callable[[Connection, dict[str, Any]], None]) -> BlobKey:
        conn = self._conn()
        try:
            request = BlobPutRequest(job_id, size, BlobType.PERMANENT if permanent else BlobType.TRANSIENT)
            head = {"op": request.OP, **request.to_wire()}
            try:
                send_body(conn, head)  # the request frame, then the body (one write when it is small)
            except OSError as exc:
                # the agent may have refused the header and closed the connection: its reply says why
                try:
                    reply = conn.recv()
                except (OSError, StewardError):
                    raise exc from None
                Connection._check(reply)
                raise
            return read_reply(request, Connection._check(conn.recv())).key
        except BaseException:
            conn.broken = True  # the stream's state is unknown: never reuse this connection
            raise

    def put_file(self, path: str | os.PathLike[str], job_id: str | None = None, *, permanent: bool = False) -> BlobKey:
        """Store a local file by streaming it (works from any host)."""
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            return self._put(size, job_id, permanent, lambda conn, head: conn.send_file(f, size, head))

    def put_bytes(self, data: bytes, job_id: str | None = None, *, permanent: bool = False) -> BlobKey:
        """Store ``data`` (streamed from memory)."""
        return self._put(len(data), job_id, permanent, lambda conn, head: conn.send_body(data, head))

    def _open_stream(self, key: BlobKey | str, job_id: str | None) -> tuple[BlobKey, Connection, RawReader]:
        key = key if isinstance(key, BlobKey) else BlobKey.parse(key)
        conn = self._conn()
        try:
            request = BlobGetRequest(job_id, key)
            conn.send({"op": request.OP, **request.to_wire()})
            raw = Connection._check(conn.recv())
        except (OSError, ProtocolError):
            conn.broken = True
            raise
        try:
            return key, conn, RawReader(conn, read_reply(request, raw).size)
        except StewardError:
            conn.broken = True   # a reply we cannot read: whatever follows it is not ours to read
            raise

    def get_to_file(self, key: BlobKey | str, dest: str | os.PathLike[str], job_id: str | None = None) -> int:
        """Download a blob into ``dest`` (verified, then renamed into place); return its size."""
        key, conn, reader = self._open_stream(key, job_id)
        try:
            return verified_copy(reader, Path(dest), key, "BlobServer")
        except BaseException:
            conn.broken = conn.broken or reader.left > 0 or not reader._verified
            raise

    def get_bytes(self, key: BlobKey | str, job_id: str | None = None) -> bytes:
        """Download a blob into memory, verified."""
        key, conn, reader = self._open_stream(key, job_id)
        try:
            data = bytes(reader.read(1 << 22))
            if reader.left:  # more than one chunk
                parts = [data]
                while len(chunk := reader.read(1 << 22)):
                    parts.append(bytes(chunk))
                data = b"".join(parts)
            else:
                reader.read(1)  # the end: the tag is verified (a small body's already is)
        except BaseException:
            conn.broken = True
            raise
        if hash_bytes(data) != key.digest:
            raise ChecksumMismatchError(f"blob {key} from the BlobServer does not match its key")
        return data

    def acquire(self, key: BlobKey | str, job_id: str | None = None) -> int:
        return self._ask(BlobAcquireRequest(_key(key), job_id)).refs

    def release(self, key: BlobKey | str, job_id: str | None = None) -> int:
        return self._ask(BlobReleaseRequest(_key(key), job_id)).refs

    def delete_job(self, job_id: str | None) -> None:
        self._ask(BlobDeleteJobRequest(job_id))

    def list(self) -> list[dict[str, Any]]:
        return self._ask(BlobListRequest()).blobs

    def stats(self) -> dict[str, int]:
        return self._ask(BlobStatsRequest()).stats


def _key(key: BlobKey | str) -> BlobKey:
    return key if isinstance(key, BlobKey) else BlobKey.parse(key)
