"""A fault-injection soak of keyed-state checkpoints (issue 18, must-show 2).

local-cluster[2,1,1024], the checkpoint dir on moto's S3 server, file merging on, P=4. The test drives
``BATCHES`` small batches of a keyed stream by hand, as ``KeyedState.process`` does (apply with
``checkpoint_id=N``, persist and run the state stage, collect for the sink, ``commit(N)``, abort on
failure), with a seeded mix of aligned and unaligned batches (``aligned_checkpoint_timeout=0``: every
unaligned subtask defers input). A seeded schedule injects faults at random batches and points:

- ``driver``: SIGKILL the driver agent (the shim restarts it);
- ``executor``: SIGKILL an executor agent (the shim restarts it);
- ``worker``: SIGKILL a Python worker: in the stage the one running the user function (``during``) or
  a random one (``stage``), before it the executor's Python daemon, after it the idle workers;
- ``rerun@committed``: apply the committed batch again with the same id; ``second@output``: a second
  action on the lazy output before the commit; both must emit the same rows as the first.

Points: ``before`` (the batch begun, its state stage not started), ``during`` (a task of the state
stage holds in the user function until the kill is done), ``stage`` (a random moment into the state
stage: tasks, uploads, seals), ``after`` (the stage ran and the sink has its rows, the commit not
sent) and, for the agents, ``commit`` (a random moment into the commit: ``_metadata``, subsumption,
the reply). A failed batch is retried with the same id until it commits, as Spark does on a query
restart; each attempt opens the state again (a KeyedState made before a driver-agent restart is not
registered with the new agent). The sink is this test's record, keyed by batch id, written after the
commit (a re-run replaces, as an idempotent foreachBatch sink does). The user function emits one row
per input row it processes, and an aligned batch drains the deferred rows at the end.

At the end: the emitted rows are the input rows exactly once; the final state and every retained
checkpoint restore to the values of the rows the batches up to it emitted; every referenced file is in
the bucket; after the orphan grace nothing unreferenced remains under ``shared/`` or ``merged/``.

``STEWARD_SOAK_SEED=<n>`` replays a run; the seed and the schedule are printed at the start and named
in every assertion message. Run under the Spark lock.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import orjson
import pandas as pd
import psutil
import pytest
from sparksteward import Steward

from tests.helpers import MARKER, agent_processes, spark_session, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.cluster]

P, M = 4, 32
BATCHES = 26          # the drain is batch BATCHES (14 faults; 32 batches took 3 minutes of CI)
ROWS, KEYS = 40, 24   # per batch
NAME = "soak"
CLUSTER = f"soak-{uuid.uuid4().hex[:8]}"
GRACE, LEASE = 5.0, 10.0
OUT = "k string, v long"
FAULTS = {"driver": 3, "executor": 4, "worker": 4, "rerun": 2, "second": 1}  # how many of each per run
POINTS = ("before", "during", "stage", "after", "commit")   # "commit": agents only, not Python workers
MAX_ATTEMPTS = 8


# --- in the Python workers --------------------------------------------------------------------------
def _gate(hook: str) -> None:
    """The first call that finds ``<hook>/arm`` takes it (one task wins), writes its pid and waits for
    ``<hook>/go``: the test kills something while this task is inside its state stage."""
    try:
        os.rename(os.path.join(hook, "arm"), os.path.join(hook, f"held-{os.getpid()}"))
    except OSError:
        return
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(hook, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)


def soak_fn(hook: str):
    """Count and sum per key in state; emit one (key, value) row per input row processed."""

    def fn(key, rows, state):
        _gate(hook)
        cur = state.get() or {"n": 0, "s": 0}
        state.update({"n": cur["n"] + len(rows), "s": cur["s"] + int(rows["v"].sum())})
        return pd.DataFrame({"k": [key] * len(rows), "v": rows["v"].astype("int64").to_list()})

    return fn


# --- fixtures ------------------------------------------------------------------------------------------
# its own session: fault-injection settings (restarts, lease and agent timeouts)
@pytest.fixture(scope="module")
def spark(s3, tmp_path_factory):
    conf = {"spark.steward.state-dir": str(tmp_path_factory.mktemp("soak-state")),
            "spark.steward.storage.options": s3.storage_options(),
            "spark.steward.cluster-id": CLUSTER,
            "spark.steward.checkpoint.orphan-grace": f"{GRACE:g}s",
            "spark.steward.checkpoint.lease-timeout": f"{LEASE:g}s",
            "spark.steward.checkpoint.agent-timeout": "8s",
            "spark.steward.agent.max-restarts": "10",
            "spark.task.maxFailures": "4",
            "spark.sql.execution.arrow.maxRecordsPerBatch": "4"}
    with spark_session("local-cluster[2,1,1024]", **conf) as session:
        wait_until(lambda: session.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1 >= 2, timeout=90,
                   what="both executors to register")
        yield session


# --- processes -------------------------------------------------------------------------------------
def _agents(role: str) -> list[psutil.Process]:
    return [p for p in agent_processes() if any(f"sparksteward.agents.{role}" in c for c in p.cmdline())]


def _executor_jvm(proc: psutil.Process) -> psutil.Process | None:
    for parent in [proc, *proc.parents()]:
        if "CoarseGrainedExecutorBackend" in " ".join(parent.cmdline()):
            return parent
    return None


def _executor_id(jvm: psutil.Process) -> str:
    cmd = jvm.cmdline()
    return cmd[cmd.index("--executor-id") + 1] if "--executor-id" in cmd else "?"


def _executor_jvms() -> list[psutil.Process]:
    """This session's executor JVMs, by executor id."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "CoarseGrainedExecutorBackend" in " ".join(proc.info["cmdline"] or ()) and \
                    proc.environ().get(MARKER) == os.environ[MARKER]:
                found.append(proc)
        except psutil.Error:
            continue
    return sorted(found, key=_executor_id)


def _children(jvm: psutil.Process, needle: str) -> list[psutil.Process]:
    out = []
    for child in jvm.children(recursive=True):
        try:
            if needle in " ".join(child.cmdline()):
                out.append(child)
        except psutil.Error:
            continue
    return out


def _python_workers(jvm: psutil.Process) -> list[psutil.Process]:
    """The executor's Python daemon and its workers (found by their cwd, the executor's work dir: a
    worker outlives a killed daemon, reparented, and Spark keeps reusing it)."""
    out = []
    try:
        cwd = jvm.cwd()
    except psutil.Error:
        return out
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if ".daemon" in " ".join(proc.info["cmdline"] or ()) and "pyspark.worker" in proc.info["cmdline"] \
                    and proc.cwd() == cwd:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def _kill(proc: psutil.Process) -> None:
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    except psutil.NoSuchProcess:
        pass


# --- the soak ------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, spark, s3, hook: Path, seed: int) -> None:
        self.spark, self.s3, self.hook, self.seed = spark, s3, hook, seed
        self.st = Steward.get(spark)
        self.chk = s3.url("soak-chk")
        self.root = s3.url("soak-chk", CLUSTER, NAME)
        rng = random.Random(seed)
        self.rng = rng
        self.frames = [pd.DataFrame({"k": [f"key-{rng.randrange(KEYS)}" for _ in range(ROWS)],
                                     "v": [b * 1000 + i for i in range(ROWS)]}) for b in range(BATCHES)]
        self.frames.append(self.frames[0].iloc[:0])   # the drain
        self.unaligned = [rng.random() < 0.5 for _ in range(BATCHES)] + [False]
        kinds = [k for k, n in FAULTS.items() for _ in range(n)]
        rng.shuffle(kinds)
        at = sorted(rng.sample(range(1, BATCHES), len(kinds)))
        self.schedule: dict[int, tuple[str, str]] = {
            b: (k, rng.choice(POINTS) if k in ("driver", "executor") else rng.choice(POINTS[:4]) if k == "worker"
                else "committed" if k == "rerun" else "output") for b, k in zip(at, kinds)}
        self.committed: dict[int, list[tuple[str, int]]] = {}
        self.events: list[str] = []
        self.ks = None

    # --- reporting ---------------------------------------------------------------------------------
    @property
    def replay(self) -> str:
        plan = " ".join(f"{b}:{k}@{p}" for b, (k, p) in sorted(self.schedule.items()))
        align = "".join("U" if u else "a" for u in self.unaligned)
        return f"STEWARD_SOAK_SEED={self.seed}; schedule {plan}; alignment per batch (U unaligned) {align}"

    def note(self, text: str) -> None:
        line = f"[soak {time.strftime('%H:%M:%S')}] {text}"
        self.events.append(line)
        print(line, flush=True)

    def fail(self, text: str) -> None:
        raise AssertionError(f"{text}\nreplay: {self.replay}\nevents:\n" + "\n".join(self.events[-40:]))

    # --- one batch ---------------------------------------------------------------------------------
    def keyed(self, b: int):
        opts = {"alignment": "unaligned", "aligned_checkpoint_timeout": 0} if self.unaligned[b] else \
            {"alignment": "aligned"}
        return self.st.keyed_state(NAME, key="k", parallelism=P, max_parallelism=M, checkpoint_dir=self.chk,
                                   num_retained=3, file_merging=True, **opts)

    def rows(self, df) -> list[tuple[str, int]]:
        return [(r.k, int(r.v)) for r in df.collect()]

    def run_batch(self, b: int) -> None:
        fault = self.schedule.get(b)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                self.attempt(b, fault if attempt == 1 else None)
                return
            except AssertionError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: retry the batch, as Spark would
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
                self.note(f"batch {b} attempt {attempt} failed: {type(exc).__name__}: {first}")
                self.recovered()
        self.fail(f"batch {b} did not commit in {MAX_ATTEMPTS} attempts")

    def attempt(self, b: int, fault: tuple[str, str] | None) -> None:
        from pyspark import StorageLevel

        kind, point = fault or (None, None)
        ks = self.keyed(b)
        df = self.spark.createDataFrame(self.frames[b], "k string, v long")
        fn = soak_fn(str(self.hook))
        out = ks.apply(df, fn, OUT, checkpoint_id=b)   # begins b
        cached = False
        try:
            if point == "before":
                self.inject(kind, b, point)
            if kind == "second":
                got, again = self.rows(out), self.rows(out)
                if collections.Counter(got) != collections.Counter(again):
                    self.fail(f"batch {b}: a second action on the output emitted other rows: "
                              f"{_diff(collections.Counter(again), collections.Counter(got))}")
                self.note(f"batch {b}: a second action emitted the same {len(got)} rows")
            else:
                out = out.persist(StorageLevel.MEMORY_AND_DISK)
                cached = True
                if point == "during":
                    self.gated(lambda: out.count(), kind, b)
                elif point == "stage":
                    self.racing(lambda: out.count(), kind, b, point, 1.5)
                else:
                    out.count()
                got = self.rows(out)
            if point == "after":
                self.inject(kind, b, point)
            if point == "commit":
                self.racing(lambda: ks.commit(b, wait=60), kind, b, point, 0.08)
            else:
                ks.commit(b, wait=60)
        except BaseException:
            try:
                ks.abort(b)
            except Exception:  # noqa: BLE001 - the agent may be gone; the retry begins b again
                pass
            raise
        finally:
            if cached:
                out.unpersist()
        self.committed[b] = got   # the sink: replace, never append
        self.ks = ks
        if kind == "rerun":
            again = self.rows(ks.apply(df, fn, OUT, checkpoint_id=b))
            ks.commit(b, wait=60)
            if collections.Counter(again) != collections.Counter(got):
                self.fail(f"batch {b}: a re-run of the committed batch emitted other rows: "
                          f"{_diff(collections.Counter(again), collections.Counter(got))}")
            self.committed[b] = again
            self.note(f"batch {b}: a re-run emitted the same {len(again)} rows")

    def gated(self, action, kind: str, b: int) -> None:
        """Run ``action`` in a thread; once a task holds in the user function, inject ``kind``."""
        for p in self.hook.iterdir():
            p.unlink()
        (self.hook / "arm").touch()
        thread, failure = _started(action, f"soak-batch-{b}")
        try:
            held = wait_until(lambda: [p for p in self.hook.iterdir() if p.name.startswith("held-")]
                              or not thread.is_alive(), timeout=120, what=f"a task of batch {b} to hold")
            if held is True:
                self.note(f"batch {b}: the stage ended before a task held (no {kind} fault injected during it)")
            else:
                self.inject(kind, b, "during", victim=int(held[0].name.split("-", 1)[1]))
        finally:
            (self.hook / "go").touch()
            (self.hook / "arm").unlink(missing_ok=True)
            thread.join(300)
        if failure:
            raise failure[0]

    def racing(self, action, kind: str, b: int, point: str, within: float) -> None:
        """Run ``action`` in a thread and inject ``kind`` after a random delay up to ``within`` seconds
        (while it runs, or just after it returned)."""
        delay = self.rng.uniform(0.0, within)
        thread, failure = _started(action, f"soak-commit-{b}")
        time.sleep(delay)
        self.inject(kind, b, f"{point}+{delay:.2f}s" + ("" if thread.is_alive() else " (it had returned)"))
        thread.join(300)
        if failure:
            raise failure[0]

    # --- faults ------------------------------------------------------------------------------------
    def inject(self, kind: str, b: int, point: str, victim: int | None = None) -> None:
        worker = psutil.Process(victim) if victim is not None and psutil.pid_exists(victim) else None
        jvm = _executor_jvm(worker) if worker is not None else None
        jvms = _executor_jvms()
        if jvm is None and jvms:
            jvm = jvms[self.rng.randrange(len(jvms))]
        if kind == "driver":
            targets = _agents("driver")
        elif kind == "executor":
            targets = _children(jvm, "sparksteward.agents.executor") if jvm is not None else []
        elif kind == "worker":   # the held one; a random one; before the stage the daemon; after it the idle ones
            python = _python_workers(jvm) if jvm is not None else []
            daemons = [p for p in python if p.ppid() == jvm.pid]
            idle = [p for p in python if p.ppid() != jvm.pid]
            targets = [worker] if worker is not None else (daemons or idle) if point == "before" else \
                idle[self.rng.randrange(len(idle)):][:1] if point == "stage" and idle else (idle or daemons)
        else:
            return
        where = f"executor {_executor_id(jvm)}" if jvm is not None and kind != "driver" else ""
        if not targets:
            seen = [" ".join(p.cmdline()[-2:]) for p in jvm.children(recursive=True)] if jvm is not None else []
            self.note(f"batch {b}: {kind} fault @{point}: no process to kill {where} (its children: {seen})")
            return
        for proc in targets:
            _kill(proc)
        self.note(f"batch {b}: SIGKILLed the {kind} process {[p.pid for p in targets]} {where} @{point} "
                  f"({'unaligned' if self.unaligned[b] else 'aligned'})")

    def recovered(self) -> None:
        """Wait for a live driver agent and one executor agent per executor."""
        def ready() -> bool:
            try:
                pid = self.st.health()["pid"]
            except Exception:  # noqa: BLE001 - restarting
                return False
            agents = _agents("executor")
            return psutil.pid_exists(pid) and len(agents) >= 2 and \
                all(time.time() - a.create_time() > 1.0 for a in agents)

        wait_until(ready, timeout=90, interval=0.2, what="the agents to be back")

    # --- checks ------------------------------------------------------------------------------------
    def expected_state(self, upto: int) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for b, rows in self.committed.items():
            if b <= upto:
                for k, v in rows:
                    out[k][0] += 1
                    out[k][1] += v
        return {k: (n, s) for k, (n, s) in out.items()}

    def metadata(self) -> dict[int, dict]:
        fs = self.s3.filesystem()
        out = {}
        for path in fs.glob(f"{self.root}/chk-*/_metadata"):
            doc = orjson.loads(fs.cat_file(path))
            out[doc["checkpoint_id"]] = doc
        return out

    def stored(self) -> dict[str, int]:
        """Relative path -> size of every object under the state's ``shared/`` and ``merged/``."""
        fs = self.s3.filesystem()
        prefix = self.root.split("://", 1)[1] + "/"
        return {p[len(prefix):]: info["size"] for sub in ("shared", "merged")
                if fs.exists(f"{self.root}/{sub}")
                for p, info in fs.find(f"{self.root}/{sub}", detail=True).items()}

    def check_checkpoints(self, when: str) -> dict[int, dict]:
        """Every retained checkpoint restores to the values of the rows its batches emitted, and every
        file it references is in the bucket, long enough."""
        from tests.helpers.keyed import read_values

        metas = self.metadata()
        stored = self.stored()
        for cid, doc in sorted(metas.items()):
            for sub in doc["subtasks"]:
                for f in (*sub["files"], *sub.get("channel_state", ())):
                    if "://" in f["path"]:
                        continue
                    size = stored.get(f["path"])
                    if size is None or size < f.get("offset", 0) + f["length"]:
                        self.fail(f"{when}: checkpoint {cid} references {f['path']} (subtask {sub['subtask']}, "
                                  f"{f['name']}, bytes {f.get('offset', 0)}+{f['length']}), which is "
                                  f"{'missing' if size is None else f'only {size} B'} in the bucket")
            values = {k: tuple(orjson.loads(v)[x] for x in ("n", "s"))
                      for k, v in read_values(self.chk, NAME, CLUSTER, doc)}
            want = self.expected_state(cid)
            if values != want:
                self.fail(f"{when}: checkpoint {cid} restores to other values than the rows batches <= {cid} "
                          f"emitted: {_dict_diff(values, want)}")
        referenced = {f["path"] for doc in metas.values() for sub in doc["subtasks"]
                      for f in (*sub["files"], *sub.get("channel_state", ()))}
        self.note(f"{when}: checkpoints {sorted(metas)} restore exactly; {len(referenced)} referenced files, "
                  f"{len(set(stored) - referenced)} unreferenced in the bucket")
        return metas

    def check_end(self) -> None:
        inputs = collections.Counter((k, int(v)) for f in self.frames for k, v in zip(f["k"], f["v"]))
        emitted = collections.Counter(r for rows in self.committed.values() for r in rows)
        if emitted != inputs:
            self.fail(f"the sink does not hold every input row exactly once: {_diff(emitted, inputs)}")
        ks = self.ks   # the drain's
        state = {r.key: tuple(orjson.loads(r.value)[x] for x in ("n", "s")) for r in ks.read().collect()}
        want = self.expected_state(BATCHES)
        if state != want:
            self.fail(f"the final state is not the input's count and sum per key: {_dict_diff(state, want)}")
        info = ks.info()
        metas = self.check_checkpoints("at the end")
        if info["pending"] or sorted(metas) != sorted(c for c in info["retained"] if c >= 0):
            self.fail(f"at the end: pending {info['pending']}, retained {info['retained']}, in the bucket "
                      f"{sorted(metas)}")
        referenced = {f["path"] for doc in metas.values() for sub in doc["subtasks"]
                      for f in (*sub["files"], *sub.get("channel_state", ()))}
        left: list[str] = []

        def swept() -> bool:
            left[:] = sorted(set(self.stored()) - referenced)
            return not left

        fs = self.s3.filesystem()
        prefix = self.root.split("://", 1)[1] + "/"
        expected = {f"chk-{c}/_metadata" for c in metas} | {"_lease", "_begun"}
        other = sorted(p[len(prefix):] for p in fs.find(self.root)
                       if not p[len(prefix):].startswith(("shared/", "merged/")) and p[len(prefix):] not in expected)
        if other:
            self.fail(f"at the end: the state root holds other files than the lease, the retained checkpoints' "
                      f"records and data files: {other}")
        started = time.monotonic()
        try:
            wait_until(swept, timeout=GRACE + 4 * LEASE + 15, interval=1.0, what="the orphans to be swept")
        except AssertionError:
            self.fail(f"unreferenced files outlived the orphan grace ({GRACE:g} s) and the idle sweeps: {left}")
        self.note(f"no unreferenced file under shared/ or merged/ after {time.monotonic() - started:.1f} s; "
                  f"{len(referenced)} referenced files, retained checkpoints {sorted(metas)}")


def _diff(got: collections.Counter, want: collections.Counter) -> str:
    extra, missing = got - want, want - got
    by_batch = lambda c: dict(collections.Counter(v // 1000 for _, v in c.elements()))  # noqa: E731
    return (f"{sum(missing.values())} rows missing (per input batch {by_batch(missing)}; e.g. "
            f"{list(missing)[:5]}), {sum(extra.values())} rows extra (per input batch {by_batch(extra)}; e.g. "
            f"{list(extra)[:5]})")


def _dict_diff(got: dict, want: dict) -> str:
    keys = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    return f"{len(keys)} keys differ (restored vs expected (n, sum)): " + \
        ", ".join(f"{k}: {got.get(k)} vs {want.get(k)}" for k in keys[:8])


def test_checkpoints_survive_a_seeded_schedule_of_kills_and_reruns(spark, s3, tmp_path):
    seed = int(os.environ.get("STEWARD_SOAK_SEED") or random.SystemRandom().randrange(1 << 31))
    hook = tmp_path / "hook"
    hook.mkdir()
    soak = Soak(spark, s3, hook, seed)
    print(f"\n[soak] {soak.replay}", flush=True)
    started = time.monotonic()
    try:
        for b in range(BATCHES + 1):
            soak.run_batch(b)
            if b in soak.schedule:   # right after a fault: what is retained restores, nothing is missing
                soak.check_checkpoints(f"after batch {b} ({soak.schedule[b][0]} @{soak.schedule[b][1]})")
        soak.note(f"{BATCHES} batches and the drain committed in {time.monotonic() - started:.0f} s")
        soak.check_end()
    except Exception as exc:
        if "\nreplay: " in str(exc):
            raise
        soak.fail(f"{type(exc).__name__}: {exc}")   # any other failure names the seed and schedule too


def _started(action, name: str) -> tuple[threading.Thread, list[BaseException]]:
    """``action`` running in a new thread, and the list its exception (if any) lands in."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
            failure.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread, failure
