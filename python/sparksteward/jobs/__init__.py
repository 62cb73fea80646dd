"""The JobResultStore (FLIP-194) and guaranteed, retried job cleanup."""

from sparksteward.jobs.cleanup import CleanupRunner, CleanupStep, RetryPolicy, StepRegistry
from sparksteward.jobs.result import JobResult, JobResultEntry, JobStatus
from sparksteward.jobs.service import JobService
from sparksteward.jobs.store import FileSystemJobResultStore, InMemoryJobResultStore, JobResultStore, open_store

__all__ = ["CleanupRunner", "CleanupStep", "FileSystemJobResultStore", "InMemoryJobResultStore", "JobResult",
           "JobResultEntry", "JobResultStore", "JobService", "JobStatus", "RetryPolicy", "StepRegistry", "open_store"]
