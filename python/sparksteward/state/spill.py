"""A subtask's input rows grouped by key in bounded memory: :class:`KeyedRowBuffer`.

The per-key form of :mod:`sparksteward.state.runner` calls its function once per key with every row of
the key in the batch, so it has to hold all of a key's rows before that call. The buffer keeps rows in
memory up to ``threshold`` bytes (their Arrow buffer sizes). Past that, it sorts what it holds by the
key column and writes it as one *run*: an Arrow IPC file in a scratch directory it creates under
``parent``. :meth:`KeyedRowBuffer.drain` returns the rows as tables sorted by key, and every row of a
key lands in the same table. With no runs, that is one table of everything held. With runs, it is a
k-way merge that reads each run one slice at a time, about ``threshold / 16`` bytes through a memory
map, and never splits a key across tables. Memory use is therefore the threshold, plus one slice per
run during the merge, plus the rows of the largest key. **One key's rows must fit in memory.**

Arrow does the key comparisons (``sort_indices``, ``less_equal``), so sorting and merging use the same
order for any orderable key type. A key's rows come back in arrival order, because runs are merged in
the order they were written and every sort is stable. Batches with the same column names and types are
accepted as one schema; nullability flags and schema metadata may differ between them.

Not thread-safe: one task uses one buffer. ``close()`` deletes the scratch directory and may be called
more than once. Use the buffer as a context manager so that an error, or a generator that is dropped
before it finishes, removes the spill files as well.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from sparksteward.errors import StateError

__all__ = ["KeyedRowBuffer"]

log = logging.getLogger("sparksteward.state.spill")

#: a run is read back in slices of about this fraction of the threshold
_SLICES_PER_THRESHOLD = 16


class KeyedRowBuffer:
    """Rows by key: in memory up to ``threshold`` bytes, then in sorted runs under ``parent``."""

    def __init__(self, key: str, threshold: int, parent: str | os.PathLike[str]) -> None:
        if threshold <= 0:
            raise StateError(f"spill threshold {threshold!r} must be a positive number of bytes")
        self.key = key
        self.threshold = int(threshold)
        self._parent = Path(parent)
        self._slice_bytes = max(1, self.threshold // _SLICES_PER_THRESHOLD)
        self._schema: pa.Schema | None = None
        self._held: list[pa.RecordBatch] = []
        self._held_bytes = 0
        self._runs: list[Path] = []
        self._dir: Path | None = None
        self._seq = 0
        #: runs written over the buffer's life (for tests and logs)
        self.runs_written = 0

    @property
    def directory(self) -> Path | None:
        """The scratch directory of the runs (None until the first spill or after :meth:`close`)."""
        return self._dir

    def add(self, batch: pa.RecordBatch) -> None:
        """Hold ``batch``'s rows, spilling everything held to a new run once it passes the threshold."""
        if batch.num_rows == 0:
            return
        if self._schema is None:
            self._schema = pa.schema([f.with_nullable(True) for f in batch.schema])
        elif [(f.name, f.type) for f in batch.schema] != [(f.name, f.type) for f in self._schema]:
            raise StateError(f"the input batches of one subtask have different columns: "
                             f"({_columns(self._schema)}) and ({_columns(batch.schema)}); give the keyed "
                             f"state one DataFrame schema per batch")
        self._held.append(pa.RecordBatch.from_arrays(batch.columns, schema=self._schema))
        self._held_bytes += batch.nbytes
        if self._held_bytes > self.threshold:
            self._spill()

    def drain(self) -> Iterator[pa.Table]:
        """Every row held, as tables sorted by key, with each key's rows all in one table; afterwards the
        buffer is empty (its runs are deleted)."""
        if not self._runs:
            if self._held:
                yield self._take_held()
            return
        runs, self._runs = self._runs, []
        sources = [_read_run(path) for path in runs]
        if self._held:
            sources.append(_slices(self._take_held(), self._slice_bytes))
        try:
            yield from _merge(sources, self.key)
        finally:
            for source in sources:
                source.close()
            for path in runs:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop what is held and delete the scratch directory (idempotent)."""
        self._held, self._held_bytes, self._runs = [], 0, []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            if self._dir.exists():
                log.warning("could not delete the spill directory %s", self._dir)
            self._dir = None

    def __enter__(self) -> KeyedRowBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take_held(self) -> pa.Table:
        table = pa.Table.from_batches(self._held, schema=self._schema)
        self._held, self._held_bytes = [], 0
        return _sorted(table, self.key)

    def _spill(self) -> None:
        table = self._take_held()
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="spill-", dir=self._parent))
        path = self._dir / f"run-{self._seq:05d}.arrow"
        self._seq += 1
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=_rows_per_slice(table, self._slice_bytes))
        self._runs.append(path)
        self.runs_written += 1
        log.debug("spilled %d rows (%d bytes in memory) to %s", table.num_rows, table.nbytes, path)


def _columns(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def _sorted(table: pa.Table, key: str) -> pa.Table:
    """``table`` stably sorted by ``key`` (rows of one key keep their order)."""
    return table.take(pc.sort_indices(table, sort_keys=[(key, "ascending")]))


def _rows_per_slice(table: pa.Table, slice_bytes: int) -> int:
    return max(1, table.num_rows * slice_bytes // max(table.nbytes, 1))


def _slices(table: pa.Table, slice_bytes: int) -> Generator[pa.RecordBatch, None, None]:
    yield from table.combine_chunks().to_batches(max_chunksize=_rows_per_slice(table, slice_bytes))


def _read_run(path: Path) -> Generator[pa.RecordBatch, None, None]:
    with pa.memory_map(str(path), "r") as source:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def _next(source: Iterator[pa.RecordBatch]) -> pa.RecordBatch | None:
    for batch in source:
        if batch.num_rows:
            return batch
    return None


def _count_le(batch: pa.RecordBatch, key: str, bound: pa.Scalar) -> int:
    """How many leading rows of ``batch`` (sorted by ``key``) have a key <= ``bound``."""
    return int(pc.sum(pc.less_equal(batch.column(key), bound)).as_py() or 0)


def _merge(sources: list[Generator[pa.RecordBatch, None, None]], key: str) -> Iterator[pa.Table]:
    """Merge sources whose batches are each sorted by ``key`` into tables sorted by ``key``. Each round
    takes every row up to the smallest last key among the current slices, plus the continuation of that
    key from the following slices. A later source can only hold keys at or above its own last key, so
    the keys in each table are complete."""
    heads = [_next(s) for s in sources]
    while True:
        live = [i for i, h in enumerate(heads) if h is not None]
        if not live:
            return
        lasts = [heads[i].column(key).slice(heads[i].num_rows - 1) for i in live]  # type: ignore[union-attr]
        bound = pc.min(pa.chunked_array(lasts))
        parts: list[pa.RecordBatch] = []
        for i in live:
            head = heads[i]
            assert head is not None
            n = _count_le(head, key, bound)
            parts.append(head.slice(0, n))
            rest: pa.RecordBatch | None = head.slice(n)
            while rest is not None and rest.num_rows == 0:   # the slice ended at the bound: it may go on
                rest = _next(sources[i])
                if rest is not None:
                    n = _count_le(rest, key, bound)
                    parts.append(rest.slice(0, n))
                    rest = rest.slice(n)
            heads[i] = rest
        yield _sorted(pa.Table.from_batches([p for p in parts if p.num_rows]), key)
