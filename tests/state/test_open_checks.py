"""What opening a keyed state checks before its first batch (issue 35 items 8 and 9), with real driver and
executor agents over their sockets: every checkpoint records the key column, and a state opened with
another key column (or type) is refused naming both and the fix; a second application opening a state
whose writer lease is held is refused at ``st.keyed_state(...)``, naming the holder, while a read of it
is not."""

from __future__ import annotations

import pytest
from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.task.task_state import SubtaskService
from sparksteward.errors import StateEncodingError, StateLeaseError
from sparksteward.wire import AgentServer, Connection, new_secret

from tests.helpers.state import split_by_subtask, write_subtask

pytestmark = pytest.mark.usefixtures("guarded_rmtree")

P, M = 2, 8


class App:
    """One application's driver and executor agents on a shared checkpoint dir."""

    def __init__(self, tmp_path, name: str, chk: str) -> None:
        secret = new_secret()
        self.driver = AgentServer("127.0.0.1", 0, secret, {})
        self.states = StateService(chk, "c1", commit_timeout=30, application=lambda: f"app-{name}")
        self.states.register_handlers(self.driver)
        self.executor = AgentServer("127.0.0.1", 0, secret, {})
        self.subtasks = SubtaskService(tmp_path / f"exec-{name}", self.driver.endpoint, secret, upload_threads=2)
        self.subtasks.register_handlers(self.executor)
        self.dconn = Connection.connect(self.driver.endpoint, secret)
        self.econn = Connection.connect(self.executor.endpoint, secret)

    def register(self, key: str, key_type: str = "string", name: str = "s", **more) -> dict:
        return self.dconn.request("state.register", name=name, checkpoint_dir=None, parallelism=P, max_parallelism=M,
                                  key_type=key_type, num_retained=1, key=key, **more)

    def check(self, key: str, writer: bool = True) -> dict:
        return self.dconn.request("state.check", name="s", checkpoint_dir=None, max_parallelism=M, key=key,
                                  writer=writer)

    def batch(self, cid: int, name: str = "s") -> dict:
        self.dconn.request("state.begin", name=name, checkpoint_id=cid)
        for i, part in enumerate(split_by_subtask({f"u{j}": j for j in range(8)}, P, M)):
            opened = self.econn.request("state.open", name=name, checkpoint_id=cid, subtask=i)
            write_subtask(self.econn, opened, i, P, M, part)
        return self.dconn.request("state.commit", name=name, checkpoint_id=cid, wait=30)

    def close(self) -> None:
        self.dconn.close()
        self.econn.close()
        self.subtasks.close()
        self.executor.close()
        self.driver.close()
        self.states.close()


def test_every_checkpoint_records_its_key_column_and_another_one_is_refused(tmp_path):
    chk = str(tmp_path / "chk")
    users = App(tmp_path, "users", chk)
    try:
        users.register("user")
        assert users.batch(0)["metadata"]["properties"]["key"] == "user"
        with pytest.raises(StateEncodingError, match=r"keyed by column 'user'.*key='page'.*key='user'"):
            users.check("page")                 # st.keyed_state("s", key="page") in the same application
        with pytest.raises(StateEncodingError, match="keyed by column 'user'"):
            users.register("page")
    finally:
        users.close()

    pages = App(tmp_path, "pages", chk)         # a new application, the writer gone
    try:
        with pytest.raises(StateEncodingError, match=r"checkpoint 0 of keyed state 's' is keyed by column 'user', "
                                                     r"but it was opened with key='page'"):
            pages.check("page")
        with pytest.raises(StateEncodingError, match="keyed by column 'user'"):
            pages.register("page")
        with pytest.raises(StateEncodingError, match="string keys"):   # the same column, another type
            pages.register("user", key_type="long")
        assert pages.check("user")["last_completed"] == 0
        pages.register("user")
        assert pages.batch(1)["metadata"]["properties"]["key"] == "user"
    finally:
        pages.close()


def test_a_second_application_is_refused_when_it_opens_a_held_state(tmp_path):
    chk = str(tmp_path / "chk")
    first = App(tmp_path, "first", chk)
    second = App(tmp_path, "second", chk)
    try:
        first.register("user")
        first.batch(0)
        with pytest.raises(StateLeaseError, match=r"is being written by application app-first on host .* \(pid"):
            second.check("user")                # st.keyed_state(...): refused now, before any query starts
        assert second.check("user", writer=False)["last_completed"] == 0   # a read (ks.read()) is not
        with pytest.raises(StateLeaseError, match="app-first"):
            second.register("user")             # and the first batch still checks for real
    finally:
        second.close()
        first.close()
    again = App(tmp_path, "again", chk)         # released when the first stopped
    try:
        assert again.check("user")["last_completed"] == 0
    finally:
        again.close()


def test_claimed_roots_named_at_open_let_a_restore_read_a_sources_claims(tmp_path):
    """A state CLAIM-restored from another lists that one's files as claimed; a third state restoring
    from it reads them only under a root named at st.keyed_state(..., claimed_roots=[...])."""
    from sparksteward.errors import CheckpointError

    chk = str(tmp_path / "chk")
    a_root, b_chk = f"{chk}/c1/a", f"{chk}/c1/b/chk-0"
    first = App(tmp_path, "first", chk)
    try:
        first.register("user", name="a")
        first.batch(0, name="a")
    finally:
        first.close()
    second = App(tmp_path, "second", chk)   # a's writer is gone: b takes its files over
    try:
        second.register("user", name="b", restore_from=f"{a_root}/chk-0", claim_mode="claim")
        assert second.batch(0, name="b")["metadata"]["properties"].get("claimed")
    finally:
        second.close()
    app = App(tmp_path, "third", chk)
    try:
        with pytest.raises(CheckpointError, match=r"pass claimed_roots="):
            app.dconn.request("state.check", name="c", checkpoint_dir=None, max_parallelism=M, key="user",
                              restore_from=b_chk)
        with pytest.raises(CheckpointError, match=r"pass claimed_roots="):
            app.register("user", name="c", restore_from=b_chk)
        app.dconn.request("state.check", name="d", checkpoint_dir=None, max_parallelism=M, key="user",
                          restore_from=b_chk, claimed_roots=[a_root])
        reply = app.register("user", name="d", restore_from=b_chk, claimed_roots=[a_root])
        assert reply["restore"]["action"] == "restored"
        assert app.batch(1, name="d")["checkpoint_id"] == 1
    finally:
        app.close()
