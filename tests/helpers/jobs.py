"""The JobResultStore suites' stores of each kind (memory, file://, s3://) and a sample JobResult."""

from __future__ import annotations

import pytest
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import JobResult, JobStatus, SparkJobOutcome, StepState
from sparksteward.jobs.store import InMemoryJobResultStore


class Stores:
    """Makes stores of one kind that share one root (so two instances see the same files)."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind, self.url = kind, url
        self._memory: dict[tuple[str, bool], InMemoryJobResultStore] = {}

    def __call__(self, cluster_id: str = "default", delete_on_commit: bool = False):
        if self.kind == "memory":
            return self._memory.setdefault((cluster_id, delete_on_commit),
                                           InMemoryJobResultStore(cluster_id, delete_on_commit))
        return FileSystemJobResultStore(self.url, cluster_id, delete_on_commit)

    @property
    def files(self) -> bool:
        return self.kind != "memory"


def needs_files(stores: Stores) -> None:
    if not stores.files:
        pytest.skip("an in-memory store has no files")


def result(job_id: str = "job-1", status: JobStatus | str = JobStatus.SUCCEEDED, end: float = 2000.0,
           cluster_id: str = "default", steps: int = 1) -> JobResult:
    return JobResult(job_id=job_id, cluster_id=cluster_id, application_id="app-1", status=status,
                     start_time=1000.0, end_time=end, payload={"rows": 3},
                     spark_jobs=(SparkJobOutcome(0, "succeeded"),),
                     cleanup=tuple(StepState("delete_path", f"/tmp/x{i}") for i in range(steps)))


def names(store) -> list[str]:
    found = (i["name"].rstrip("/").rsplit("/", 1)[-1] for i in store.base.listdir())
    return sorted(n for n in found if not n.startswith("."))  # not the store's lock and lease files
