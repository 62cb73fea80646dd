"""A driver agent's StateService and executor agents' SubtaskServices over real sockets, without Spark:
what the file-merging and checkpoint-path suites drive batches through."""

from __future__ import annotations

import itertools
from pathlib import Path

from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.checkpoint.task.task_state import SubtaskService
from sparksteward.wire import AgentServer, Connection, new_secret

from tests.helpers.state import split_by_subtask, write_subtask

M = 64


class MergingRig:
    """A driver agent's StateService and ``executors`` executor agents' SubtaskServices."""

    def __init__(self, tmp: Path, checkpoint_dir: str, *, parallelism: int, executors: int = 2,
                 num_retained: int = 1, merging: MergingOptions | None = None, agent_timeout: float = 30,
                 name: str = "s", restore_from: str | None = None) -> None:
        self.tmp, self.p, self.checkpoint_dir, self.name = tmp, parallelism, checkpoint_dir, name
        self.secret = new_secret()
        self.driver = AgentServer("127.0.0.1", 0, self.secret, {})
        self.states = StateService(checkpoint_dir, "c1", commit_timeout=60, merging=merging or MergingOptions(),
                                   agent_timeout=agent_timeout)
        self.states.register_handlers(self.driver)
        self.execs = []
        for e in range(executors):
            server = AgentServer("127.0.0.1", 0, self.secret, {})
            svc = SubtaskService(tmp / f"exec{e}", self.driver.endpoint, self.secret, upload_threads=2)
            svc.register_handlers(server)
            self.execs.append((server, svc, Connection.connect(server.endpoint, self.secret)))
        self.dconn = Connection.connect(self.driver.endpoint, self.secret)
        self.registered = self.dconn.request("state.register", name=name, checkpoint_dir=None,
                                             parallelism=parallelism, max_parallelism=M, key_type="string",
                                             num_retained=num_retained, restore_from=restore_from)
        self.storage = CheckpointStorage.open(checkpoint_dir, name, "c1")
        self._turn = itertools.count()

    def task(self, cid: int, subtask: int, delta: dict[str, int], executor: int | None = None) -> None:
        e = next(self._turn) % len(self.execs) if executor is None else executor
        econn = self.execs[e][2]
        opened = econn.request("state.open", name=self.name, checkpoint_id=cid, subtask=subtask)
        write_subtask(econn, opened, subtask, self.p, M, delta)

    def batch(self, cid: int, delta: dict[str, int]) -> dict:
        self.dconn.request("state.begin", name=self.name, checkpoint_id=cid)
        for i, part in enumerate(split_by_subtask(delta, self.p, M)):
            self.task(cid, i, part)
        return self.dconn.request("state.commit", name=self.name, checkpoint_id=cid, wait=60)

    def rescale(self, parallelism: int) -> None:
        """Open the state again with another parallelism: the next checkpoint rebuilds its subtasks."""
        self.dconn.request("state.register", name=self.name, checkpoint_dir=None, parallelism=parallelism,
                           max_parallelism=M, key_type="string", num_retained=1)
        self.p = parallelism

    def values(self, meta: CheckpointMetadata) -> dict[str, int]:
        from tests.helpers.keyed import read_values

        return {k: int(v) for k, v in read_values(self.checkpoint_dir, self.name, "c1", meta.to_json())}

    def referenced(self) -> set[str]:
        return {f.path for cid in self.storage.checkpoint_ids() for f in self.storage.read_metadata(cid).files()}

    def close(self) -> None:
        self.dconn.close()
        for server, svc, conn in self.execs:
            conn.close()
            svc.close()
            server.close()
        self.driver.close()
        self.states.close()
