"""What runs in the Python workers for a :class:`~sparksteward.keyed_state.KeyedState`: the
``mapInArrow`` functions of a batch (:func:`subtask_fn`) and of a distributed read (:func:`read_fn`).

A batch's task is one subtask of checkpoint N. It asks its executor agent to restore the base of N
for its subtask (``state.open``; the last completed checkpoint before N, so every attempt of N starts
from the same state), builds its input (:func:`unaligned_input`: the base's channel state, then its
own rows; with an unaligned alignment both in key-group order, cut where the rows go to a new channel
state instead, FLIP-76), runs the user function on the subtask's RocksDB backend (the per-key form
once per key, with the options :func:`_pandas_options` reads from the session's conf), takes the
sync-phase snapshot and hands it to the executor agent with what it counted (``state.upload``, its
:class:`~sparksteward.checkpoint.messages.TaskCounters`), which uploads it and acks the driver agent's
coordinator. A task that ends before the upload releases its subtask (``state.release``). See
:mod:`sparksteward.checkpoint.task.task_state`; the typed messages are in
:mod:`sparksteward.checkpoint.messages`.

:func:`read_table` restores subtasks of a completed checkpoint into a scratch dir of the calling
process and decodes one state variable: the driver calls it for a small read, each task of a
distributed read (:func:`read_fn`) for its own subtask, both with the session's storage options.

Pickling: :func:`subtask_fn` and :func:`read_fn` return closures, which the driver ships to the
workers by cloudpickle by value, with what they close over (the user function, the ids, the schema).
What they call is module-level in this importable module and is pickled by reference, so the worker
imports it from its own installation; pyspark and the state and checkpoint modules are imported
inside the functions, on the worker. Keep it so: nothing here holds state of the driver.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from sparksteward.errors import StateError, StateFunctionError

__all__ = ["INIT_COL", "KG_COL", "ROUTE_COL", "apply_initial", "function_failure", "guarded", "read_fn", "read_table", "subtask_fn",
           "unaligned_input"]

ROUTE_COL = "__steward_subtask"
"""The column of a batch's rows that names their subtask (the task drops it before the user function)."""
KG_COL = "__steward_key_group"
"""Unaligned states: the column of the key group the task sorts its new input by."""
INIT_COL = "__steward_initial"
"""A first batch with an initial state: true on the initial state's rows, which each subtask gets first."""


def subtask_fn(name: str, checkpoint_id: int, key: str, fn: Callable[..., Any], schema: Any,
               form: str, parallelism: int | None = None, declared: dict[str, Any] | None = None, *,
               on_timer: Callable[..., Any] | None = None) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The ``mapInArrow`` function of checkpoint ``checkpoint_id`` (runs in Python workers).

    ``declared``: the state's declared variables (``states``, the record), the batch's processing time
    (``now_ms``) and watermark (``watermark_ms``), the event-time column, delay and late-row mode
    (``event_time``, decision 0028), the variables to delete (``dropped``) and the sweep's budget (``sweep``).
    ``on_timer``: called for the subtask's due timers after ``fn`` (:mod:`sparksteward.state.firing`).

    When the user's function fails, the task fails with a :class:`StateFunctionError` raised from the
    top of this function once the subtask is released, so that the error Spark reports begins with its
    first line (state, checkpoint, subtask, key, the function's exception) and the function's traceback.
    """

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None  # mapInArrow runs this in a task
        subtask = ctx.partitionId()
        where = f"keyed state {name!r}, checkpoint {checkpoint_id}, subtask {subtask}"
        failed = None
        try:
            yield from _run_subtask(batches, name, checkpoint_id, subtask, key, guarded(fn, form, where), schema,
                                    form, parallelism, declared or {},
                                    None if on_timer is None else guarded(on_timer, form, where + ", a timer"))
        except StateFunctionError as exc:   # raised by the function, or its output refused by the runner
            failed = exc if str(exc).startswith(where) else StateFunctionError(f"{where}, {exc}")
        if failed is not None:  # the first line of the task's error: the state function failed
            raise failed.with_traceback(None)

    return run


def guarded(fn: Callable[..., Any], form: str, where: str) -> Callable[..., Any]:
    """``fn`` as the runner calls it, raising :class:`StateFunctionError` (from the function's own
    exception) when it raises. What it returns is the runner's to check (:mod:`sparksteward.state.runner`),
    which refuses it by key or column. ``where`` names the state, the checkpoint and the subtask."""

    def call(first: Any, rows: Any, state: Any) -> Any:
        try:
            return fn(first, rows, state)
        except Exception as exc:
            raise StateFunctionError(function_failure(where, form, first, exc)) from exc

    return call


def function_failure(where: str, form: str, first: Any, exc: BaseException) -> str:
    """The message of a state function's failure: one line naming where and what it raised, then its
    traceback (from the function's own frame on)."""
    import traceback

    lines = str(exc).strip().splitlines()
    raised = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # skip guarded's own frame
    trace = "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()
    return f"{where}, {_keys_of(form, first)}: the state function raised {raised}\n{trace}"


def _keys_of(form: str, first: Any) -> str:
    """``key 'a'`` (per-key form) or ``keys ['a', 'b', 'c', ...] (N in the batch)`` (Arrow form)."""
    if form != "arrow":
        return f"key {first!r}"
    try:
        n = len(first)
        shown = first.slice(0, 3).to_pylist() if hasattr(first, "slice") else list(first)[:3]
    except Exception:  # noqa: BLE001 - only a description
        return "a batch of keys"
    return f"keys {shown!r}{' ...' if n > 3 else ''} ({n} in the batch)"


def _run_subtask(batches: Iterator[Any], name: str, checkpoint_id: int, subtask: int, key: str,
                 fn: Callable[..., Any], schema: Any, form: str, parallelism: int | None,
                 declared: dict[str, Any], on_timer: Callable[..., Any] | None = None) -> Iterator[Any]:
    """One subtask of checkpoint ``checkpoint_id``: open, run, snapshot and upload, or release."""
    from sparksteward.checkpoint.begun import Cut
    from sparksteward.checkpoint.messages import (
        CutReply,
        OpenReply,
        OpenRequest,
        ReleaseRequest,
        TaskCounters,
        TaskCutRequest,
        UploadRequest,
    )
    from sparksteward.state.backend import RocksDBStateBackend
    from sparksteward.state.event_time import EventTime
    from sparksteward.state.firing import fire
    from sparksteward.state.keygroups import key_group_range
    from sparksteward.state.runner import run_arrow, run_pandas
    from sparksteward.state.typed import TypedStates, drop_variables, restore_clock, sweep_both
    from sparksteward.wire.messages import ask
    from sparksteward.worker import executor_connection, settle_heap

    settle_heap()   # the modules above stay out of the collections PySpark runs after each task
    from pyspark import TaskContext

    conn = executor_connection()
    limit = _keep_open(TaskContext.get())
    keep = limit > 0
    held = _HELD.of(name) if keep else []
    started = time.perf_counter()
    dropped = _HELD.take_dropped(name)
    try:
        skip_below = restore_clock(declared.get("now_ms"), declared.get("watermark_ms"), declared.get("states"))
        opened: OpenReply = ask(conn, OpenRequest(name, checkpoint_id, subtask, parallelism, skip_below,
                                                  held=held, dropped=dropped, pid=os.getpid()))
    except BaseException:
        _HELD.close(held)   # the agent may have deleted their dirs: never use them again
        _HELD.drop_later(name, held + dropped)   # named at the next open, so the agent deletes their dirs
        raise
    open_ms = int((time.perf_counter() - started) * 1000)
    _HELD.close(opened.stale)
    token = opened.token
    uploaded = False
    writer = None
    backend = None
    try:
        p, m = opened.parallelism, opened.max_parallelism
        kg = key_group_range(m, p, subtask)
        backend = _HELD.take(opened.kept) if opened.kept else None
        started = time.perf_counter()
        kept = backend is not None
        if backend is None:
            backend = RocksDBStateBackend(opened.workdir, kg, m, opened.key_type, create=False,
                                          flush_wal_above=opened.flush_wal_above)
        else:   # decision 0026: the DB this worker kept open is exactly the base
            backend.entries_ingested = backend.wal_bytes = 0
        db_open_ms = int((time.perf_counter() - started) * 1000)
        try:
            now_ms = int(declared.get("now_ms") or 0)
            typed = TypedStates(backend, declared.get("states"), now_ms, checkpoint_id, declared.get("watermark_ms"),
                                event_time=bool(declared.get("event_time")))
            if declared.get("dropped"):
                drop_variables(backend, declared["dropped"])
            runner = run_arrow if form == "arrow" else run_pandas
            cleaned: Iterator[Any] = (b.drop_columns([ROUTE_COL]) if ROUTE_COL in b.schema.names else b for b in batches)

            def propose(cut: Cut, overflow: bool) -> Cut:
                reply: CutReply = ask(conn, TaskCutRequest(token, cut.group, overflow, cut.rows))
                return Cut(reply.cut, reply.rows)

            initial_rows = 0
            if declared.get("initial"):   # decision 0028: the initial state's rows come first, applied before
                cleaned, initial_rows = apply_initial(cleaned, declared["initial"], key, backend, typed, form,
                                                      f"keyed state {name!r}, checkpoint {checkpoint_id}, subtask "
                                                      f"{subtask}, its initial state")
            counters: dict[str, Any] = {"initial_rows": initial_rows}   # counted as the input is read
            event = EventTime(**declared["event_time"]) if declared.get("event_time") else None
            if event is not None:   # decision 0028: late rows dropped or flagged, event times counted, as they
                # arrive: a row a cut defers is judged by this batch's watermark, never again when replayed
                cleaned = _judged(cleaned, event, declared.get("watermark_ms"), counters)
            chunk_rows = _chunk_rows(TaskContext.get()) if form == "chunks" else None
            source, writer, _ = unaligned_input(
                opened.to_wire(), cleaned, key, kg, m, propose,
                f"subtask {subtask} of checkpoint {checkpoint_id} of keyed state {name!r}", counters=counters,
                late_flag=None if event is None else event.late == "keep", chunk_rows=chunk_rows)
            if form == "arrow":   # one call with all the rows, up to the spill threshold; unaligned: per buffer
                options: dict[str, Any] = {
                    "max_input_bytes": None if writer is not None else _spill_threshold(TaskContext.get())}
            else:
                options = _pandas_options(TaskContext.get(), key_group_ordered=writer is not None)
                options["chunk_rows"] = chunk_rows
            outputs = runner(source, key, fn, backend, schema, states=typed, counters=counters, **options)
            if on_timer is not None:   # after the input: the due timers, of keys with and without input
                outputs = itertools.chain(outputs, fire(on_timer, "arrow" if form == "arrow" else "pandas",
                                                        backend, typed, schema, counters,
                                                        held=lambda: None if writer is None else writer.deferred_keys))
            for out in outputs:
                counters["rows_out"] = counters.get("rows_out", 0) + out.num_rows
                yield out
            swept = sweep_both(typed, checkpoint_id, int(declared.get("sweep") or 100_000))
            if swept is not None:
                counters.update(ttl_expired_removed=swept.deleted, ttl_sweep_ms=int(swept.ms),
                                ttl_timers_dropped=swept.timers_dropped)
            channel = writer.close() if writer is not None else None
            writer = None
            counters["entries_estimate"] = backend.db.property_int_value("rocksdb.estimate-num-keys") or 0
            snap = backend.snapshot(opened.snapshot, keep_open=keep)  # the sync phase
        except BaseException:
            backend.close()   # a DB the task failed in is never kept
            raise
        if not keep:
            backend.close()
        counters["channel_bytes"] = channel.bytes if channel is not None else 0
        counters["wal_bytes"] = backend.wal_bytes  # the WAL this open replayed
        counters["entries_ingested"] = backend.entries_ingested
        counters.update(open_ms=open_ms, db_open_ms=db_open_ms, kept_open=int(kept))
        ask(conn, UploadRequest(token, snap.sync_ms, snap.flush_ms,   # the async phase
                                TaskCounters.counted(counters), keep=keep))
        uploaded = True
        if keep:
            _HELD.put(token, name, backend, limit)
            backend = None
    finally:
        if backend is not None and keep:
            backend.close()   # an upload the agent refused: the DB is not kept
        if writer is not None:
            writer.abort()
        if not uploaded:
            try:
                ask(conn, ReleaseRequest(token))
            except Exception:  # noqa: BLE001 - the task's own error matters more
                pass


def apply_initial(batches: Iterator[Any], spec: dict[str, Any], key: str, backend: Any, states: Any, form: str,
                  where: str) -> tuple[Iterator[Any], int]:
    """Run the initial state's function over the rows tagged :data:`INIT_COL` (which come first in the
    subtask), with its own columns, through the batch's runner; return the rest of the input with the
    input's columns, and how many initial rows there were. The function writes state and timers and
    returns nothing (anything else is refused)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from sparksteward.state.runner import run_arrow, run_pandas

    fn = spec["fn"]
    it = iter(batches)
    held: list[Any] = []
    rest: list[Any] = []
    for batch in it:
        n = int(pc.sum(batch.column(INIT_COL)).as_py() or 0)   # sorted: the tagged rows first
        if n:
            held.append(batch.slice(0, n).select(spec["columns"]))
        if n < batch.num_rows:
            rest.append(batch.slice(n))
            break

    def initial(first: Any, rows: Any, state: Any) -> None:
        if fn(first, rows, state) is not None:
            raise StateFunctionError(f"{where}: the initial state function writes state and timers and returns "
                                     f"nothing; it returned a value")

    runner = run_arrow if form == "arrow" else run_pandas
    for _ in runner(iter(held), key, guarded(initial, form, where), backend, pa.schema([]), states=states):
        pass
    columns = spec["input"]
    return (b.select(columns) for b in itertools.chain(rest, it)), sum(b.num_rows for b in held)


class _HeldDBs:
    """The DBs this Python worker keeps open after their uploads (decision 0026), by the open's token,
    oldest first; at most ``spark.steward.state.keep-open`` of them. Only a task of the same state and
    subtask takes one, and only when the executor agent names it as exactly its base. A DB closed here
    on its own is named to the agent at the next open of its state (``dropped``), so its dir goes."""

    def __init__(self) -> None:
        self._dbs: dict[str, tuple[str, Any]] = {}   # token -> (state, backend)
        self._dropped: dict[str, list[str]] = {}     # state -> tokens closed here since its last open
        self._pid = os.getpid()

    def _mine(self) -> None:
        if self._pid != os.getpid():   # a forked child holds none of its parent's DBs
            self._dbs, self._dropped, self._pid = {}, {}, os.getpid()

    def of(self, name: str) -> list[str]:
        self._mine()
        return [t for t, (n, _) in self._dbs.items() if n == name]

    def take_dropped(self, name: str) -> list[str]:
        self._mine()
        return self._dropped.pop(name, [])

    def drop_later(self, name: str, tokens: list[str]) -> None:
        self._dropped.setdefault(name, []).extend(tokens)

    def take(self, token: str) -> Any:
        entry = self._dbs.pop(token, None)
        return entry[1] if entry is not None else None

    def close(self, tokens: list[str]) -> None:
        for token in tokens:
            entry = self._dbs.pop(token, None)
            if entry is not None:
                entry[1].close()

    def put(self, token: str, name: str, backend: Any, limit: int) -> None:
        self._mine()
        self._dbs[token] = (name, backend)
        while len(self._dbs) > limit:
            old = next(iter(self._dbs))
            old_name, old_backend = self._dbs.pop(old)
            old_backend.close()
            self._dropped.setdefault(old_name, []).append(old)


_HELD = _HeldDBs()


def _keep_open(ctx: Any) -> int:
    """``spark.steward.state.keep-open`` from the task's local properties (0: close each batch's DB)."""
    from sparksteward.config import StewardConfig

    key = "spark.steward.state.keep-open"
    raw = ctx.getLocalProperty(key) if ctx is not None else None
    return StewardConfig.from_conf({key: raw} if raw else {}).state_keep_open


def _spill_threshold(ctx: Any) -> int:
    """``spark.steward.state.spill-threshold`` from the task's local properties."""
    from sparksteward.config import StewardConfig

    spill_key = "spark.steward.state.spill-threshold"
    raw = ctx.getLocalProperty(spill_key) if ctx is not None else None
    return StewardConfig.from_conf({spill_key: raw} if raw else {}).state_spill_threshold


def _chunk_rows(ctx: Any) -> int:
    """``spark.steward.state.chunk-rows`` from the task's local properties: the rows of one chunk of the
    ``form="chunks"`` function (decision 0028)."""
    from sparksteward.config import StewardConfig

    chunk_key = "spark.steward.state.chunk-rows"
    raw = ctx.getLocalProperty(chunk_key) if ctx is not None else None
    return StewardConfig.from_conf({chunk_key: raw} if raw else {}).state_chunk_rows


def _pandas_options(ctx: Any, key_group_ordered: bool) -> dict[str, Any]:
    """Options of :func:`~sparksteward.state.runner.run_pandas` from the task's local properties, which
    carry the session's conf (Spark SQL propagates every ``spark.*`` setting to its tasks): the spill
    threshold (``spark.steward.state.spill-threshold``) and the output batch size (Spark's
    ``spark.sql.execution.arrow.maxRecordsPerBatch``; 0 or less means unlimited to Spark, the default
    here). With ``key_group_ordered`` (an unaligned subtask) keys are called per key group."""
    from sparksteward.state.runner import DEFAULT_OUTPUT_ROWS

    threshold = _spill_threshold(ctx)
    try:
        rows = int(ctx.getLocalProperty("spark.sql.execution.arrow.maxRecordsPerBatch") or 0)
    except ValueError:
        rows = 0
    return {"spill_threshold": threshold, "max_output_rows": rows if rows > 0 else DEFAULT_OUTPUT_ROWS,
            "key_group_ordered": key_group_ordered}


def _judged(batches: Iterator[Any], event: Any, watermark_ms: int | None, counters: dict[str, Any]) -> Iterator[Any]:
    """The new input judged by the batch's watermark (:func:`~sparksteward.state.event_time.judge`), before
    the cut; a late flag goes before the key-group column, where a replayed row has it."""
    from sparksteward.state.event_time import judge

    for b in judge(batches, event, watermark_ms, counters):
        if KG_COL in b.schema.names and b.schema.names[-1] != KG_COL:
            i = b.schema.get_field_index(KG_COL)
            b = b.drop_columns([KG_COL]).append_column(b.schema.field(i), b.column(i))
        yield b


def _flagged(replayed: Iterator[Any], keep: bool) -> Iterator[Any]:
    """Replayed rows as the new rows come with ``late="keep"`` (``keep``: with a late flag, False where
    channel state written before the judging moved before the cut has none) or ``"drop"`` (without one,
    the rows flagged late under ``"keep"`` left out): a state reopened with the other choice still
    replays its backlog."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from sparksteward.state.event_time import LATE_COLUMN

    for b in replayed:
        has = LATE_COLUMN in b.schema.names
        if keep and not has:
            b = b.append_column(pa.field(LATE_COLUMN, pa.bool_(), nullable=False),
                                pa.array([False] * b.num_rows, pa.bool_()))
        elif not keep and has:
            b = b.filter(pc.invert(b.column(LATE_COLUMN))).drop_columns([LATE_COLUMN])
        yield b


def unaligned_input(opened: dict[str, Any], batches: Iterator[Any], key: str, kg: Any, m: int,
                    propose: Callable[[Any, bool], Any], what: str, *, counters: dict[str, Any] | None = None,
                    late_flag: bool | None = None, chunk_rows: int | None = None) -> tuple[Iterator[Any], Any, dict[str, Any]]:
    """A subtask's input (FLIP-76): the base's channel state (filtered by key group after a rescale)
    and its own batches; aligned, the channel state first; with an unaligned alignment (or a cut
    another attempt recorded), both in key-group order, and the rows from the cut on go to a
    channel-state writer instead (returned, for the caller to close), with the counts of the rows
    processed and deferred (fields of :class:`~sparksteward.checkpoint.messages.TaskCounters`).
    ``opened``: the ``state.open`` reply's JSON object; ``counters``: the dict to count in; ``late_flag``:
    with an event-time column, whether the new rows carry a late flag (``late="keep"``): replayed rows are
    made to match (None: no event time). ``chunk_rows`` (``form="chunks"``): the cut may fall inside a key
    group, whose rows then come in content order, in batches of that many rows. See
    :mod:`sparksteward.checkpoint.unaligned.task_cut`."""

    from sparksteward.checkpoint.begun import Cut
    from sparksteward.checkpoint.unaligned.channel_state import (
        AlignmentMode,
        AlignmentOptions,
        ChannelStateWriter,
        read_channel_state,
        replay,
    )
    from sparksteward.checkpoint.unaligned.task_cut import iter_cut, merge_by_key_group
    from sparksteward.state.keygroups import key_groups

    sources = [(r["name"], r["path"]) for r in opened.get("replay") or []]
    if sources and opened.get("replay_filter"):
        replayed: Iterator[Any] = replay(sources, key, kg, m, opened["key_type"])
    else:
        replayed = (b for n, path in sources for b in read_channel_state(path, n))
    if late_flag is not None:
        replayed = _flagged(replayed, late_flag)
    replayed, batches = _one_schema(replayed, batches, what)
    alignment = AlignmentOptions.from_json(opened.get("alignment"))
    cut = None if opened.get("cut") is None else Cut(opened["cut"], opened.get("cut_rows") or 0)
    deadline_in = opened.get("deadline_in")
    deadline = time.monotonic() + float(deadline_in or 0)
    writer = None
    counters = {} if counters is None else counters
    if (alignment.unaligned and deadline_in is not None) or (cut is not None and cut < Cut(kg.stop)):
        cap = alignment.max_inflight_bytes if alignment.alignment is AlignmentMode.UNALIGNED_MAX_INFLIGHT else None
        writer = ChannelStateWriter(opened["channel"], max_bytes=cap, key=key)
    if writer is None:   # aligned: everything, with no key-group column to drop when none was added
        source = itertools.chain(replayed, (b.drop_columns([KG_COL]) if KG_COL in b.schema.names else b
                                            for b in batches))
        return _count_rows(source, counters), None, counters
    passed = None if cut is not None or deadline_in is None else (lambda: time.monotonic() >= deadline)

    def groups_of(batch: Any) -> Any:
        import pyarrow as pa

        return pa.array(key_groups(batch.column(key).to_pylist(), m, opened["key_type"]), pa.int32())

    # content order where a cut may fall inside a key group: this attempt's chunks, or a recorded cut that
    # does (an attempt of another form follows it all the same)
    order = chunk_rows or (65536 if cut is not None and cut.rows else None)
    merged = merge_by_key_group(replayed, batches, kg_column=KG_COL, key_groups=groups_of,
                                within=None if not order else (key, order))
    return (iter_cut(merged, kg_column=KG_COL, start=kg.start, stop=kg.stop, cut=cut, deadline_passed=passed,
                     propose=propose, writer=writer, counters=counters, what=what, within=bool(chunk_rows)),
            writer, counters)


def _one_schema(replayed: Iterator[Any], batches: Iterator[Any], what: str) -> tuple[Iterator[Any], Iterator[Any]]:
    """``replayed`` and ``batches`` as they are, but a new row whose columns (names and types) differ
    from those of the replayed channel state raises :class:`StateError`: the deferred rows of an
    unaligned batch and the new input of another schema cannot be processed by one function."""
    seen: list[Any] = []

    def first(source: Iterator[Any]) -> Iterator[Any]:
        for b in source:
            if b.num_rows and not seen:
                seen.append(b.schema)
            yield b

    def columns(schema: Any) -> list[tuple[str, Any]]:
        return [(f.name, f.type) for f in schema if f.name != KG_COL]

    def checked(source: Iterator[Any]) -> Iterator[Any]:
        for b in source:
            if b.num_rows and seen and columns(b.schema) != columns(seen[0]):
                old = ", ".join(f"{n} {t}" for n, t in columns(seen[0]))
                new = ", ".join(f"{n} {t}" for n, t in columns(b.schema))
                raise StateError(
                    f"{what}: its new input has columns ({new}), but the rows an unaligned batch deferred into "
                    f"the base checkpoint (channel state, processed first) have columns ({old}); one function "
                    f"cannot process both. Drain the deferred rows with an aligned batch (ks.drain(...)) before "
                    f"changing the input schema, then apply the new input")
            yield b

    return first(replayed), checked(batches)


def _count_rows(source: Iterator[Any], counters: dict[str, int]) -> Iterator[Any]:
    counters.update(rows_processed=0, rows_deferred=0, unaligned=0)
    for batch in source:
        counters["rows_processed"] += batch.num_rows
        yield batch


def read_fn(checkpoint_dir: str, name: str, cluster_id: str, meta_json: dict[str, Any], variable: str | None,
            now_ms: int, storage_options: dict[str, dict[str, Any]] | None = None
            ) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The ``mapInArrow`` function of a distributed read: each input row is a subtask index.

    ``storage_options`` (``spark.steward.storage.options``, parsed) travel in the closure: the Python
    worker opens the checkpoint with them, whatever its environment holds."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            for index in batch.column(0).to_pylist():
                table = read_table(checkpoint_dir, name, cluster_id, meta_json, variable, subtasks=[index],
                                   now_ms=now_ms, storage_options=storage_options)
                yield from table.to_batches(max_chunksize=65536)

    return run


def read_table(checkpoint_dir: str, name: str, cluster_id: str, meta_json: dict[str, Any],
               variable: str | None = None, subtasks: list[int] | None = None, now_ms: int | None = None,
               storage_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """Every entry of ``variable`` (None: the default value state) of a completed checkpoint (of the
    given ``subtasks``, default all), restored into a scratch dir of this process, as a pyarrow Table
    (see :mod:`sparksteward.checkpoint.reader`). Every store it opens (the state's, and those of files
    a restored checkpoint left elsewhere) is opened with ``storage_options`` per protocol."""
    from sparksteward.checkpoint.reader import read_variable
    from sparksteward.checkpoint.records import CheckpointMetadata
    from sparksteward.checkpoint.storage import CheckpointStorage
    from sparksteward.storage import options_scope

    with options_scope(storage_options or {}):
        storage = CheckpointStorage.open(checkpoint_dir, name, cluster_id)
        meta = CheckpointMetadata.from_bytes(orjson.dumps(meta_json), f"checkpoint {meta_json.get('checkpoint_id')}")
        return read_variable(storage, meta, variable, subtasks=subtasks, now_ms=now_ms)

