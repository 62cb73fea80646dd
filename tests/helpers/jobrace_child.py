"""A child process for ``tests/jobs/test_run_race.py``: a real JobService on a real store.

``rerun STORE JOB STEPS_JSON BEGIN_DELAY FINISH_DELAY``
    A new driver's ``st.job(JOB, force=True)``: begin (forced) after BEGIN_DELAY seconds, print the
    run id, add the steps, finish after FINISH_DELAY seconds and wait for the commit.
``recover STORE DELAY``
    A new driver starting up: after DELAY seconds, ``recover()`` and wait for its cleanups.
``finishloop STORE SPOOL_DIR SHUTDOWN_TIMEOUT BODY_SECONDS``
    Begin and finish jobs ``j0``, ``j1``, ... (each "running" BODY_SECONDS) until killed, printing
    ``BEGUN <job>`` after each ``begin`` and ``ACK <job>`` after each ``finish`` returns (``tests/jobs/test_finish_retry.py`` SIGKILLs it at random points).

Both use a fast fixed retry policy. Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time

import orjson
from sparksteward.errors import StewardError
from sparksteward.jobs.fs_store import open_store
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.service import JobService
from sparksteward.jobs.steps import CleanupStep
from sparksteward.storage import set_default_options


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    cmd, store_url = argv[0], argv[1]
    if cmd == "finishloop":
        # fail fast on a stopped endpoint (spark.steward.storage.options in production), so that the
        # retries and the spool of finish() are what a kill lands in, not s3fs's own backoff
        set_default_options({"s3": {"config_kwargs": {
            "retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 2}}})
        store = open_store(store_url)
        store.base.fs.retries = 1  # s3fs's own retry loop (1.9 s of backoff per call) off as well
        svc = JobService(store, policy=RetryPolicy.fixed(0.05), shutdown_timeout=float(argv[3]), spool_dir=argv[2])
        for i in itertools.count():
            job = f"j{i}"
            while True:
                try:
                    svc.begin(job)
                    print(f"BEGUN {job}", flush=True)
                    break
                except StewardError as exc:  # the store is down: begin cannot check for an earlier result
                    print(f"begin {job}: {exc}", file=sys.stderr, flush=True)
                    time.sleep(0.02)
            time.sleep(float(argv[4]))  # the job's body
            entry = svc.finish(job, "SUCCEEDED", payload={"i": i}, wait=0)
            print(f"ACK {job} {entry.source}", flush=True)
    svc = JobService(open_store(store_url), policy=RetryPolicy.fixed(0.05), shutdown_timeout=30)
    with svc:
        if cmd == "rerun":
            job, steps, begin_delay, finish_delay = argv[2], orjson.loads(argv[3]), float(argv[4]), float(argv[5])
            time.sleep(begin_delay)
            svc.begin(job, force=True)
            run_id = svc.run_id(job)
            print(f"RUN {run_id}", flush=True)
            for step in steps:
                svc.add_cleanup_step(job, CleanupStep.from_dict(step))
            time.sleep(finish_delay)
            entry = svc.finish(job, "SUCCEEDED", payload={"run": run_id}, wait=60)
            print(f"FINISHED {entry.state}", flush=True)
        elif cmd == "recover":
            time.sleep(float(argv[2]))
            started = svc.recover()
            print(f"RECOVERING {','.join(started)}", flush=True)
            svc.wait_idle(60)
        else:
            raise SystemExit(f"unknown command {cmd!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
