"""The driver agent: one per application, started by the shim's DriverPlugin.

It owns the application's jobs and their results (JobService over the JobResultStore) and cleanup.
The user's Python driver reaches it through :class:`sparksteward.client.Steward`. Run as
``python -m sparksteward.agents.driver`` (the shim does this).

Jobs: the whole application is one job, with id ``spark.steward.job.id`` or the Spark application id.
If that id already has a stored result the agent refuses to start (``fatal JOB_ALREADY_COMPLETED``),
which fails SparkContext start before any user code runs. Scoped jobs (``st.job(id)``) are attributed
their Spark jobs through the ``sparksteward-job-<id>`` job tag.

Metrics: every ``spark.steward.metrics.interval`` a thread compares :meth:`DriverAgent.metrics` (per
keyed state: the file-merging numbers, the unaligned backlog, and the figures of its latest completed
checkpoint, ``state.<name>.checkpoint.*``, see :mod:`sparksteward.checkpoint.coordination.report`) with what it
sent last and, when they changed, writes one ``metrics`` line toward the shim, which keeps them as
gauges of the driver plugin's ``metricRegistry`` (Spark's metrics system). ``health`` carries the
same numbers under ``metrics``. Each completed checkpoint is also logged once at INFO (logger
``sparksteward.checkpoint.coordination.report``).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, BinaryIO

from sparksteward import shim_protocol
from sparksteward.agents.base import Agent, run_agent
from sparksteward.blob.server import BlobServer
from sparksteward.blob.store import open_blob_store
from sparksteward.checkpoint.coordination.driver_service import StateService, default_checkpoint_dir
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.checkpoint.unaligned.channel_state import AlignmentOptions
from sparksteward.config import StewardConfig
from sparksteward.errors import JobAlreadyCompleted
from sparksteward.jobs.service import JobService
from sparksteward.jobs.steps import CleanupStep
from sparksteward.jobscope import job_id_from_tag
from sparksteward.owner import OwnerRecord, private_dir, sweep_dead

__all__ = ["DriverAgent"]

log = logging.getLogger("sparksteward.agents.driver")

#: Staged HA files older than this are leftovers of killed uploads (no upload takes an hour to stage).
_STAGED_MAX_AGE = 3600.0


def _server_dir(state_dir: str) -> str:
    """A fresh private local store for this agent, with an owner file.

    Stores of agents that died (SIGKILL) are swept first, but only those proven dead on this host
    (hostname + boot id, then pid + start time, see :mod:`sparksteward.owner`): the state dir may be
    a home directory shared with other hosts, and ``/proc`` may not exist (macOS). A store without an
    owner file is never deleted.
    """
    root = private_dir(Path(os.path.expanduser(state_dir)) / "blob-local")
    sweep_dead(root, "server-")   # the local blob stores of dead driver agents
    path = tempfile.mkdtemp(prefix=f"server-{os.getpid()}-", dir=root)  # 0700
    OwnerRecord.current().write(path)
    return path


def _scoped_jobs(tags: list[str]) -> list[str]:
    """Job ids named by ``sparksteward-job-<id>`` tags (SparkSession tags carry a prefix)."""
    return [job_id for job_id in map(job_id_from_tag, tags) if job_id is not None]


class DriverAgent(Agent):
    """Driver-side agent. See the module docstring."""

    role = "driver"

    def __init__(self, hello: dict[str, Any], clock: Any = None, cfg: StewardConfig | None = None) -> None:
        super().__init__(hello, clock, cfg)
        self.app_id: str | None = None
        self.app_job: str | None = self.cfg.job_id or None
        self._spark_job_owner: dict[int, list[str]] = {}
        self._finished = threading.Event()
        self.jobs = JobService.from_config(self.cfg, clock=self.clock)
        try:
            if self.app_job:
                self.jobs.begin(self.app_job, kind="application", force=self.cfg.job_force_rerun)
        except JobAlreadyCompleted:
            self.server.close()
            raise
        self.ha = open_blob_store(self.cfg.effective_ha_path, self.cfg.cluster_id)
        self.blobs = BlobServer(_server_dir(self.cfg.effective_state_dir), self.ha,
                                retention=self.cfg.blob_retention_interval, max_size=self.cfg.blob_max_size,
                                clock=self.clock, secret=self.secret)
        self.blobs.register_handlers(self.server)
        self.jobs.registry.register("blob_job_dir", self.blobs.delete_job)
        self.states = StateService(default_checkpoint_dir(self.cfg), self.cfg.cluster_id,
                                   commit_timeout=self.cfg.checkpoint_commit_timeout,
                                   merging=MergingOptions.from_config(self.cfg),
                                   agent_timeout=self.cfg.checkpoint_agent_timeout,
                                   alignment=AlignmentOptions.from_config(self.cfg),
                                   lease_timeout=self.cfg.checkpoint_lease_timeout,
                                   orphan_grace=self.cfg.checkpoint_orphan_grace,
                                   application=lambda: self.app_id)  # keyed state (issues 8-10)
        self.states.register_handlers(self.server)
        self._recovery = threading.Thread(target=self._housekeeping, name="steward-recovery", daemon=True)
        self._recovery.start()
        self.jobs.register_handlers(self.server, application=lambda: self.app_id,
                                    max_message=self.cfg.rpc_max_message_size)

    def _housekeeping(self) -> None:
        try:
            swept = self.ha.sweep_staged(_STAGED_MAX_AGE)  # uploads killed mid-way (local HA stores)
            if swept:
                log.info("swept %d staged HA blob file(s) left by killed uploads", swept)
            self.jobs.prune()
            self.jobs.recover()
            # HA blobs of jobs whose result is committed are orphans: staged cleanup takes them
            live = {j for j in self.ha.jobs() if j is None or not (e := self.jobs.get(j)) or not e.clean}
            orphans = self.blobs.retain_jobs(live)
            if orphans:
                log.info("%d orphaned job blob directories put into staged cleanup", len(orphans))
        except Exception:
            log.exception("recovery failed; run `steward jobs cleanup` and `steward blobs gc`")

    def shutdown_grace_ms(self) -> int:
        return int((self.cfg.cleanup_shutdown_timeout + 10) * 1000)

    def health_details(self) -> dict[str, Any]:
        return {"app_id": self.app_id, "app_job_id": self.app_job, "metrics": self.metrics()}

    # --- metrics (issue 9, Visibility) -------------------------------------------------------
    def metrics(self) -> dict[str, int | float]:
        """The numbers for health and Spark's metrics system: ``state.<name>.merged.*``,
        ``state.<name>.unaligned.*`` and ``state.<name>.checkpoint.*`` per keyed state."""
        return self.states.metrics()

    def attach_stdout(self, out: BinaryIO) -> None:
        super().attach_stdout(out)
        self._metrics_stop = threading.Event()
        self._metrics_thread: threading.Thread | None = None
        if self.cfg.metrics_interval > 0:
            self._metrics_thread = threading.Thread(target=self._report_metrics, name="steward-metrics",
                                                    daemon=True)
            self._metrics_thread.start()

    def _report_metrics(self) -> None:
        sent: dict[str, int | float] = {}
        failed = ""
        while not self._metrics_stop.wait(self.cfg.metrics_interval):
            try:
                values = self.metrics()
                if values != sent:
                    self.to_shim(shim_protocol.encode_metrics(values))
                    sent = values
                failed = ""
            except Exception as exc:  # noqa: BLE001 - a bad number must not end the reporting
                if str(exc) != failed:
                    log.warning("metrics for Spark's metrics system failed (retrying every %g s): %s",
                                self.cfg.metrics_interval, exc)
                failed = str(exc)

    # --- events ------------------------------------------------------------------------------
    def on_app_start(self, msg: dict[str, Any]) -> None:
        self.app_id = msg["app_id"]
        log.info("application %s (%s) started", msg["app_id"], msg["app_name"])
        if self.app_job is None:
            job = msg["app_id"]
            try:
                self.jobs.begin(job, application_id=self.app_id, kind="application")
            except JobAlreadyCompleted:
                # local-cluster and a restarted standalone master number applications from 0 again, so an
                # application started in the same second as an earlier one has its id: give this one its own
                job = f"{msg['app_id']}.{uuid.uuid4().hex[:8]}"
                log.info("application id %s already has a completed job in the JobResultStore (an id reused "
                         "by a restarted master); this application's job is %s", msg["app_id"], job)
                self.jobs.begin(job, application_id=self.app_id, kind="application")
            self.app_job = job
        else:
            self.jobs.set_application_id(self.app_job, msg["app_id"])

    def on_job_start(self, msg: dict[str, Any]) -> None:
        owners = _scoped_jobs(msg["job_tags"]) + ([self.app_job] if self.app_job else [])
        self._spark_job_owner[msg["job_id"]] = owners
        for job_id in owners:
            self.jobs.record_spark_job(job_id, msg["job_id"])

    def on_job_end(self, msg: dict[str, Any]) -> None:
        for job_id in self._spark_job_owner.pop(msg["job_id"], [self.app_job] if self.app_job else []):
            self.jobs.record_spark_job(job_id, msg["job_id"], msg["result"], msg["reason"])

    def on_app_end(self, msg: dict[str, Any]) -> None:
        if not self.app_job or not self.jobs.is_running(self.app_job):
            return
        if msg.get("checkpoint_dir"):
            self.jobs.add_cleanup_step(self.app_job, CleanupStep("spark_checkpoint_dir", msg["checkpoint_dir"]))
        self.jobs.add_cleanup_step(self.app_job, CleanupStep("blob_job_dir", self.app_job))
        status = "SUCCEEDED" if msg.get("exit_code") in (0, None) else "FAILED"
        failure = None if status == "SUCCEEDED" else {
            "type": "ApplicationExit", "message": f"exit code {msg['exit_code']}", "where": self.app_id or ""}
        self.jobs.finish(self.app_job, status, failure=failure, wait=0)

    def close(self) -> None:
        stop, thread = getattr(self, "_metrics_stop", None), getattr(self, "_metrics_thread", None)
        if stop is not None:
            stop.set()
        if thread is not None:
            thread.join(5.0)
        super().close()
        states = getattr(self, "states", None)
        if states is not None:
            states.close()   # releases the states' writer leases
        self.jobs.close(self.cfg.cleanup_shutdown_timeout)
        if self._recovery.is_alive():  # bounded: recovery's store calls time out on their own
            self._recovery.join(self.cfg.cleanup_shutdown_timeout)
        self.blobs.close()  # the local store; HA copies stay for recovery until their job is final


if __name__ == "__main__":
    sys.exit(run_agent(DriverAgent))
