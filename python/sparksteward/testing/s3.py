"""A real S3 wire endpoint for tests: moto's server on 127.0.0.1.

``with local_s3() as s3:`` starts ``moto.server.ThreadedMotoServer`` on a free loopback port, creates
a bucket, and exports ``AWS_ENDPOINT_URL`` and dummy credentials so that s3fs in this process and in
every child process (agents started by Spark) talk to it. The environment is restored on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["LocalS3", "local_s3"]

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class LocalS3:
    endpoint: str
    bucket: str
    server: object = None

    def stop(self) -> None:
        """Make the endpoint unreachable (objects are kept: moto's state lives in this process)."""
        self.server.stop()  # type: ignore[attr-defined]

    def restart(self) -> None:
        """Serve again on the same port, with the same objects."""
        from moto.server import ThreadedMotoServer

        port = int(self.endpoint.rsplit(":", 1)[1])
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join((self.bucket, *parts))

    def filesystem(self):  # noqa: ANN201 - s3fs is an optional dependency
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
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(_ENV)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    s3 = LocalS3(endpoint, bucket, server)
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
            s3.server.stop()  # type: ignore[attr-defined]
        except Exception:  # already stopped by the test
            pass
