"""Fixtures of the restore suites: a guard on local deletes, and a source state with two checkpoints."""

from __future__ import annotations

import os

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.storage import CheckpointStorage

from tests.helpers.checkpoint import BATCHES, M, P, run_batch


@pytest.fixture()
def deletes_stay_in_tmp_path(tmp_path, monkeypatch):
    """Use in a module (``pytestmark = pytest.mark.usefixtures(...)``): whatever the code under test deletes
    locally must be under tmp_path (claimed files included)."""
    from sparksteward.storage import Location

    real = Location.delete

    def delete(self, path, recursive=False):
        if self.is_local:
            p = os.path.realpath(path)
            assert p.startswith(os.path.realpath(tmp_path) + os.sep), f"delete outside tmp_path: {p}"
        return real(self, path, recursive)

    monkeypatch.setattr(Location, "delete", delete)


@pytest.fixture
def source(tmp_path, store_url):
    """State 'a' with checkpoints 0 and 1 completed."""
    storage = CheckpointStorage.open(store_url, "a")
    coord = CheckpointCoordinator(storage, P, M)
    for n in range(2):
        run_batch(coord, storage, tmp_path / "a", n, BATCHES[n])
        coord.complete(n)
    return storage, coord.completed(1)
