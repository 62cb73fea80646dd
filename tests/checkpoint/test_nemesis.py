"""The nemesis soak of keyed-state checkpoints (issue 35): a real stream under a seeded schedule of faults.

A driver process of its own (``tests/helpers/nemesis_app.py``, local-cluster[2,1,1024]) runs a
streaming query: ``spark.readStream`` over JSON files this test adds one per micro-batch,
``writeStream.foreachBatch(ks.process(fn, schema, sink=...))``, checkpoints on moto's S3 server (one
server for the run, in this process), file merging on (``max_file_size`` at its 64 KB minimum),
declared states with a processing-time TTL (``count`` and the list ``recent``, and ``total`` without
one). Each application runs the state aligned or unaligned, with a small ``aligned_checkpoint_timeout``
(subtasks that start late defer their input, which later batches and the final drain emit), and every
restart changes the parallelism. The sink is the standard exactly-once ``foreachBatch`` sink: one file
per checkpoint id, skipped when it exists.

The schedule, drawn from the printed seed (``STEWARD_SEED=<n>`` repeats it; timings are not
repeatable), puts one fault on each of some batches:

- ``sink_kill``: the driver process SIGKILLs itself right after its sink wrote the batch, before the
  commit; a new application (another parallelism; the same alignment or the other, drawn) gets the
  batch again. If the product refuses to run an unaligned batch again at another parallelism (it names
  the first delivery's), the soak stops that application and runs the batch at the one asked for;
- ``executor``: SIGKILL an executor agent or an executor JVM, while a merged or shared file of the
  batch is being uploaded (PUTs slowed to widen the window) or while a task holds in the function;
- ``task_fail``: the function raises in a task's attempt 0 (before, between or after its state
  writes); Spark runs the task again;
- ``offline``: ``steward checkpoints gc --min-age 0s`` and/or ``steward checkpoints savepoint`` from
  another process while the batch's ``_metadata`` or a merged file is being written, or at a random
  moment; a refusal while the lease is held is correct (counted), a broken checkpoint is not;
- ``restart``: stop the application after the batch and start another with another parallelism and
  the other alignment (so every run has both);
- ``lease``: the lease cannot be renewed for about a lease timeout: the driver agent SIGSTOPped, or
  the S3 server stopped (an outage);
- ``clock``: the driver agent's clock is stepped back (``SPARK_STEWARD_TEST_CLOCK_OFFSET_FILE``, see
  :mod:`sparksteward.clock`) before the batch.

Between two applications ``steward checkpoints savepoint`` runs too, and must succeed.

After every restart (of the application or of its query) and at the end, with nothing running:

- every emitted row is an input row, emitted once; every value the function emitted (count, list
  length, total) is what a model in plain Python gives when it replays the emitted rows in
  checkpoint order at the emitted processing times, which never go back;
- every retained checkpoint, and every savepoint taken, restores (``read_variable``, what
  ``KeyedState.read`` and ``steward checkpoints read`` run) to exactly the model's state after that
  checkpoint (the TTL variables read at the checkpoint's processing time);
- at the end, after a drain and ``steward checkpoints gc --min-age 0s``: every input row emitted
  exactly once, the totals per key those of the input (also as ``steward checkpoints read`` prints
  them), and no data file left under the state root that no checkpoint references.

Run alone (it starts Spark applications of its own, one at a time): ``make soak``, or
``.venv/bin/python -m pytest -q -ra -m soak -s tests/checkpoint/test_nemesis.py``; 10-12 minutes on
the 2-core machine under load. The last line prints the seed and the counts. To study one fault:
``STEWARD_NEMESIS_BATCHES`` (fewer batches), ``STEWARD_NEMESIS_FAULTS="sink_kill=3,offline=0"``
(counts per kind), ``STEWARD_NEMESIS_ALIGNMENT=aligned|unaligned`` (every application),
``STEWARD_NEMESIS_KEEP_GOING=1`` (note each new problem and fail only at the end).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from sparksteward.clock import OFFSET_FILE_ENV
from sparksteward.testing.s3 import local_s3

from tests.helpers import MARKER, REPO, agent_processes, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.cluster]

# input files (then the final drain): 22 hold every one of FAULTS' 15 faults and the clock steps, at a
# fault every 1.4 batches (34 batches and 20 faults took 9-10.5 minutes of .ci/run's 45); fewer: a try-out
BATCHES = int(os.environ.get("STEWARD_NEMESIS_BATCHES", "22"))
ROWS, KEYS = 30, 40          # rows per batch, keys (skewed: a few hot, many rare)
M = 16
PARALLELISMS = (2, 3, 4)
TTL_S = 6.0
LEASE_S, AGENT_TIMEOUT_S, GRACE_S = 8.0, 6.0, 5.0
NAME = "nemesis"
CLUSTER = f"nemesis-{uuid.uuid4().hex[:8]}"
FAULTS = {"sink_kill": 2, "executor": 3, "task_fail": 3, "offline": 4, "restart": 1, "lease": 2}
# STEWARD_NEMESIS_FAULTS="sink_kill=2,offline=0": other counts (to study one kind of fault alone)
FAULTS.update({k: int(n) for k, _, n in (kv.partition("=") for kv in
                                         filter(None, os.environ.get("STEWARD_NEMESIS_FAULTS", "").split(",")))})
CLOCK_STEPS = 4
MAX_APPS = 16
MAX_QUERY_FAILURES = 6       # of one batch: more, and the stream is stuck
BATCH_TIMEOUT = 300.0
# STEWARD_NEMESIS_KEEP_GOING=1: note each new problem and go on, failing at the end (to see which faults
# break what in one run); by default the first check that finds a problem fails the run
KEEP_GOING = os.environ.get("STEWARD_NEMESIS_KEEP_GOING") == "1"
# STEWARD_NEMESIS_ALIGNMENT=aligned|unaligned: every application runs that alignment (to study one)
ALIGNMENT = os.environ.get("STEWARD_NEMESIS_ALIGNMENT", "")


# --- processes ---------------------------------------------------------------------------------
def _mine(proc: psutil.Process) -> bool:
    try:
        return proc.environ().get(MARKER) == os.environ[MARKER]
    except psutil.Error:
        return False


def _executor_jvms() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "CoarseGrainedExecutorBackend" in " ".join(proc.info["cmdline"] or ()) and _mine(proc):
            found.append(proc)
    return found


def _agents(role: str) -> list[psutil.Process]:
    out = []
    for proc in agent_processes():
        try:
            if any(f"sparksteward.agents.{role}" in c for c in proc.cmdline()):
                out.append(proc)
        except psutil.Error:
            continue
    return out


def _executor_jvm_of(pid: int) -> psutil.Process | None:
    try:
        for parent in psutil.Process(pid).parents():
            if "CoarseGrainedExecutorBackend" in " ".join(parent.cmdline()):
                return parent
    except psutil.Error:
        pass
    return None


def _kill(proc: psutil.Process) -> bool:
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        return True
    except psutil.NoSuchProcess:
        return False
    except psutil.TimeoutExpired:
        return True


def _group(pgid: int) -> list[psutil.Process]:
    alive = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (psutil.Error, ProcessLookupError):
            continue
    return alive


class Stopped(Exception):
    """The injector was told the batch is over."""


# --- the model ---------------------------------------------------------------------------------
class KeyModel:
    __slots__ = ("n", "n_exp", "recent", "t")

    def __init__(self) -> None:
        self.n: int | None = None
        self.n_exp: int | None = None
        self.recent: tuple[tuple[int, int], ...] = ()   # (rid, expiry ms)
        self.t: int | None = None

    def copy(self) -> KeyModel:
        c = KeyModel()
        c.n, c.n_exp, c.recent, c.t = self.n, self.n_exp, self.recent, self.t
        return c


class Model:
    """What the state holds after each checkpoint, replayed from the sink's rows in checkpoint order."""

    def __init__(self, inputs: dict[int, tuple[str, int]], ttl_ms: int) -> None:
        self.inputs, self.ttl = inputs, ttl_ms
        self.after: dict[int, dict[str, KeyModel]] = {}
        self.now: dict[int, int | None] = {}
        self.emitted: collections.Counter[int] = collections.Counter()
        self.problems: list[str] = []
        self.rows = 0
        self.diverged: dict[str, int] = {}   # key -> the checkpoint whose emitted values first differed
        self.late = 0

    def replay(self, sink: dict[int, list[dict]]) -> None:
        state: dict[str, KeyModel] = {}
        prev: tuple[int, int] | None = None
        for cid in sorted(sink):
            rows = sink[cid]
            self.rows += len(rows)
            now = None
            if rows:
                nows = sorted({int(r["now"]) for r in rows})
                if len(nows) > 1:
                    self.problems.append(f"checkpoint {cid}: its rows carry {len(nows)} processing times {nows[:5]} "
                                         f"(one per checkpoint: issue 35 item 3)")
                now = nows[0]
                if prev is not None and now < prev[1]:
                    self.problems.append(f"checkpoint {cid}: processing time {now} is {prev[1] - now} ms before that "
                                         f"of checkpoint {prev[0]} ({prev[1]}): it must never go back (item 3)")
                prev = (cid, now)
                by_key: dict[str, list[dict]] = collections.defaultdict(list)
                for r in rows:
                    rid = int(r["rid"])
                    self.emitted[rid] += 1
                    self.late += rid // 1000 < cid   # deferred by an unaligned batch, emitted by a later one
                    if self.inputs.get(rid) != (r["k"], int(r["v"])):
                        self.problems.append(f"checkpoint {cid}: emitted row {rid} ({r['k']}, {r['v']}) is not an "
                                             f"input row ({self.inputs.get(rid)})")
                    by_key[r["k"]].append(r)
                for k, krows in sorted(by_key.items()):
                    s = state.get(k, KeyModel()).copy()
                    alive = s.n_exp is not None and s.n_exp > now
                    n = (s.n if alive and s.n is not None else 0) + len(krows)
                    recent = tuple(e for e in s.recent if e[1] > now)
                    m = len(recent) + len(krows)
                    t = (s.t or 0) + sum(int(r["v"]) for r in krows)
                    got = sorted({(int(r["n"]), int(r["m"]), int(r["t"])) for r in krows})
                    if k not in self.diverged and got != [(n, m, t)]:
                        self.diverged[k] = cid
                        self.problems.append(
                            f"checkpoint {cid} key {k} ({len(krows)} rows, now {now}): emitted (count, recent, total) "
                            f"{got}, the model says {(n, m, t)} (before: count {s.n} expiring {s.n_exp}, "
                            f"{len(s.recent)} recent of which {len(recent)} alive, total {s.t})")
                    if k in self.diverged:   # reported once: from there on the model follows the emitted values
                        n, t = got[0][0], got[0][2]
                    s.n, s.n_exp, s.t = n, now + self.ttl, t
                    s.recent = recent + tuple((int(r["rid"]), now + self.ttl) for r in sorted(krows, key=lambda r: r["rid"]))
                    state[k] = s
            self.now[cid] = now
            self.after[cid] = {k: v.copy() for k, v in state.items()}
        twice = [(rid, times) for rid, times in sorted(self.emitted.items()) if times > 1]
        for rid, times in twice[:10]:
            self.problems.append(f"row {rid} {self.inputs.get(rid)} was emitted {times} times")
        if len(twice) > 10:
            self.problems.append(f"... {len(twice)} rows were emitted more than once")

    def bounds(self, cid: int) -> tuple[int, float]:
        """(lo, hi): the processing time of ``cid``, or when its rows are unknown, the latest one before
        it and the next one after it."""
        if self.now.get(cid) is not None:
            return self.now[cid], self.now[cid]
        before = [t for c, t in self.now.items() if c < cid and t is not None]
        after = [t for c, t in self.now.items() if c > cid and t is not None]
        return (max(before) if before else 0), (min(after) if after else float("inf"))

    def state_at(self, cid: int) -> dict[str, KeyModel]:
        known = [c for c in self.after if c <= cid]
        return self.after[max(known)] if known else {}


# --- the soak ----------------------------------------------------------------------------------
class Nemesis:
    def __init__(self, s3, tmp: Path, seed: int) -> None:
        self.s3, self.tmp, self.seed = s3, tmp, seed
        self.rng = random.Random(seed)
        self.restart_rng = random.Random(seed * 7 + 1)   # restarts draw from their own stream
        self.control = tmp / "control"
        (self.control / "sink").mkdir(parents=True)
        self.source = tmp / "source"
        self.source.mkdir()
        self.offset_file = tmp / "clock-offset"
        self.offset_file.write_text("0")
        self.offset = 0.0
        self.chk = s3.url("nemesis-chk")
        self.prefix = f"nemesis-chk/{CLUSTER}/{NAME}/"
        self.options = s3.storage_options()
        (self.control / "config.json").write_text(json.dumps({
            "source": str(self.source), "spark_chk": str(tmp / "spark-chk"), "state_chk": self.chk, "name": NAME,
            "max_parallelism": M, "num_retained": 2, "ttl_s": TTL_S, "merge_max_file_size": 65536,
            "records_per_batch": 4,
            "steward_conf": {"spark.steward.state-dir": str(tmp / "steward-state"),
                             "spark.steward.cluster-id": CLUSTER,
                             "spark.steward.storage.options": self.options,
                             "spark.steward.checkpoint.lease-timeout": f"{LEASE_S:g}s",
                             "spark.steward.checkpoint.agent-timeout": f"{AGENT_TIMEOUT_S:g}s",
                             "spark.steward.checkpoint.orphan-grace": f"{GRACE_S:g}s",
                             "spark.steward.agent.max-restarts": "50"}}))
        rng = self.rng
        self.files: list[list[tuple[int, str, int]]] = []
        for b in range(BATCHES):
            self.files.append([(b * 1000 + j, f"k{min(int(rng.expovariate(1 / 7)), KEYS - 1):02d}", rng.randrange(1000))
                               for j in range(ROWS)])
        self.inputs = {rid: (k, v) for rows in self.files for rid, k, v in rows}
        kinds = [k for k, n in FAULTS.items() for _ in range(n)]
        rng.shuffle(kinds)
        kinds = kinds[:BATCHES - 2]
        at = sorted(rng.sample(range(1, BATCHES - 1), len(kinds)))
        self.schedule: dict[int, tuple[str, dict]] = {b: (k, self._params(k)) for b, k in zip(at, kinds)}
        self.clock_steps = {b: -round(rng.uniform(8, 25), 1) for b in rng.sample(range(1, BATCHES), min(CLOCK_STEPS, BATCHES - 1))}
        self.first = {"parallelism": rng.choice(PARALLELISMS), "alignment": rng.choice(("aligned", "unaligned")),
                      "timeout": round(rng.uniform(0.05, 0.4), 2)}
        self.counts: collections.Counter[str] = collections.Counter()
        self.log: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.app = -1
        self.app_conf: dict = {}
        self.seen = 0          # lines of the current app's events already handled
        self.failures = 0      # query failures of the current app
        self.savepoints: list[str] = []
        self.begun = threading.Event()   # the current batch began (its foreachBatch was called)
        self.checked_rows = self.late_rows = 0
        self.checked_checkpoints = 0
        self.problems: list[str] = []     # with KEEP_GOING: every problem found so far
        self.failed_at: list[str] = []

    def _params(self, kind: str) -> dict:
        rng = self.rng
        if kind == "executor":
            return {"target": rng.choice(("agent", "jvm")), "point": rng.choice(("upload", "upload", "stage"))}
        if kind == "task_fail":
            return {"mode": rng.choice(("before", "mid", "after"))}
        if kind == "offline":
            return {"tools": rng.choice((("gc",), ("gc",), ("savepoint",), ("gc", "savepoint"))),
                    "point": rng.choice(("metadata", "metadata", "seal", "anytime")), "delay": round(rng.uniform(0, 3), 2)}
        if kind == "lease":
            return {"how": rng.choice(("pause", "pause", "outage")), "delay": round(rng.uniform(0, 1.5), 2),
                    "seconds": round(rng.uniform(0.9, 1.3) * LEASE_S, 1)}
        return {}

    # --- reporting -------------------------------------------------------------------------------
    @property
    def replay(self) -> str:
        plan = " ".join(f"{b}:{k}{'(' + ','.join(f'{a}={v}' for a, v in p.items()) + ')' if p else ''}"
                        for b, (k, p) in sorted(self.schedule.items()))
        clock = " ".join(f"{b}:{s:+g}s" for b, s in sorted(self.clock_steps.items()))
        return f"STEWARD_SEED={self.seed}; first app {self.first}; schedule {plan}; clock steps {clock}"

    def note(self, text: str) -> None:
        line = f"[nemesis {time.strftime('%H:%M:%S')}] {text}"
        self.log.append(line)
        print(line, flush=True)

    def fail(self, text: str) -> None:
        tail = ""
        if self.app >= 0:
            log = self.control / f"app-{self.app}.log"
            if log.exists():
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise AssertionError(f"{text}\nreplay: {self.replay}\nevents:\n" + "\n".join(self.log[-60:]) +
                             f"\n--- app {self.app} log (tail):\n{tail}")

    # --- applications ----------------------------------------------------------------------------
    def start_app(self, why: str, parallelism: int | None = None) -> None:
        self.app += 1
        if self.app >= MAX_APPS:
            self.fail(f"{self.app} applications started: the stream does not settle")
        if self.app == 0:
            conf = dict(self.first)
        else:
            rng = self.restart_rng
            other = "unaligned" if self.app_conf["alignment"] == "aligned" else "aligned"
            # a planned restart switches the alignment (so the run has both); after a kill it is drawn, so
            # that a re-delivered batch runs with the same alignment as its first delivery, or the other
            conf = {"parallelism": rng.choice([p for p in PARALLELISMS if p != self.app_conf["parallelism"]]),
                    "alignment": other if why == "planned restart" or rng.random() < 0.5 else self.app_conf["alignment"],
                    "timeout": round(rng.uniform(0.05, 0.4), 2)}
            if parallelism is not None:   # as the product asked: the same alignment, that parallelism
                conf.update(parallelism=parallelism, alignment=self.app_conf["alignment"])
            self.counts["restarts"] += 1
        if ALIGNMENT:
            conf["alignment"] = ALIGNMENT
        self.app_conf = conf
        self.seen = self.failures = 0
        self.started = False
        env = {**os.environ, OFFSET_FILE_ENV: str(self.offset_file)}   # PYTHONPATH has the repo (conftest.py)
        cmd = [sys.executable, "-m", "tests.helpers.nemesis_app", "--control", str(self.control), "--app",
               str(self.app), "--parallelism", str(conf["parallelism"]), "--alignment", conf["alignment"],
               "--timeout", str(conf["timeout"])]
        with open(self.control / f"app-{self.app}.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.note(f"app {self.app} ({why}): P={conf['parallelism']} {conf['alignment']}"
                  f"{' timeout ' + str(conf['timeout']) + ' s' if conf['alignment'] == 'unaligned' else ''}, "
                  f"pid {self.proc.pid}")

    def events(self) -> list[str]:
        path = self.control / f"events-{self.app}.log"
        if not path.exists():
            return []
        text = path.read_text()
        lines = text.splitlines()
        if not text.endswith("\n"):   # a line being written: read it next time
            lines = lines[:-1]
        new = [line.split(" ", 1)[1] for line in lines[self.seen:]]
        self.seen = len(lines)
        return new

    def wait_gone(self) -> None:
        """Wait for the application's process group (driver, JVM, executors, agents) to exit."""
        assert self.proc is not None
        pgid = self.proc.pid
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        try:
            wait_until(lambda: not _group(pgid), timeout=60, interval=0.2,
                       what=f"app {self.app}'s JVM, executors and agents to exit")
        finally:
            for proc in _group(pgid):
                _kill(proc)

    def stop_app(self, mode: str) -> None:
        (self.control / f"stop-{self.app}").write_text(mode)
        deadline = time.monotonic() + 180
        assert self.proc is not None
        while self.proc.poll() is None:
            for e in self.events():
                self.note(f"app {self.app}: {e}")
            if time.monotonic() > deadline:
                self.fail(f"app {self.app} did not stop within 180 s")
            time.sleep(0.2)
        for e in self.events():
            self.note(f"app {self.app}: {e}")
        if self.proc.returncode != 0:
            self.fail(f"app {self.app} exited with code {self.proc.returncode} when asked to stop ({mode})")
        self.wait_gone()

    # --- one batch -------------------------------------------------------------------------------
    def add_file(self, b: int) -> None:
        tmp = self.source / f".part-{b:04d}.json.tmp"
        tmp.write_text("".join(json.dumps({"rid": rid, "k": k, "v": v}) + "\n" for rid, k, v in self.files[b]))
        os.utime(tmp, (1_800_000_000 + b, 1_800_000_000 + b))   # the source takes files in mtime order
        os.replace(tmp, self.source / f"part-{b:04d}.json")

    def batch(self, b: int) -> None:
        kind, params = self.schedule.get(b, (None, {}))
        if b in self.clock_steps:
            self.offset += self.clock_steps[b]
            tmp = self.offset_file.with_suffix(".tmp")
            tmp.write_text(repr(self.offset))
            os.replace(tmp, self.offset_file)
            self.counts["clock steps"] += 1
            self.note(f"batch {b}: the driver agent's clock stepped {self.clock_steps[b]:+g} s (offset {self.offset:+g} s)")
        done = threading.Event()
        self.begun = threading.Event()
        injector = None
        if kind == "sink_kill":
            (self.control / "kill-after-sink").write_text(str(b))
        elif kind == "task_fail":
            (self.control / "fail-arm").write_text(params["mode"])
        elif kind == "offline":
            runners = {tool: self.cli_runner(tool, b) for tool in params["tools"]}
            injector = self.injector(lambda: self.offline(b, params, runners, done), done)
        elif kind == "executor":
            if params["point"] == "stage":
                (self.control / "gate-arm").touch()
            injector = self.injector(lambda: self.executor_kill(b, params, done), done)
        elif kind == "lease":
            injector = self.injector(lambda: self.lease_fault(b, params, done), done)
        if kind:
            self.note(f"batch {b}: {kind} {params or ''}")
        self.add_file(b)
        try:
            self.await_commit(b, kind, injector, done)
        finally:
            done.set()
            if injector is not None:
                injector.join(120)
            for name in ("kill-after-sink", "fail-arm", "gate-arm"):
                (self.control / name).unlink(missing_ok=True)
            (self.control / "gate-go").touch()
        if kind == "task_fail" and not list(self.control.glob("fail-taken-*")):
            self.note(f"batch {b}: no task took the failure")
        for p in self.control.glob("fail-taken-*"):
            p.unlink()
            self.counts["task failures"] += 1
        for p in self.control.glob("gate-held-*"):
            p.unlink()
        (self.control / "gate-go").unlink(missing_ok=True)
        if kind == "restart":
            self.note(f"batch {b}: stopping app {self.app} for a restart with another parallelism")
            self.stop_app("plain")
            self.offline_savepoint(f"after app {self.app} stopped")
            self.verify(f"after app {self.app} stopped")
            self.start_app("planned restart")

    def injector(self, action, done: threading.Event) -> threading.Thread:
        def run() -> None:
            try:
                action()
            except Stopped:
                pass
            except Exception as exc:  # noqa: BLE001 - a broken injector is reported, the soak goes on
                self.note(f"injector failed: {type(exc).__name__}: {exc}")
        thread = threading.Thread(target=run, name="nemesis-injector", daemon=True)
        thread.start()
        return thread

    def await_commit(self, b: int, kind: str | None, injector: threading.Thread | None, done: threading.Event) -> None:
        deadline = time.monotonic() + BATCH_TIMEOUT
        failures = 0
        refused: int | None = None
        assert self.proc is not None
        while True:
            committed = False
            for e in self.events():
                word = e.split(" ", 1)[0]
                if word == "begin" and e.split()[1] == str(b):
                    self.begun.set()
                if word in ("begin", "sink"):
                    continue
                self.note(f"app {self.app}: {e}")
                if word == "started":
                    self.started = True
                if word == "committed":
                    _, bid, cid = e.split()
                    if int(bid) == b:
                        if int(cid) != b:
                            self.fail(f"batch {b} committed as checkpoint {cid}: no drain ran, they must be equal")
                        committed = True
                elif word == "refused-parallelism":
                    refused = int(e.split()[1])
                elif word == "query-failed" and refused is not None:
                    # the re-delivery of an unaligned batch at another parallelism was refused, naming the way
                    # out: run the batch at the first delivery's parallelism (what a user would do)
                    self.counts["re-deliveries refused at another parallelism"] += 1
                    if injector is not None:
                        injector.join(120)
                    self.stop_app("plain")
                    self.verify(f"app {self.app} refused batch {b} at parallelism {self.app_conf['parallelism']}")
                    self.start_app(f"batch {b} asks for parallelism {refused}", parallelism=refused)
                    refused, failures = None, 0
                    deadline = time.monotonic() + BATCH_TIMEOUT
                    break
                elif word == "query-failed":
                    self.counts["query restarts"] += 1
                    failures += 1
                    if injector is not None:
                        injector.join(120)
                    self.verify(f"app {self.app}'s query failed")
                    if failures > MAX_QUERY_FAILURES:
                        self.fail(f"batch {b}: the query failed {failures} times in a row: the stream is stuck; "
                                  f"problems so far:\n  " + "\n  ".join(self.problems[:40]))
                    (self.control / f"resume-{self.app}-{self.failures}").touch()
                    self.failures += 1
            if committed:
                return
            if self.proc.poll() is not None:
                for e in self.events():
                    self.note(f"app {self.app}: {e}")
                code = self.proc.returncode
                killed = any(self.control.glob(f"kill-after-sink.taken-{self.app}"))
                if killed and code == -signal.SIGKILL:
                    self.counts["driver kills after the sink"] += 1
                    for p in self.control.glob("kill-after-sink.taken-*"):
                        p.unlink()
                else:
                    self.counts["unexpected app exits"] += 1
                    self.note(f"app {self.app} exited with code {code} unasked; its log:\n" + "\n".join(
                        (self.control / f"app-{self.app}.log").read_text(errors="replace").splitlines()[-30:]))
                    if not self.started:
                        self.fail(f"app {self.app} exited with code {code} before its query started")
                self.wait_gone()
                if injector is not None:
                    injector.join(120)
                self.offline_savepoint(f"after app {self.app} died")
                self.verify(f"app {self.app} died")
                self.start_app(f"after app {self.app} died")
                deadline = time.monotonic() + BATCH_TIMEOUT
            if time.monotonic() > deadline:
                self.fail(f"batch {b} did not commit within {BATCH_TIMEOUT:g} s")
            time.sleep(0.1)

    # --- faults ------------------------------------------------------------------------------------
    def wait_for(self, what: str, predicate, done: threading.Event, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while True:
            got = predicate()
            if got:
                return got
            if done.is_set():
                raise Stopped()
            if time.monotonic() > deadline:
                self.note(f"missed: {what} did not happen within {timeout:g} s")
                raise Stopped()
            time.sleep(0.005)

    def in_flight(self, match) -> list[tuple[str, str]]:
        return [(op, key) for op, key in self.s3.in_flight() if key.startswith(self.prefix) and match(op, key[len(self.prefix):])]

    def window(self, point: str, b: int, done: threading.Event) -> str:
        """Wait for ``point`` of batch ``b``: a ``_metadata`` or a merged/shared file being PUT, or a delay."""
        if point == "metadata":
            got = self.wait_for(f"batch {b}'s _metadata PUT", lambda: self.in_flight(
                lambda op, rel: op == "PutObject" and rel.endswith("/_metadata") and rel.startswith("chk-")), done)
        elif point in ("seal", "upload"):
            got = self.wait_for(f"an upload of batch {b}", lambda: self.in_flight(
                lambda op, rel: op in ("PutObject", "UploadPart") and rel.startswith(("merged/", "shared/"))), done)
        else:
            return "a random moment"
        return f"{got[0][0]} {got[0][1][len(self.prefix):]} in flight"

    def cli_runner(self, tool: str, b: int) -> tuple[subprocess.Popen, Path]:
        where = self.tmp / f"cli-{tool}-{b}"
        where.mkdir()
        args = ["checkpoints", "gc", self.chk, NAME, "--min-age", "0s"] if tool == "gc" else \
            ["checkpoints", "savepoint", self.chk, NAME, self.s3.url("nemesis-savepoints", f"sp-{b}")]
        args += ["--cluster-id", CLUSTER, "--conf", f"spark.steward.storage.options={self.options}"]
        proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.nemesis_cli", str(where), *args], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=open(where / "stderr", "wb"))
        wait_until(lambda: (where / "ready").exists() or proc.poll() is not None, timeout=60,
                   what=f"the {tool} command to start")
        return proc, where

    def offline(self, b: int, params: dict, runners: dict, done: threading.Event) -> None:
        at = "the batch's end (its window was missed)"
        try:
            slow = self.s3.slow("PutObject", 2.0) if params["point"] in ("metadata", "seal") else _nothing()
            with slow:
                if params["point"] == "anytime":
                    self.wait_for(f"batch {b} to begin", self.begun.is_set, done)
                    done.wait(params["delay"])
                at = self.window(params["point"], b, done)
                for _, where in runners.values():
                    (where / "go").touch()
                results = {tool: self.result(where) for tool, (_, where) in runners.items()}
        except Stopped:
            for _, where in runners.values():
                (where / "go").touch()
            results = {tool: self.result(where) for tool, (_, where) in runners.items()}
        finally:
            for proc, where in runners.values():
                (where / "go").touch()
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for tool, res in results.items():
            text = (res["out"] + res["err"]).strip().replace("\n", " | ")[:300]
            if res["code"] == 0:
                self.counts[f"{tool} runs"] += 1
                if tool == "savepoint":
                    self.savepoints.append(res["out"].strip().splitlines()[0])
            elif "lease" in text or "being written" in text:
                self.counts[f"{tool} refusals"] += 1
            else:
                self.counts[f"{tool} errors"] += 1
            self.note(f"batch {b}: steward checkpoints {tool} at {at}: exit {res['code']}: {text}")

    def offline_savepoint(self, when: str) -> None:
        """``steward checkpoints savepoint`` while no application runs: it must succeed (the writer is
        gone) and restore to its checkpoint's state (the next verify reads it)."""
        url = self.s3.url("nemesis-savepoints", f"between-{self.app}")
        got = subprocess.run([sys.executable, "-m", "sparksteward", "checkpoints", "savepoint", self.chk, NAME, url,
                              "--cluster-id", CLUSTER, "--conf", f"spark.steward.storage.options={self.options}"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        text = (got.stdout + got.stderr).strip().replace("\n", " | ")[:300]
        self.note(f"steward checkpoints savepoint {when}: exit {got.returncode}: {text}")
        if got.returncode == 0:
            self.counts["savepoint runs"] += 1
            self.savepoints.append(got.stdout.strip().splitlines()[0])
        elif "no completed checkpoint" not in text:
            self.counts["savepoint errors"] += 1
            problem = f"steward checkpoints savepoint {when}, with no application running, failed: {text}"
            if not KEEP_GOING:
                self.fail(problem)
            self.problems.append(problem)
            self.failed_at.append(when)

    @staticmethod
    def result(where: Path) -> dict:
        return wait_until(lambda: (where / "result.json").exists() and json.loads((where / "result.json").read_text()),
                          timeout=120, what=f"the command in {where}")

    def executor_kill(self, b: int, params: dict, done: threading.Event) -> None:
        if params["point"] == "stage":
            held = self.wait_for(f"a task of batch {b} to hold", lambda: list(self.control.glob("gate-held-*")), done)
            jvm = _executor_jvm_of(int(held[0].name.rsplit("-", 1)[1]))
            at = "a task holding in the function"
            try:
                if jvm is None:
                    self.note(f"batch {b}: the held task's executor JVM is gone")
                    return
                victims = [jvm] if params["target"] == "jvm" else [
                    c for c in jvm.children(recursive=True) if "sparksteward.agents.executor" in " ".join(c.cmdline())]
                self._kill_one(b, params["target"], victims, at)
            finally:
                (self.control / "gate-go").touch()
            return
        with self.s3.slow("PutObject", 1.5):
            at = self.window("upload", b, done)
            victims = _executor_jvms() if params["target"] == "jvm" else _agents("executor")
            self._kill_one(b, params["target"], victims, at)

    def _kill_one(self, b: int, target: str, victims: list[psutil.Process], at: str) -> None:
        if not victims:
            self.note(f"batch {b}: no executor {target} to kill at {at}")
            return
        victim = self.rng.choice(sorted(victims, key=lambda p: p.pid)) if len(victims) > 1 else victims[0]
        if _kill(victim):
            self.counts[f"executor {target} kills"] += 1
            self.note(f"batch {b}: SIGKILLed executor {target} {victim.pid} at {at}")

    def lease_fault(self, b: int, params: dict, done: threading.Event) -> None:
        self.wait_for(f"batch {b} to begin", self.begun.is_set, done)
        done.wait(params["delay"])
        if params["how"] == "outage":
            self.note(f"batch {b}: S3 down for {params['seconds']} s")
            self.s3.stop()
            try:
                time.sleep(params["seconds"])   # the length of the outage, not a synchronisation
            finally:
                self.s3.restart()
            self.counts["store outages"] += 1
            return
        agents = _agents("driver")
        if not agents:
            self.note(f"batch {b}: no driver agent to pause")
            return
        agent = agents[0]
        self.note(f"batch {b}: driver agent {agent.pid} SIGSTOPped for {params['seconds']} s")
        agent.send_signal(signal.SIGSTOP)
        try:
            time.sleep(params["seconds"])   # the length of the pause, not a synchronisation
        finally:
            agent.send_signal(signal.SIGCONT)
        self.counts["driver agent pauses"] += 1

    # --- checks ------------------------------------------------------------------------------------
    def sink(self) -> dict[int, list[dict]]:
        return {int(p.stem): json.loads(p.read_text()) for p in sorted((self.control / "sink").glob("*.json"))}

    def storage(self):
        from sparksteward.checkpoint.storage import CheckpointStorage

        return CheckpointStorage.open(self.chk, NAME, CLUSTER)

    def verify(self, why: str, final: bool = False) -> Model:
        from sparksteward.checkpoint.reader import read_variable
        from sparksteward.checkpoint.storage import open_checkpoint
        from sparksteward.storage import options_scope

        started = time.monotonic()
        model = Model(self.inputs, int(TTL_S * 1000))
        model.replay(self.sink())
        problems = list(model.problems)
        with options_scope(json.loads(self.options)):
            storage = self.storage()
            targets = [(f"checkpoint {cid}", storage, lambda c=cid: storage.read_metadata(c))
                       for cid in storage.checkpoint_ids()]
            for url in self.savepoints:
                targets.append((f"savepoint {url}", None, lambda u=url: open_checkpoint(u)))
            for what, st, load in targets:
                try:
                    if st is None:
                        st, meta = load()
                    else:
                        meta = load()
                    problems += self.compare(what, model, meta, lambda var, now, st=st, meta=meta: read_variable(
                        st, meta, var, now_ms=now))
                except Exception as exc:  # noqa: BLE001 - a checkpoint that cannot be read is the finding
                    problems.append(f"{what} cannot be restored: {type(exc).__name__}: {str(exc)[:500]}")
                self.checked_checkpoints += 1
        if final:
            missing = sorted(set(self.inputs) - set(model.emitted))
            if missing:
                problems.append(f"{len(missing)} input rows were never emitted, e.g. "
                                f"{[(r, self.inputs[r]) for r in missing[:8]]}")
            truth: dict[str, int] = collections.Counter()
            for k, v in self.inputs.values():
                truth[k] += v
            last = model.state_at(max(model.after)) if model.after else {}
            got = {k: s.t for k, s in last.items() if s.t is not None}
            if got != dict(truth):
                problems.append(f"final totals per key differ from the input's: "
                                f"{sorted(set(got.items()) ^ set(truth.items()))[:10]}")
            read = subprocess.run([sys.executable, "-m", "sparksteward", "checkpoints", "read", self.chk, NAME, "total",
                                   "--json", "--limit", "1000000", "--cluster-id", CLUSTER, "--conf",
                                   f"spark.steward.storage.options={self.options}"], cwd=REPO, capture_output=True,
                                  text=True, timeout=300)
            cli = {r["key"]: r["value"] for r in map(json.loads, read.stdout.splitlines())} if read.returncode == 0 else None
            if cli != dict(truth):
                problems.append(f"steward checkpoints read of the latest checkpoint's totals (exit {read.returncode}: "
                                f"{read.stderr.strip()[:200]}) differ from the input's: "
                                f"{sorted(set((cli or {}).items()) ^ set(truth.items()))[:10]}")
        self.checked_rows, self.late_rows = model.rows, model.late
        new = [p for p in problems if p not in self.problems]
        self.note(f"verified ({why}): {len(model.after)} sink files, {model.rows} rows, "
                  f"{len(targets)} checkpoints/savepoints in {time.monotonic() - started:.1f} s"
                  f"{'' if not problems else f': {len(problems)} PROBLEMS ({len(new)} new)'}")
        if new:
            text = f"{why}: {len(new)} new problem(s):\n  " + "\n  ".join(new[:25])
            if not KEEP_GOING:
                self.fail(text)
            self.note(text)
            self.problems.extend(new)
            self.failed_at.append(why)
        return model

    def compare(self, what: str, model: Model, meta, read) -> list[str]:
        cid = meta.checkpoint_id
        if cid not in model.after:
            return [f"{what} completed, but the sink has no file for checkpoint {cid}"]
        lo, hi = model.bounds(cid)
        # keys whose emitted values differed at or before cid were reported then; later checkpoints skip them
        state = {k: s for k, s in model.after[cid].items() if model.diverged.get(k, cid + 1) > cid}
        skip = set(model.after[cid]) - set(state)
        out = []
        totals = {r["key"]: r["value"] for r in read("total", lo).to_pylist() if r["key"] not in skip}
        want = {k: s.t for k, s in state.items() if s.t is not None}
        if totals != want:
            out.append(f"{what}: total differs from the model at {len(set(totals.items()) ^ set(want.items()))} "
                       f"entries: {_diff(totals, want)}")
        counts = {r["key"]: r["value"] for r in read("count", lo).to_pylist() if r["key"] not in skip}
        may = {k: s.n for k, s in state.items() if s.n_exp is not None and s.n_exp > lo}
        must = {k: s.n for k, s in state.items() if s.n_exp is not None and s.n_exp > hi}
        if not (set(must.items()) <= set(counts.items()) <= set(may.items())):
            out.append(f"{what} (processing time {lo}{'' if lo == hi else f'..{hi}'}): count differs from the "
                       f"model: {_diff(counts, may)}")
        recent = {(r["key"], r["value"]) for r in read("recent", lo).to_pylist() if r["key"] not in skip}
        may_r = {(k, rid) for k, s in state.items() for rid, exp in s.recent if exp > lo}
        must_r = {(k, rid) for k, s in state.items() for rid, exp in s.recent if exp > hi}
        if not (must_r <= recent <= may_r):
            out.append(f"{what}: recent differs from the model: {len(recent - may_r)} elements too many "
                       f"{sorted(recent - may_r)[:6]}, {len(must_r - recent)} missing {sorted(must_r - recent)[:6]}")
        return out

    def leftovers(self) -> list[str]:
        from sparksteward.storage import options_scope

        with options_scope(json.loads(self.options)):
            storage = self.storage()
            ids = storage.checkpoint_ids()
            referenced = set().union(set(), *(storage.read_metadata(c).physical_paths() for c in ids))
            fs = self.s3.filesystem()
            root = self.s3.url("nemesis-chk", CLUSTER, NAME)[len("s3://"):]
            everything = {p[len(root) + 1:] for p in fs.find(root)}
        allowed = {f"chk-{c}/_metadata" for c in ids} | {"_lease", "_drains", "_begun"}   # records of the state
        return sorted(p for p in everything if p not in allowed and p not in referenced)

    # --- the run -----------------------------------------------------------------------------------
    def run(self) -> None:
        self.note(self.replay)
        started = time.monotonic()
        self.start_app("first")
        try:
            for b in range(BATCHES):
                self.batch(b)
            self.note(f"all {BATCHES} batches committed; draining and stopping app {self.app}")
            self.stop_app("drain")
            gc = subprocess.run([sys.executable, "-m", "sparksteward", "checkpoints", "gc", self.chk, NAME,
                                 "--min-age", "0s", "--cluster-id", CLUSTER, "--conf",
                                 f"spark.steward.storage.options={self.options}"], cwd=REPO, capture_output=True,
                                text=True, timeout=300)
            self.note(f"final gc: exit {gc.returncode}: {(gc.stdout + gc.stderr).strip()[:300]}")
            if gc.returncode != 0:
                self.fail(f"the final gc failed (no application runs): {gc.stdout} {gc.stderr}")
            self.verify("the end", final=True)
            left = self.leftovers()
            if left:
                self.fail(f"after the final gc, {len(left)} file(s) under the state root that no checkpoint "
                          f"references: {left[:10]}")
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
            if self.proc is not None:
                for proc in _group(self.proc.pid):
                    _kill(proc)
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        if self.problems:
            self.fail(f"{len(self.problems)} problem(s), found at {self.failed_at}; counts: {counts}:\n  " +
                      "\n  ".join(self.problems[:60]))
        self.note(f"PASSED seed {self.seed}: {BATCHES} batches + drain, {self.app + 1} applications, "
                  f"{self.checked_rows} rows checked ({self.late_rows} emitted by a later batch than their own: "
                  f"deferred), {self.checked_checkpoints} checkpoint/savepoint restores "
                  f"checked; {counts}; {time.monotonic() - started:.0f} s")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _diff(got: dict, want: dict) -> str:
    keys = sorted(set(got) | set(want), key=str)
    diffs = [f"{k}: {got.get(k)} (model {want.get(k)})" for k in keys if got.get(k) != want.get(k)]
    return "; ".join(diffs[:8]) + (f" (+{len(diffs) - 8} more)" if len(diffs) > 8 else "")


def test_nemesis(tmp_path):
    seed = int(os.environ.get("STEWARD_SEED") or random.SystemRandom().randrange(1, 1_000_000))
    print(f"\nnemesis soak: STEWARD_SEED={seed}", flush=True)
    with local_s3() as s3:
        Nemesis(s3, tmp_path, seed).run()
