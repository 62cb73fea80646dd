"""Must-show 1 of issue 8: exactly-once under failure, on local-cluster[2,1,1024], as a streaming query
with a file source (one JSON file per micro-batch) and ``foreachBatch`` through ``KeyedState.process``.

Each test injects one failure during batch 2 of 5 files, then restarts the query with the same Spark
checkpointLocation and the same state, with a sixth file added, and compares every per-key value
(``ks.read()``) with a clean run of the six files:

- the sink raises after the state stage;
- an executor JVM is SIGKILLed while batch 2's state stage runs;
- the driver process (a child Python process running the query) is SIGKILLed right after
  ``commit(2)``, before Spark records batch 2; a new driver re-runs batch 2 from the retained base.

Run under the Spark lock.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from pyspark.errors import StreamingQueryException
from sparksteward import Steward
from sparksteward.checkpoint.storage import CheckpointStorage

from tests.helpers import spark_session, wait_until
from tests.helpers.keyed import state_of
from tests.helpers.state_process_driver import KILL_KEY, count_sum_fn, expected, start_query, write_inputs

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

CLUSTER = f"exactly-once-{uuid.uuid4().hex[:8]}"
FILES = 6
P, M = 4, 32


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exactly-once")
    write_inputs(root / "all", FILES)
    return root


# its own session: its tests SIGKILL an executor JVM, and the cluster id names the checkpoint paths
@pytest.fixture(scope="module")
def spark(dirs):
    with spark_session("local-cluster[2,1,1024]", **{"spark.executor.memory": "1g",
                                                      "spark.steward.state-dir": str(dirs / "state"),
                                                      "spark.steward.cluster-id": CLUSTER}) as session:
        wait_until(lambda: executors(session) >= 2, timeout=90, what="both executors to register")
        yield session


def executors(spark) -> int:
    return spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1


def keyed(spark, name: str, dirs: Path):
    return Steward.get(spark).keyed_state(name, key="k", parallelism=P, max_parallelism=M,
                                          checkpoint_dir=str(dirs / "state-chk"))


def source_with(dirs: Path, name: str, count: int) -> Path:
    src = dirs / f"src-{name}"
    src.mkdir(exist_ok=True)
    for i, p in enumerate(sorted((dirs / "all").iterdir())[:count]):
        if not (src / p.name).exists():
            tmp = src / f".{p.name}.tmp"  # the file source must not see a half-written file
            shutil.copy(p, tmp)
            os.utime(tmp, (1_800_000_000 + i, 1_800_000_000 + i))  # the source takes files by mtime (in ms)
            os.replace(tmp, src / p.name)
    return src


def leftovers(ks, dirs: Path) -> set[str]:
    storage = CheckpointStorage.open(str(dirs / "state-chk"), ks.name, CLUSTER)
    referenced = set().union(set(), *(storage.read_metadata(c).physical_paths() for c in ks.info()["retained"]))
    return storage.stored_files() - referenced


class Recorder:
    """A sink that keeps the batch ids it saw and the rows it wrote."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.batches: list[int] = []

    def __call__(self, out, batch_id) -> None:
        out.collect()
        if batch_id == self.fail_on:
            self.fail_on = None
            raise ConnectionError(f"the sink is down during batch {batch_id}")
        self.batches.append(batch_id)


def finish(spark, ks, dirs: Path, name: str) -> Recorder:
    """Add the sixth file and restart the query on the same checkpoint location and state."""
    sink = Recorder()
    start_query(spark, ks, source_with(dirs, name, FILES), dirs / f"spark-chk-{name}", sink).awaitTermination()
    return sink


@pytest.fixture(scope="module")
def clean(spark, dirs):
    """One clean run over the six files; it equals pandas over the same files."""
    ks = keyed(spark, "clean", dirs)
    sink = Recorder()
    start_query(spark, ks, source_with(dirs, "clean", FILES), dirs / "spark-chk-clean", sink).awaitTermination()
    assert sink.batches == list(range(FILES))
    values = state_of(ks)
    assert values == expected(sorted((dirs / "all").iterdir())) and KILL_KEY in values
    return values


def test_sink_raises_after_the_state_stage(spark, dirs, clean):
    ks = keyed(spark, "sink", dirs)
    sink = Recorder(fail_on=2)
    query = start_query(spark, ks, source_with(dirs, "sink", 5), dirs / "spark-chk-sink", sink)
    with pytest.raises(StreamingQueryException, match="the sink is down during batch 2"):
        query.awaitTermination()
    info = ks.info()
    assert info["last_completed"] == 1 and info["pending"] == []
    wait_until(lambda: not leftovers(ks, dirs), timeout=30, what="the aborted checkpoint's files to go")
    assert finish(spark, ks, dirs, "sink").batches == [2, 3, 4, 5]  # Spark re-delivers batch 2
    assert state_of(ks) == clean


@pytest.mark.soak   # 50 s of a real executor JVM kill and its replacement: make soak runs it, after the suite
def test_executor_jvm_sigkilled_during_a_batch(spark, dirs, clean):
    ks = keyed(spark, "executor", dirs)
    hook = dirs / "hook"
    hook.mkdir()
    (hook / "arm").touch()
    sink = Recorder()
    query = start_query(spark, ks, source_with(dirs, "executor", 5), dirs / "spark-chk-executor", sink,
                        fn=count_sum_fn(str(hook)))
    pid = int(wait_until(lambda: (hook / "pid").is_file() and (hook / "pid").read_text(), timeout=120,
                         what="batch 2's state stage to reach the kill point"))
    jvm = psutil.Process(pid)
    assert "CoarseGrainedExecutorBackend" in " ".join(jvm.cmdline())  # an executor, never the driver
    assert ks.info()["pending"] == [2]
    jvm.send_signal(signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(pid) or jvm.status() == psutil.STATUS_ZOMBIE, timeout=30,
               what="the executor JVM to die")
    (hook / "go").touch()  # the killed task's Python worker may still wait: let it go
    try:
        query.awaitTermination()  # the lost tasks ran again on the other executor, or the query failed
    except StreamingQueryException:
        pass
    wait_until(lambda: executors(spark) >= 2, timeout=90, what="a replacement executor")
    sink = finish(spark, ks, dirs, "executor")
    assert sink.batches and sink.batches[-1] == 5
    assert state_of(ks) == clean
    wait_until(lambda: not leftovers(ks, dirs), timeout=30, what="the killed attempt's files to go")


@pytest.mark.soak   # 42 s of real kills: it runs in make soak, after the suite (which must stay under 20 minutes)
def test_driver_sigkilled_after_commit_before_spark_records_the_batch(spark, dirs, clean, tmp_path):
    name = "driver"
    spark_chk = dirs / f"spark-chk-{name}"
    cmd = [sys.executable, "-m", "tests.helpers.state_process_driver", "--source", str(source_with(dirs, name, 5)),
           "--spark-chk", str(spark_chk), "--state-chk", str(dirs / "state-chk"), "--state-dir",
           str(tmp_path / "driver-state"), "--cluster-id", CLUSTER, "--name", name, "--kill-after", "2"]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "python"), str(root), os.environ["PYTHONPATH"]])}
    driver = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        output, _ = driver.communicate(timeout=150)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == -signal.SIGKILL, output[-3000:]
    assert "committed batch 2" in output and "committed batch 3" not in output

    def group_alive():  # the driver's JVM, executors and agents go when it goes (stdin EOF)
        alive = []
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == driver.pid and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except (psutil.Error, ProcessLookupError):
                continue
        return alive

    try:
        wait_until(lambda: not group_alive(), timeout=60, what="the killed driver's JVM and agents to exit")
    finally:
        for proc in group_alive():
            proc.kill()
    assert sorted(p.name for p in spark_chk.joinpath("commits").iterdir() if not p.name.startswith(".")) == \
        ["0", "1"]  # Spark never recorded batch 2

    # a new driver (this process's application) for the same cluster id and state
    storage = CheckpointStorage.open(str(dirs / "state-chk"), name, CLUSTER)
    assert storage.checkpoint_ids() == [1, 2]  # 2 completed, and its base is kept for a re-run of 2
    ks = keyed(spark, name, dirs)
    sink = finish(spark, ks, dirs, name)
    assert sink.batches == [2, 3, 4, 5]  # batch 2 ran again, from checkpoint 1
    assert state_of(ks) == clean
    wait_until(lambda: not leftovers(ks, dirs), timeout=30, what="the re-run's own files to go")
