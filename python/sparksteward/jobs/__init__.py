"""The JobResultStore (FLIP-194) and guaranteed, retried job cleanup.

- :mod:`~sparksteward.jobs.result`: the ``JobResult`` record and its versioned JSON encoding;
- :mod:`~sparksteward.jobs.store`: the store interfaces and the in-memory and fsspec stores;
- :mod:`~sparksteward.jobs.cleanup`: declarative cleanup steps, retry policy and runner;
- :mod:`~sparksteward.jobs.service`: ``JobService``, which the driver agent uses;
- :mod:`~sparksteward.jobs.cli`: ``steward jobs ...``.
"""

from sparksteward.jobs.cleanup import (BlobJobDirCleanup, CleanupOutcome, CleanupRunner, CleanupStep, RetryPolicy,
                                       StepRegistry)
from sparksteward.jobs.result import Failure, JobResult, JobResultEntry, JobStatus, SparkJobOutcome, StepState
from sparksteward.jobs.service import JobService
from sparksteward.jobs.store import (FileSystemJobResultStore, InMemoryJobResultStore, JobResultStore, JobResultView,
                                     JobResultWriter, Listing, open_store)

__all__ = ["BlobJobDirCleanup", "CleanupOutcome", "CleanupRunner", "CleanupStep", "Failure",
           "FileSystemJobResultStore", "InMemoryJobResultStore", "JobResult", "JobResultEntry", "JobResultStore",
           "JobResultView", "JobResultWriter", "JobService", "JobStatus", "Listing", "RetryPolicy",
           "SparkJobOutcome", "StepRegistry", "StepState", "open_store"]
