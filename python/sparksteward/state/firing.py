"""Firing a subtask's due timers after its input (issue 38 slice 2, decision 0028).

After the function ran over a batch's input, the task finds the timers of its key groups that are due
at the batch's processing time and watermark (:func:`~sparksteward.state.timers.due`: one range scan
per key group and domain) and calls the timer callback for every such key, **with or without input in
the batch**; what it returns joins the batch's output:

- per-key form: ``on_timer(key, timers, state)`` once per key, ``timers`` its due
  :class:`~sparksteward.state.timers.Timer` s earliest first, ``state`` as in ``fn``;
- Arrow form: ``on_timer(keys, expired, state)`` once per subtask, ``expired`` a table of ``key``,
  ``time`` and ``at`` (epoch ms) of every due timer, ``keys`` its distinct keys.

A timer is deleted just before its callback, in the same writes as what the callback writes, so it
fires once per completed checkpoint: an attempt that fails leaves its DB behind, and a re-run starts
from the base, where the timer is still registered, and fires it again with the same time, so with
the same output. The due timers are collected before the first callback: a timer a callback
registers at or before the batch's time fires in the next batch, never in a loop. On an unaligned
subtask, the timers of a key whose rows the cut deferred wait with them: they fire in the batch that
processes those rows, after them, so a key's timers never overtake its own rows; the timers of the
other keys, deferred key groups included, fire as in an aligned batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyType, decode_key
from sparksteward.state.runner import DEFAULT_OUTPUT_ROWS, KeyedStateAccess, KeyState, _conform, _Output
from sparksteward.state.timers import Timer, due, due_columns, forget, forget_all, forget_at, next_processing
from sparksteward.state.typed import TypedStates

__all__ = ["fire", "fire_arrow", "fire_pandas"]



def _due(access: KeyedStateAccess, counters: dict[str, Any] | None,
         held: set[object] | None) -> list[tuple[bytes, bytes, Timer]]:
    """The subtask's due timers but those of the keys in ``held``, collected before any callback runs,
    counted as ``timers_fired``."""
    states = access.states
    fired = [] if states is None else list(due(access.backend, states.now_ms, states.watermark_ms))
    if held:
        key_type = access.backend.key_type
        fired = [f for f in fired if decode_key(f[1], key_type) not in held]
    if counters is not None:
        counters["timers_fired"] = len(fired)
    return fired


def fire_pandas(on_timer: Callable[..., Any], access: KeyedStateAccess, schema: pa.Schema, *,
                max_output_rows: int = DEFAULT_OUTPUT_ROWS, counters: dict[str, Any] | None = None,
                held: set[object] | None = None) -> Iterator[pa.RecordBatch]:
    """``on_timer(key, timers, state)`` for every key with due timers (see the module docstring)."""
    fired = _due(access, counters, held)
    if not fired:
        return
    backend: RocksDBStateBackend = access.backend
    by_key: dict[tuple[bytes, bytes], list[Timer]] = {}
    for group, raw, timer in fired:
        by_key.setdefault((group, raw), []).append(timer)
    output = _Output(schema, max_output_rows)
    with backend.buffered() as store:   # one write batch, as the input's calls
        for (group, raw), timers in by_key.items():
            store.next_key()
            wb = backend.new_batch()
            for timer in timers:
                forget(wb, group, raw, timer)
            store.write(wb)
            key = decode_key(raw, backend.key_type)
            result = on_timer(key, sorted(timers, key=lambda t: (t.at, t.time)), KeyState(access, key))
            if result is not None:
                yield from output.add(result, key)
    yield from output.flush()


def fire_arrow(on_timer: Callable[..., Any], access: KeyedStateAccess, schema: pa.Schema, *,
               counters: dict[str, Any] | None = None, held: set[object] | None = None) -> Iterator[pa.RecordBatch]:
    """``on_timer(keys, expired, state)`` once with every due timer of the subtask (see the module docstring).
    Vectorized: one key listing per key group and domain, the keys and times decoded as arrays, the fired
    by-time entries deleted with one range delete per key group and domain."""
    states = access.states
    if states is None:
        return
    backend = access.backend
    fired = due_columns(backend, states.now_ms, states.watermark_ms)
    keys = _keys(fired.raws, backend.key_type)
    domains = pa.array(fired.domains, pa.binary())
    ats = pa.array(fired.ats, pa.int64())
    wb = backend.new_batch()
    if held:   # a key with rows the cut deferred keeps its timers: delete the others one by one
        fire_mask = pc.invert(pc.is_in(keys, value_set=pa.array(list(held), keys.type)))
        picked = np.flatnonzero(fire_mask.to_numpy(zero_copy_only=False))
        for i in picked.tolist():
            forget_at(wb, fired, i)
        keys, domains, ats = keys.filter(fire_mask), domains.filter(fire_mask), ats.filter(fire_mask)
    else:
        forget_all(wb, fired)
    if counters is not None:
        counters["timers_fired"] = len(keys)
    if not len(keys):
        return
    backend.store.write(wb)
    times = pc.if_else(pc.equal(domains, pa.scalar(b"e", pa.binary())), "event", "processing")
    expired = pa.table({"key": keys, "time": times, "at": ats})
    out = _conform(on_timer(pc.unique(keys), expired, access), schema)
    if out is not None:
        yield out


def _keys(raws: list[bytes], key_type: KeyType) -> pa.Array:
    """Keys from their canonical bytes (:func:`~sparksteward.state.keygroups.key_bytes`), at once."""
    if key_type is KeyType.STRING:
        return pa.array(raws, pa.binary()).cast(pa.string())
    if key_type is KeyType.BINARY:
        return pa.array(raws, pa.binary())
    dtype, arrow = ("<i8", pa.int64()) if key_type is KeyType.LONG else ("<i4", pa.int32())
    return pa.array(np.frombuffer(b"".join(raws), dtype=dtype).astype(dtype[1:]), arrow)


def fire(on_timer: Callable[..., Any], form: str, backend: RocksDBStateBackend, states: TypedStates,
         schema: pa.Schema, counters: dict[str, Any] | None = None,
         held: Callable[[], set[object] | None] | None = None) -> Iterator[pa.RecordBatch]:
    """The due timers of the subtask of ``backend`` at the time of ``states``, in the function's ``form``;
    ``held()``, asked once the input is read: the keys whose rows an unaligned cut deferred (their timers
    fire in a later batch, after those rows), None for none."""
    access = KeyedStateAccess(backend, states=states)
    keys = None if held is None else held()
    fired = fire_arrow(on_timer, access, schema, counters=counters, held=keys) if form == "arrow" else \
        fire_pandas(on_timer, access, schema, counters=counters, held=keys)
    yield from fired
    if counters is not None:   # what the idle watcher waits for (keyed_idle.py)
        counters["next_timer_ms"] = next_processing(backend)
        if states.event_time:
            counters["next_event_timer_ms"] = next_processing(backend, "event")
