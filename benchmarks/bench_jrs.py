"""JobResultStore: commit latency (create dirty + mark clean) on file:// and moto S3, and the time to
list 10,000 entries. Prints one table."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from sparksteward.jobs.result import JobResult, JobStatus
from sparksteward.jobs.store import FileSystemJobResultStore
from sparksteward.testing.s3 import local_s3

COMMITS = 300
LIST_N = 10_000


def result(job_id: str) -> JobResult:
    return JobResult(job_id=job_id, cluster_id="default", application_id="app", status=JobStatus.SUCCEEDED,
                     start_time=0.0, end_time=1.0, payload={"rows": 1})


def commit_latency(store: FileSystemJobResultStore, n: int) -> tuple[float, float]:
    times = []
    for i in range(n):
        t = time.perf_counter()
        store.create_dirty(result(f"bench-{i}"))
        store.mark_clean(f"bench-{i}")
        times.append(time.perf_counter() - t)
    times.sort()
    return statistics.median(times) * 1000, times[int(len(times) * 0.99) - 1] * 1000


def list_time(store: FileSystemJobResultStore, n: int) -> float:
    base = store.base
    base.makedirs()
    from sparksteward.jobs.result import encode_result

    if base.is_local:
        for i in range(n):
            base.write_atomic(base.path(f"list-{i}.json"), encode_result(result(f"list-{i}")))
    else:
        base.fs.pipe({base.path(f"list-{i}.json"): encode_result(result(f"list-{i}")) for i in range(n)})
    t = time.perf_counter()
    got = store.list()
    elapsed = time.perf_counter() - t
    assert len(got.entries) >= n
    return elapsed


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        p50, p99 = commit_latency(FileSystemJobResultStore(d + "/c"), COMMITS)
        rows.append(("file://", p50, p99, list_time(FileSystemJobResultStore(d + "/l"), LIST_N), LIST_N))
    with local_s3() as s3:
        p50, p99 = commit_latency(FileSystemJobResultStore(s3.url("c")), COMMITS)
        n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
        rows.append(("s3:// (moto)", p50, p99, list_time(FileSystemJobResultStore(s3.url("l")), n), n))
    print(f"JobResultStore: {COMMITS} commits (create dirty + mark clean) and a full listing")
    print(f"{'store':14} {'commit p50 ms':>14} {'commit p99 ms':>14} {'list s':>8} {'entries':>8}")
    for name, p50, p99, lt, n in rows:
        print(f"{name:14} {p50:14.2f} {p99:14.2f} {lt:8.2f} {n:8d}")
    print("(moto lists are GET-per-entry through one HTTP server thread; pass N to list more on S3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
