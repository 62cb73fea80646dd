"""A long, low-volume keyed stream on moto S3 stays small (decision 0021): 5,000 batches of a few keys at P=2.

What it drives: a real driver agent and a real executor agent (processes started as the shim starts
them, :class:`sparksteward.testing.agent.AgentProcess`), checkpoints on moto's S3 server on 127.0.0.1
(s3fs), FLIP-306 file merging on (``within``), ``num-retained`` 1. Each batch is what
``KeyedState.process`` does around a Spark micro-batch: ``state.begin``, then per subtask the very
code a Spark task runs (``keyed_tasks._run_subtask``: ``state.open``, the Arrow-form user function
on the subtask's RocksDB, the sync-phase snapshot, ``state.upload``), then ``state.commit`` (which
waits for the executor agent's async phase: WAL fold, compaction, merged upload, seal, ack). Only
Spark itself is left out (its micro-batch scheduling costs about a second a batch, too slow for 5,000
batches in minutes); the tasks run one after the other in this process, connected to the executor
agent as a Python worker is.

Every batch adds +1 to 4 of 40 keys. At batches 500, 1000, 2000, 3000, 4000 and 5000 it reports, over
the window since the previous mark: the most files of a subtask's handle, the largest ``_metadata``,
the most objects in the state's prefix (LIST every 10 batches), the p50 batch time, and the most
requests (GET, HEAD, LIST) a cold restore made: ``_metadata`` read and every subtask restored from S3
into a fresh scratch dir and a fresh file cache (``keyed_tasks.read_table``), counted by the S3
server's request log, on each of the window's last 20 batches (a fold cycle is 17). Every restore is
checked to give the exact counts. Maxima over a window, because files go up and down with the fold
cycle. Each figure must stay within 1.5x of its value at batch 500.

Run: ``python benchmarks/bench_long_stream.py``; ``BENCH_BATCHES=500`` for a short run (the marks
scale with it).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson
import pyarrow as pa
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.keyed_tasks import _run_subtask, read_table
from sparksteward.state.keygroups import key_group, subtask_for_key_group
from sparksteward.testing.agent import AgentProcess
from sparksteward.testing.s3 import local_s3
from sparksteward.wire import new_secret
from sparksteward.worker import executor_connection

BATCHES = int(os.environ.get("BENCH_BATCHES", "5000"))
MARKS = [500, 1000, 2000, 3000, 4000, 5000] if BATCHES >= 5000 else \
    sorted({max(1, BATCHES * k // 10) for k in (1, 2, 4, 6, 8, 10)})
P, M, KEYS, PER_BATCH = 2, 128, 40, 4
RESTORES_PER_WINDOW = 20
LIST_EVERY = 10
NAME = "long"
SCHEMA = pa.schema([("k", pa.string()), ("n", pa.int64())])
READ_OPS = ("GetObject", "HeadObject", "ListObjects")


def count(keys, table, state):
    """The Arrow form: add each row's ``v`` to its key's count; emit the new counts."""
    ks = keys.to_pylist()
    old = state.get_many(ks)
    add = collections.Counter()
    for k, v in zip(table.column("k").to_pylist(), table.column("v").to_pylist()):
        add[k] += v
    new = [(o or 0) + add[k] for k, o in zip(ks, old)]
    state.put_many(ks, new)
    return pa.table({"k": ks, "n": new}, schema=SCHEMA)


def delta(b: int) -> dict[str, int]:
    return {f"key{(b * 7 + i * 11) % KEYS}": 1 for i in range(PER_BATCH)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="bench-long-"))
    with local_s3() as s3:
        checkpoint_dir = s3.url("chk")
        cluster = f"long-{uuid.uuid4().hex[:6]}"
        secret, port = new_secret(), free_port()
        conf = {"spark.steward.state-dir": str(root / "state"), "spark.steward.cluster-id": cluster,
                "spark.steward.checkpoint.dir": checkpoint_dir,
                "spark.steward.storage.options": s3.storage_options()}
        with open(root / "agents.log", "wb") as agent_log:
            driver = AgentProcess("driver", conf, secret=secret, port=port, stderr=agent_log)
            executor = AgentProcess("executor", conf, secret=secret, rendezvous_dir=str(root / "exec"),
                                    driver_endpoint=f"127.0.0.1:{port}", stderr=agent_log)
            assert driver.ready and executor.ready, (driver.first, executor.first)
            try:
                rows = run(root, s3, driver, executor, checkpoint_dir, cluster)
            finally:
                for a in (executor, driver):
                    a.stop()
                    if a.proc.stdout:
                        a.proc.stdout.close()
    return report(rows)


def run(root: Path, s3, driver: AgentProcess, executor: AgentProcess, checkpoint_dir: str, cluster: str) -> list[dict]:
    executor_connection(str(root / "exec"))   # the task's connection, as a Python worker finds it
    dconn = driver.connect()
    dconn.request("state.register", name=NAME, checkpoint_dir=None, parallelism=P, max_parallelism=M,
                  key_type="string", num_retained=1)
    storage = CheckpointStorage.open(checkpoint_dir, NAME, cluster)
    prefix = storage.location.path()
    fs = storage.location.fs
    expected: collections.Counter[str] = collections.Counter()
    window = {"files": 0, "metadata": 0, "objects": 0, "requests": 0, "times": [], "restores": 0}
    rows = []
    started = time.monotonic()
    for cid in range(BATCHES):
        d = delta(cid)
        parts: list[dict[str, list]] = [{"k": [], "v": []} for _ in range(P)]
        for k, v in d.items():
            part = parts[subtask_for_key_group(M, P, key_group(k, M))]
            part["k"].append(k)
            part["v"].append(v)
        t0 = time.perf_counter()
        dconn.request("state.begin", name=NAME, checkpoint_id=cid)
        for i, part in enumerate(parts):
            batch = pa.RecordBatch.from_pydict(part, schema=pa.schema([("k", pa.string()), ("v", pa.int64())]))
            for _ in _run_subtask(iter([batch]), NAME, cid, i, "k", count, SCHEMA, "arrow", P, {}):
                pass
        dconn.request("state.commit", name=NAME, checkpoint_id=cid, wait=120)
        window["times"].append(time.perf_counter() - t0)
        expected.update(d)

        meta = storage.read_metadata(cid)
        window["files"] = max(window["files"], *(len(s.files) for s in meta.subtasks))
        window["metadata"] = max(window["metadata"], len(meta.to_bytes()))
        mark = next(m for m in MARKS if m > cid)
        if cid % LIST_EVERY == 0 or cid + 1 == mark:
            fs.invalidate_cache()
            window["objects"] = max(window["objects"], len(fs.find(prefix)))
        if cid + 1 > mark - RESTORES_PER_WINDOW:
            window["requests"] = max(window["requests"], cold_restore(s3, storage, checkpoint_dir, cluster, cid,
                                                                      expected))
            window["restores"] += 1
        if cid + 1 == mark:
            rows.append({"batch": mark, "files": window["files"], "metadata": window["metadata"],
                         "objects": window["objects"], "p50_ms": statistics.median(window["times"]) * 1000,
                         "requests": window["requests"], "restores": window["restores"],
                         "elapsed_s": time.monotonic() - started})
            print(f"batch {mark}: {rows[-1]}", file=sys.stderr, flush=True)
            window = {"files": 0, "metadata": 0, "objects": 0, "requests": 0, "times": [], "restores": 0}
    dconn.close()
    return rows


def cold_restore(s3, storage: CheckpointStorage, checkpoint_dir: str, cluster: str, cid: int,
                 expected: collections.Counter[str]) -> int:
    """Read checkpoint ``cid``'s ``_metadata`` and restore every subtask from S3 into a fresh scratch
    dir and cache; check the counts; return the GET, HEAD and LIST requests it made."""
    mark = s3.mark()
    fresh = CheckpointStorage(storage.location, NAME)
    meta = fresh.read_metadata(cid)
    table = read_table(checkpoint_dir, NAME, cluster, orjson.loads(meta.to_bytes()))
    got = {k: orjson.loads(v) for k, v in zip(table.column("key").to_pylist(), table.column("value").to_pylist())}
    assert got == dict(expected), f"checkpoint {cid} restored {got}, expected {dict(expected)}"
    return sum(1 for r in s3.requests_since(mark) if r.op in READ_OPS)


def report(rows: list[dict]) -> int:
    cols = [("batch", "batch"), ("files", "files/subtask (max)"), ("metadata", "_metadata B (max)"),
            ("objects", "objects (max)"), ("p50_ms", "batch p50 ms"), ("requests", "cold-restore GET+HEAD+LIST (max)")]
    print(f"{BATCHES} batches of {PER_BATCH} keys (of {KEYS}) at P={P}, moto S3, file merging within, "
          f"num-retained 1; maxima over the window since the previous mark")
    print(" | ".join(h for _, h in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.0f}" if isinstance(r[c], float) else str(r[c]) for c, _ in cols))
    base, failed = rows[0], []
    for r in rows[1:]:
        for c, h in cols[1:]:
            ratio = r[c] / base[c] if base[c] else 1.0
            if not 1 / 1.5 <= ratio <= 1.5:
                failed.append(f"{h} at batch {r['batch']}: {r[c]:.0f} is {ratio:.2f}x its value at batch {base['batch']}")
    print(f"total {rows[-1]['elapsed_s']:.0f} s")
    if failed:
        print("NOT FLAT:\n  " + "\n  ".join(failed))
        return 1
    print(f"flat: every figure within 1.5x of batch {base['batch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
