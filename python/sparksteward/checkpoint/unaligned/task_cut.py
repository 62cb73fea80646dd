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
- **Inside a key group** (decision 0028): a function that takes a key's rows in chunks
  (``form="chunks"``) may be cut between two chunks of one key, so a hot key no longer holds the cut
  back for its whole call. The cut is then the pair ``(c, n)``: key group ``c`` after its first ``n``
  rows, in an order every attempt finds alike: by key, the replayed rows first, then the new rows by
  the content of every column (rows equal in all columns are interchangeable, so "the first ``n``" is
  one multiset of rows). The rest of the key's rows come first in its call of the next batch.
- The first attempt to reach its timeout (at a buffer boundary, after a key group's last row) or its
  end proposes its position to the coordinator (``state.cut``), which records the first proposal and
  answers once it is durable in the begun record (:mod:`~sparksteward.checkpoint.begun`), so a
  delivery of the batch after a driver restart cuts the same; the completed checkpoint keeps the cuts
  in ``properties.cuts`` (and ``properties.cut_rows``) for re-runs. An attempt that opens after
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

from sparksteward.checkpoint.begun import Cut
from sparksteward.checkpoint.unaligned.channel_state import ChannelStateWriter
from sparksteward.errors import CheckpointOrderError

__all__ = ["iter_cut", "merge_by_key_group"]

_PHASE = "__steward_phase"   # 0: replayed, 1: new; sorted after the key group

#: propose(cut, overflow) -> the cut that stands
Propose = Callable[[Cut, bool], Cut]


def merge_by_key_group(replayed: Iterable[pa.RecordBatch], batches: Iterable[pa.RecordBatch], *,
                       kg_column: str, key_groups: Callable[[pa.RecordBatch], pa.Array],
                       within: tuple[str, int] | None = None) -> Iterator[pa.RecordBatch]:
    """One subtask's input in key-group order, with ``kg_column``: per key group the ``replayed`` rows
    (which lack the column: ``key_groups(batch)`` computes it) in their order, then the new ``batches``
    (which carry it). Held in memory: the backlog and one partition of one batch.

    ``within=(key, chunk_rows)``: a cut may fall inside a key group (decision 0028), so its rows come in
    an order every attempt finds alike, whatever order the shuffle delivered them in: by key, then the
    replayed rows before the new ones, then by every column (rows equal in all are interchangeable), in
    batches of at most ``chunk_rows`` rows (where the cut checks its deadline)."""
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
    order = [(kg_column, "ascending"), (_PHASE, "ascending")]
    if within is not None:
        key, chunk = within
        table, order = _content_order(table, key, kg_column)
    table = table.take(pc.sort_indices(table, sort_keys=order))
    yield from table.drop_columns([c for c in table.column_names if c.startswith(_PHASE)]).to_batches(
        max_chunksize=max(1, chunk))


def _content_order(table: pa.Table, key: str, kg_column: str) -> tuple[pa.Table, list[tuple[str, str]]]:
    """``table`` (with a sortable stand-in for each column Arrow cannot sort: its values' JSON) and the
    sort keys (key group, key, phase, every column) of a content order."""
    import orjson

    order = [(kg_column, "ascending"), (key, "ascending"), (_PHASE, "ascending")]
    for i, name in enumerate(list(table.column_names)):
        if name in (kg_column, key, _PHASE):
            continue
        column = table.column(name)
        try:
            pc.sort_indices(column.slice(0, 2))
        except (pa.ArrowTypeError, pa.ArrowNotImplementedError, pa.ArrowInvalid):
            stand_in = f"{_PHASE}_{i}"
            option = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
            values = [orjson.dumps(v, option=option, default=repr) for v in column.to_pylist()]
            table = table.append_column(stand_in, pa.array(values, pa.binary()))
            name = stand_in
        order.append((name, "ascending"))
    return table, order


def iter_cut(batches: Iterable[pa.RecordBatch], *, kg_column: str,
             start: int, stop: int, cut: Cut | None, deadline_passed: Callable[[], bool] | None,
             propose: Propose, writer: ChannelStateWriter | None, counters: dict[str, int],
             what: str = "this subtask", within: bool = False) -> Iterator[pa.RecordBatch]:
    """The batches a subtask processes (without ``kg_column``): its input (replayed and new rows,
    sorted by ``kg_column``: :func:`merge_by_key_group`) before the cut; the rest go to ``writer``.

    ``cut``: the recorded cut (None: not recorded yet; the first deadline or the end proposes one).
    ``deadline_passed``: None when this attempt has no timeout (aligned, or a recorded cut).
    ``within``: the deadline may cut inside a key group, before the next row (its input in content order,
    :func:`merge_by_key_group` with ``within``); otherwise at the next key-group boundary. A recorded cut
    inside a key group is followed either way.
    ``counters`` gets ``rows_processed``, ``rows_deferred`` and ``unaligned`` (1 when rows stay deferred).
    """
    for name in ("rows_processed", "rows_deferred", "unaligned"):
        counters.setdefault(name, 0)
    done = Cut(start)   # the position after the last row processed: key group, rows of it processed
    end = Cut(stop)

    def conflict(recorded: Cut) -> CheckpointOrderError:
        return CheckpointOrderError(
            f"{what}: another attempt of this checkpoint cut its input at key group {recorded.group} (after "
            f"{recorded.rows} of its rows), but this attempt already processed up to key group {done.group} (its "
            f"{done.rows} rows); this attempt is discarded (Spark's retry follows the recorded cut, so every attempt "
            f"emits the same rows)")

    def processed(rows: pa.RecordBatch, kgs: np.ndarray) -> pa.RecordBatch:
        nonlocal done
        last = int(kgs[-1])
        same = len(kgs) - int(np.searchsorted(kgs, last, side="left"))   # rows of the last key group
        done = Cut(last, same + (done.rows if done.group == last else 0))
        counters["rows_processed"] += rows.num_rows
        return rows

    for batch in batches:
        if batch.num_rows == 0:
            continue
        kgs = batch.column(kg_column).to_numpy(zero_copy_only=False)
        rows = batch.drop_columns([kg_column])
        if cut is None and writer is not None and deadline_passed is not None and done.rows and deadline_passed():
            first = int(kgs[0])
            proposal = Cut(first, done.rows if first == done.group else 0) if within else Cut(done.group + 1)
            cut = propose(proposal, False)
            if cut < done:
                raise conflict(cut)
        if cut is None or cut >= end:
            yield processed(rows, kgs)
            continue
        split = int(np.searchsorted(kgs, cut.group, side="left"))
        if cut.rows:   # inside key group cut.group: its first cut.rows rows, counting those processed before
            before = done.rows if done.group == cut.group else 0
            here = int(np.searchsorted(kgs, cut.group, side="right")) - split
            split += max(0, min(here, cut.rows - before))
        head, tail = rows.slice(0, split), rows.slice(split)
        if head.num_rows:
            yield processed(head, kgs[:split])
        if not tail.num_rows:
            continue
        if writer is None:
            raise CheckpointOrderError(f"{what} must defer input past key group {cut.group} but has no "
                                       f"channel-state writer: open the state with an unaligned alignment")
        if writer.append(tail):
            counters["rows_deferred"] += tail.num_rows
            continue
        # over the byte cap: every attempt at this cut finds the same, so the cut moves to the end
        stands = propose(cut, True)
        if stands < end:
            raise conflict(stands)
        cut = end
        for back in writer.take_back():
            counters["rows_deferred"] -= back.num_rows
            counters["rows_processed"] += back.num_rows
            yield back
        writer = None
        yield processed(tail, kgs[split:])
    if cut is None and writer is not None:   # the end, before any timeout: nothing deferred
        cut = propose(end, False)
        if cut < done:
            raise conflict(cut)
    counters["unaligned"] = 1 if counters["rows_deferred"] else 0
