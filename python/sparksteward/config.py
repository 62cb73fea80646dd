"""The one registry of ``spark.steward.*`` options, and the frozen config parsed from it.

Every option has a key, a type, a default, a description and (optionally) deprecated keys. Values are
parsed once, by :meth:`StewardConfig.from_conf`, into a frozen :class:`StewardConfig`; a bad value raises
:class:`~sparksteward.errors.ConfigError` naming the key, the value and what is allowed.
``docs/configuration.md`` and ``conf/spark-defaults.conf.example`` are generated from :data:`OPTIONS`
(``python -m sparksteward.config``), and a test keeps them in sync.

Durations use Spark's syntax (``500ms``, ``30s``, ``5min``, ``1h``, ``30d``), so the JVM shim can read
the few keys it needs with ``SparkConf.getTimeAsMs``. Sizes use Spark's byte syntax (``64k``, ``256m``,
``10g``).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparksteward.errors import ConfigError
from sparksteward.ids import validate_id
from sparksteward.wire.messages import MAX_PARALLELISM

__all__ = ["LOG_LEVELS", "OPTIONS", "TESTED_SPARK_VERSIONS", "Option", "StewardConfig", "default_state_dir",
           "log_level", "parse_bytes", "parse_duration"]

log = logging.getLogger("sparksteward.config")

PREFIX = "spark.steward."

_DURATION_UNITS = {
    "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
    "d": 86400.0,
}
_SIZE_UNITS = {"b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30,
               "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}
#: Spark's (log4j's) level names and Python's, as :mod:`logging` levels (``spark.steward.log.level``)
LOG_LEVELS = {"ALL": logging.DEBUG, "TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
              "WARN": logging.WARNING, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
              "FATAL": logging.CRITICAL, "CRITICAL": logging.CRITICAL, "OFF": logging.CRITICAL + 10}
#: The pyspark major.minor versions CI tests, oldest first: the newest runs the whole suite (``make test``),
#: the others the compat set (``make compat``, which reads this line). ``configure()`` refuses any other
#: unless ``spark.steward.spark-version-check`` is false.
TESTED_SPARK_VERSIONS = ("4.0", "4.1", "4.2", "4.3")
_NUMBER_UNIT = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_duration(text: str) -> float:
    """Parse a Spark-style duration (``30min``, ``5s``, ``250ms``) into seconds.

    A bare number means seconds. Raises ``ValueError`` on anything else.
    """
    m = _NUMBER_UNIT.match(text)
    if not m or m.group(2).lower() not in _DURATION_UNITS | {"": 1.0}:
        raise ValueError(text)
    return float(m.group(1)) * _DURATION_UNITS.get(m.group(2).lower(), 1.0)


def parse_bytes(text: str) -> int:
    """Parse a Spark-style size (``64k``, ``256m``, ``10g``) into bytes; a bare number is bytes."""
    m = _NUMBER_UNIT.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS | {"": 1}:
        raise ValueError(text)
    return int(float(m.group(1)) * _SIZE_UNITS.get(m.group(2).lower(), 1))


def default_state_dir() -> Path:
    """The per-user directory for embedded local state: ``$XDG_STATE_HOME/spark-steward``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "spark-steward"


@dataclass(frozen=True, slots=True)
class Option:
    """One typed option: ``kind`` is ``str``, ``bool``, ``int``, ``duration``, ``bytes`` or ``url``."""

    key: str
    kind: str
    default: str
    description: str
    allowed: str = ""
    check: Callable[[Any], bool] | None = None
    deprecated_keys: tuple[str, ...] = ()

    @property
    def attr(self) -> str:
        return self.key[len(PREFIX):].replace(".", "_").replace("-", "_")

    def parse(self, raw: str) -> Any:
        """Parse and validate ``raw``; raise ConfigError naming key, value and what is allowed."""
        why = ""
        try:
            value = _PARSERS[self.kind](raw)
            ok = self.check is None or self.check(value)
        except _JsonValueError as exc:   # says what is wrong without the value
            ok, why = False, f" ({exc})"
        except (ValueError, TypeError):
            ok = False
        if not ok:
            shown = "this value" if self.kind == "json" else repr(raw)   # a JSON option may hold credentials
            raise ConfigError(
                f"{self.key}={shown} is not allowed{why}: expected {self.allowed or _KIND_HELP[self.kind]}. "
                f"Fix the value in --conf, spark-defaults.conf or SparkSession.builder.config()."
            )
        return value


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(raw)


class _JsonValueError(ValueError):
    """What is wrong with a JSON option, in words that never quote its value (it may hold credentials)."""


def _parse_json_object(raw: str) -> dict[str, Any]:
    import orjson

    try:
        value = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError as exc:
        raise _JsonValueError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _JsonValueError(f"a JSON {type(value).__name__}, not a JSON object")
    for name, inner in value.items():
        if not isinstance(inner, dict):
            raise _JsonValueError(f"the value of {name!r} is a JSON {type(inner).__name__}, not a JSON object")
    return value


def _parse_id(raw: str) -> str:
    return validate_id(raw.strip(), what="id") if raw.strip() else ""


_PARSERS: dict[str, Callable[[str], Any]] = {
    "str": lambda raw: raw.strip(),
    "id": _parse_id,
    "bool": _parse_bool,
    "int": lambda raw: int(raw.strip()),
    "float": lambda raw: float(raw.strip()),
    "duration": parse_duration,
    "bytes": parse_bytes,
    "url": lambda raw: raw.strip(),
    "json": lambda raw: _parse_json_object(raw),
}
_KIND_HELP = {
    "str": "a string",
    "id": "an id of letters, digits, '.', '_', '-' (at most 200 characters)",
    "bool": "true or false",
    "int": "an integer",
    "float": "a number such as 2.0",
    "duration": "a duration >= 0 such as 500ms, 30s, 5min, 1h or 30d",
    "bytes": "a size > 0 such as 64k, 256m or 10g",
    "url": "a path or fsspec URL such as /data/steward, file:///data/steward or s3://bucket/steward",
    "json": 'a JSON object of objects, such as {"s3": {"client_kwargs": {"endpoint_url": "http://minio:9000"}}}',
}


def _nonneg(v: float) -> bool:
    return v >= 0


def _positive(v: float) -> bool:
    return v > 0


OPTIONS: tuple[Option, ...] = (
    Option("spark.steward.cluster-id", "id", "default",
           "Namespace of job ids: (cluster id, job id) is globally unique. Job results and HA blobs "
           "live under this id, so two clusters sharing a storage path must use different ids.",
           check=bool),
    Option("spark.steward.state-dir", "url", "",
           "Directory for embedded local state (job results, HA blobs) when their paths are not set. "
           "Empty means the per-user $XDG_STATE_HOME/spark-steward (~/.local/state/spark-steward)."),
    Option("spark.steward.storage.options", "json", "{}",
           "fsspec storage options per protocol, applied to every storage path the agents, the driver, the tasks "
           "and the steward command open, e.g. "
           "an S3 endpoint. Credentials belong in the environment or an instance profile, not here: this "
           "value is not redacted."),
    Option("spark.steward.agent.python", "str", "",
           "Python executable for the agents. Empty means the Python PySpark uses "
           "(spark.pyspark.python, PYSPARK_PYTHON, then python3). It must have spark-steward installed."),
    Option("spark.steward.agent.start-timeout", "duration", "120s",
           "How long SparkContext start waits for the driver agent to report ready.",
           check=_positive),
    Option("spark.steward.agent.max-restarts", "int", "3",
           "How often the shim restarts an agent that died unexpectedly.", check=_nonneg,
           allowed="an integer >= 0"),
    Option("spark.steward.driver.port", "int", "0",
           "Port of the driver agent's socket (BlobServer and client API). 0 picks a free port.",
           check=lambda v: 0 <= v <= 65535, allowed="an integer from 0 to 65535"),
    Option("spark.steward.rpc.max-message-size", "bytes", "16m",
           "Largest control message a peer may send on an agent socket; larger ones are refused.",
           check=_positive),
    Option("spark.steward.rpc.timeout", "duration", "120s",
           "Socket timeout for requests between clients and agents. A request that asks the agent to "
           "wait (jobs.finish) gets its wait on top. After a timeout only idempotent requests "
           "(health, events, gets and listings) are sent again.", check=_positive),
    Option("spark.steward.rpc.handshake-timeout", "duration", "10s",
           "Hard deadline for a new connection to an agent to complete its mutual authentication; "
           "slower peers are disconnected.", check=_positive),
    Option("spark.steward.rpc.max-pending-handshakes", "int", "64",
           "How many connections may be authenticating at once. Unauthenticated connections never "
           "hold a request slot; when this bound is full, a new connection evicts the oldest pending "
           "one, so slow peers cannot lock clients out.", check=_positive, allowed="an integer > 0"),
    Option("spark.steward.rpc.max-connections", "int", "512",
           "How many authenticated connections an agent serves at once (a thread each). Executor "
           "agents keep a few idle connections to the driver agent for reuse, so the driver agent "
           "needs a few per executor; a connection over the bound waits for a free slot.",
           check=_positive, allowed="an integer > 0"),
    Option("spark.steward.agent.events.max-bytes", "bytes", "4m",
           "Size bound of each agent's buffer of recent Spark events (served by the events request); "
           "the oldest events are dropped first. The buffer also holds at most 2000 events.",
           check=_positive),
    Option("spark.steward.log.level", "str", "WARN",
           "Level of the agents' log lines on stderr, which Spark puts in the driver's and executors' logs. "
           "Unset, the agents follow Spark's level: spark.log.level at start (else WARN, Spark's console "
           "default, or the JVM's level when quieter), then every sc.setLogLevel (the shim tells each agent "
           "when its JVM's level changes; executors' JVMs change with spark.executor.syncLogLevel.enabled). Each agent also writes INFO and above (or this level, "
           "when lower) to its own log file, <state-dir>/logs/driver-agent.log or "
           "executor-agent-<executor id>.log, rotated at 10 MB with 5 old files kept; health() names it. "
           "The environment variable SPARK_STEWARD_LOG_LEVEL, when set, overrides this.",
           check=lambda v: v.upper() in LOG_LEVELS, allowed="TRACE, DEBUG, INFO, WARN, ERROR or OFF"),
    Option("spark.steward.config.strict", "bool", "false",
           "Refuse an unknown spark.steward.* key (a typo) with an error naming it and the closest known "
           "key, instead of warning about it once and ignoring it."),
    Option("spark.steward.spark-version-check", "bool", "true",
           "sparksteward.configure(builder) refuses a pyspark whose major.minor version is not one we test "
           f"({', '.join(TESTED_SPARK_VERSIONS)}), naming the version it found. Set this to false on the builder "
           "to run on another version anyway."),
    Option("spark.steward.metrics.interval", "duration", "5s",
           "How often the driver agent checks its numbers (per keyed state: merged physical and logical "
           "files and bytes, space amplification, no-reuse files, and the latest completed checkpoint's "
           "report as state.<name>.checkpoint.*) and, when they changed, hands them to "
           "the shim, which reports them as gauges of Spark's metrics system under "
           "plugin.sparksteward.shim.StewardPlugin. 0 turns the reporting off (health still has them).",
           check=_nonneg),
    Option("spark.steward.blob.storage-dir", "url", "",
           "Local directory of the BlobServer's store. Empty means a fresh directory under the "
           "state dir, deleted when the driver agent exits."),
    Option("spark.steward.blob.ha.storage-path", "url", "",
           "fsspec URL of the HA blob store (file://, s3://, ...). Empty means <state-dir>/ha; "
           "'none' disables the HA store (no recovery of blobs after a driver restart)."),
    Option("spark.steward.blob.retention.interval", "duration", "30min",
           "Staged cleanup period: an unreferenced blob is deleted between one and two intervals "
           "after its last release.", check=_nonneg),
    Option("spark.steward.blob.cache.max-size", "bytes", "10g",
           "Size limit of each executor's blob cache; unreferenced blobs are evicted LRU first.",
           check=_positive),
    Option("spark.steward.blob.max-size", "bytes", "16g",
           "Largest blob a peer may upload or announce.", check=_positive),
    Option("spark.steward.blob.fetch.retries", "int", "5",
           "How often a BlobCache retries a failed download from the BlobServer.", check=_nonneg,
           allowed="an integer >= 0"),
    Option("spark.steward.jrs.storage-path", "url", "",
           "fsspec URL of the JobResultStore. Empty means <state-dir>/job-results; 'memory' keeps "
           "results in the driver agent only."),
    Option("spark.steward.jrs.delete-on-commit", "bool", "false",
           "Delete a job's result when its cleanup commits, instead of keeping it as <job>.json. "
           "Keeping it is what protects completed jobs from being re-run."),
    Option("spark.steward.jrs.retention", "duration", "30d",
           "Committed job results older than this are pruned when the driver agent starts. "
           "0 keeps them forever.", check=_nonneg),
    Option("spark.steward.job.id", "id", "",
           "Stable id of the application job. Empty means the Spark application id."),
    Option("spark.steward.job.force-rerun", "bool", "false",
           "Run the application even though its job id already has a stored result."),
    Option("spark.steward.cleanup.initial-backoff", "duration", "1s",
           "First delay before retrying a failed cleanup step.", check=_positive),
    Option("spark.steward.cleanup.max-backoff", "duration", "1h",
           "Largest delay between retries of a cleanup step.", check=_positive),
    Option("spark.steward.cleanup.max-attempts", "int", "0",
           "Attempts per cleanup step before giving up and leaving the result dirty; 0 = unlimited.",
           check=_nonneg, allowed="an integer >= 0 (0 = unlimited)"),
    Option("spark.steward.cleanup.shutdown-timeout", "duration", "30s",
           "How long the driver agent waits for cleanup at application end before leaving the "
           "result dirty for the next driver to finish.", check=_nonneg),
)

# --- keyed state and checkpoints (issue 8) ------------------------------------------------------
OPTIONS = OPTIONS + (
    Option("spark.steward.checkpoint.dir", "url", "",
           "fsspec URL under which keyed-state checkpoints live, as <dir>/<cluster-id>/<state>/ "
           "(chk-<N>/_metadata, shared/). Empty means <state-dir>/checkpoints. A keyed_state's "
           "checkpoint_dir argument overrides it."),
    Option("spark.steward.checkpoint.num-retained", "int", "1",
           "Completed checkpoints kept per state. The base of the last completed checkpoint is also "
           "kept until the next one begins, so a re-run batch can restore it.",
           check=lambda v: v >= 1, allowed="an integer >= 1"),
    Option("spark.steward.checkpoint.claim-mode", "str", "no_claim",
           "Default claim_mode of keyed_state(restore_from=...): no_claim duplicates the checkpoint's "
           "files into the new state (S3 CopyObject, hard links: no bytes through the executors); "
           "claim takes them over in place without copying, and deletes them once later checkpoints "
           "subsume them, so the source state must not be used again.",
           check=lambda v: v in ("no_claim", "claim"), allowed="no_claim or claim"),
    Option("spark.steward.checkpoint.commit-timeout", "duration", "10min",
           "How long commit(batch) waits for every subtask to acknowledge its upload before the "
           "checkpoint is aborted.", check=_positive),
    Option("spark.steward.checkpoint.upload-threads", "int", "4",
           "Threads per executor agent that upload checkpoint files (the async phase).",
           check=lambda v: 1 <= v <= 64, allowed="an integer from 1 to 64"),
    Option("spark.steward.checkpoint.agent-timeout", "duration", "30s",
           "How long the driver agent waits for an executor agent that holds files of a pending "
           "checkpoint (merged files not sealed yet) or opened one of its subtasks that has not acked "
           "(its task or upload still running) to answer before commit aborts the checkpoint (its "
           "executor was lost). Agents poll every second while they hold such files or subtasks (four times "
           "within a timeout shorter than 4 s).",
           check=_positive),
    Option("spark.steward.checkpoint.lease-timeout", "duration", "60s",
           "One state has one writer: the driver agent holds a lease on each state root it writes and "
           "renews it every third of this time. Another application may take the state over only when "
           "the holder released the lease, died on the same host, or left it unrenewed for this long "
           "(timed on the taker's own clock); a holder that could not renew for 80% of it stops "
           "writing.", check=_positive),
    Option("spark.steward.checkpoint.orphan-grace", "duration", "10min",
           "Files of a state that no retained checkpoint references (a crashed upload, an abandoned "
           "attempt) are deleted by the state's writer once they are this old, at its start and "
           "whenever nothing is pending. Files are never swept without the writer lease."),
    # FLIP-306 file merging (issue 9); Flink's execution.checkpointing.file-merging.* semantics
    Option("spark.steward.checkpoint.file-merging.enabled", "bool", "true",
           "Pack the small files of a checkpoint (MANIFEST, CURRENT, OPTIONS, SSTs below max-file-size) "
           "of all the subtasks that ran on one executor into a few physical files under merged/, so a "
           "checkpoint writes about one object per executor instead of several per partition. On by "
           "default: see docs/decisions/0010 for the measurement. A keyed_state's file_merging argument "
           "overrides it per state."),
    Option("spark.steward.checkpoint.file-merging.max-file-size", "bytes", "32m",
           "Size at which a merged physical file is closed and the next one begun. Files at least this "
           "large are uploaded whole under shared/.", check=lambda v: v >= 64 << 10,
           allowed="a size of at least 64k"),
    Option("spark.steward.checkpoint.file-merging.mode", "str", "within",
           "within: one checkpoint's segments per physical file (every store). across: an executor "
           "keeps appending to the same physical file across checkpoints, in place (local file systems "
           "only; refused on object stores).",
           check=lambda v: v in ("within", "across"), allowed="within or across"),
    Option("spark.steward.checkpoint.file-merging.max-space-amplification", "float", "2.0",
           "When the physical bytes of merged files exceed the live logical bytes of the retained "
           "checkpoints times this, the most wasteful files are marked no-reuse and the next checkpoint "
           "writes their live segments again (the compaction). Below 1 turns space control off.",
           check=_nonneg, allowed="a number >= 0 (below 1 turns it off)"),
    # FLIP-76 unaligned checkpoints (issue 10); per state: keyed_state(alignment=..., ...)
    Option("spark.steward.checkpoint.unaligned.alignment", "str", "aligned",
           "aligned: a batch ends when its slowest subtask ends. unaligned: a subtask still processing once "
           "aligned-checkpoint-timeout has passed (counted from the start of the batch's state stage) stops "
           "at a buffer boundary and defers the rest of its input into the checkpoint (channel state), which "
           "the next batch replays first. unaligned_max_inflight: the same while the deferred bytes fit in "
           "max-inflight-bytes, else the subtask finishes aligned.",
           check=lambda v: v in ("aligned", "unaligned", "unaligned_max_inflight"),
           allowed="aligned, unaligned or unaligned_max_inflight"),
    Option("spark.steward.checkpoint.unaligned.aligned-checkpoint-timeout", "duration", "1s",
           "With an unaligned alignment: how long after the start of a batch's state stage subtasks may "
           "process before deferring the rest of their input; 0 means unaligned from the start (each "
           "subtask still processes at least one buffer).", check=_nonneg),
    Option("spark.steward.checkpoint.unaligned.max-inflight-bytes", "bytes", "64m",
           "unaligned_max_inflight: the most channel state (deferred input) one subtask may write per "
           "checkpoint. It must hold at least one input buffer.", check=_positive),
    Option("spark.steward.state.max-parallelism", "int", "128",
           "Default number of key groups of a keyed state (its largest possible parallelism). It "
           "cannot change once a state has a checkpoint.",
           check=lambda v: 1 <= v <= MAX_PARALLELISM, allowed=f"an integer from 1 to {MAX_PARALLELISM}"),
    Option("spark.steward.state.local-dir", "url", "",
           "Local directory for the RocksDB working dirs, snapshots and the checkpoint file cache of "
           "each executor agent. Empty means a fresh directory under the executor's local dirs, "
           "deleted when the agent exits."),
    Option("spark.steward.state.wal-flush-size", "bytes", "256k",
           "A subtask's snapshot keeps the batch's writes in RocksDB's WAL instead of flushing them (the "
           "sync phase writes and fsyncs nothing); the executor agent folds a snapshot with more WAL "
           "than this into an SST before uploading it (the async phase). Larger: fewer, larger SSTs, "
           "and more WAL to upload and to replay at each open.", check=_positive),
    Option("spark.steward.state.task-flush-size", "bytes", "64k",
           "A task whose subtask DB holds more WAL than this at its sync phase flushes the memtable into an "
           "SST itself instead of leaving the WAL for the executor agent to fold: the memtable holds those "
           "writes already, so the flush costs a fraction of the agent's replay and flush, and the next open "
           "replays nothing. It adds a flush to that sync phase (about 8 ms for 16k entries here). A bulk "
           "put without a TTL of four times this many raw bytes skips the memtable and the WAL: the task "
           "writes it as an SST and ingests it (decision 0023). 0 turns both off (decision 0022).",
           check=_nonneg),
    Option("spark.steward.state.wal-flush-files", "int", "16",
           "The executor agent also folds a snapshot's WAL into an SST once it spans more than this many "
           "WAL files, however small (each open of a subtask adds one or two, so this bounds the WAL's age "
           "in batches too). A low-volume stream then never piles up WAL files: files per subtask, the "
           "size of _metadata, retained merged files and the requests of a cold restore stay bounded "
           "(decision 0021). Larger: fewer folds, more WAL files to replay and restore.",
           check=_positive, allowed="an integer > 0"),
    Option("spark.steward.state.compaction.max-space-amplification", "float", "1.25",
           "A subtask's RocksDB lives for one batch, so its own compactions rarely finish and the garbage of "
           "TTL deletes and overwrites piles up in the checkpoints. When a snapshot's data (SSTs and WAL, "
           "after the WAL fold) is more than this times its last sorted run (its deepest level) and at "
           "least a tenth of the entries above that run are deletions, the executor agent uploads a fully "
           "compacted copy instead (decision 0019). Lower: smaller checkpoints, the whole state rewritten "
           "and uploaded more often. Below 1 turns it off.",
           check=_nonneg, allowed="a number >= 0 (below 1 turns it off)"),
    Option("spark.steward.state.compaction.min-size", "bytes", "1m",
           "A subtask's snapshot with less data (SSTs and WAL) than this is never compacted before its "
           "upload (see compaction.max-space-amplification), unless its SSTs are many (see "
           "compaction.max-files); a snapshot this small that the agent just folded is compacted into one "
           "SST (decision 0021).", check=_positive),
    Option("spark.steward.state.compaction.max-files", "int", "8",
           "When a snapshot has more than this many SSTs above its last sorted run (the L0 SSTs that WAL "
           "folds add, since a subtask's RocksDB rarely finishes a compaction of its own), the executor "
           "agent uploads a fully compacted copy instead, whatever its size or garbage, so the files of a "
           "subtask stay bounded however long the stream runs (decision 0021).",
           check=_positive, allowed="an integer > 0"),
    Option("spark.steward.state.open-timeout", "duration", "6h",
           "How long an executor agent keeps a subtask that a task opened and neither uploaded nor released "
           "(the task was killed) before it deletes its working dir. Such a subtask is released sooner once "
           "its checkpoint completes or is aborted at the driver, or when the same subtask of a newer "
           "checkpoint opens on that executor; this is the backstop for a checkpoint left pending (a query "
           "stopped mid-batch). Keep it above the longest a task of a batch can run: a task still running "
           "past it has its upload refused.", check=_positive),
    Option("spark.steward.state.cache.max-size", "bytes", "10g",
           "Size limit of each executor's cache of checkpoint files (restores hard-link from it).",
           check=_positive),
    Option("spark.steward.state.ttl.sweep-max-entries", "int", "100000",
           "The most expired entries (expiry index keys) one subtask removes in a batch, after the state "
           "function ran; the rest are removed by the next batches. An expired entry is never returned "
           "either way; this bounds the time a batch spends on removal.", check=_positive),
    Option("spark.steward.state.keep-open", "int", "8",
           "How many subtask DBs a Python worker keeps open between batches (decision 0026). A task whose "
           "subtask's DB its worker still holds, and whose base checkpoint is exactly what that DB holds, goes "
           "on with it instead of opening the restored copy; its snapshot then flushes the memtable instead of "
           "closing the DB. Each held DB keeps its memtable and open files. 0 opens and closes each batch's DB "
           "(the behaviour before). Tasks read it from the session's conf.", check=_nonneg),
    Option("spark.steward.state.spill-threshold", "bytes", "64m",
           "The per-key (pandas) form calls its function once per key per batch with all of the key's rows, "
           "so each task reads its subtask's whole input first: this much of it in memory, the rest spilled "
           "to sorted Arrow files in the subtask's working dir and merged back one key at a time (one key's "
           "rows must fit in memory). Tasks read it from the session's conf, so spark.conf.set applies to "
           "the next batch.", check=_positive),
    Option("spark.steward.state.chunk-rows", "int", "1000",
           "The rows of one chunk that a form=\"chunks\" function gets (fn(key, chunks, state), a key's rows as "
           "an iterator of DataFrames). On an unaligned state the cut checks its deadline between two chunks, "
           "so a hot key defers the rest of its rows to the next batch (decision 0028): smaller chunks keep the "
           "cut closer to the timeout, each chunk costs a DataFrame slice. Tasks read it from the session's "
           "conf.", check=_positive, allowed="an integer > 0"),
)

_BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}
_BY_DEPRECATED: dict[str, Option] = {k: o for o in OPTIONS for k in o.deprecated_keys}
_SUFFIXES = [k[len(PREFIX):] for k in _BY_KEY]  # compared without the prefix every key shares
_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(key: str, message: str, *args: Any) -> None:
    """Log a warning about ``key`` the first time this process sees it."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)


def parse_setting(key: str, raw: str | None) -> Any:
    """One ``spark.steward.*`` setting's value from its text ``raw`` (None: its default), parsed and
    checked as :class:`StewardConfig` does; a bad value raises :class:`ConfigError` naming the key."""
    opt = _BY_KEY[key]
    return opt.parse(opt.default if raw is None else raw)


def log_level(name: str) -> int:
    """The :mod:`logging` level of a Spark (log4j) level name such as ``WARN``; ``ValueError`` if unknown."""
    try:
        return LOG_LEVELS[name.strip().upper()]
    except KeyError:
        raise ValueError(name) from None


@dataclass(frozen=True)
class StewardConfig:
    """Frozen, parsed ``spark.steward.*`` settings; one attribute per option of :data:`OPTIONS`.

    ``spark.steward.blob.retention.interval`` becomes ``blob_retention_interval``; durations are in
    seconds, sizes in bytes. The defaults are the registry's defaults, parsed (a test keeps the fields
    and :data:`OPTIONS` equal). Build it with :meth:`from_conf`.
    """

    extra: Mapping[str, str] = field(default_factory=dict)
    """Non-steward Spark settings the agents were given (``spark.app.name``, ``spark.master``, ...)."""

    cluster_id: str = "default"
    state_dir: str = ""
    storage_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    agent_python: str = ""
    agent_start_timeout: float = 120.0
    agent_max_restarts: int = 3
    driver_port: int = 0
    rpc_max_message_size: int = 16 << 20
    rpc_timeout: float = 120.0
    rpc_handshake_timeout: float = 10.0
    rpc_max_pending_handshakes: int = 64
    rpc_max_connections: int = 512
    agent_events_max_bytes: int = 4 << 20
    log_level: str = "WARN"
    config_strict: bool = False
    spark_version_check: bool = True
    metrics_interval: float = 5.0
    blob_storage_dir: str = ""
    blob_ha_storage_path: str = ""
    blob_retention_interval: float = 1800.0
    blob_cache_max_size: int = 10 << 30
    blob_max_size: int = 16 << 30
    blob_fetch_retries: int = 5
    jrs_storage_path: str = ""
    jrs_delete_on_commit: bool = False
    jrs_retention: float = 30 * 86400.0
    job_id: str = ""
    job_force_rerun: bool = False
    cleanup_initial_backoff: float = 1.0
    cleanup_max_backoff: float = 3600.0
    cleanup_max_attempts: int = 0
    cleanup_shutdown_timeout: float = 30.0
    checkpoint_dir: str = ""
    checkpoint_num_retained: int = 1
    checkpoint_claim_mode: str = "no_claim"
    checkpoint_commit_timeout: float = 600.0
    checkpoint_upload_threads: int = 4
    checkpoint_agent_timeout: float = 30.0
    checkpoint_lease_timeout: float = 60.0
    checkpoint_orphan_grace: float = 600.0
    checkpoint_file_merging_enabled: bool = True
    checkpoint_file_merging_max_file_size: int = 32 << 20
    checkpoint_file_merging_mode: str = "within"
    checkpoint_file_merging_max_space_amplification: float = 2.0
    checkpoint_unaligned_alignment: str = "aligned"
    checkpoint_unaligned_aligned_checkpoint_timeout: float = 1.0
    checkpoint_unaligned_max_inflight_bytes: int = 64 << 20
    state_max_parallelism: int = 128
    state_local_dir: str = ""
    state_wal_flush_size: int = 256 << 10
    state_task_flush_size: int = 64 << 10
    state_wal_flush_files: int = 16
    state_compaction_max_space_amplification: float = 1.25
    state_compaction_min_size: int = 1 << 20
    state_compaction_max_files: int = 8
    state_open_timeout: float = 6 * 3600.0
    state_cache_max_size: int = 10 << 30
    state_ttl_sweep_max_entries: int = 100_000
    state_keep_open: int = 8
    state_spill_threshold: int = 64 << 20
    state_chunk_rows: int = 1000

    @classmethod
    def from_conf(cls, conf: Mapping[str, str] | None = None, *, warn: bool = True) -> StewardConfig:
        """Parse a SparkConf-like mapping.

        An unknown ``spark.steward.*`` key is warned about once per process, or refused with a
        ConfigError when ``spark.steward.config.strict`` is true; a deprecated key is warned about once
        and used. ``warn=False`` keeps quiet about both, for processes that parse a conf the driver
        agent already checked (executor agents, the client in the user's driver).
        """
        conf = dict(conf or {})
        values: dict[str, Any] = {}
        strict_opt = _BY_KEY["spark.steward.config.strict"]
        strict = strict_opt.parse(str(conf.get(strict_opt.key, strict_opt.default)))
        for key, raw in list(conf.items()):
            if not key.startswith(PREFIX) or key in _BY_KEY:
                continue
            if key in _BY_DEPRECATED:
                new = _BY_DEPRECATED[key].key
                if warn:
                    _warn_once(key, "%s is deprecated; use %s", key, new)
                conf.setdefault(new, raw)
                continue
            hint = [PREFIX + k for k in difflib.get_close_matches(key[len(PREFIX):], _SUFFIXES, n=1)]
            if strict:
                closest = f"did you mean {hint[0]}?" if hint else "no known key is close (docs/configuration.md)."
                raise ConfigError(
                    f"unknown setting {key}={raw!r}: {closest} spark.steward.config.strict=true refuses keys it "
                    f"does not know; fix the key in --conf, spark-defaults.conf or SparkSession.builder.config(), "
                    f"or remove it.")
            if warn:
                _warn_once(key, "unknown setting %s ignored%s", key, f" (did you mean {hint[0]}?)" if hint else "")
        for opt in OPTIONS:
            values[opt.attr] = opt.parse(str(conf.get(opt.key, opt.default)))
        extra = {k: v for k, v in conf.items() if not k.startswith(PREFIX)}
        return cls(extra=extra, **values)

    @property
    def effective_state_dir(self) -> str:
        return self.state_dir or str(default_state_dir())

    @property
    def effective_ha_path(self) -> str | None:
        path = self.blob_ha_storage_path
        if path.lower() == "none":
            return None
        return path or os.path.join(self.effective_state_dir, "ha")

    @property
    def effective_jrs_path(self) -> str:
        return self.jrs_storage_path or os.path.join(self.effective_state_dir, "job-results")


def render_markdown() -> str:
    """The docs table, generated from :data:`OPTIONS`."""
    lines = [
        "# Configuration",
        "",
        "Generated from `sparksteward.config.OPTIONS` by `python -m sparksteward.config`; do not edit.",
        "Set these like any Spark setting: `--conf`, `spark-defaults.conf` or `SparkSession.builder`.",
        "With none set, everything runs on embedded local defaults under the per-user state dir.",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    for o in OPTIONS:
        default = f"`{o.default}`" if o.default else "(empty)"
        lines.append(f"| `{o.key}` | {default} | {o.description} Allowed: {o.allowed or _KIND_HELP[o.kind]}. |")
    return "\n".join(lines) + "\n"


def render_defaults_conf() -> str:
    """``conf/spark-defaults.conf.example``, generated from :data:`OPTIONS`."""
    out = [
        "# spark-steward settings with their defaults. Generated by `python -m sparksteward.config`.",
        "# Copy what you need into $SPARK_HOME/conf/spark-defaults.conf and uncomment it.",
        "#",
        "# spark.plugins                 sparksteward.shim.StewardPlugin",
        "# spark.jars                    <output of `steward jar`>",
        "",
    ]
    for o in OPTIONS:
        out.append("# " + o.description)
        out.append(f"# {o.key:<45} {o.default}")
        out.append("")
    return "\n".join(out)


def write_generated(root: Path) -> None:
    """Write the generated docs table and example conf under the project ``root``."""
    (root / "docs" / "configuration.md").write_text(render_markdown())
    (root / "conf" / "spark-defaults.conf.example").write_text(render_defaults_conf())


if __name__ == "__main__":  # pragma: no cover - maintenance entry point
    write_generated(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2])
