"""What plugin tests run in Python workers (imported there from here, by reference)."""

from __future__ import annotations


def task_probe(_):
    """Runs in a Python worker: find this executor's agent and wait until it saw this task start."""
    import time

    from pyspark import TaskContext
    from sparksteward.worker import executor_connection

    tid = TaskContext.get().taskAttemptId()
    conn = executor_connection()
    deadline = time.monotonic() + 20
    while True:
        seen = [e["task_attempt_id"] for e in conn.request("events", type="task_start")["events"]]
        if tid in seen or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    health = conn.request("health")
    return [(tid, health["executor_id"], health["pid"], tid in seen)]
