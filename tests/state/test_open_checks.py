"""What opening a keyed state checks before its first batch (issue 35 items 8 and 9), with real driver and
executor agents over their sockets: every checkpoint records the key column, and a state opened with
another key column (or type) is refused naming both and the fix; a second application opening a state
whose writer lease is held is refused at ``st.keyed_state(...)``, naming the holder, while a read of it
is not."""

from __future__ import annotations

import pytest

from sparksteward.checkpoint.service import StateService
from sparksteward.checkpoint.subtasks import SubtaskService
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

    def register(self, key: str, key_type: str = "string") -> dict:
        return self.dconn.request("state.register", name="s", checkpoint_dir=None, parallelism=P, max_parallelism=M,
                                  key_type=key_type, num_retained=1, key=key)

    def check(self, key: str, writer: bool = True) -> dict:
        return self.dconn.request("state.check", name="s", checkpoint_dir=None, max_parallelism=M, key=key,
                                  writer=writer)

    def batch(self, cid: int) -> dict:
        self.dconn.request("state.begin", name="s", checkpoint_id=cid)
        for i, part in enumerate(split_by_subtask({f"u{j}": j for j in range(8)}, P, M)):
            opened = self.econn.request("state.open", name="s", checkpoint_id=cid, subtask=i)
            write_subtask(self.econn, opened, i, P, M, part)
        return self.dconn.request("state.commit", name="s", checkpoint_id=cid, wait=30)

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
