"""The executor agent: one per executor, started by the shim's ExecutorPlugin.

It owns the executor's BlobCache (a private ``cache-<pid>`` dir with an owner file; at start it
sweeps the cache dirs of agents proven dead on this host) and publishes a rendezvous file under
``SparkFiles.getRootDirectory()`` so that the executor's Python workers can find its socket. Run as
``python -m sparksteward.agents.executor`` (the shim does this).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from sparksteward.agents.base import Agent, run_agent
from sparksteward.blob.cache import BlobCache
from sparksteward.blob.job_sweeper import CacheJobSweeper
from sparksteward.blob.store import open_blob_store
from sparksteward.checkpoint.task.task_state import SubtaskService
from sparksteward.config import StewardConfig
from sparksteward.owner import private_dir, sweep_dead
from sparksteward.rendezvous import Rendezvous
from sparksteward.state.snapshot import CompactionPolicy

__all__ = ["ExecutorAgent"]

log = logging.getLogger("sparksteward.agents.executor")


class ExecutorAgent(Agent):
    """Executor-side agent. See the module docstring."""

    role = "executor"

    def __init__(self, hello: dict[str, Any], clock: Any = None, cfg: StewardConfig | None = None) -> None:
        super().__init__(hello, clock, cfg)
        self.executor_id: str = hello["executor_id"]
        self.rendezvous = Rendezvous(hello["rendezvous_dir"] or ".")
        ha = open_blob_store(self.cfg.effective_ha_path, self.cfg.cluster_id)
        private_dir(self.rendezvous.dir)
        cache_dir = self.rendezvous.dir / f"cache-{os.getpid()}"
        sweep_dead(self.rendezvous.dir, "cache-", keep=cache_dir)  # caches of killed or restarted agents
        self.cache = BlobCache(cache_dir, ha, hello.get("driver_endpoint"),
                               self.secret, max_size=self.cfg.blob_cache_max_size,
                               fetch_retries=self.cfg.blob_fetch_retries, rpc_timeout=self.cfg.rpc_timeout)
        self.cache.register_handlers(self.server)
        endpoint = hello.get("driver_endpoint")
        self.sweeper = CacheJobSweeper(self.cache, endpoint, self.secret, timeout=self.cfg.rpc_timeout) \
            if endpoint else None
        self.states = SubtaskService(self.cfg.state_local_dir or self.rendezvous.dir, endpoint, self.secret,
                                     upload_threads=self.cfg.checkpoint_upload_threads,
                                     cache_max_bytes=self.cfg.state_cache_max_size,
                                     wal_flush_bytes=self.cfg.state_wal_flush_size,
                                     wal_flush_files=self.cfg.state_wal_flush_files,
                                     task_flush_bytes=self.cfg.state_task_flush_size,
                                     agent_timeout=self.cfg.checkpoint_agent_timeout,
                                     compaction=CompactionPolicy(self.cfg.state_compaction_max_space_amplification,
                                                                 self.cfg.state_compaction_min_size,
                                                                 self.cfg.state_compaction_max_files),
                                     open_timeout=self.cfg.state_open_timeout, clock=self.clock)  # keyed state
        self.states.register_handlers(self.server)
        self.rendezvous.publish(self.server.endpoint, self.secret, self.executor_id, timeout=self.cfg.rpc_timeout)

    def on_task_succeeded(self, msg: dict[str, Any]) -> None:
        self.cache.release_task(msg["task_attempt_id"])

    def on_task_failed(self, msg: dict[str, Any]) -> None:
        self.cache.release_task(msg["task_attempt_id"])

    def health_details(self) -> dict[str, Any]:
        return {"executor_id": self.executor_id}

    def close(self) -> None:
        self.rendezvous.withdraw()
        super().close()
        if self.sweeper is not None:
            self.sweeper.close()
        self.cache.close()
        self.states.close()


if __name__ == "__main__":
    sys.exit(run_agent(ExecutorAgent))
