"""Fixtures of the blob suites: an HA store on file:// and on moto's S3, and a BlobRig over it."""

from __future__ import annotations

import itertools

import pytest
from sparksteward.blob.store import FileSystemBlobStore

from tests.helpers.blob import BlobRig

_n = itertools.count()


@pytest.fixture(params=["file", "s3"])
def ha(request, tmp_path):
    if request.param == "file":
        return FileSystemBlobStore(str(tmp_path / "ha"), "c1")
    return FileSystemBlobStore(request.getfixturevalue("s3").url(f"ha-{next(_n)}"), "c1")


@pytest.fixture()
def rig(tmp_path, ha):
    r = BlobRig(tmp_path, ha)
    yield r
    r.close()
