"""Buckets on the session's one moto S3 server (tests/conftest.py starts it)."""

from __future__ import annotations

import dataclasses
import uuid

from sparksteward.testing.s3 import LocalS3


def new_bucket(server: LocalS3) -> LocalS3:
    """``server`` seen through a new bucket of its own: the same endpoint, request log and ``slow``
    knob, but ``url``, ``requests_since`` and ``in_flight`` name and count only this bucket's objects
    and requests. ``stop``/``restart`` would stop every bucket's endpoint: a test that needs them
    starts a server of its own (``local_s3()``)."""
    bucket = dataclasses.replace(server, bucket=f"steward-test-{uuid.uuid4().hex[:8]}")
    bucket.filesystem().mkdir(bucket.bucket)
    return bucket


def clear_delays(server: LocalS3) -> dict[str, float]:
    """Answer every operation on time again; return the delays that were still set (a ``LocalS3.slow``
    left behind, which would slow every later test down)."""
    with server._lock:
        left = dict(server._delays)
        server._delays.clear()
    return left
