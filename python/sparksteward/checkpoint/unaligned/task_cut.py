"""FLIP-76 cuts: where an unaligned subtask stops processing new input, the same for every attempt.

An unaligned subtask defers the input it has not processed when its aligned-checkpoint timeout
passes. If each attempt of checkpoint N (a second action, a recomputed partition, a speculative
copy, a re-run of a completed batch) decided by its own clock where to stop, each would emit other
rows and defer others, and the last ack would keep a state that does not match the rows the sink
wrote. So the point is decided once per subtask and checkpoint:

- The task processes its input in key-group order (:func:`merge_by_key_group`): for each key group,
  the base's replayed channel state first, then the new rows, so a key's deferred rows still come
  before its new ones. "Every row whose key group is below ``c``" is then the same set of rows in
  every attempt, whatever order the shuffle delivered them in. The **cut** ``c`` of a subtask is the
  first key group it defers (replayed and new rows alike); the end of its key-group range means
  nothing is deferred. A straggler thus processes about one timeout's worth of work per batch; the
  rest, the older backlog included, waits for the next batch or a drain.
- The first attempt to reach its timeout (at a buffer boundary, after a key group's last row) or its
  end proposes its position to the coordinator (``state.cut``), which records the first proposal and
  answers once it is durable in the begun record (:mod:`~sparksteward.checkpoint.begun`), so a
  delivery of the batch after a driver restart cuts the same; the completed checkpoint keeps the cuts
  in ``properties.cuts`` for re-runs. An attempt that opens after
  a cut was recorded follows it, clock or not. An attempt that learns of a cut later than its
  position keeps processing up to it; one that already processed past it raises, and Spark's retry
  follows the recorded cut.
- ``unaligned_max_inflight``: the deferred rows pass the byte cap or not by their logical size
  (:func:`~sparksteward.checkpoint.unaligned.channel_state.logical_size`), which does not depend on how rows are chunked, so every attempt at one cut finds the same; the
  first to find it moves the cut to the end of the range (process everything), and the others follow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparksteward.checkpoint.unaligned.channel_state import ChannelStateWriter
from sparksteward.errors import CheckpointOrderError

__all__ = ["iter_cut", "merge_by_key_group"]

_PHASE = "__steward_phase"   # 0: replayed, 1: new; sorted after the key group

#: propose(cut, overflow) -> the cut that stands
Propose = Callable[[int, bool], int]


def merge_by_key_group(replayed: Iterable[pa.RecordBatch], batches: Iterable[pa.RecordBatch], *,
                       kg_column: str, key_groups: Callable[[pa.RecordBatch], pa.Array]) -> Iterator[pa.RecordBatch]:
    """One subtask's input in key-group order, with ``kg_column``: per key group the ``replayed`` rows
    (which lack the column: ``key_groups(batch)`` computes it) in their order, then the new ``batches``
    (which carry it). Held in memory: the backlog and one partition of one batch."""
    tables = []
    for phase, source in ((0, replayed), (1, batches)):
        items = [b for b in source if b.num_rows]
        if not items:
            continue
        if phase == 0:
            items = [b.append_column(kg_column, key_groups(b)) for b in items]
        t = pa.Table.from_batches(items)
        tables.append(t.append_column(_PHASE, pa.array([phase] * t.num_rows, pa.int8())))
    if not tables:
        return
    table = pa.concat_tables(tables)
    chunk = max(b.num_rows for t in tables for b in t.to_batches())
    table = table.take(pc.sort_indices(table, sort_keys=[(kg_column, "ascending"), (_PHASE, "ascending")]))
    yield from table.drop_columns([_PHASE]).to_batches(max_chunksize=chunk)


def iter_cut(batches: Iterable[pa.RecordBatch], *, kg_column: str,
             start: int, stop: int, cut: int | None, deadline_passed: Callable[[], bool] | None,
             propose: Propose, writer: ChannelStateWriter | None, counters: dict[str, int],
             what: str = "this subtask") -> Iterator[pa.RecordBatch]:
    """The batches a subtask processes (without ``kg_column``): its input (replayed and new rows,
    sorted by ``kg_column``: :func:`merge_by_key_group`) below the cut; the rest go to ``writer``.

    ``cut``: the recorded cut (None: not recorded yet; the first deadline or the end proposes one).
    ``deadline_passed``: None when this attempt has no timeout (aligned, or a recorded cut).
    ``counters`` gets ``rows_processed``, ``rows_deferred`` and ``unaligned`` (1 when rows stay deferred).
    """
    for key in ("rows_processed", "rows_deferred", "unaligned"):
        counters.setdefault(key, 0)
    processed = False
    last: int | None = None   # the key group of the last new row processed

    def conflict(recorded: int) -> CheckpointOrderError:
        return CheckpointOrderError(
            f"{what}: another attempt of this checkpoint cut its input at key group {recorded}, but this attempt "
            f"already processed key group {last}; this attempt is discarded (Spark's retry follows the recorded "
            f"cut, so every attempt emits the same rows)")

    for batch in batches:
        if batch.num_rows == 0:
            continue
        kgs = batch.column(kg_column)
        rows = batch.drop_columns([kg_column])
        if cut is None and writer is not None and deadline_passed is not None and processed and deadline_passed():
            proposal = start if last is None else last + 1
            cut = propose(proposal, False)
            if cut < proposal:
                raise conflict(cut)
        if cut is None or cut >= stop:
            counters["rows_processed"] += rows.num_rows
            processed = True
            last = int(kgs[-1].as_py())
            yield rows
            continue
        split = int(np.searchsorted(kgs.to_numpy(zero_copy_only=False), cut, side="left"))
        head, tail = rows.slice(0, split), rows.slice(split)
        if head.num_rows:
            counters["rows_processed"] += head.num_rows
            processed = True
            last = int(kgs[split - 1].as_py())
            yield head
        if not tail.num_rows:
            continue
        if writer is None:
            raise CheckpointOrderError(f"{what} must defer input past key group {cut} but has no channel-state "
                                       f"writer: open the state with an unaligned alignment")
        if writer.append(tail):
            counters["rows_deferred"] += tail.num_rows
            continue
        # over the byte cap: every attempt at this cut finds the same, so the cut moves to the end
        stands = propose(cut, True)
        if stands < stop:
            raise conflict(stands)
        cut = stop
        for back in writer.take_back():
            counters["rows_deferred"] -= back.num_rows
            counters["rows_processed"] += back.num_rows
            yield back
        writer = None
        counters["rows_processed"] += tail.num_rows
        last = int(kgs[-1].as_py())
        yield tail
    if cut is None and writer is not None:   # the end, before any timeout: nothing deferred
        cut = propose(stop, False)
        if cut < stop and last is not None and last >= cut:
            raise conflict(cut)
    counters["unaligned"] = 1 if counters["rows_deferred"] else 0
