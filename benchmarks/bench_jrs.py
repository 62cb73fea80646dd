"""JobResultStore benchmark: commit latency and listing time on file:// and on moto S3.

- commit: ``create_dirty`` + ``mark_clean`` of one result (FLIP-194's write path without cleanup
  steps), p50 and p99 over COMMITS commits;
- list: ``list()`` of a store holding N clean results (one directory listing plus one batch read);
- recovery scan: ``list(state="dirty")`` on the same store plus 10 dirty results, which reads only
  the dirty files (what a driver does at start).

moto serves S3 from one Python process on loopback, so its numbers measure the client path and
request count, not a real object store. Run: ``python benchmarks/bench_jrs.py [S3_LIST_N]`` (the S3
listing defaults to 2,000 entries because moto reads about 100 objects a second).
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time

from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import JobResult, JobStatus, StepState
from sparksteward.tables import table
from sparksteward.testing.s3 import local_s3

COMMITS = 300
LIST_N = 10_000
S3_LIST_N = 2_000  # moto serves about 100 GETs a second: 10,000 take two minutes (pass 10000 to run it)
DIRTY_N = 10


def result(job_id: str, dirty: bool = False) -> JobResult:
    return JobResult(job_id=job_id, cluster_id="default", application_id="app-20261122", status=JobStatus.SUCCEEDED,
                     start_time=1.7e9, end_time=1.7e9 + 60, payload={"rows": 12345, "output": f"s3://bkt/out/{job_id}"},
                     cleanup=(StepState("delete_path", f"s3://bkt/tmp/{job_id}", "pending" if dirty else "done", 1),
                              StepState("blob_job_dir", job_id, "pending" if dirty else "done", 1)))


def commit_latency(store: FileSystemJobResultStore, n: int) -> tuple[float, float]:
    times = []
    for i in range(n):
        r = result(f"bench-{i}")
        t = time.perf_counter()
        store.create_dirty(r)
        store.mark_clean(r.job_id)
        times.append(time.perf_counter() - t)
    q = statistics.quantiles(times, n=100, method="inclusive")
    return statistics.median(times) * 1000, q[98] * 1000


def fill(store: FileSystemJobResultStore, n: int) -> None:
    """Write n clean and DIRTY_N dirty results directly (the benchmark measures reads, not this)."""
    base = store.base
    files = {base.path(f"list-{i:05d}.json"): result(f"list-{i:05d}").to_json() for i in range(n)}
    files.update({base.path(f"dirty-{i}_DIRTY.json"): result(f"dirty-{i}", dirty=True).to_json() for i in range(DIRTY_N)})
    if base.is_local:
        base.makedirs()
        for path, data in files.items():
            with open(path, "wb") as f:
                f.write(data)
    else:
        paths = list(files)
        for i in range(0, len(paths), 1000):
            base.fs.pipe({p: files[p] for p in paths[i:i + 1000]})


def list_times(store: FileSystemJobResultStore, n: int) -> tuple[float, float]:
    fill(store, n)
    t = time.perf_counter()
    listing = store.list()
    full = time.perf_counter() - t
    assert len(listing.entries) == n + DIRTY_N and not listing.corrupt, (len(listing.entries), listing.corrupt[:3])
    t = time.perf_counter()
    dirty = store.list(state="dirty")
    scan = time.perf_counter() - t
    assert len(dirty.entries) == DIRTY_N
    return full, scan


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    s3_n = int(sys.argv[1]) if len(sys.argv) > 1 else S3_LIST_N
    rows = []
    with tempfile.TemporaryDirectory() as d:
        p50, p99 = commit_latency(FileSystemJobResultStore(f"file://{d}/commit"), COMMITS)
        full, scan = list_times(FileSystemJobResultStore(f"{d}/list"), LIST_N)
        rows.append(["file://", f"{p50:.2f}", f"{p99:.2f}", f"{LIST_N:,}", f"{full:.2f}", f"{scan * 1000:.0f}"])
    with local_s3() as s3:
        p50, p99 = commit_latency(FileSystemJobResultStore(s3.url("commit")), COMMITS)
        full, scan = list_times(FileSystemJobResultStore(s3.url("list")), s3_n)
        rows.append(["s3:// (moto)", f"{p50:.2f}", f"{p99:.2f}", f"{s3_n:,}", f"{full:.2f}", f"{scan * 1000:.0f}"])
    print(f"JobResultStore: {COMMITS} commits (create dirty + mark clean) per store; listing N clean + "
          f"{DIRTY_N} dirty results")
    print(table(rows, ["STORE", "COMMIT P50 MS", "COMMIT P99 MS", "N", "LIST ALL S", "DIRTY SCAN MS"]))
    print("moto is one local Python server: S3 numbers show request counts and client overhead, not AWS latency.")
    if s3_n < LIST_N:
        print(f"S3 lists {s3_n:,} entries, not {LIST_N:,}, to keep the run short; "
              f"`python benchmarks/bench_jrs.py {LIST_N}` lists {LIST_N:,} (about two minutes on moto).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
