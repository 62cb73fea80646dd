"""``KeyedState``: Flink-style keyed state for PySpark DataFrames (issue 8), from the user's driver.

::

    ks = st.keyed_state("counts", key="user", parallelism=4)
    out = ks.apply(batch_df, fn, "user string, n long", checkpoint_id=7)   # lazy
    out.write...                                                          # the action
    ks.commit(7)                                                          # chk-7/_metadata
    ks.read()                                                             # DataFrame (key, value)
    ks.savepoint("s3://bkt/savepoints/counts-1")                          # self-contained copy

    st.keyed_state("counts2", key="user", parallelism=4,                  # start from another state's
                   restore_from="s3://.../counts/chk-7", claim_mode="no_claim")  # checkpoint (or savepoint)

``apply_arrow``/``apply`` begin checkpoint N on the driver agent, route every row to its subtask
(``repartitionById`` on pyspark >= 4.1, the routing values on 4.0; see :mod:`.routing`) and run
``mapInArrow``. Each task asks its executor agent to restore the base of N for its subtask (the last
completed checkpoint before N: every attempt of N, a retried task or a second action included, starts
from the same state), runs the user function, takes the sync-phase snapshot and hands it to the
executor agent, which uploads it and acks the driver agent's coordinator. ``commit(N)`` waits for the
P acks and completes N. pyspark is imported lazily.

This module is the driver's side; what runs in the Python workers (the ``mapInArrow`` functions of
a batch and of ``read(distributed=True)``) is :mod:`sparksteward.keyed_tasks`.

``restore_from`` is restored by the driver agent when the state is registered (by
``Steward.keyed_state`` itself, which knows the key type from the checkpoint) and has no checkpoint
of its own: NO_CLAIM duplicates the files into this state's directory (S3 CopyObject, hard links),
CLAIM takes them over in place. If the state already has checkpoints, ``restore_from`` is ignored
with a warning (``restore_info``): the latest checkpoint of the state itself wins, as in Flink.

``process(fn, schema, sink=...)`` returns the ``foreachBatch`` function that does all of it for
micro-batch N: apply with ``checkpoint_id=N``, ``sink(out, N)`` (the state stage runs inside the
sink's job; persisted first with ``persist=True``, or once a sink took several actions),
``commit(N)``; if anything fails it aborts N (the files only N uploaded are deleted) and re-raises,
so the query fails and Spark re-delivers N when it restarts.

**Drain** (FLIP-76). Spark runs no micro-batch without input, so the rows unaligned batches deferred
wait until input comes again. ``drain()`` processes them now: an empty batch, aligned, under the
next checkpoint id, through the ``fn``/``schema``/``sink`` of ``process`` (or given ones). That id
is recorded in the state (``_drains``, see :mod:`sparksteward.checkpoint.unaligned.backlog`) and later
streaming batches skip it, so batch N's checkpoint id is N plus the drains before it, the id
``sink`` gets too. ``info()["backlog"]`` shows what waits.

**Rescale.** ``st.keyed_state(name, ..., parallelism=P2)`` with the state's max parallelism, in a new
application or between batches of this one, makes the next checkpoint's tasks rebuild their subtasks
from the last checkpoint's (each reads only the old subtasks overlapping its key groups;
``info()["checkpoints"]`` reports what each read). A KeyedState object made before that is refused
from then on; another max parallelism is refused (:class:`~sparksteward.errors.ParallelismError`).

**Event time** (decision 0028): with ``event_time``, each batch runs with the watermark the driver
chose when it began (:mod:`sparksteward.state.event_time`), late rows dropped and counted or flagged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from sparksteward.checkpoint.lifecycle_messages import (
    AbortReply,
    AbortRequest,
    BeginReply,
    BeginRequest,
    CheckReply,
    CheckRequest,
    CommitReply,
    CommitRequest,
    InfoReply,
    InfoRequest,
    OpenedReply,
    OpenedRequest,
    RegisterReply,
    RegisterRequest,
    SavepointRequest,
)
from sparksteward.errors import StateEncodingError, StateError, StateNotRegisteredError, StewardError
from sparksteward.keyed_figures import KeyedStateFigures
from sparksteward.keyed_idle import IdleTimers
from sparksteward.keyed_spark import arrow_schema as _arrow_schema
from sparksteward.keyed_spark import as_ours as _as_ours
from sparksteward.keyed_spark import check_event_column as _check_event_column
from sparksteward.keyed_spark import streaming_query as _streaming_query
from sparksteward.keyed_spark import task_failure as _task_failure
from sparksteward.keyed_tasks import INIT_COL, KG_COL, ROUTE_COL, read_fn, read_table, subtask_fn
from sparksteward.state.runner import check_form as _check_form
from sparksteward.wire.messages import Message

__all__ = ["KeyedState"]

if TYPE_CHECKING:
    from sparksteward.state.event_time import EventTime
log = logging.getLogger("sparksteward.keyed_state")

_SPARK_KEY_TYPES = {"StringType": "string", "LongType": "long", "IntegerType": "int", "BinaryType": "binary"}
_KEY_SQL = {"string": "string", "long": "bigint", "int": "int", "binary": "binary"}
_BATCH_LOCKS: dict[str, threading.Lock] = {}   # state name -> held while a batch or a drain of it runs
_BATCH_LOCKS_GUARD = threading.Lock()
_REPORTS = 100   # checkpoint reports a KeyedState keeps (report())


def _batch_lock(name: str) -> threading.Lock:
    """One lock per state name in this driver process: a drain waits for a running batch of the
    state (and the next batch for the drain), so a drain never takes an id a running batch began."""
    with _BATCH_LOCKS_GUARD:
        return _BATCH_LOCKS.setdefault(name, threading.Lock())


class KeyedState(KeyedStateFigures):
    """A keyed state of this application (see the module docstring). Use ``Steward.keyed_state``."""

    def __init__(self, steward: Any, name: str, *, key: str, parallelism: int, max_parallelism: int,
                 key_type: str | None = None, checkpoint_dir: str | None = None, num_retained: int = 1,
                 restore_from: str | None = None, claim_mode: str = "no_claim",
                 file_merging: dict[str, Any] | None = None, alignment: dict[str, Any] | None = None,
                 states: list[dict[str, Any]] | None = None, delete_states: list[str] | None = None,
                 sweep_max_entries: int = 100_000, claimed_roots: list[str] | None = None,
                 event_time: EventTime | None = None) -> None:
        if not isinstance(key, str) or not key:
            raise StateEncodingError(f"key={key!r} must name the key column")
        self._st, self.name, self.key = steward, name, key
        self.parallelism, self.max_parallelism = parallelism, max_parallelism
        self.checkpoint_dir = checkpoint_dir
        self.num_retained = num_retained
        self.key_type = key_type
        self.restore_from = restore_from
        self.claim_mode = claim_mode
        self.claimed_roots = list(claimed_roots or ())   # roots a restore_from record's claims may lie under
        self.file_merging = file_merging
        self.alignment = alignment
        self._declared = states            # the declarations given (JSON), None: keep the recorded ones
        self._delete_states = list(delete_states or [])
        self._sweep_max_entries = sweep_max_entries
        self.event_time = event_time   # the event-time column, watermark delay and late rows' fate
        #: the state's declared variables as the driver agent resolved them (``properties.states``)
        self.states: dict[str, Any] | None = None
        #: what registering did with ``restore_from`` (action "restored", "kept" or "ignored", the
        #: duplication counts), once the first apply registered the state; None without restore_from
        self.restore_info: dict[str, Any] | None = None
        self._process_args: dict[str, Any] | None = None  # fn, schema, sink, form, persist, wait of process()
        self._registered = False
        self.last_checkpoint_id: int | None = None  # the id the latest apply began
        self.rescaled_from: int | None = None  # the latest checkpoint's parallelism, when this one differs
        self.idle_timers: IdleTimers | None = None  # the watcher of the latest process(..., idle_timers=)
        # initial_state(df, fn): applied by every checkpoint that starts from an empty state (the first
        # batch, and its re-run after the commit, which must give the same rows)
        self._initial: tuple[Any, Callable[..., Any]] | None = None
        self._initial_first = False   # until a commit: the batches that may apply it run aligned
        self._reports: dict[int, dict[str, Any]] = {}   # checkpoint id -> its report, the latest _REPORTS

    # --- driver agent ------------------------------------------------------------------------
    def _register(self, key_type: str) -> None:
        if self.key_type is not None and self.key_type != key_type:
            raise StateEncodingError(
                f"key column {self.key!r} of this DataFrame is {key_type}, but keyed state {self.name!r} has "
                f"{self.key_type} keys: cast the column to {self.key_type}")
        self.key_type = key_type
        if not self._registered:
            reply: RegisterReply = self._st.ask(RegisterRequest(
                name=self.name, checkpoint_dir=self.checkpoint_dir, parallelism=self.parallelism,
                max_parallelism=self.max_parallelism, key_type=key_type, num_retained=self.num_retained,
                restore_from=self.restore_from, claim_mode=self.claim_mode, file_merging=self.file_merging,
                alignment=self.alignment, states=self._declared, delete_states=self._delete_states or None,
                key=self.key, claimed_roots=self.claimed_roots,
                event_time=self.event_time.recorded() if self.event_time is not None else None))
            self.rescaled_from = reply.rescaled_from
            self.states = reply.states
            self._registered = True
            self.restore_info = reply.restore
            if self.restore_info and self.restore_info.get("action") == "ignored":
                log.warning("%s", self.restore_info["note"])

    def _ask(self, request: Message) -> Any:
        """A ``state.*`` request of this state, and its typed reply; when the driver agent restarted
        since this state was registered (the shim restarts a dead agent), register again once and
        repeat it."""
        try:
            return self._st.ask(request)
        except StateNotRegisteredError:
            if not self._registered or self.key_type is None:
                raise
            log.warning("keyed state %s: the driver agent restarted; registering the state again", self.name)
            self._registered = False
            self._register(self.key_type)
            return self._st.ask(request)

    def _check(self) -> CheckReply:
        """``state.check`` with this object's settings: what opening it would find (no lease taken)."""
        return self._st.ask(CheckRequest(name=self.name, checkpoint_dir=self.checkpoint_dir,
                                         max_parallelism=self.max_parallelism, file_merging=self.file_merging,
                                         alignment=self.alignment))

    def _key_type_of(self, df: Any) -> str:
        fields = {f.name: f for f in df.schema.fields}
        if self.key not in fields:
            raise StateEncodingError(f"key column {self.key!r} of keyed state {self.name!r} does not exist; the "
                                     f"DataFrame has columns {list(fields)}")
        type_name = type(fields[self.key].dataType).__name__
        if type_name not in _SPARK_KEY_TYPES:
            raise StateEncodingError(
                f"key column {self.key!r} of keyed state {self.name!r} has type "
                f"{fields[self.key].dataType.simpleString()}, which cannot be a key: cast it to string, bigint, "
                f"int or binary")
        return _SPARK_KEY_TYPES[type_name]

    # --- the batch API -----------------------------------------------------------------------
    def apply_arrow(self, df: Any, fn: Callable[..., Any], schema: Any, checkpoint_id: int | None = None, *,
                    on_timer: Callable[..., Any] | None = None) -> Any:
        """``fn(keys, rows: pyarrow.Table, state) -> pyarrow.Table | None`` per input batch; lazy. Then, for
        the subtask's due timers, ``on_timer(keys, expired: pyarrow.Table, state)`` (state/firing.py)."""
        return self._begin_apply(df, fn, schema, checkpoint_id, "arrow", on_timer=on_timer)[0]

    def apply(self, df: Any, fn: Callable[..., Any], schema: Any, checkpoint_id: int | None = None, *,
              on_timer: Callable[..., Any] | None = None, chunks: bool = False) -> Any:
        """``fn(key, rows: pandas.DataFrame, state)`` per key, returning a row (tuple or dict), a list of
        rows, a DataFrame or None; lazy. Then ``on_timer(key, timers, state)`` per key with due timers.
        ``chunks``: ``rows`` is an iterator of DataFrames (``form="chunks"`` of :meth:`process`)."""
        return self._begin_apply(df, fn, schema, checkpoint_id, "chunks" if chunks else "pandas", on_timer=on_timer)[0]

    def initial_state(self, df: Any, fn: Callable[..., Any]) -> None:
        """Bootstrap the state in its first batch: before that batch's input, ``fn`` runs over ``df`` (with
        the key column) as the batch's function would (``fn(key, rows, state)``; Arrow form ``fn(keys, rows,
        state)``), writing states and timers and returning nothing; in every attempt and delivery of the
        batch that starts from an empty state (a failed first batch applies it again from empty), never
        after. Refused, naming the state, once the state has a checkpoint or will restore one (a query's
        restart: ``if ks.info()["last_completed"] is None: ks.initial_state(...)``)."""
        checked = self._check()
        has = checked.last_completed if checked.last_completed is not None else \
            self.restore_from if checked.restore_from not in (None, "ignored") else None
        if has is not None or not callable(fn) or self._key_type_of(df) != (self.key_type or self._key_type_of(df)):
            raise StateError(f"initial_state of keyed state {self.name!r}: " + (
                f"the state has a checkpoint already ({has}); an initial state only bootstraps a first batch. "
                f"Drop initial_state(...) (what it wrote is in the checkpoint), or bootstrap another state name"
                if has is not None else f"fn={fn!r} must be a function" if not callable(fn) else
                f"its key column {self.key!r} has another type than the state's ({self.key_type})"))
        self._initial, self._initial_first = (df, fn), True

    def _begin_apply(self, df: Any, fn: Callable[..., Any], schema: Any, checkpoint_id: int | None, form: str, *,
                     batch_id: int | None = None, drain: bool = False, timers: bool = False,
                     on_timer: Callable[..., Any] | None = None) -> tuple[Any, int | None]:
        """Begin a checkpoint (``checkpoint_id``; a streaming batch's by ``batch_id``; a drain's) and
        return the lazy output and its id; ``(None, None)`` for a drain with nothing to drain."""
        from pyspark.sql import functions as F

        from sparksteward.routing import key_group_sql, route_sql, subtask_sql

        if not callable(fn) or (on_timer is not None and not callable(on_timer)):
            raise StateError(f"fn={fn!r} and on_timer={on_timer!r} must be functions")
        self._register(self._key_type_of(df))
        if not drain:   # a drain's empty input has the key column only
            _check_event_column(df, self.event_time, self.name)
        struct, arrow_schema = _arrow_schema(df.sparkSession, schema)
        begun: BeginReply = self._ask(BeginRequest(
            name=self.name, checkpoint_id=checkpoint_id, batch_id=batch_id, parallelism=self.parallelism,
            query=_streaming_query(df), drain=drain, timers=timers,   # an initial state's batch runs aligned
            alignment={"alignment": "aligned"} if self._initial_first and not drain else None))
        if begun.backlog_warning:
            log.warning("%s", begun.backlog_warning)
        cid = begun.checkpoint_id
        if cid is None:
            return None, None
        p = self.parallelism
        initial = self._initial if begun.empty and not drain else None
        input_columns = df.columns
        if initial is not None:   # its rows first in each subtask, tagged (keyed_tasks.apply_initial)
            df = df.withColumn(INIT_COL, F.lit(False)).unionByName(
                initial[0].withColumn(INIT_COL, F.lit(True)), allowMissingColumns=True)
        routed = df.withColumn(ROUTE_COL, F.expr(subtask_sql(self.key, p, self.max_parallelism)))
        if begun.unaligned:   # FLIP-76: the task sorts its new input by key group (see checkpoint/unaligned/task_cut.py);
            # computed before the exchange: no node may sit between it and mapInArrow, or AQE drops the
            # state stage of an empty batch, whose subtasks must still replay and checkpoint
            routed = routed.withColumn(KG_COL, F.expr(key_group_sql(self.key, self.max_parallelism)).cast("int"))
        if hasattr(routed, "repartitionById"):
            routed = routed.repartitionById(p, ROUTE_COL)
        else:
            routed = routed.withColumn(ROUTE_COL, F.expr(route_sql(ROUTE_COL, p))).repartition(p, ROUTE_COL)
        if initial is not None:
            routed = routed.sortWithinPartitions(F.col(INIT_COL).desc())
            declared_initial = {"fn": initial[1], "input": input_columns, "columns": initial[0].columns}
        self.last_checkpoint_id = cid
        # the checkpoint's processing time (TTL) and watermark: chosen once by the coordinator, the same for
        # every task, attempt and delivery of it (checkpoint/begun.py)
        assert begun.time is not None   # a begun checkpoint has its time
        # the record as of this begin: the drops not yet run by a completed checkpoint's tasks included
        self.states = begun.states
        declared = {"states": self.states, "now_ms": begun.time.processing_ms, "sweep": self._sweep_max_entries,
                    "dropped": (self.states or {}).get("dropped") or [], "watermark_ms": begun.time.watermark_ms,
                    "event_time": self.event_time.to_json() if self.event_time is not None else None}
        if initial is not None:
            declared["initial"] = declared_initial
        task = subtask_fn(self.name, cid, self.key, fn, arrow_schema, form, p, declared, on_timer=on_timer)
        return routed.mapInArrow(task, struct), cid

    def __getstate__(self) -> dict[str, Any]:   # in a Connect foreachBatch function: all but the watcher thread
        return {**self.__dict__, "idle_timers": None}

    def process(self, fn: Callable[..., Any], schema: Any, sink: Callable[[Any, int], Any], form: str = "pandas", *,
                persist: bool | None = None, wait: float | None = None,
                on_timer: Callable[..., Any] | None = None, idle_timers: float | None = None) -> Callable[[Any, int], None]:
        """The ``writeStream.foreachBatch`` function that applies ``fn``, writes and commits each batch.

        Parameters
        ----------
        fn : callable
            The user function: ``fn(key, rows, state)`` (``form="pandas"``, as in :meth:`apply`),
            ``fn(key, chunks, state)`` (``form="chunks"``: the key's rows as an iterator of DataFrames, so
            an unaligned cut may fall inside a hot key, decision 0028) or ``fn(keys, rows, state)``
            (``form="arrow"``, as in :meth:`apply_arrow`).
        schema : StructType or str
            The output schema of ``fn``.
        sink : callable
            ``sink(out, checkpoint_id)`` writes the batch's output DataFrame ``out``. The id is
            Spark's batch id, plus one for every :meth:`drain` before the batch (drains take ids
            of their own), so it rises with every batch and drain and is the same in every attempt.
        persist : bool, optional
            True: persist ``out`` (memory and disk) and materialise it on every subtask before the
            sink runs, so that the sink's actions read it (two jobs a batch). False: the state stage
            runs inside the sink's job, one job a batch, as Spark runs its own stateful operators;
            each further action of the sink on ``out`` runs the stage again, from the same base, so
            its rows are the first run's only if ``fn`` is deterministic. None (the default): False
            until a batch's sink takes a second action on ``out`` (the commit's report counts the
            runs, ``stage_runs``), then True from the next batch on, with a warning. Pass True for a
            sink that always takes several actions, or whose ``fn`` is not deterministic.
        wait : float, optional
            How long ``commit`` waits for the acks (default ``spark.steward.checkpoint.commit-timeout``).
        on_timer : callable, optional
            Called after ``fn`` for the keys whose timers are due (with or without input in the batch):
            ``on_timer(key, timers, state)`` per key, or ``on_timer(keys, expired, state)`` (Arrow form);
            its rows join the output (:mod:`sparksteward.state.firing`).
        idle_timers : float, optional
            Seconds: while the query runs no batch that long and a processing-time timer is due, an
            empty batch fires it (``drain(timers=True)``; the bound and cost: :mod:`sparksteward.keyed_idle`).

        Returns
        -------
        callable
            ``run(batch_df, batch_id)``: apply as checkpoint ``batch_id`` (past the drains' ids),
            ``sink(out, id)``, ``commit(id)``. If the state stage, the sink or the commit raises,
            checkpoint ``batch_id`` is aborted (its own uploads deleted) and the error re-raised (one of
            ours from a task, the function's or a null key's, as that error, logged first, Spark's on it
            as ``spark_error``): the query fails, and its restart re-delivers the batch, which starts
            again from the same base. A batch whose checkpoint completed already (the driver died after
            the commit, before Spark recorded the batch) runs again from the base, keeps the first result.
        """
        if not callable(fn):
            raise StateError(f"fn={fn!r} must be a function")
        if not callable(sink):
            raise StateError(f"sink={sink!r} must be a function sink(out_df, batch_id) that writes the batch's output")
        _check_form(form)
        if idle_timers and getattr(self._st, "remote", False):   # decision 0030
            from sparksteward.connect import refuse

            raise refuse("keyed_state(...).process(idle_timers=...)", "its watcher is a thread beside the query, and a "
                         "Connect foreachBatch runs on the server", "Leave idle_timers out on Connect (timers fire when "
                         "a batch runs)")
        self._process_args = {"fn": fn, "schema": schema, "sink": sink, "form": form, "persist": persist, "wait": wait,
                              "on_timer": on_timer}
        if self.idle_timers is not None:   # the watcher of an earlier process() function
            self.idle_timers.stop()
        watcher = self.idle_timers = IdleTimers(self, idle_timers) if idle_timers else None

        learned = False   # persist=None: a sink took several actions on an unpersisted output

        def run(batch_df: Any, batch_id: int) -> None:
            nonlocal learned
            with _batch_lock(self.name):
                # begins the batch's checkpoint, or refuses an old one
                out, cid = self._begin_apply(batch_df, fn, schema, None, form, batch_id=int(batch_id), on_timer=on_timer)
                assert cid is not None  # only a drain can begin no checkpoint
                cached = persist if persist is not None else learned
                self._write_and_commit(out, cid, sink, cached, wait, f"batch {batch_id}")
                if watcher is not None:
                    watcher.batch_ran(_streaming_query(batch_df))
                runs = int((self._reports.get(cid) or {}).get("stage_runs", 1))
                if not cached and persist is None and runs > 1:
                    learned = True
                    log.warning("the sink of keyed state %s ran the state stage %d times in batch %s (it took that "
                                "many actions on the output): process() persists the output from the next batch "
                                "on. Pass persist=True to do so from the first batch", self.name, runs, batch_id)

        return run

    def _write_and_commit(self, out: Any, cid: int, sink: Callable[[Any, int], Any] | None, persist: bool,
                          wait: float | None, what: str) -> Any:
        """Run the state stage (persisted: once per subtask), ``sink(out, cid)``, ``commit(cid)``;
        abort ``cid`` and re-raise if any of it fails. Returns the persisted ``out`` when there is
        no sink (the caller unpersists it)."""
        cached = False
        try:
            if persist or sink is None:
                from pyspark import StorageLevel

                out = out.persist(StorageLevel.MEMORY_AND_DISK)
                cached = True
                out.count()  # the state stage, once, on every subtask
            if sink is not None:
                sink(out, cid)
            if not cached and sink is not None:
                self._run_unopened(out, cid)
            self.commit(cid, wait=wait)
        except BaseException as exc:
            # ours inside Spark's task error (the function's, a null key, ...); ours raised here stay as they are
            failure = None if isinstance(exc, StewardError) else _task_failure(exc)
            if failure:   # on the console first: Spark's own exception buries it under the JVM's frames
                log.error("%s of keyed state %r failed: %s", what, self.name, failure[1])
            try:
                deleted = self.abort(cid)
                log.warning("%s of keyed state %s failed: checkpoint %s aborted (%d files deleted)",
                            what, self.name, cid, deleted)
            except Exception as abort_exc:  # noqa: BLE001 - the batch's own error matters more
                log.warning("aborting checkpoint %s of keyed state %s failed: %s", cid, self.name, abort_exc)
            if cached:
                out.unpersist()
            if failure:   # raised as ours, not under Spark's chain of it (kept in the log and on the error)
                log.debug("%s of keyed state %s: Spark's error: %s", what, self.name, exc)
                raise _as_ours(failure, exc) from None
            raise
        if sink is None:
            return out
        if cached:
            out.unpersist()
        return None

    def _run_unopened(self, out: Any, cid: int) -> None:
        """After a sink on an unpersisted ``out``: if its actions left subtasks unrun (``take``,
        ``isEmpty``, a ``limit``), run the state stage on all of them (those that ran run again from
        the same base), so that the commit finds every ack instead of waiting for it."""
        opened: OpenedReply = self._ask(OpenedRequest(name=self.name, checkpoint_id=cid))
        if opened.unopened:
            log.info("the sink of keyed state %s left subtasks %s of checkpoint %s unrun: running the state stage",
                     self.name, opened.unopened, cid)
            out.count()

    def drain(self, fn: Callable[..., Any] | None = None, schema: Any = None,
              sink: Callable[[Any, int], Any] | None = None, form: str | None = None, *,
              wait: float | None = None, timers: bool = False) -> Any:
        """Process the rows unaligned batches deferred (the backlog, ``info()["backlog"]``) now.

        Spark runs no micro-batch without input, so when a stream's input stops, the deferred rows
        wait for the next batch. Call ``drain`` when the input pauses for longer than their output
        may wait, before ``read()`` or a savepoint that must include them, before stopping a query
        for good, and before changing the input schema. It applies an empty batch aligned: every
        subtask processes its deferred rows whole and defers nothing, under the next checkpoint id,
        which later streaming batches skip (see :meth:`process`). A drain waits for a running batch
        of this state in this process, and is refused while a checkpoint is pending or a batch
        failed since the last completed checkpoint (its retry processes the backlog first anyway).

        Parameters
        ----------
        fn, schema, form : optional
            As in :meth:`process`; default: those given to the latest :meth:`process` call.
        sink : callable, optional
            ``sink(out, checkpoint_id)``; default: the sink of :meth:`process`. With no sink at all
            the output is returned instead.
        wait : float, optional
            How long ``commit`` waits for the acks.
        timers : bool
            Run the empty batch also without a backlog, to fire the timers due on an idle stream (with
            the ``on_timer`` of :meth:`process`): processing-time timers due now, and event-time timers
            at or below the watermark the last batch's events moved.

        Returns
        -------
        int or DataFrame or None
            With a sink: the drain's checkpoint id, or None when there was no backlog. Without: the
            output DataFrame, persisted (``unpersist()`` it when done), empty when there was no
            backlog.
        """
        given = self._process_args or {}
        fn = fn if fn is not None else given.get("fn")
        schema = schema if schema is not None else given.get("schema")
        sink = sink if sink is not None else given.get("sink")
        form = form or given.get("form") or "pandas"
        wait = wait if wait is not None else given.get("wait")
        if fn is None or schema is None:
            raise StateError(f"drain of keyed state {self.name!r} needs the function and output schema that process "
                             f"the deferred rows: pass fn= and schema= (the ones of process/apply), or call "
                             f"process(...) first")
        _check_form(form)
        spark = self._st.spark
        key_type = self.key_type or self._check().key_type
        if key_type is None:   # no checkpoint at all: nothing was deferred
            return None if sink is not None else spark.createDataFrame([], _arrow_schema(spark, schema)[0])
        empty = spark.createDataFrame([], f"`{self.key}` {_KEY_SQL[key_type]}")
        with _batch_lock(self.name):
            out, cid = self._begin_apply(empty, fn, schema, None, form, drain=True, timers=timers,
                                         on_timer=given.get("on_timer"))
            if cid is None:
                log.info("keyed state %s has no backlog to drain", self.name)
                return None if sink is not None else spark.createDataFrame([], _arrow_schema(spark, schema)[0])
            result = self._write_and_commit(out, cid, sink, True, wait, f"drain {cid}")
        log.info("keyed state %s drained its backlog in checkpoint %s", self.name, cid)
        return cid if sink is not None else result

    def commit(self, checkpoint_id: int | None = None, wait: float | None = None) -> int:
        """Wait for every subtask's ack of ``checkpoint_id`` (default: the newest pending one) and
        complete it; older checkpoints are subsumed. Returns the id. On a failed upload, or when
        ``wait`` (default ``spark.steward.checkpoint.commit-timeout``) runs out, the checkpoint is
        aborted and :class:`~sparksteward.errors.CheckpointError` raised."""
        try:
            reply: CommitReply = self._ask(CommitRequest(name=self.name, checkpoint_id=checkpoint_id, wait=wait))
        except StateNotRegisteredError as exc:
            if self._registered:
                raise
            raise StateError(f"keyed state {self.name!r} has nothing to commit: no batch was applied to it in this "
                             f"application. Apply one first (ks.apply(df, fn, schema) or ks.apply_arrow(...)), then "
                             f"commit its checkpoint; or let ks.process(...) in foreachBatch apply and commit each "
                             f"batch") from exc
        if reply.report:
            self._reports[reply.checkpoint_id] = reply.report
            while len(self._reports) > _REPORTS:
                del self._reports[min(self._reports)]
        self._initial_first = False   # the state has a checkpoint: later batches run as configured
        scope = self._st.current_scope()
        if scope is not None:  # FLIP-194: the job's result keeps its final checkpoint of this state
            scope.note_checkpoint(self.name, reply.checkpoint_id, reply.path)
        return reply.checkpoint_id

    def abort(self, checkpoint_id: int) -> int:
        """Drop pending checkpoint ``checkpoint_id`` and delete the files only it uploaded."""
        aborted: AbortReply = self._ask(AbortRequest(name=self.name, checkpoint_id=checkpoint_id))
        return aborted.deleted

    def savepoint(self, url: str) -> str:
        """Write a self-contained copy of the latest completed checkpoint to ``url`` (any fsspec URL)
        and return ``url``; ``st.keyed_state(..., restore_from=url)`` restores it anywhere.

        The driver agent duplicates the files (S3 CopyObject, hard links; no bytes through the
        executors) to ``<url>/shared/`` and writes ``<url>/_metadata`` last: a savepoint exists whole
        or not at all. A ``url`` that already holds a savepoint is refused."""
        if not isinstance(url, str) or not url:
            raise StateError(f"savepoint url={url!r} must be a path or an fsspec URL such as s3://bucket/savepoints/x")
        self._st.ask(SavepointRequest(name=self.name, url=url, checkpoint_dir=self.checkpoint_dir))
        return url

    def read(self, variable: str | None = None, distributed: bool = False) -> Any:
        """A DataFrame of one state variable in the latest completed checkpoint, in this application or
        before its first batch (a state opened by ``st.keyed_state`` in a new application reads its
        latest checkpoint without being applied).

        ``variable`` None: the default value state, ``(key, value)`` with ``value`` as JSON text. A
        declared value state: ``(key, value)`` of its type; a list state: ``(key, value)``, one row per
        element in list order; a map state: ``(key, map_key, value)``. Entries whose TTL expired by now
        are left out.

        By default the driver restores every subtask and the rows are in the DataFrame (fine for
        small states). With ``distributed=True`` the DataFrame is lazy, a read of the state data source
        (``spark.read.format("steward-state")``) pinned to that checkpoint: one task per subtask of the
        checkpoint restores and decodes it on an executor, so large states never pass through the
        driver. Run its actions before that checkpoint is subsumed (``num_retained`` commits later).

        Both open the checkpoint with the session's ``spark.steward.storage.options`` (an S3 endpoint,
        say), as the agents do; the tasks of a distributed read get them with the task, not from
        their environment.
        """
        from pyspark.sql.pandas.types import from_arrow_schema

        from sparksteward.checkpoint.reader import variable_schema
        from sparksteward.checkpoint.records import CheckpointMetadata

        # not applied in this application: the driver agent reads the latest record, no lease taken
        info: InfoReply | CheckReply = self._ask(InfoRequest(self.name)) if self._registered else self._check()
        spark = self._st.spark
        meta_json = info.latest
        if meta_json is None:
            if variable is not None:
                raise StateError(f"keyed state {self.name!r} has no completed checkpoint to read {variable!r} from")
            key_sql = _KEY_SQL[self.key_type or "string"]
            return spark.createDataFrame([], f"key {key_sql}, value string")
        meta = CheckpointMetadata.from_bytes(orjson.dumps(meta_json), f"checkpoint {meta_json.get('checkpoint_id')}")
        arrow = variable_schema(meta, variable)
        schema = from_arrow_schema(arrow)
        now_ms = int(time.time() * 1000)
        options = _storage_options(spark)
        if distributed and meta.checkpoint_id >= 0:   # the state data source, pinned to this checkpoint
            reader = spark.read.format("steward-state").option("state", self.name).option(
                "cluster_id", info.cluster_id).option("checkpoint_id", meta.checkpoint_id)
            return (reader if variable is None else reader.option("variable", variable)).load(info.checkpoint_dir)
        if distributed:   # the restored starting point, which the source does not list
            n = len(meta_json["subtasks"])
            fn = read_fn(info.checkpoint_dir, self.name, info.cluster_id, meta_json, variable, now_ms, options)
            return spark.range(0, n, 1, n).mapInArrow(fn, schema)
        table = read_table(info.checkpoint_dir, self.name, info.cluster_id, meta_json, variable, now_ms=now_ms,
                           storage_options=options)
        return spark.createDataFrame(table.to_pylist(), schema)


def _storage_options(spark: Any) -> dict[str, dict[str, Any]]:
    """The session's ``spark.steward.storage.options``, which the agents were started with too: a read
    opens the checkpoint with them on the driver and in its tasks, whatever their environment holds."""
    from sparksteward.config import parse_setting
    from sparksteward.storage import OPTIONS_KEY

    return parse_setting(OPTIONS_KEY, spark.conf.get(OPTIONS_KEY, None))
