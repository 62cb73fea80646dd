"""The JobResultStore contract's fixtures: ``stores`` (and one ``store`` of them) on memory, file:// and
moto's S3."""

from __future__ import annotations

import itertools

import pytest

from tests.helpers.jobs import Stores

_ids = itertools.count()


@pytest.fixture(params=["memory", "file", "s3"])
def stores(request, tmp_path) -> Stores:
    if request.param == "memory":
        return Stores("memory", "")
    if request.param == "file":
        return Stores("file", str(tmp_path / "jrs"))
    return Stores("s3", request.getfixturevalue("s3").url(f"jrs-{next(_ids)}"))


@pytest.fixture()
def store(stores):
    return stores()
