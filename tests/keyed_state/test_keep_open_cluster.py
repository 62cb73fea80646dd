"""Decision 0026 under Spark (issue 37, must-show 4): a Python worker keeps its subtask's DB open between
batches, and every reuse rule holds with exact results on local-cluster[2,1,1024] (two executors, so
tasks land on other workers and executors between batches): a task that failed after writing, a worker
SIGKILLed in the middle of a task, a second action of a batch, and a rescale and back inside one
application. Each test also shows that DBs were kept (a test of reuse that never reuses proves nothing).

The speculative copy is `test_speculation.py`, the other host `tests/cross_host/test_blobs_and_state.py`
(`test_process_defaults_on_the_other_host_...`): both run with the DBs kept, the default."""

from __future__ import annotations

import os
import signal

import pandas as pd
import pytest
from sparksteward import Steward

from tests.helpers.keyed import SCHEMA, make_batches, reference, state_of

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture(scope="module")
def spark(cluster_spark, tmp_path_factory):
    return cluster_spark, tmp_path_factory.mktemp("keep-open-cluster")


def counting(fail: dict[str, str] | None = None):
    """The per-key count and sum; the first attempt of the task holding a key of ``fail`` writes
    garbage into the key's state, then raises (``"raise"``) or SIGKILLs its own Python worker
    (``"kill"``)."""
    fail = fail or {}

    def fn(key, rows, state):
        from pyspark import TaskContext

        how = fail.get(key)
        if how and TaskContext.get().attemptNumber() == 0:
            state.update({"n": -1_000_000, "s": -1_000_000})   # in the attempt's DB, never in a checkpoint
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"first attempt of {key!r} fails after writing")
        cur = state.get() or {"n": 0, "s": 0}
        cur = {"n": cur["n"] + len(rows), "s": cur["s"] + int(rows["v"].sum())}
        state.update(cur)
        return key, cur["n"], cur["s"]

    return fn


def kept(ks, checkpoints) -> int:
    return sum((ks.report(checkpoint_id=c) or {}).get("kept_open", 0) for c in checkpoints)


def run_batches(spark, ks, batches, first: int, applied: list, fail_at: dict[int, dict[str, str]] | None = None):
    for i, b in enumerate(batches, start=first):
        fn = counting((fail_at or {}).get(i))
        ks.apply(spark.createDataFrame(b), fn, SCHEMA, checkpoint_id=i).write.mode("overwrite").format("noop").save()
        ks.commit(i, wait=120)
        applied.append(b)


def test_a_task_that_failed_after_writing_and_a_killed_worker_leave_no_db_to_reuse(spark):
    spark, root = spark
    ks = Steward.get(spark).keyed_state("keep-failed", key="k", parallelism=4, max_parallelism=32,
                                        checkpoint_dir=str(root / "chk-failed"))
    source = make_batches(11, count=3)
    batches = [source[i % 3].assign(v=source[i % 3]["v"] + i) for i in range(6)]
    keys = sorted(set(batches[0]["k"]))
    applied: list[pd.DataFrame] = []
    # checkpoint 2: one task writes garbage, then raises; checkpoint 3: one task writes garbage, then its
    # worker is SIGKILLed (with the DBs it holds). Spark retries both tasks; each retry starts from its base.
    # PySpark's worker exits after a task's error too, so both retries run on another worker: what this
    # shows is that each retry starts from its base (a kept DB of checkpoint 1 or a restore), never from
    # the failed attempt's files. The rules on which DB may go on are test_keep_open.py's, on real agents
    run_batches(spark, ks, batches, 0, applied, fail_at={2: {keys[0]: "raise"}, 3: {keys[1]: "kill"}})
    assert state_of(ks) == reference(applied)
    assert kept(ks, range(1, 6)) > 0, "no task went on with a kept DB: the test shows nothing"


def test_a_second_action_and_a_rescale_and_back_in_one_application_stay_exact(spark):
    spark, root = spark
    st = Steward.get(spark)
    chk = str(root / "chk-rescale")
    ks = st.keyed_state("keep-rescale", key="k", parallelism=4, max_parallelism=32, checkpoint_dir=chk)
    source = make_batches(12, count=3)
    batches = [source[i % 3].assign(v=source[i % 3]["v"] + i) for i in range(12)]
    applied: list[pd.DataFrame] = []
    run_batches(spark, ks, batches[:2], 0, applied)
    # checkpoint 2 computed by two actions before its commit: both start from checkpoint 1, the second
    # finds the kept DB moved past its base and restores; the state counts the batch once
    out = ks.apply(spark.createDataFrame(batches[2]), counting(), SCHEMA, checkpoint_id=2)
    first, second = sorted(out.collect()), sorted(out.collect())
    assert first == second
    ks.commit(2, wait=120)
    applied.append(batches[2])
    run_batches(spark, ks, batches[3:4], 3, applied)
    assert state_of(ks) == reference(applied)
    # the workers hold DBs of 4 subtasks; at 2 (and back at 4) none of them is a base
    ks = st.keyed_state("keep-rescale", key="k", parallelism=2, max_parallelism=32, checkpoint_dir=chk)
    run_batches(spark, ks, batches[4:6], 4, applied)
    assert state_of(ks) == reference(applied)
    ks = st.keyed_state("keep-rescale", key="k", parallelism=4, max_parallelism=32, checkpoint_dir=chk)
    run_batches(spark, ks, batches[6:12], 6, applied)
    assert state_of(ks) == reference(applied)
    # where a task runs is Spark's choice (about half land where their DB is): over 20 tasks, some do
    assert kept(ks, range(7, 12)) > 0, "no task went on with a kept DB after the rescale back"


def _executor_pid() -> int:
    """The executor JVM of this Python worker: the parent of its daemon (``/proc``, Linux)."""
    with open(f"/proc/{os.getppid()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _block(sc, mark, flag):
    """A one-task job that holds one executor's only core until ``flag`` exists, after writing the
    executor's pid to ``mark``."""
    def hold(_):
        import time

        with open(mark, "w") as f:
            f.write(str(_executor_pid()))
        while not os.path.exists(flag):
            time.sleep(0.02)

    sc.parallelize([0], 1).foreach(hold)


def test_a_subtask_that_lands_on_another_executor_every_batch_never_reuses_a_stale_db(spark):
    """Every batch runs on the executor the batch before did not use: two one-task jobs hold both
    executors' single cores, the one on the wanted executor is let go, and the batch's four subtasks
    all run there. Each task therefore finds the DB its subtask's last run kept on the other executor
    (one checkpoint behind, when it comes back there) and must restore its base instead: no batch after
    the first goes on with a kept DB, and the state is exact."""
    import threading

    from tests.helpers import wait_until

    spark, root = spark
    sc = spark.sparkContext
    marks = root / "alternate-marks"
    marks.mkdir()
    ks = Steward.get(spark).keyed_state("keep-alternate", key="k", parallelism=4, max_parallelism=32,
                                        checkpoint_dir=str(root / "chk-alternate"))
    source = make_batches(13, count=3)
    batches = [source[i % 3].assign(v=source[i % 3]["v"] + i) for i in range(5)]
    where = str(marks / "ran-{}-{}")

    def fn(key, rows, state):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        with open(where.format(ctx.stageId(), ctx.partitionId()), "w") as f:
            f.write(str(_executor_pid()))
        cur = state.get() or {"n": 0, "s": 0}
        cur = {"n": cur["n"] + len(rows), "s": cur["s"] + int(rows["v"].sum())}
        state.update(cur)
        return key, cur["n"], cur["s"]

    applied: list[pd.DataFrame] = []
    used: list[int] = []
    for i, b in enumerate(batches):
        holders, flags = [], []
        for j in range(2):   # both cores held, then the one on the executor the last batch did not use let go
            mark, flag = marks / f"hold-{i}-{j}", marks / f"free-{i}-{j}"
            t = threading.Thread(target=_block, args=(sc, str(mark), str(flag)), daemon=True)
            t.start()
            wait_until(lambda mark=mark: mark.exists() and mark.read_text(), timeout=60,
                       what=f"blocker {j} of batch {i} to start")
            holders.append((t, int(mark.read_text())))
            flags.append(flag)
        pids = [pid for _, pid in holders]
        assert len(set(pids)) == 2, f"both blockers ran on executor {pids[0]}"
        free = pids.index(used[-1]) ^ 1 if used else 0   # the blocker not on the last batch's executor
        flags[free].touch()
        holders[free][0].join(60)
        before = set(marks.glob("ran-*"))
        df = spark.createDataFrame(b)   # parallelize of local data: scheduled like the state stage
        ks.apply(df, fn, SCHEMA, checkpoint_id=i).write.mode("overwrite").format("noop").save()
        ran = {int(p.read_text()) for p in set(marks.glob("ran-*")) - before}
        for flag in flags:
            flag.touch()
        for t, _ in holders:
            t.join(60)
        ks.commit(i, wait=120)
        applied.append(b)
        assert len(ran) == 1, f"batch {i} ran on executors {ran}, not on one"
        if used:
            assert ran != {used[-1]}, f"batch {i} ran on executor {used[-1]} again"
        used.append(ran.pop())
    assert state_of(ks) == reference(applied)
    assert kept(ks, range(1, len(batches))) == 0, [ks.report(checkpoint_id=c) for c in range(len(batches))]
