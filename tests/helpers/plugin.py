"""What plugin tests run in Python workers (imported there from here, by reference)."""

from __future__ import annotations


def _seen_health():
    """This task's id, whether this executor's agent saw it start (within 20 s), and the agent's health then."""
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
    return tid, tid in seen, conn.request("health")


def task_probe(_):
    """Runs in a Python worker: find this executor's agent and wait until it saw this task start."""
    tid, seen, health = _seen_health()
    return [(tid, health["executor_id"], health["pid"], seen)]


def log_level_probe(_):
    """Runs in a Python worker: this executor agent's console level once it saw this task start (a
    ``log_level`` line of the shim comes before the ``task_start`` it precedes)."""
    _, seen, health = _seen_health()
    return [(health["executor_id"], health["log_level"] if seen else "task_start not seen")]
