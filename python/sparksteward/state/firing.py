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

import pyarrow as pa
import pyarrow.compute as pc

from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyType, decode_key
from sparksteward.state.runner import DEFAULT_OUTPUT_ROWS, KeyedStateAccess, KeyState, _conform, _Output
from sparksteward.state.timers import Timer, due, forget, next_processing
from sparksteward.state.typed import TypedStates

__all__ = ["fire", "fire_arrow", "fire_pandas"]

_KEY_ARROW = {KeyType.STRING: pa.string(), KeyType.LONG: pa.int64(), KeyType.INT: pa.int32(),
              KeyType.BINARY: pa.binary()}


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
    """``on_timer(keys, expired, state)`` once with every due timer of the subtask (see the module docstring)."""
    fired = _due(access, counters, held)
    if not fired:
        return
    backend = access.backend
    wb = backend.new_batch()
    for group, raw, timer in fired:
        forget(wb, group, raw, timer)
    backend.store.write(wb)
    keys = pa.array([decode_key(raw, backend.key_type) for _, raw, _ in fired], _KEY_ARROW[backend.key_type])
    expired = pa.table({"key": keys, "time": pa.array([t.time for _, _, t in fired], pa.string()),
                        "at": pa.array([t.at for _, _, t in fired], pa.int64())})
    out = _conform(on_timer(pc.unique(keys), expired, access), schema)
    if out is not None:
        yield out


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
