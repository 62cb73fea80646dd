"""``Steward``: the user's handle on the driver agent, from the Python driver process.

``Steward.get(spark)`` reads the driver agent's endpoint and the application secret from the
SparkConf (the shim put them there during SparkContext start) and returns a client. Requests use one
authenticated connection per thread, so a ``Steward`` may be shared across threads.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from typing import Any

from sparksteward.blob.broadcast import BroadcastHandle
from sparksteward.blob.client import BlobClient
from sparksteward.blob.messages import BlobAddLibraryRequest, BlobOpenFileRequest
from sparksteward.blob.payload import write_payload
from sparksteward.errors import (
    AgentUnavailableError,
    ConfigError,
    InvalidIdError,
    InvalidRequestError,
    JobAlreadyCompleted,
    StewardError,
)
from sparksteward.jobscope import JobResults, JobScope
from sparksteward.libraries import library_kind
from sparksteward.shim_protocol import PLUGIN_CLASS
from sparksteward.wire import Connection
from sparksteward.wire.messages import read_reply

__all__ = ["JobResults", "Steward", "repeatable"]

_CONF_PREFIX = f"spark.plugins.internal.conf.{PLUGIN_CLASS}."


#: The agents' own ops (not in the op registry) that change nothing, so the client may send them again
_REPEATABLE_AGENT_OPS = frozenset({"health", "events"})


def repeatable(op: str) -> bool:
    """Whether the client may send ``op`` again after a timeout or a dropped connection: it changes
    nothing, or nothing a repeat could change twice (the registry's ``repeatable``,
    :data:`~sparksteward.wire.messages.OPS`). Every other op (jobs.begin, jobs.finish, blob.put,
    blob.acquire, state.commit, ...) is sent at most once: its outcome after a lost reply is unknown."""
    if op in _REPEATABLE_AGENT_OPS:
        return True
    from sparksteward.ops import all_ops  # only after a failure: the message modules, loaded once

    known = all_ops().get(op)
    return known is not None and known.repeatable


def _client_settings(conf: Any) -> dict[str, Any]:
    """``timeout``, ``max_message`` and ``default_wait`` for a client, from a SparkConf's
    ``spark.steward.rpc.timeout``, ``rpc.max-message-size`` and ``cleanup.shutdown-timeout``."""
    from sparksteward.config import StewardConfig

    cfg = StewardConfig.from_conf({k: v for k, v in conf.getAll() if k.startswith("spark.steward.")},
                                  warn=False)  # the driver agent warned about unknown keys
    return {"timeout": cfg.rpc_timeout, "max_message": cfg.rpc_max_message_size,
            "default_wait": cfg.cleanup_shutdown_timeout}


class Steward:
    """A client of the driver agent. Use :meth:`get` rather than the constructor.

    ``timeout`` is the socket timeout of a request (``spark.steward.rpc.timeout``); a request with a
    ``wait`` gets the wait on top (``default_wait`` when the wait is null). After a timeout or a
    dropped connection only :func:`repeatable` ops are sent again, once.
    """

    _instances: dict[str, Steward] = {}
    _instances_lock = threading.Lock()

    def __init__(self, endpoint: str, secret: str, *, spark: Any = None, timeout: float = 120.0,
                 max_message: int = 16 << 20, default_wait: float = 30.0) -> None:
        self.endpoint = endpoint
        self._secret = secret
        self._timeout = timeout
        self._max_message = max_message
        self._default_wait = default_wait
        self._local = threading.local()
        self._conns: weakref.WeakSet[Connection] = weakref.WeakSet()
        self.spark = spark
        self.remote = False   # a Spark Connect client (set by get): no JVM here
        self._closed = False

    @classmethod
    def get(cls, spark: Any = None) -> Steward:
        """Return the client for ``spark``'s application (default: the active SparkSession).

        Raises
        ------
        AgentUnavailableError
            If the plugin is not enabled in that session.
        """
        if spark is None:
            from pyspark.sql import SparkSession

            spark = SparkSession.getActiveSession()
            if spark is None:
                raise AgentUnavailableError("no active SparkSession: pass one to Steward.get(spark)")
        from sparksteward.connect import ConnectConf, is_connect

        remote = is_connect(spark)   # a Spark Connect client: the server's conf over Connect (decision 0030)
        conf = ConnectConf(spark) if remote else spark.sparkContext.getConf()
        app_id = str(conf.get("spark.app.id"))
        with cls._instances_lock:
            inst = cls._instances.get(app_id)
            if inst is not None and not inst._closed:
                return inst
            endpoint, secret = conf.get(_CONF_PREFIX + "endpoint"), conf.get(_CONF_PREFIX + "secret")
            if remote and endpoint:   # Connect hides the secret's key from clients: ask an executor
                from sparksteward.connect import application_secret

                secret = application_secret(spark)
            if (not endpoint or not secret) and remote:
                raise AgentUnavailableError(
                    f"spark-steward is not enabled in the Spark Connect server of application {app_id}: start the "
                    f"server with --conf spark.plugins={PLUGIN_CLASS} --jars \"$(steward jar)\" --conf "
                    f"spark.python.daemon.module=sparksteward.daemon (docs/decisions/0030-spark-connect-clients.md)")
            if not endpoint or not secret:
                raise AgentUnavailableError(
                    f"spark-steward is not enabled in application {app_id}: build the session with "
                    f"sparksteward.configure(SparkSession.builder) or pass "
                    f"--conf spark.plugins={PLUGIN_CLASS} --jars \"$(steward jar)\"")
            inst = cls(endpoint, secret, spark=spark, **_client_settings(conf))
            inst.remote = remote
            cls._instances[app_id] = inst
            if not remote and hasattr(spark, "dataSource"):   # spark.read.format("steward-state") (issue 39)
                from sparksteward.state_source import register

                register(spark)
            return inst

    # --- transport ---------------------------------------------------------------------------
    def _conn(self) -> Connection:
        if self._closed:
            raise AgentUnavailableError("this Steward client is closed")
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.is_stale():  # broken, or closed by the agent while idle
            self._drop()
            conn = None
        if conn is None:
            conn = Connection.connect(self.endpoint, self._secret, timeout=self._timeout,
                                      max_message=self._max_message)
            self._local.conn = conn
            self._conns.add(conn)
        return conn

    def _op_timeout(self, op: str, fields: dict[str, Any]) -> float:
        if "wait" not in fields:
            return self._timeout
        wait = fields["wait"]
        if wait is None:
            wait = self._default_wait
        if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 < wait < float("inf"):
            return self._timeout + float(wait)
        return self._timeout

    def ask(self, request: Any) -> Any:
        """Send a typed request (a :class:`~sparksteward.wire.messages.Message`) to the driver agent and
        return its op's typed reply; retries as :meth:`request` does."""
        return read_reply(request, self.request(request.OP, **request.to_wire()))

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request to the driver agent and return its reply.

        A stale connection is replaced before sending. After a timeout or a connection lost
        mid-request, a :func:`repeatable` op is sent once more on a new connection; any
        other op raises :class:`AgentUnavailableError` saying it was not retried.
        """
        timeout = self._op_timeout(op, fields)
        for attempt in (1, 2):
            conn = self._conn()
            try:
                return conn.call(op, fields, timeout)
            except (OSError, StewardError) as exc:
                if not conn.broken:
                    raise  # the agent's answer (an error reply): the connection is fine
                self._drop()
                if not repeatable(op):
                    raise AgentUnavailableError(
                        f"{op} to the agent at {self.endpoint} got no reply ({type(exc).__name__}: {exc}); it "
                        f"was not retried because {op} is not idempotent, so the agent may or may not have "
                        f"applied it. Check the state (e.g. st.job_results.get) before trying again") from exc
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _pages(self, op: str, items: str, cursor_field: str, **fields: Any) -> list[Any]:
        """Every item of a paged list op, following its ``next`` cursor."""
        out: list[Any] = []
        cursor = None
        while True:
            reply = self.request(op, **fields, **({cursor_field: cursor} if cursor is not None else {}))
            out.extend(reply[items])
            cursor = reply.get("next")
            if cursor is None:
                return out

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # --- API ---------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """The driver agent's state, uptime and counts of the Spark events it has seen."""
        return self.request("health")

    def events(self, type: str | None = None) -> list[dict[str, Any]]:  # protocol name
        """Recent Spark events the driver agent received (newest last), optionally of one type."""
        return self._pages("events", "events", "after", type=type)

    # --- jobs (FLIP-194) ------------------------------------------------------------------------
    def job(self, job_id: str, *, force: bool = False, wait: float | None = None) -> JobScope:
        """A scoped job: ``with st.job("ingest-2026-11-22") as job: ...``.

        Raises :class:`JobAlreadyCompleted` on entry if the store already holds a result for
        ``job_id`` (unless ``force``). On exit the result is written, the job's cleanup runs (its
        registered paths and its blob directory), and the result is committed; ``wait`` bounds how
        long the exit waits for that commit (default ``spark.steward.cleanup.shutdown-timeout``).
        """
        return JobScope(self, job_id, force=force, wait=wait)

    def run_once(self, job_id: str, fn: Callable[[], Any], *, force: bool = False) -> Any:
        """Run ``fn()`` as job ``job_id`` the first time; afterwards return its stored payload.

        A stored result that is not SUCCEEDED raises :class:`JobAlreadyCompleted`; nothing is re-run
        silently (pass ``force=True`` to re-run).
        """
        try:
            with self.job(job_id, force=force) as scope:
                value = fn()
                scope.set_result(value)
            return value
        except JobAlreadyCompleted as exc:
            if exc.entry is not None and exc.entry.status.value == "SUCCEEDED":
                return exc.entry.payload
            raise

    # --- blobs (FLIP-19) -----------------------------------------------------------------------
    @property
    def blobs(self) -> BlobClient:
        """Low-level put/get/delete of permanent and transient blobs, with a job id."""
        return BlobClient(self._conn, ask=self.ask)

    def current_job(self) -> str:
        """The job new blobs belong to: the innermost ``st.job`` scope of this thread, else the
        application job."""
        scope = getattr(self._local, "scope", None)
        if scope:
            return scope[-1]
        if getattr(self, "_app_job", None) is None:
            self._app_job = self.health()["app_job_id"]
        return self._app_job

    def current_scope(self) -> Any:
        """The innermost ``st.job`` scope of this thread (a :class:`~sparksteward.jobscope.JobScope`),
        or None outside any scope."""
        objects = getattr(self._local, "scope_objects", None)
        return objects[-1] if objects else None

    def broadcast(self, obj: Any) -> BroadcastHandle:
        """Store ``obj`` once (content-addressed) and return a small handle whose ``.value`` works in
        tasks and on the driver; numpy/arrow buffers are zero-copy in workers."""
        job = self.current_job()
        blobs = self.blobs
        # same host: written straight into the server's incoming dir; a Connect client streams it
        fd, path = tempfile.mkstemp(prefix="steward-broadcast-") if self.remote else blobs.staging_file()
        try:
            with os.fdopen(fd, "wb") as f:
                size = write_payload(obj, f)
            key = blobs.put_file(path, job) if self.remote else blobs.put_path(path, job, move=True)
        finally:
            if os.path.exists(path):
                os.unlink(path)
        blobs.acquire(key, job)
        return BroadcastHandle(str(key), job, size, value=obj, local=True,
                               release=functools.partial(_release_quietly, blobs, str(key), job))

    def add_library(self, path: str | os.PathLike[str]) -> str:
        """Make a .whl, .zip, .egg or .py importable in Python workers for every later task;
        cached per executor by content. Returns the blob key."""
        name = os.path.basename(os.fspath(path))
        daemon = self._conf("spark.python.daemon.module")
        if self.spark is not None and daemon != "sparksteward.daemon":
            raise ConfigError(
                f"spark.python.daemon.module={daemon!r}: add_library needs Python workers forked from "
                f"sparksteward.daemon. Build the session with sparksteward.configure(builder) or pass "
                f"--conf spark.python.daemon.module=sparksteward.daemon")
        try:
            library_kind(name)
        except ValueError as exc:
            raise InvalidIdError(str(exc)) from None
        if not os.path.isfile(path):
            raise InvalidIdError(f"library {os.fspath(path)!r} is not a file")
        blobs = self.blobs
        job = self.current_job()
        if self.remote:
            key = blobs.put_file(path, job, permanent=True)
        else:
            fd, staged = blobs.staging_file()
            os.close(fd)
            shutil.copyfile(path, staged)
            key = blobs.put_path(staged, job, permanent=True, move=True)
        self.ask(BlobAddLibraryRequest(job, key, name))
        return str(key)

    # --- jars and files through steward:// URLs (issue 11, decision 0009) -----------------------
    def _put_file_url(self, path: str | os.PathLike[str], what: str) -> str:
        from sparksteward.blob.url import BlobUrl, app_scope, validate_file_name

        name = validate_file_name(os.path.basename(os.fspath(path)))
        if not os.path.isfile(path):
            raise InvalidIdError(f"{what} {os.fspath(path)!r} is not a file")
        if what == "jar":
            _check_jar(os.fspath(path))
        blobs = self.blobs
        job = self.current_job()
        if self.remote:   # a Connect client: streamed to the driver agent
            return str(BlobUrl(app_scope(self._secret), job, blobs.put_file(path, job, permanent=True), name))
        fd, staged = blobs.staging_file()
        os.close(fd)
        try:
            shutil.copyfile(path, staged)
            key = blobs.put_path(staged, job, permanent=True, move=True)
        finally:
            if os.path.exists(staged):
                os.unlink(staged)
        return str(BlobUrl(app_scope(self._secret), job, key, name))

    def _add_on_connect(self, command: str, url: str) -> str:
        """``ADD FILE``/``ADD JAR`` of ``url`` (or a path on the server's host), run by the Connect server for
        this client's session (decision 0030): Spark adds it to the session's artifacts."""
        assert self.spark is not None
        if not all(c.isalnum() or c in "/:._+-" for c in url):   # ours is: never quote into SQL what is not
            raise InvalidIdError(f"{url!r} cannot go into {command}")
        self.spark.sql(f"{command} '{url}'").collect()
        return url

    def add_jar(self, path: str | os.PathLike[str]) -> str:
        """Upload a jar as a permanent blob of the current job (HA when configured) and add it to Spark
        with ``sc.addJar`` as a ``steward://`` URL, which executors fetch once each through their BlobCache,
        verified. The job's end deletes the blob: add a jar in the scope that uses it (or outside any
        ``st.job`` for the whole application). Returns the URL. A file that is not a jar (a zip with a
        manifest or classes) is refused, naming it, before anything is uploaded."""
        url = self._put_file_url(path, "jar")
        if self.remote:   # the server's session loads classes from a local file: the driver agent's verified copy
            self._add_on_connect("ADD JAR", self.ask(BlobOpenFileRequest(url)).path)
            return url
        if self.spark is not None:
            self.spark.sparkContext._jsc.sc().addJar(url)  # PySpark has no public addJar
            # the driver needs the classes too (spark.udf.registerJavaFunction loads them here): the
            # driver agent's verified copy joins the session's class loader (no steward: URL handler)
            local = self.ask(BlobOpenFileRequest(url)).path
            jvm = self.spark.sparkContext._jvm
            self.spark._jsparkSession.sharedState().jarClassLoader().addURL(jvm.java.io.File(local).toURI().toURL())
        return url

    def add_file(self, path: str | os.PathLike[str]) -> str:
        """Like :meth:`add_jar`, for ``sc.addFile`` (tasks read it with ``SparkFiles.get(name)``). On Spark
        Connect the server's ``ADD FILE`` adds the URL for the client's session (``add_jar``: ``ADD JAR`` of the
        driver agent's verified copy, decision 0030)."""
        url = self._put_file_url(path, "file")
        if self.remote:
            return self._add_on_connect("ADD FILE", url)
        if self.spark is not None:
            self.spark.sparkContext.addFile(url)
        return url

    # --- keyed state (issue 8) ------------------------------------------------------------------
    def read_state(self, state: str | None = None, *, url: str | None = None, checkpoint_dir: str | None = None,
                   checkpoint_id: int | None = None, variable: str | None = None, metadata: bool = False,
                   expiry: bool = False, changes_from: int | None = None) -> Any:
        """A lazy DataFrame of one variable of a retained checkpoint of ``state`` (default: the latest, the
        default value state) in ``checkpoint_dir`` (default ``spark.steward.checkpoint.dir``), or of the
        checkpoint or savepoint at ``url``, read offline by ``spark.read.format("steward-state")``: one task
        per subtask, nothing written into the source. ``metadata``: the checkpoints instead, one row each.
        ``expiry``: a last column ``expires_ms``, each entry's TTL expiry (null without a TTL).
        ``changes_from``: the change feed instead, what changed in the variable from that older retained
        checkpoint to this one, with ``change_type`` (``upsert``/``delete``) and ``checkpoint_id``
        (:mod:`sparksteward.checkpoint.changes`). Bad input raises here, naming it (:mod:`sparksteward.state_source`)."""
        self._needs_jvm("read_state", _STATE_WHY, _STATE_INSTEAD)
        from sparksteward.state_source import read_state

        return read_state(self.spark, state, url=url, checkpoint_dir=checkpoint_dir, checkpoint_id=checkpoint_id,
                          variable=variable, metadata=metadata, expiry=expiry, changes_from=changes_from)

    def write_savepoint(self, url: str, *, state: str, states: list[Any], data: dict[str, Any], parallelism: int,
                        max_parallelism: int | None = None) -> str:
        """Bootstrap a savepoint of keyed state ``state`` at ``url`` from DataFrames, one per declared
        variable (``data``, shaped as a read of it gives), written in parallel by the executors; returns
        the URL of its ``_metadata``, which ``restore_from`` and ``read_state(url=...)`` take
        (:mod:`sparksteward.state_writer`)."""
        self._needs_jvm("write_savepoint", _STATE_WHY, _STATE_INSTEAD)
        from sparksteward.state_writer import write_savepoint

        return write_savepoint(self.spark, url, state=state, states=states, data=data, parallelism=parallelism,
                               max_parallelism=max_parallelism or int(self.spark.sparkContext.getConf().get(
                                   "spark.steward.state.max-parallelism", "128")))

    def derive_savepoint(self, url: str, *, source: str, states: list[Any] | None = None,
                         transform: dict[str, Any] | None = None, add: dict[str, Any] | None = None,
                         drop: list[str] = (), parallelism: int | None = None,   # type: ignore[assignment]
                         max_parallelism: int | None = None) -> str:
        """A new savepoint at ``url`` from the checkpoint or savepoint ``source``, with variables transformed
        (``transform={"name": fn}``, ``fn(df) -> df``), added (``add``) or dropped (``drop``), re-declared
        (``states``), at another parallelism or max parallelism; the source is only read
        (:func:`sparksteward.state_writer.derive_savepoint`)."""
        self._needs_jvm("derive_savepoint", _STATE_WHY, _STATE_INSTEAD)
        from sparksteward.state_writer import derive_savepoint

        return derive_savepoint(self.spark, url, source=source, states=states, transform=transform, add=add,
                                drop=list(drop), parallelism=parallelism, max_parallelism=max_parallelism)

    def keyed_state(self, name: str, *, key: str, parallelism: int, max_parallelism: int | None = None,
                    checkpoint_dir: str | None = None, num_retained: int | None = None,
                    restore_from: str | None = None, claim_mode: str | None = None,
                    file_merging: bool | dict[str, Any] | None = None, alignment: str | None = None,
                    aligned_checkpoint_timeout: float | None = None, max_inflight_bytes: int | None = None,
                    states: list[Any] | None = None, delete_states: list[str] | None = None,
                    claimed_roots: list[str] | None = None, event_time: str | None = None,
                    watermark_delay: float | Any = 0, late: str = "drop") -> Any:
        """A :class:`~sparksteward.keyed_state.KeyedState` named ``name`` keyed by column ``key``, with
        ``parallelism`` subtasks over ``max_parallelism`` key groups (default
        ``spark.steward.state.max-parallelism``), checkpointed under ``checkpoint_dir`` (default
        ``spark.steward.checkpoint.dir``), keeping ``num_retained`` completed checkpoints.

        ``restore_from`` (a retained ``.../chk-<N>`` directory of another state, or a savepoint) is the
        starting point of a state that has no checkpoint of its own, taken by ``claim_mode``
        (``"no_claim"``: fast duplication, the default ``spark.steward.checkpoint.claim-mode``;
        ``"claim"``: in place, the source becomes this state's). A state that has checkpoints ignores
        it with a warning. A changed ``max_parallelism`` and a ``restore_from`` that cannot be restored
        are refused here, before anything is written. A source whose record lists files outside it as
        claimed (it was itself restored with CLAIM from another state) is read there only under the
        ``claimed_roots`` you name (those states' roots): a record alone proves no claim.

        ``file_merging`` overrides ``spark.steward.checkpoint.file-merging.*`` for this state (FLIP-306):
        ``True``/``False``, or a dict of ``enabled``, ``max_file_size`` (bytes), ``mode``
        (``"within"``/``"across"``) and ``max_space_amplification``.

        ``alignment`` (``"aligned"``, ``"unaligned"``, ``"unaligned_max_inflight"``),
        ``aligned_checkpoint_timeout`` (seconds from the start of a batch's state stage; 0: at once) and
        ``max_inflight_bytes`` override ``spark.steward.checkpoint.unaligned.*`` (FLIP-76): a subtask still
        processing at the timeout defers the rest of its input into the checkpoint, and the next batch
        replays it first.

        ``states`` declares the state's variables (:func:`~sparksteward.value_state`,
        :func:`~sparksteward.list_state`, :func:`~sparksteward.map_state`), typed and with an optional
        TTL; the function reaches them as ``state.value(name)``, ``state.list(name)`` and
        ``state.map(name)``. Every checkpoint records them; a changed declaration is checked here
        against the state's latest checkpoint (adding a nullable field, dropping a field and widening
        a number are accepted; anything else is refused naming the variable). ``delete_states`` drops
        variables and their entries. Without ``states`` the recorded declarations stay as they are.

        ``event_time`` names the input's event-time column (a timestamp, a date or epoch ms) and
        ``watermark_delay`` (seconds or a timedelta) how late a row may come: each batch runs with the
        watermark the batches before it set (their largest event time minus the delay; it never goes
        back, and every checkpoint records it), which the function reads as ``state.watermark_ms``.
        A row at or below it is late: ``late="drop"`` drops and counts it (``late_rows`` in the
        batch's report), ``late="keep"`` hands it over with a boolean ``__late`` column."""
        from sparksteward.checkpoint.lifecycle_messages import CheckReply, CheckRequest
        from sparksteward.checkpoint.restore import ClaimMode
        from sparksteward.connect import ConnectConf
        from sparksteward.errors import StateError, StateSchemaError
        from sparksteward.keyed_state import KeyedState
        from sparksteward.state.event_time import EventTime
        from sparksteward.state.keygroups import validate_parallelism

        conf = None if self.spark is None else ConnectConf(self.spark) if self.remote else self.spark.sparkContext.getConf()
        if max_parallelism is None:
            max_parallelism = int(conf.get("spark.steward.state.max-parallelism", "128")) if conf else 128
        if num_retained is None:
            num_retained = int(conf.get("spark.steward.checkpoint.num-retained", "1")) if conf else 1
        if claim_mode is None:
            claim_mode = conf.get("spark.steward.checkpoint.claim-mode", "no_claim") if conf else "no_claim"
        mode = ClaimMode.parse(claim_mode).value
        if restore_from is not None and (not isinstance(restore_from, str) or not restore_from):
            raise StateError(f"restore_from={restore_from!r} must be the path of a retained checkpoint "
                             f"(<checkpoint-dir>/<cluster>/<state>/chk-<N>) or of a savepoint")
        validate_parallelism(parallelism, max_parallelism)
        from sparksteward.keyed_options import alignment_overrides, declarations, merging_overrides

        declared, dropped = declarations(states, delete_states)
        events = None if event_time is None else EventTime.of(event_time, watermark_delay, late)
        by_event = [d["name"] for d in declared or () if d.get("ttl_time") == "event" and d.get("ttl_ms")]
        if by_event and events is None:
            raise StateSchemaError(f"state variables {by_event} of keyed state {name!r} expire by event time, which "
                                   f"needs a watermark: name the event-time column with event_time=... (and "
                                   f"watermark_delay=...), or give them ttl_time='processing'")
        merging = merging_overrides(file_merging)
        aligned = alignment_overrides(alignment, aligned_checkpoint_timeout, max_inflight_bytes)
        checked: CheckReply = self.ask(CheckRequest(
            name=name, checkpoint_dir=checkpoint_dir, max_parallelism=max_parallelism, restore_from=restore_from,
            claim_mode=mode, file_merging=merging, alignment=aligned, states=declared, delete_states=dropped,
            key=key, writer=True, claimed_roots=list(claimed_roots or ())))
        sweep = int(conf.get("spark.steward.state.ttl.sweep-max-entries", "100000")) if conf else 100_000
        ks = KeyedState(self, name, key=key, parallelism=parallelism, max_parallelism=max_parallelism,
                        checkpoint_dir=checkpoint_dir, num_retained=num_retained, restore_from=restore_from,
                        claim_mode=mode, file_merging=merging, alignment=aligned, states=declared,
                        delete_states=dropped, sweep_max_entries=sweep, claimed_roots=claimed_roots,
                        event_time=events)
        ks.states = checked.states   # the declarations as the next batch will use them
        if restore_from is not None:  # the key type is known: restore (or note it is ignored) now
            assert checked.key_type is not None   # a check with restore_from names it (or refuses)
            ks._register(checked.key_type)
        return ks

    @property
    def job_results(self) -> JobResults:
        """Read access to the JobResultStore: ``st.job_results.get(job_id)``, ``.list()``."""
        return JobResults(self)

    def _conf(self, key: str) -> str | None:
        """``key`` of the application's conf (None without a session)."""
        if self.spark is None:
            return None
        if self.remote:
            return self.spark.conf.get(key, None)
        return self.spark.sparkContext.getConf().get(key)

    def _needs_jvm(self, call: str, why: str, instead: str) -> None:
        """Refuse ``call`` on a Spark Connect client (decision 0030), naming why and what to do instead."""
        if self.remote:
            from sparksteward.connect import refuse

            raise refuse(call, why, instead)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """A client pickled into a function (a Spark Connect ``foreachBatch`` runs it in a Python process of
        the server) is a new client there of the same agent, on that process's active session."""
        return _revive, (self.endpoint, self._secret, self._timeout, self._max_message, self._default_wait,
                         self.remote)

    def close(self) -> None:
        """Close this client's connections. Idempotent; the agent keeps running."""
        self._closed = True
        for conn in list(self._conns):
            conn.close()

    def __enter__(self) -> Steward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_STATE_WHY = "its Spark side still needs the driver's SparkContext (job groups, local properties, data sources)"
_STATE_INSTEAD = ("Run it in a classic PySpark session with the plugin (an application spark-submitted to the cluster), "
                  "or use `steward state show|read|diff|bootstrap` from any host that reaches the checkpoints' storage")


def _revive(endpoint: str, secret: str, timeout: float, max_message: int, default_wait: float,
            remote: bool) -> Steward:
    """:meth:`Steward.__reduce__`'s other side."""
    from pyspark.sql import SparkSession

    inst = Steward(endpoint, secret, spark=SparkSession.getActiveSession(), timeout=timeout,
                   max_message=max_message, default_wait=default_wait)
    inst.remote = remote
    return inst


def _release_quietly(blobs: BlobClient, key: str, job: str) -> None:
    """Release a broadcast's reference; the session may already be gone (then the job's end cleans up)."""
    with contextlib.suppress(StewardError, OSError):
        blobs.release(key, job)


def _check_jar(where: str) -> None:
    """Refuse the file ``where`` unless it is a jar: a zip archive with ``META-INF/MANIFEST.MF`` or a
    ``.class`` entry (reads the zip's central directory only)."""
    import zipfile

    try:
        with zipfile.ZipFile(where) as jar:
            names = jar.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise InvalidRequestError(f"jar {where!r} is not a jar (not a zip archive: {exc}): pass the .jar that "
                                  f"javac/jar, sbt or Maven built, or use add_file for other files") from None
    if "META-INF/MANIFEST.MF" not in names and not any(n.endswith(".class") for n in names):
        raise InvalidRequestError(f"jar {where!r} is a zip archive with neither META-INF/MANIFEST.MF nor classes "
                                  f"({len(names)} entries): pass a jar, or use add_file/add_library for other files")
