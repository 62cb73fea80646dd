"""FLIP-76 cuts: where an unaligned subtask stops processing new input, the same for every attempt.

An unaligned subtask defers the input it has not processed when its aligned-checkpoint timeout
passes. If each attempt of checkpoint N (a second action, a recomputed partition, a speculative
copy, a re-run of a completed batch) decided by its own clock where to stop, each would emit other
rows and defer others, and the last ack would keep a state that does not match the rows the sink
wrote. So the point is decided once per subtask and checkpoint:

- The new input of an unaligned state reaches the task sorted by key group (``sortWithinPartitions``
  on the key-group column), so "every new row whose key group is below ``c``" is the same set of rows
  in every attempt, whatever order the shuffle delivered them in. The **cut** ``c`` of a subtask is the
  first key group whose new rows it defers; the end of its key-group range means nothing is deferred.
- The replayed channel state of the base is always processed whole, first: a key's deferred rows
  come before its new ones, and a backlog is never deferred twice.
- The first attempt to reach its timeout (at a buffer boundary, after a key group's last row) or its
  end proposes its position to the coordinator (``state.cut``), which records the first proposal; the
  completed checkpoint keeps the cuts in ``properties.cuts`` for re-runs. An attempt that opens after
  a cut was recorded follows it, clock or not. An attempt that learns of a cut later than its
  position keeps processing up to it; one that already processed past it raises, and Spark's retry
  follows the recorded cut.
- ``unaligned_max_inflight``: the deferred rows pass the byte cap or not by their :func:`logical_size`,
  (:func:`~sparksteward.checkpoint.channel.logical_size`),
  which does not depend on how rows are chunked, so every attempt at one cut finds the same; the
  first to find it moves the cut to the end of the range (process everything), and the others follow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa

from sparksteward.checkpoint.channel import ChannelStateWriter
from sparksteward.errors import CheckpointOrderError

__all__ = ["iter_cut"]

#: propose(cut, overflow) -> the cut that stands
Propose = Callable[[int, bool], int]


def iter_cut(replayed: Iterable[pa.RecordBatch], batches: Iterable[pa.RecordBatch], *, kg_column: str,
             start: int, stop: int, cut: int | None, deadline_passed: Callable[[], bool] | None,
             propose: Propose, writer: ChannelStateWriter | None, counters: dict[str, int],
             what: str = "this subtask") -> Iterator[pa.RecordBatch]:
    """The batches a subtask processes (without ``kg_column``): ``replayed`` whole, then the new
    ``batches`` (sorted by ``kg_column``) below the cut; the rest go to ``writer``.

    ``cut``: the recorded cut (None: not recorded yet; the first deadline or the end proposes one).
    ``deadline_passed``: None when this attempt has no timeout (aligned, or a recorded cut).
    ``counters`` gets ``rows_processed``, ``rows_deferred`` and ``unaligned`` (1 when rows stay deferred).
    """
    for key in ("rows_processed", "rows_deferred", "unaligned"):
        counters.setdefault(key, 0)
    processed = False
    for batch in replayed:
        if batch.num_rows:
            processed = True
            counters["rows_processed"] += batch.num_rows
            yield batch
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
