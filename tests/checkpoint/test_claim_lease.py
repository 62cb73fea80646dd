"""CLAIM takes a source state's files over, so it is refused while that state still has a live writer
(its ``_lease`` record says so); NO_CLAIM copies and is always allowed. file:// and moto S3."""

from __future__ import annotations

import time

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.lease import StateLease, read_lease
from sparksteward.checkpoint.restore import restore_from
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import CheckpointError
from sparksteward.owner import OwnerRecord

from tests.helpers.checkpoint import BATCHES, M, P, run_batch

ELSEWHERE = OwnerRecord("other-host", "boot", 4242, 1.0, "pid:[1]")


@pytest.fixture
def source(tmp_path, store_url):
    """State 'a' with checkpoint 0 completed (written without a lease, like a finished writer)."""
    storage = CheckpointStorage.open(store_url, "a")
    coord = CheckpointCoordinator(storage, P, M)
    run_batch(coord, storage, tmp_path / "a", 0, BATCHES[0])
    coord.complete(0)
    return storage


def _lease(storage, *, renewed_ago: float, owner=None, ttl: float = 30.0) -> StateLease:
    lease = StateLease(storage.location, storage.state, application="app-src", ttl=ttl,
                       wall=lambda: time.time() - renewed_ago, owner=owner)
    lease.acquire()
    return lease


@pytest.mark.parametrize("holder", ["renewing elsewhere", "on this host, alive"])
def test_claim_of_a_source_with_a_live_writer_is_refused_and_writes_nothing(store_url, source, holder):
    if holder == "renewing elsewhere":
        _lease(source, renewed_ago=1, owner=ELSEWHERE)
    else:   # renewed long ago by the wall clock, but its process (this one) still runs here
        _lease(source, renewed_ago=3600)
    dst = CheckpointStorage.open(store_url, "b")
    with pytest.raises(CheckpointError) as err:
        restore_from(source.url_of("chk-0"), dst, max_parallelism=M, claim_mode="claim")
    msg = str(err.value)
    assert "live writer" in msg and "application app-src" in msg and source.url in msg
    assert "claim_mode='no_claim'" in msg and "Stop that application" in msg
    assert not dst.has_restored() and not dst.shared_files()
    # NO_CLAIM copies: the source's writer may go on
    restored = restore_from(source.url_of("chk-0"), dst, max_parallelism=M, claim_mode="no_claim")
    assert restored.properties["claim_mode"] == "no_claim"


@pytest.mark.parametrize("holder", ["released", "expired elsewhere"])
def test_claim_of_a_source_whose_writer_is_gone_is_allowed(store_url, source, holder):
    if holder == "released":
        _lease(source, renewed_ago=0).release()
    else:
        _lease(source, renewed_ago=3600, owner=ELSEWHERE)
    assert read_lease(source.location) is not None
    dst = CheckpointStorage.open(store_url, "b")
    restored = restore_from(source.url_of("chk-0"), dst, max_parallelism=M, claim_mode="claim")
    assert restored.properties["claim_mode"] == "claim" and dst.has_restored()
