"""FLIP-76 channel state: the input a straggling subtask deferred into its checkpoint (issue 10).

When a subtask is still processing once its batch's aligned-checkpoint timeout has passed, it stops
at a key-group boundary, or between two chunks of a key with ``form="chunks"`` (the cut, the same for
every attempt: :mod:`sparksteward.checkpoint.unaligned.task_cut`), appends the rest of its new input to a :class:`ChannelStateWriter` and takes its state snapshot. The file becomes part of checkpoint N (``SubtaskHandle.channel_state``, merged like
every small file, FLIP-306), and batch N+1 first replays it (:func:`read_channel_state`), then its
own input.

**Format** (version 1) of one channel-state file::

    b"STWCHAN"  7 bytes: magic
    version     1 byte
    an Arrow IPC stream: the schema, then the deferred record batches in arrival order

The buffers are written as they arrived, already in Arrow's wire format; nothing is pickled, so
any Python (or any Arrow reader past the 8-byte header) can decode it. A file that does not start
with the magic, has a newer version or a torn stream raises :class:`CheckpointCorruptError` naming the
file; the reader never returns a partial replay silently.

**Policies** (:class:`AlignmentOptions`, Flink's ``execution.checkpointing.unaligned.*``):

- ``aligned``: never defer (today's behaviour);
- ``unaligned``: defer the new input left once the timeout passed;
- ``unaligned_max_inflight``: defer only while the deferred rows fit in ``max_inflight_bytes``; once
  the next buffer would not fit, the subtask takes back what it deferred and finishes aligned. Order
  is kept either way: a deferred buffer is never followed by a processed one of the same subtask.

A batch always processes at least one buffer before any cut, so a subtask makes progress even with
a timeout of 0.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from sparksteward.enums import ParsedEnum
from sparksteward.errors import CheckpointCorruptError, ConfigError

if TYPE_CHECKING:   # pyarrow is imported where it is used: the driver agent reads only AlignmentOptions
    import pyarrow as pa
    import pyarrow.ipc as ipc

__all__ = ["CHANNEL_STATE_VERSION", "AlignmentMode", "AlignmentOptions", "ChannelStateWriter", "ChannelStats",
           "logical_size", "read_channel_state"]

MAGIC = b"STWCHAN"
CHANNEL_STATE_VERSION = 1
_HEADER = MAGIC + bytes([CHANNEL_STATE_VERSION])
_COALESCE_BYTES = 1 << 20


class AlignmentMode(ParsedEnum):
    ALIGNED = "aligned"
    UNALIGNED = "unaligned"
    UNALIGNED_MAX_INFLIGHT = "unaligned_max_inflight"

    @classmethod
    def _refusal(cls, value: object) -> Exception:
        return ConfigError(f"alignment={value!r} is not valid: use 'aligned', 'unaligned' or "
                           f"'unaligned_max_inflight'")


@dataclass(frozen=True, slots=True)
class AlignmentOptions:
    """How one state's subtasks treat the end of a batch (``spark.steward.checkpoint.unaligned.*``)."""

    alignment: AlignmentMode = AlignmentMode.ALIGNED
    aligned_checkpoint_timeout: float = 1.0   # seconds from the start of the state stage; 0: at once
    max_inflight_bytes: int = 64 << 20       # unaligned_max_inflight: the cap of one subtask's channel state

    def __post_init__(self) -> None:
        object.__setattr__(self, "alignment", AlignmentMode.parse(self.alignment))
        t = self.aligned_checkpoint_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t or t < 0:
            raise ConfigError(f"aligned_checkpoint_timeout={t!r} must be a number of seconds >= 0 (0: unaligned "
                              f"from the start of the batch)")
        b = self.max_inflight_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ConfigError(f"max_inflight_bytes={b!r} must be a positive number of bytes")

    @property
    def unaligned(self) -> bool:
        return self.alignment is not AlignmentMode.ALIGNED

    def to_json(self) -> dict[str, Any]:
        return {"alignment": self.alignment.value, "aligned_checkpoint_timeout": self.aligned_checkpoint_timeout,
                "max_inflight_bytes": self.max_inflight_bytes}

    @classmethod
    def from_config(cls, cfg: Any) -> AlignmentOptions:
        return cls(alignment=cfg.checkpoint_unaligned_alignment,
                   aligned_checkpoint_timeout=float(cfg.checkpoint_unaligned_aligned_checkpoint_timeout),
                   max_inflight_bytes=int(cfg.checkpoint_unaligned_max_inflight_bytes))

    @classmethod
    def from_json(cls, d: Any) -> AlignmentOptions:
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ConfigError(f"alignment options {d!r} are not an object")
        return cls(alignment=d.get("alignment", "aligned"),
                   aligned_checkpoint_timeout=d.get("aligned_checkpoint_timeout", 1.0),
                   max_inflight_bytes=d.get("max_inflight_bytes", 64 << 20))


@dataclass(frozen=True, slots=True)
class ChannelStats:
    """What a subtask deferred into one channel-state file."""

    path: Path
    batches: int
    rows: int
    bytes: int


def logical_size(batch: pa.RecordBatch) -> int:
    """The bytes of ``batch``'s values (variable-width values plus 4 per row, fixed-width values by
    their bit width), the same however the rows are split into batches."""
    import pyarrow as pa
    import pyarrow.compute as pc

    bits = 0
    for col in batch.columns:
        t = col.type
        if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) \
                or pa.types.is_large_binary(t):
            bits += 8 * (int(pc.sum(pc.binary_length(col)).as_py() or 0) + 4 * len(col))
        else:
            try:
                bits += t.bit_width * len(col)
            except ValueError:   # nested types: their buffers are as good as it gets
                bits += 8 * col.nbytes
    return (bits + 7) // 8


class ChannelStateWriter:
    """Appends deferred record batches to one channel-state file, written whole or not at all.

    ``max_bytes``: with ``unaligned_max_inflight``, :meth:`append` returns False (and writes nothing)
    when the buffer would take the deferred rows past the cap, counted by :func:`logical_size` so that
    the same rows pass it or not however they are chunked. Not thread-safe (one task writes one file).
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int | None = None, key: str | None = None) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.key = key   # with a key column: ``deferred_keys`` collects the keys of the rows deferred
        self.deferred_keys: set[object] = set()
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        self._file: BinaryIO | None = None
        self._writer: ipc.RecordBatchStreamWriter | None = None
        self._pending: list[pa.RecordBatch] = []   # small buffers coalesced before they are written
        self._pending_bytes = self._pending_rows = self._max_rows = 0
        self._logical = 0   # logical_size of what is deferred, which the byte cap applies to
        self._schema: pa.Schema | None = None
        self.batches = self.rows = 0
        self._closed = False

    @property
    def bytes(self) -> int:
        return (self._file.tell() if self._file is not None else 0) + self._pending_bytes

    def _flush(self) -> None:
        """Write the pending buffers as one record batch: a replay filtered by key group after a
        rescale yields many small pieces, and each written batch costs its own IPC header. Pieces
        are joined up to the largest buffer seen, so a replayed buffer is never larger than an input
        buffer (a batch processes at least one, and its size bounds that batch's time)."""
        import pyarrow as pa
        import pyarrow.ipc as ipc

        if not self._pending:
            return
        if len(self._pending) == 1:
            batch = self._pending[0]
        else:
            table = pa.Table.from_batches(self._pending).combine_chunks()
            batch = table.to_batches()[0]
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self._tmp, "wb")  # closed in close()/abort()
            self._file.write(_HEADER)
            self._writer = ipc.new_stream(self._file, batch.schema)
        self._writer.write_batch(batch)
        self._pending, self._pending_bytes, self._pending_rows = [], 0, 0

    def append(self, batch: pa.RecordBatch) -> bool:
        """Defer ``batch``; False when the byte cap does not allow it (nothing written then)."""
        if self._closed:
            raise ValueError("the channel-state writer is closed")
        size = batch.nbytes
        if self.max_bytes is not None:
            logical = logical_size(batch)   # the same for the same rows however they are chunked
            if self._logical + logical > self.max_bytes:
                return False
            self._logical += logical
        if self._pending and batch.schema != self._pending[0].schema:
            self._flush()
        if self._schema is not None and batch.schema != self._schema:
            raise CheckpointCorruptError(
                f"cannot defer a buffer with schema {batch.schema} into channel-state file {self.path}, which holds "
                f"{self._schema}: a subtask's input must keep one schema within a batch")
        self._schema = batch.schema
        if self.key is not None:
            import pyarrow.compute as pc

            self.deferred_keys.update(pc.unique(batch.column(self.key)).to_pylist())
        self._pending.append(batch)
        self._pending_bytes += size
        self._pending_rows += batch.num_rows
        self._max_rows = max(self._max_rows, batch.num_rows)
        if self._pending_rows >= self._max_rows or self._pending_bytes >= _COALESCE_BYTES:
            self._flush()   # pieces are joined back up to the largest buffer seen, never beyond it
        self.batches += 1
        self.rows += batch.num_rows
        return True

    def take_back(self) -> Iterator[pa.RecordBatch]:
        """Give back the deferred batches in order and drop the file (``unaligned_max_inflight``: the
        subtask finishes aligned after all)."""
        pending, self._pending, self._pending_bytes, self._pending_rows = self._pending, [], 0, 0
        self._logical = 0
        self.deferred_keys = set()
        if self._writer is None:
            self.batches = self.rows = 0
            return iter(pending)
        self._writer.close()
        assert self._file is not None  # the writer writes into it
        self._file.close()
        self._writer = self._file = None
        data = self._tmp.read_bytes()
        self._tmp.unlink()
        self.batches = self.rows = 0
        return itertools.chain(read_channel_state(io.BytesIO(data), str(self._tmp)), pending)

    def close(self) -> ChannelStats | None:
        """Finish the file (fsynced, then renamed into place); None when nothing was deferred."""
        if self._closed:
            raise ValueError("the channel-state writer is closed")
        self._closed = True
        self._flush()
        if self._writer is None:
            return None
        self._writer.close()
        assert self._file is not None  # the writer writes into it
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        os.replace(self._tmp, self.path)
        return ChannelStats(self.path, self.batches, self.rows, size)

    def abort(self) -> None:
        """Drop whatever was written. Idempotent."""
        self._closed = True
        with contextlib.suppress(Exception):
            if self._writer is not None:
                self._writer.close()
        with contextlib.suppress(Exception):
            if self._file is not None:
                self._file.close()
        self._writer = self._file = None
        self._pending, self._pending_bytes, self._pending_rows = [], 0, 0
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()

    def __enter__(self) -> ChannelStateWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()


def read_channel_state(source: str | os.PathLike[str] | BinaryIO, name: str | None = None
                       ) -> Iterator[pa.RecordBatch]:
    """The deferred batches of one channel-state file, in order, in one sequential pass.

    Raises :class:`CheckpointCorruptError` naming the file (``name``, default the path) for a bad
    magic, a newer version, or a torn or corrupt stream.
    """
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from sparksteward.state.event_time import LATE_COLUMN

    what = name or str(source)
    f = open(source, "rb") if isinstance(source, (str, os.PathLike)) else source
    try:
        header = f.read(len(_HEADER))
        if len(header) < len(_HEADER) or header[:len(MAGIC)] != MAGIC:
            raise CheckpointCorruptError(f"channel-state file {what} is not a spark-steward channel-state file (bad "
                                         f"header {header[:8]!r}): the checkpoint is corrupt; restore an older one")
        version = header[len(MAGIC)]
        if version > CHANNEL_STATE_VERSION:
            raise CheckpointCorruptError(
                f"channel-state file {what} was written by a newer spark-steward (version {version}; this one reads "
                f"up to {CHANNEL_STATE_VERSION}): upgrade spark-steward to restore it")
        try:
            reader = ipc.open_stream(f)
            late = reader.schema.get_field_index(LATE_COLUMN)
            if late >= 0 and reader.schema.field(late).type != pa.bool_():
                raise CheckpointCorruptError(
                    f"channel-state file {what} has a {LATE_COLUMN!r} column of type {reader.schema.field(late).type}; "
                    f"spark-steward writes it as a boolean late flag (late='keep'), so the file was written by "
                    f"something else: restore an older checkpoint")
            yield from reader
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
            raise CheckpointCorruptError(f"channel-state file {what} is corrupt or torn ({exc}); nothing of it was "
                                         f"replayed. Restore an older checkpoint") from exc
    finally:
        if f is not source:
            f.close()


def replay(sources: Iterable[tuple[str, BinaryIO | str | os.PathLike[str]]], key: str, keep: Any,
           max_parallelism: int, key_type: Any) -> Iterator[pa.RecordBatch]:
    """The rows of the channel-state files ``sources`` (``(name, file)`` in order) whose key group
    is in ``keep`` (a :class:`KeyGroupRange`): after a rescale a new subtask replays the overlapping
    old subtasks' files and drops the rows another subtask now owns, so the channel state does not
    grow when it is deferred again."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from sparksteward.state.keygroups import key_groups

    for name, f in sources:
        for batch in read_channel_state(f, name):
            if key not in batch.schema.names:
                raise CheckpointCorruptError(f"channel-state file {name} has no key column {key!r} (columns "
                                             f"{batch.schema.names}): it belongs to another state")
            groups = pa.array(key_groups(batch.column(key).to_pylist(), max_parallelism, key_type), pa.int32())
            mask = pc.and_(pc.greater_equal(groups, keep.start), pc.less(groups, keep.stop))
            kept = batch.filter(mask)
            if kept.num_rows:
                yield kept
