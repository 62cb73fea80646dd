"""Shared fixtures for the keyed-state and checkpoint suites: every storage suite runs on file:// and
on moto's S3 server (one per test module)."""

from __future__ import annotations

import uuid

import pytest

from sparksteward.testing.s3 import local_s3

STORES = ["file", "s3"]


@pytest.fixture(scope="module")
def _s3_server():
    with local_s3() as s3:
        yield s3


@pytest.fixture(params=STORES)
def store_url(request, tmp_path):
    """A fresh checkpoint-dir URL on each store."""
    if request.param == "file":
        return str(tmp_path / "checkpoints")
    s3 = request.getfixturevalue("_s3_server")
    return s3.url(f"chk-{uuid.uuid4().hex[:8]}")
