"""Bodies: the raw bytes of a length that a frame announced, each followed by a tag of its own.

A body's tag is computed under its own key, ``Kb = HMAC(K, direction | "B" | seq | size)``, where ``K``
is the session key of the handshake (:mod:`sparksteward.wire.handshake`). It is Poly1305 under the
one-time key ``Kb`` when both sides have ``cryptography`` (negotiated in the handshake, inside both
proofs), else ``HMAC-SHA256`` keyed the same way (decision 0007). Under ``poly1305-large``, the first
choice, bodies under 64 KiB take the HMAC-SHA256 form, whose keyed state is copied rather than set up
per body. Senders hash each 1 MiB chunk of a file right after ``sendfile`` handed it to the kernel,
from a read-only memory map (no copies); readers hash each chunk as it arrives and verify the tag
before they hand the last chunk over, so a tampered or truncated body is never accepted. Bodies and
frames share the sequence counter. A frame and a small body that follows it go out in one write.

:class:`BodyStreams` is the body half of :class:`~sparksteward.wire.connection.Connection` (a mixin);
:class:`RawReader` reads one body as a file. Not thread-safe, like the connection.
"""

from __future__ import annotations

import hmac
import mmap
import os
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from sparksteward.errors import AuthenticationError, ProtocolError

try:  # a declared dependency; if it cannot be imported, bodies fall back to HMAC-SHA256
    from cryptography.hazmat.primitives.poly1305 import Poly1305
    _Poly1305: type[Poly1305] | None = Poly1305
except ImportError:  # pragma: no cover - depends on the environment
    _Poly1305 = None

__all__ = ["BODY_MACS", "BodyStreams", "RawReader", "TAG_SIZE", "write_all"]

TAG_SIZE = 32
_CHUNK = 1 << 20  # a body's bytes move in chunks this big: each stays in cache while it is hashed and written
_PARALLEL_MAC = 1 << 20  # HMAC-SHA256 bodies this big are hashed on a helper thread
_READ_AHEAD = 64 << 10  # after the handshake, a short read asks the socket for up to this much

#: Bodies under this size take HMAC-SHA256 under ``poly1305-large``: a keyed HMAC copy costs about
#: 2 µs where setting up a Poly1305 context costs about 15, more than hashing 64 KiB.
_SMALL_BODY = 64 << 10
#: Body MACs this process can compute, preferred first. The client offers them, the server picks.
#: ``poly1305-large``: Poly1305 for bodies of :data:`_SMALL_BODY` bytes or more, HMAC-SHA256 below.
BODY_MACS: tuple[str, ...] = (("poly1305-large", "poly1305") if _Poly1305 is not None else ()) + ("hmac-sha256",)


class _PolyMac:
    """Poly1305 under a one-time key (each body's own key, derived from the session key, direction
    and sequence number), padded to :data:`TAG_SIZE`."""

    def __init__(self, key: bytes) -> None:
        assert _Poly1305 is not None  # poly1305 is offered (BODY_MACS), so negotiated, only when it imported
        self._p = _Poly1305(key)

    def update(self, data: bytes | memoryview) -> None:
        self._p.update(data)

    def digest(self) -> bytes:
        return self._p.finalize() + bytes(TAG_SIZE - 16)


class BodyStreams:
    """Sending and receiving bodies: the body half of :class:`~sparksteward.wire.connection.Connection`.

    A mixin: the session state it uses (the session key, the sequence numbers, the socket) belongs to
    the connection, and the names below are what it relies on.
    """

    sock: socket.socket
    peer: str
    body_mac: str
    unread_body: bool
    _key: Any
    _out: bytes
    _in: bytes
    _send_seq: int
    _recv_seq: int

    if TYPE_CHECKING:
        def _mac(self, direction: bytes, kind: bytes, seq: int, size: int = -1) -> Any: ...

        def _fail(self, exc: BaseException) -> BaseException: ...

        def _sendall(self, data: bytes | memoryview) -> None: ...

        def _encode(self, msg: dict[str, Any]) -> bytes: ...

        def recv_exact(self, n: int) -> bytes: ...

        def _read_into(self, view: memoryview, want: int, total: int) -> int: ...

    def expect_body(self) -> None:
        """Declare (server side, first thing in a handler) that this request is followed by a body:
        if the handler fails before reading it, the server closes the connection rather than parse
        the body as requests."""
        self.unread_body = True

    def _body_mac(self, direction: bytes, size: int) -> Any:
        if self._key is None:
            raise ProtocolError("bodies are only sent on authenticated connections")
        seq = self._send_seq if direction == self._out else self._recv_seq
        if direction == self._out:
            self._send_seq += 1
        else:
            self._recv_seq += 1
        h = self._mac(direction, b"B", seq, size)
        if self.body_mac == "poly1305" or (self.body_mac == "poly1305-large" and size >= _SMALL_BODY):
            return _PolyMac(h.digest())
        return h

    def _verify_body(self, h: Any, size: int, tag: bytes | memoryview | None = None) -> None:
        self.unread_body = False
        if not hmac.compare_digest(h.digest(), self.recv_exact(TAG_SIZE) if tag is None else tag):
            raise self._fail(AuthenticationError(
                f"the {size}-byte body from peer {self.peer} does not match its tag (tampered or corrupted "
                f"in transit); it was discarded and the connection closed"))

    def send_body(self, data: bytes | memoryview, head: dict[str, Any] | None = None) -> None:
        """Send ``data`` as a body (then its tag). ``head``: a frame to send just before it (small
        bodies go out in the same write)."""
        framed = b"" if head is None else self._encode(head)
        h = self._body_mac(self._out, len(data))
        h.update(data)
        if len(data) < _PARALLEL_MAC:
            self._sendall(b"".join((framed, data, h.digest())))
        else:
            if framed:
                self._sendall(framed)
            self._sendall(data)
            self._sendall(h.digest())

    def send_file(self, f: BinaryIO | int, n: int, head: dict[str, Any] | None = None) -> None:
        """Send exactly ``n`` bytes of ``f`` as a body: from a file's current offset, or from the start
        of a file descriptor. ``sendfile`` for the bytes, a tag computed
        over a read-only memory map of the same range (no copies) on a helper thread meanwhile. Bodies
        under 1 MiB go out as one read and one write instead. ``head``: a frame to send just before
        the body (small bodies go out in the same write)."""
        if isinstance(f, int):
            if n < _PARALLEL_MAC:
                self._send_range(f, 0, n, head)
            else:
                with open(f, "rb", buffering=0, closefd=False) as wrapped:
                    wrapped.seek(0)
                    self.send_file(wrapped, n, head)
            return
        start = f.tell()
        if n < _PARALLEL_MAC:
            self._send_range(f.fileno(), start, n, head, getattr(f, "name", None))
            f.seek(start + n)
            return
        framed = b"" if head is None else self._encode(head)
        h = self._body_mac(self._out, n)
        if framed:
            self._sendall(framed)
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    end = start + n
                    if end > len(view):
                        raise ProtocolError(f"cannot send {n} bytes from offset {start} of a {len(view)}-byte file")
                    if isinstance(h, _PolyMac):  # cheap: each chunk right after the kernel took it
                        sent = 0
                        while sent < n:
                            k = self.sock.sendfile(f, offset=start + sent, count=min(_CHUNK, n - sent))
                            if k <= 0:
                                break
                            h.update(view[start + sent:start + sent + k])
                            sent += k
                    else:  # HMAC on a second thread while the kernel sends (both release the GIL)
                        hasher = threading.Thread(target=h.update, args=(view[start:end],), name="steward-mac")
                        hasher.start()
                        try:
                            sent = self.sock.sendfile(f, offset=start, count=n)
                        finally:
                            hasher.join()
                    if sent != n:
                        raise ProtocolError(f"sent {sent} of {n} bytes to {self.peer}")
                finally:
                    view.release()
        except (OSError, ProtocolError) as exc:
            raise self._fail(exc) from None
        self._sendall(h.digest())

    def _send_range(self, fd: int, start: int, n: int, head: dict[str, Any] | None, name: object = None) -> None:
        """A small body: one read, and one write with its head frame and tag."""
        framed = b"" if head is None else self._encode(head)
        h = self._body_mac(self._out, n)
        try:
            data = os.pread(fd, n, start)
        except OSError as exc:
            raise self._fail(exc) from None
        if len(data) != n:
            raise self._fail(ProtocolError(f"cannot send {n} bytes from offset {start} of "
                                           f"{name or 'a file'!r}: it is shorter"))
        h.update(data)
        self._sendall(b"".join((framed, data, h.digest())))

    def recv_into_file(self, f: BinaryIO | int, n: int, on_chunk: Callable[[bytes | memoryview], None] | None = None) -> None:
        """Copy exactly ``n`` body bytes from the socket into ``f``, a file or a file descriptor
        (``on_chunk`` sees each chunk); the body's tag is verified before the last chunk is written
        (AuthenticationError if it fails). A small body and its tag are taken in one receive."""
        if n + TAG_SIZE < _READ_AHEAD:
            body = self._recv_whole_body(self._body_mac(self._in, n), n)
            write_all(f, body)
            if on_chunk is not None:
                on_chunk(body)
            return
        reader = RawReader(self, n)
        while len(chunk := reader.read(_CHUNK)):
            write_all(f, chunk)
            if on_chunk is not None:
                on_chunk(chunk)

    def _recv_whole_body(self, h: Any, n: int) -> memoryview:
        """A small body and its tag in one receive, ``h`` (its MAC) verified: the body's bytes."""
        data = memoryview(self.recv_exact(n + TAG_SIZE))
        h.update(data[:n])
        self._verify_body(h, n, data[n:])
        return data[:n]


class RawReader:
    """A file-like ``read(n)`` over exactly ``size`` body bytes of a connection (the returned view is
    valid until the next read). The body's tag is verified before the last chunk is returned, so a
    tampered body raises AuthenticationError instead of ending.

    Chunks are at most 1 MiB, so one stays in the CPU cache while it is received, MAC'd, checksummed
    and written by the caller. Poly1305 hashes each chunk at once; under the HMAC-SHA256 fallback two
    reused buffers alternate and a chunk's MAC is computed on a helper thread while the caller writes
    it and the next one arrives (hashing releases the GIL).
    """

    def __init__(self, conn: BodyStreams, size: int) -> None:
        self.conn, self.size, self.left = conn, size, size
        self._bufs: list[bytearray] = []  # made on the first read that needs them
        self._turn = 0
        self._mac = conn._body_mac(conn._in, size)
        self._hasher: threading.Thread | None = None
        self._verified = False

    def _join(self) -> None:
        if self._hasher is not None:
            self._hasher.join()
            self._hasher = None

    def _finish(self) -> None:
        self._join()
        if not self._verified:
            self._verified = True
            self.conn._verify_body(self._mac, self.size)

    def read(self, n: int) -> memoryview | bytes:
        if self.left <= 0:
            self._finish()
            return b""
        if self.left == self.size < min(n, _PARALLEL_MAC):  # small: body and tag in one receive
            self.left, self._verified = 0, True
            return self.conn._recv_whole_body(self._mac, self.size)
        if not self._bufs:
            cap = min(_CHUNK, max(self.size, 1))
            self._bufs = [bytearray(cap)] + ([bytearray(cap)] if self.size > cap else [])
        buf = self._bufs[self._turn]
        self._turn = (self._turn + 1) % len(self._bufs)
        view = memoryview(buf)[: min(n, self.left, len(buf))]
        got = 0
        try:
            while got < len(view):
                got += self.conn._read_into(view[got:], len(view) - got, self.size)
        finally:
            self._join()  # the previous chunk is hashed (in order) before this one starts
        chunk = view[:got]
        self.left -= got
        if got >= _PARALLEL_MAC and not isinstance(self._mac, _PolyMac):
            self._hasher = threading.Thread(target=self._mac.update, args=(chunk,), name="steward-mac")
            self._hasher.start()
        else:
            self._mac.update(chunk)
        if self.left == 0:
            self._finish()
        return chunk


def write_all(f: BinaryIO | int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``f``, an unbuffered file or a file descriptor: one write may take part
    of it (write(2) on a disk that fills up, or past RLIMIT_FSIZE, returns a short count without an
    error)."""
    view = memoryview(data)
    while len(view):
        k = os.write(f, view) if isinstance(f, int) else f.write(view)
        if not k:  # None: a non-blocking file took nothing
            raise OSError(f"writing {len(view)} bytes to {getattr(f, 'name', 'a file')!r} made no progress")
        view = view[k:]
