"""The on-disk form of a broadcast payload: pickle protocol 5 with out-of-band buffers.

Layout of a payload file (all integers little-endian)::

    b"STWPAY01"            8-byte magic
    header length          u32
    header                 orjson: {"version": 1, "pickle": [offset, length],
                                    "buffers": [[offset, length], ...]}
    ...                    the pickle stream and every buffer, each starting at a 64-byte boundary

:func:`write_payload` streams the buffers of numpy arrays, pyarrow buffers and anything else that
exposes protocol-5 ``PickleBuffer``\\ s straight from the object's memory into the file.
:func:`load_payload` memory-maps the file read-only and hands the buffers to ``pickle.loads`` as views
of the map, so values are **zero-copy**: every Python worker of an executor shares the page-cache copy
of the cached file, and a worker's anonymous memory does not grow with the payload. Objects without
out-of-band buffers load with an ordinary unpickle.

The payload is the user's object, so it is pickled by design; spark-steward's own records never are.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
from typing import Any, BinaryIO

import orjson

from sparksteward.errors import CorruptRecordError

__all__ = ["MAGIC", "load_payload", "write_payload"]

MAGIC = b"STWPAY01"
_ALIGN = 64
_HEADER_LEN = struct.Struct("<I")
_MAX_HEADER = 64 << 20


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def write_payload(obj: Any, f: BinaryIO) -> int:
    """Pickle ``obj`` into ``f`` with out-of-band buffers; return the number of bytes written."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    # the header length depends on the offsets, which depend on the header length: reserve generously
    sizes = [len(stream), *(r.nbytes for r in raws)]
    reserve = 64 + 48 * len(sizes)
    start = _aligned(len(MAGIC) + _HEADER_LEN.size + reserve)
    spans, pos = [], start
    for size in sizes:
        spans.append([pos, size])
        pos = _aligned(pos + size)
    header = orjson.dumps({"version": 1, "pickle": spans[0], "buffers": spans[1:]})
    assert len(header) <= reserve, "header reservation too small"
    f.write(MAGIC + _HEADER_LEN.pack(len(header)) + header)
    written = len(MAGIC) + _HEADER_LEN.size + len(header)
    for (offset, size), data in zip(spans, [memoryview(stream), *raws]):
        f.write(b"\0" * (offset - written))
        f.write(data)
        written = offset + size
    return written


def _header(mm: mmap.mmap | bytes, source: str) -> dict[str, Any]:
    if len(mm) < len(MAGIC) + _HEADER_LEN.size or mm[: len(MAGIC)] != MAGIC:
        raise CorruptRecordError(f"{source} is not a spark-steward payload (bad magic)")
    (length,) = _HEADER_LEN.unpack_from(mm, len(MAGIC))
    start = len(MAGIC) + _HEADER_LEN.size
    if length > _MAX_HEADER or start + length > len(mm):
        raise CorruptRecordError(f"{source}: payload header is truncated")
    try:
        header = orjson.loads(mm[start:start + length])
        spans = [header["pickle"], *header["buffers"]]
        if header.get("version") != 1 or any(o < 0 or n < 0 or o + n > len(mm) for o, n in spans):
            raise ValueError("bad spans or version")
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CorruptRecordError(f"{source}: payload header is unreadable: {exc}") from exc
    return header


def load_payload(path: str | os.PathLike[str]) -> Any:
    """Load a payload file, zero-copy for out-of-band buffers (views of a read-only memory map).

    The map stays open as long as any view of it is alive.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CorruptRecordError(f"{path}: payload file is empty")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    header = _header(mm, str(path))
    view = memoryview(mm)
    p_off, p_len = header["pickle"]
    buffers = [view[o:o + n] for o, n in header["buffers"]]
    try:
        return pickle.loads(view[p_off:p_off + p_len], buffers=buffers)
    except Exception as exc:
        raise CorruptRecordError(f"{path}: payload does not unpickle: {type(exc).__name__}: {exc}") from exc
