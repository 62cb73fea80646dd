"""A real S3 wire endpoint for tests: moto's server on 127.0.0.1.

``with local_s3() as s3:`` starts ``moto.server.ThreadedMotoServer`` on a free loopback port, creates
a bucket, and exports ``AWS_ENDPOINT_URL`` and dummy credentials so that s3fs in this process and in
every child process (agents started by Spark) talk to it. The environment is restored on exit.

Every request the server answers is logged (:attr:`LocalS3.requests`, a list of :class:`S3Request`):
its S3 operation, key and the body bytes in and out, so a test can count what crossed the wire, for
example that a restore issued only ``CopyObject`` requests and no object bytes moved. The requests
being served right now (headers read, body still arriving or being stored) are in
:meth:`LocalS3.in_flight`, so a crash test can kill a client in the middle of an upload::

    mark = s3.mark()
    ...                                   # the work under test (any process)
    reqs = s3.requests_since(mark)
    assert sum(r.bytes_in + r.bytes_out for r in reqs if r.op in ("GetObject", "PutObject")) == 0
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import orjson

if TYPE_CHECKING:
    from _typeshed.wsgi import InputStream, StartResponse, WSGIApplication, WSGIEnvironment
    from moto.server import ThreadedMotoServer

__all__ = ["LocalS3", "S3Request", "local_s3"]

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True, slots=True)
class S3Request:
    """One request the server answered: ``op`` is the S3 operation (``GetObject``, ``PutObject``,
    ``CopyObject``, ``HeadObject``, ``DeleteObject``, ``DeleteObjects``, ``ListObjects``, ...);
    ``bytes_in``/``bytes_out`` are the request and response body sizes."""

    op: str
    method: str
    bucket: str
    key: str
    copy_source: str
    status: int
    bytes_in: int
    bytes_out: int


def _op_of(method: str, key: str, query: str, copy_source: str) -> str:
    params = {q.split("=", 1)[0] for q in query.split("&") if q}
    if "uploadId" in params or "uploads" in params:
        if method == "PUT":
            return "UploadPartCopy" if copy_source else "UploadPart"
        return {"POST": "MultipartUpload", "DELETE": "AbortMultipartUpload"}.get(method, "Multipart")
    if not key:
        if method == "POST" and "delete" in params:
            return "DeleteObjects"
        return {"GET": "ListObjects", "HEAD": "HeadBucket", "PUT": "CreateBucket",
                "DELETE": "DeleteBucket"}.get(method, method)
    if method == "PUT":
        return "CopyObject" if copy_source else "PutObject"
    return {"GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(method, method)


class _CountingInput:
    def __init__(self, stream: InputStream) -> None:
        self._stream = stream
        self.count = 0

    def read(self, *args: int) -> bytes:
        data = self._stream.read(*args)
        self.count += len(data)
        return data

    def readline(self, *args: int) -> bytes:
        data = self._stream.readline(*args)
        self.count += len(data)
        return data

    def __iter__(self) -> Iterator[bytes]:
        for line in self._stream:
            self.count += len(line)
            yield line


class _RequestLog:
    """WSGI middleware recording every S3 request (thread-safe)."""

    def __init__(self, app: WSGIApplication, log: list[S3Request], lock: threading.Lock,
                 in_flight: dict[int, tuple[str, str, str]], delays: dict[str, float]) -> None:
        self._app = app
        self._log = log
        self._lock = lock
        self._in_flight = in_flight
        self._delays = delays

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        counting = _CountingInput(environ["wsgi.input"])
        environ["wsgi.input"] = counting
        status: list[int] = [0]

        def start(status_line: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], object]:
            status[0] = int(status_line.split(" ", 1)[0])
            return start_response(status_line, headers, exc_info)

        method = environ.get("REQUEST_METHOD", "")
        path = unquote(environ.get("PATH_INFO", "")).lstrip("/")
        bucket, _, key = path.partition("/")
        copy_source = unquote(environ.get("HTTP_X_AMZ_COPY_SOURCE", ""))
        op = _op_of(method, key, environ.get("QUERY_STRING", ""), copy_source)
        token = id(counting)
        with self._lock:
            self._in_flight[token] = (op, bucket, key)
            delay = self._delays.get(op, 0.0)
        if delay:   # a slow store, for tests of what must not wait on it
            time.sleep(delay)
        try:
            chunks = list(self._app(environ, start))
        finally:
            with self._lock:
                self._in_flight.pop(token, None)
        with self._lock:
            self._log.append(S3Request(op, method, bucket, key, copy_source, status[0], counting.count,
                                       sum(len(c) for c in chunks)))
        return chunks


def _logging_server(port: int, log: list[S3Request], lock: threading.Lock,
                    in_flight: dict[int, tuple[str, str, str]], delays: dict[str, float]) -> ThreadedMotoServer:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    class Server(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = _RequestLog(DomainDispatcherApplication(create_backend_app), log, lock, in_flight, delays)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Server(ip_address="127.0.0.1", port=port, verbose=False)


@dataclass
class LocalS3:
    endpoint: str
    bucket: str
    server: ThreadedMotoServer | None = None   # set by local_s3()
    requests: list[S3Request] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _in_flight: dict[int, tuple[str, str, str]] = field(default_factory=dict, repr=False)
    _delays: dict[str, float] = field(default_factory=dict, repr=False)

    @contextlib.contextmanager
    def slow(self, op: str, seconds: float) -> Iterator[None]:
        """Answer every ``op`` request (``CopyObject``, ``PutObject``, ...) ``seconds`` late meanwhile."""
        with self._lock:
            self._delays[op] = seconds
        try:
            yield
        finally:
            with self._lock:
                self._delays.pop(op, None)

    def mark(self) -> int:
        """A position in :attr:`requests`, for :meth:`requests_since`."""
        with self._lock:
            return len(self.requests)

    def requests_since(self, mark: int) -> list[S3Request]:
        """The requests answered since ``mark`` (to this bucket)."""
        with self._lock:
            return [r for r in self.requests[mark:] if r.bucket == self.bucket]

    def storage_options(self) -> str:
        """``spark.steward.storage.options`` that point agents at this server explicitly (their
        environment may predate it): the JSON of fsspec's ``s3`` options."""
        return orjson.dumps({"s3": {"client_kwargs": {"endpoint_url": self.endpoint}, "key": "testing",
                                    "secret": "testing"}}).decode()

    def in_flight(self) -> list[tuple[str, str]]:
        """(operation, key) of the requests to this bucket the server is serving now (body arriving)."""
        with self._lock:
            return [(op, key) for op, bucket, key in self._in_flight.values() if bucket == self.bucket]

    def stop(self) -> None:
        """Make the endpoint unreachable (objects are kept: moto's state lives in this process)."""
        assert self.server is not None  # local_s3() starts one
        self.server.stop()

    def restart(self) -> None:
        """Serve again on the same port, with the same objects."""
        port = int(self.endpoint.rsplit(":", 1)[1])
        self.server = _logging_server(port, self.requests, self._lock, self._in_flight, self._delays)
        self.server.start()

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join((self.bucket, *parts))

    def filesystem(self) -> Any:  # an s3fs.S3FileSystem (s3fs: an optional dependency, no stubs)
        import s3fs

        return s3fs.S3FileSystem(client_kwargs={"endpoint_url": self.endpoint}, key="testing",
                                 secret="testing", skip_instance_cache=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_s3(bucket: str | None = None) -> Iterator[LocalS3]:
    """Run moto's S3 server on loopback for the duration of the block.

    moto keeps its buckets in this process across servers, so the default bucket name is unique.
    """
    bucket = bucket or f"steward-test-{uuid.uuid4().hex[:8]}"
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    port = _free_port()
    s3 = LocalS3(f"http://127.0.0.1:{port}", bucket)
    s3.server = _logging_server(port, s3.requests, s3._lock, s3._in_flight, s3._delays)
    s3.server.start()
    endpoint = s3.endpoint
    saved = {k: os.environ.get(k) for k in (*_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(_ENV)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        s3.filesystem().mkdir(bucket)
        yield s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            s3.stop()
        except Exception:  # noqa: BLE001 - already stopped by the test
            pass
