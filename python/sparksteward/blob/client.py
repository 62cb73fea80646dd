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
from sparksteward.hashing import hash_bytes
from sparksteward.blob.store import verified_copy
from sparksteward.errors import ChecksumMismatchError, ProtocolError, StewardError
from sparksteward.wire import Connection, RawReader

__all__ = ["BlobClient"]


class BlobClient:
    """Blob operations over ``conn()`` (a callable returning this thread's Connection).

    ``request(op, **fields)`` sends the small control requests; :class:`~sparksteward.client.Steward`
    passes its own, which retries only idempotent ops. Streams use ``conn()`` directly; a stream that
    fails part-way leaves its connection marked broken, so the next ``conn()`` opens a new one.
    """

    def __init__(self, conn: Callable[[], Connection],
                 request: Callable[..., dict[str, Any]] | None = None) -> None:
        self._conn = conn
        self._request_fn = request
        self._incoming: str | None = None

    def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        if self._request_fn is not None:
            return self._request_fn(op, **fields)
        return self._conn().request(op, **fields)

    @property
    def incoming(self) -> str:
        """The server's incoming directory (same host only)."""
        if self._incoming is None:
            self._incoming = self._request("blob.info")["incoming"]
        return self._incoming

    def staging_file(self) -> tuple[int, str]:
        """A new file in the server's incoming directory: ``(fd, path)``; hand it to ``put_path``."""
        return tempfile.mkstemp(prefix="put-", dir=self.incoming)

    def put_path(self, path: str, job_id: str | None = None, *, permanent: bool = False,
                 move: bool = True) -> BlobKey:
        """Store a file that is already in :attr:`incoming` (same host: no copy through a socket)."""
        reply = self._request("blob.put_path", path=str(path), job_id=job_id,
                              type=(BlobType.PERMANENT if permanent else BlobType.TRANSIENT).value, move=move)
        return BlobKey.parse(reply["key"])

    def _put(self, size: int, job_id: str | None, permanent: bool,
             send_body: Callable[[Connection, dict[str, Any]], None]) -> BlobKey:
        conn = self._conn()
        try:
            head = {"op": "blob.put", "job_id": job_id, "size": size,
                    "type": (BlobType.PERMANENT if permanent else BlobType.TRANSIENT).value}
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
            return BlobKey.parse(Connection._check(conn.recv())["key"])
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

    def _open_stream(self, key: BlobKey | str, job_id: str | None) -> tuple[BlobKey, RawReader]:
        key = key if isinstance(key, BlobKey) else BlobKey.parse(key)
        conn = self._conn()
        try:
            conn.send({"op": "blob.get", "job_id": job_id, "key": str(key)})
            return key, RawReader(conn, int(Connection._check(conn.recv())["size"]))
        except (OSError, ProtocolError):
            conn.broken = True
            raise

    def get_to_file(self, key: BlobKey | str, dest: str | os.PathLike[str], job_id: str | None = None) -> int:
        """Download a blob into ``dest`` (verified, then renamed into place); return its size."""
        key, reader = self._open_stream(key, job_id)
        try:
            return verified_copy(reader, Path(dest), key, "BlobServer")
        except BaseException:
            reader.conn.broken = reader.conn.broken or reader.left > 0 or not reader._verified
            raise

    def get_bytes(self, key: BlobKey | str, job_id: str | None = None) -> bytes:
        """Download a blob into memory, verified."""
        key, reader = self._open_stream(key, job_id)
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
            reader.conn.broken = True
            raise
        if hash_bytes(data) != key.digest:
            raise ChecksumMismatchError(f"blob {key} from the BlobServer does not match its key")
        return data

    def acquire(self, key: BlobKey | str, job_id: str | None = None) -> int:
        return self._request("blob.acquire", key=str(key), job_id=job_id)["refs"]

    def release(self, key: BlobKey | str, job_id: str | None = None) -> int:
        return self._request("blob.release", key=str(key), job_id=job_id)["refs"]

    def delete_job(self, job_id: str | None) -> None:
        self._request("blob.delete_job", job_id=job_id)

    def list(self) -> list[dict[str, Any]]:
        return self._request("blob.list")["blobs"]

    def stats(self) -> dict[str, int]:
        return self._request("blob.stats")["stats"]
