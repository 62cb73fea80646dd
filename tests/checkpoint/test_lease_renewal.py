"""The renewal of every state's lease in one application (issue 35 item 10): one state's error never
stops the others' renewals. The state whose lease cannot be renewed fences itself, says why once, and
refuses its next batch naming why; the others go on renewing and writing. Over real agent sockets,
without Spark."""

from __future__ import annotations

import logging
import shutil

import pytest
from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.lease import read_lease
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.errors import StewardError
from sparksteward.wire import AgentServer, Connection, new_secret

from tests.helpers import wait_until

P, M = 2, 8
TTL = 1.5   # renewed every 0.5 s


@pytest.fixture()
def two_states(tmp_path):
    secret = new_secret()
    driver = AgentServer("127.0.0.1", 0, secret, {})
    states = StateService(str(tmp_path / "chk"), "c1", commit_timeout=30, lease_timeout=TTL)
    states.register_handlers(driver)
    conn = Connection.connect(driver.endpoint, secret)
    for name in ("a", "b"):
        conn.request("state.register", name=name, checkpoint_dir=None, parallelism=P, max_parallelism=M,
                     key_type="string", num_retained=1)
    yield states, conn, tmp_path
    conn.close()
    driver.close()
    states.close()


def test_a_deleted_state_folder_fences_that_state_and_the_others_go_on_renewing(two_states, caplog):
    states, conn, tmp = two_states
    b = CheckpointStorage.open(str(tmp / "chk"), "b", "c1").location
    wait_until(lambda: read_lease(b).seq >= 1, timeout=10, what="b's lease to be renewed once")
    caplog.set_level(logging.WARNING, logger="sparksteward")
    shutil.rmtree(tmp / "chk" / "c1" / "a")   # an operator deletes a live state's checkpoint folder
    seq = read_lease(b).seq
    wait_until(lambda: read_lease(b).seq >= seq + 4, timeout=20, what="b's lease to go on being renewed")
    states.registered("b").lease.check()   # b may write
    assert conn.request("state.begin", name="b", checkpoint_id=None)["checkpoint_id"] == 0
    conn.request("state.abort", name="b", checkpoint_id=0)

    lease_a = states.registered("a").lease
    assert not lease_a.held and "was deleted" in lease_a.info()["problem"]
    with pytest.raises(StewardError, match=r"keyed state 'a' .*can no longer be written.*_lease was deleted"):
        conn.request("state.begin", name="a", checkpoint_id=None)
    said = [r for r in caplog.records if r.levelno >= logging.ERROR and "keyed state a" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]   # said once, not every renewal
    assert not (tmp / "chk" / "c1" / "a").exists()   # a wrote nothing back
