"""The JobResultStore (FLIP-194) and guaranteed, retried job cleanup.

- :mod:`~sparksteward.jobs.result`: the ``JobResult`` record and its versioned JSON encoding;
- :mod:`~sparksteward.jobs.store`: the store interfaces and the in-memory store;
- :mod:`~sparksteward.jobs.fs_store`: the store on any fsspec file system;
- :mod:`~sparksteward.jobs.lease`: leases and the store lock (``flock`` on local stores);
- :mod:`~sparksteward.jobs.steps`: declarative cleanup steps and the registry of their executors;
- :mod:`~sparksteward.jobs.pathguard`: which paths a ``delete_path`` step may delete;
- :mod:`~sparksteward.jobs.retry`: the retry policy of failed steps;
- :mod:`~sparksteward.jobs.cleanup`: the runner that retries the steps, then commits;
- :mod:`~sparksteward.jobs.spool`: results kept locally until the store takes them;
- :mod:`~sparksteward.jobs.delivery`: storing a finished result, with retries, else into the spool;
- :mod:`~sparksteward.jobs.service`: ``JobService``, which the driver agent uses;
- :mod:`~sparksteward.jobs.cli`: ``steward jobs ...``.
"""

from sparksteward.jobs.cleanup import CleanupOutcome, CleanupRunner
from sparksteward.jobs.fs_store import FileSystemJobResultStore, open_store
from sparksteward.jobs.result import Failure, JobResult, JobResultEntry, JobStatus, SparkJobOutcome, StepState
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.service import JobService
from sparksteward.jobs.steps import BlobJobDirCleanup, CleanupStep, StepRegistry
from sparksteward.jobs.store import InMemoryJobResultStore, JobResultStore, JobResultView, JobResultWriter, Listing

__all__ = ["BlobJobDirCleanup", "CleanupOutcome", "CleanupRunner", "CleanupStep", "Failure",
           "FileSystemJobResultStore", "InMemoryJobResultStore", "JobResult", "JobResultEntry", "JobResultStore",
           "JobResultView", "JobResultWriter", "JobService", "JobStatus", "Listing", "RetryPolicy",
           "SparkJobOutcome", "StepRegistry", "StepState", "open_store"]
