"""The byte encoding of keyed state in RocksDB: one documented, versioned format, never pickle.

Any Python (the CLI, ``read()``, another version) can decode what this module wrote.

**Values** start with one tag byte that names the encoding and its version:

====  ==========================  ===========================================================
tag   name                        payload
====  ==========================  ===========================================================
0x01  JSON, version 1             UTF-8 JSON (orjson; numpy scalars and arrays become numbers
                                  and lists, NaN/inf are refused)
0x02  bytes, version 1            the raw bytes (``bytes``/``bytearray``/``memoryview`` values)
====  ==========================  ===========================================================

Tags 0x00 and 0x03-0xff are reserved; decoding one raises :class:`StateEncodingError` saying the
state was written by a newer version. A ``None`` value is never stored: writing ``None`` clears.

**Keys** are laid out so that every key-group range is one contiguous byte range, and one key's map
entries are one contiguous prefix:

==========  ========  =======================================================================
offset      length    field
==========  ========  =======================================================================
0           2         key group, unsigned big-endian (0 .. 32767)
2           1         state kind: ``v`` value, ``m`` map, ``l`` list
3           1         ``n`` = length of the state name in UTF-8 bytes (1 .. 255)
4           n         the state name
4+n         4         ``k`` = length of the key bytes, unsigned big-endian
8+n         k         the key bytes (:func:`sparksteward.state.keygroups.key_bytes`)
8+n+k       rest      map state only: the map key, encoded as a value (tag + payload)
==========  ========  =======================================================================

Byte ranges ``[2-byte start, 2-byte stop)`` therefore select key groups ``[start, stop)`` exactly.
Key group prefixes ``0x8000`` and above are never used by state and are free for backend metadata.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import orjson

from sparksteward.errors import StateEncodingError
from sparksteward.wire.messages import MAX_PARALLELISM

__all__ = [
    "KIND_LIST",
    "KIND_MAP",
    "KIND_VALUE",
    "TAG_BYTES",
    "TAG_JSON",
    "decode_value",
    "encode_value",
    "group_bounds",
    "key_prefix",
    "split_key",
    "state_key",
]

TAG_JSON = 0x01
TAG_BYTES = 0x02
KIND_VALUE = b"v"
KIND_MAP = b"m"
KIND_LIST = b"l"
_KINDS = (KIND_VALUE, KIND_MAP, KIND_LIST)
_GROUP = struct.Struct(">H")
_LEN = struct.Struct(">I")
_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_finite(value: Any) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError(f"{v} is not a finite number")
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())


def encode_value(value: object) -> bytes:
    """Encode a JSON value or bytes; anything else raises :class:`StateEncodingError` naming it."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes((TAG_BYTES,)) + bytes(value)
    if value is None:
        raise StateEncodingError("None cannot be stored as a state value: call clear() to remove a value")
    try:
        payload = orjson.dumps(value, option=_JSON_OPTS)
        _check_finite(value)
    except (TypeError, ValueError, orjson.JSONEncodeError) as exc:
        raise StateEncodingError(
            f"state value {_describe(value)} of type {type(value).__name__} cannot be encoded: {exc}. "
            f"State values must be JSON values (None, bool, int, float, str, lists and dicts with str "
            f"keys, numpy numbers) or bytes; convert other objects (for example to a dict) first") from exc
    return bytes((TAG_JSON,)) + payload


def decode_value(data: bytes | bytearray | memoryview | None) -> Any:
    """Decode what :func:`encode_value` wrote; ``None`` (absent) stays ``None``."""
    if data is None:
        return None
    data = bytes(data)
    if not data:
        raise StateEncodingError("stored state value is empty: it was not written by spark-steward")
    tag = data[0]
    if tag == TAG_JSON:
        try:
            return orjson.loads(data[1:])
        except orjson.JSONDecodeError as exc:
            raise StateEncodingError(f"stored JSON state value is corrupt: {exc}") from exc
    if tag == TAG_BYTES:
        return data[1:]
    raise StateEncodingError(
        f"stored state value has encoding tag 0x{tag:02x}, which this version does not know: it was "
        f"written by a newer spark-steward; upgrade to read it")


def _name_bytes(name: str) -> bytes:
    if not isinstance(name, str) or not name:
        raise StateEncodingError(f"state name {name!r} must be a non-empty str")
    raw = name.encode("utf-8")
    if len(raw) > 255:
        raise StateEncodingError(f"state name {name[:40]!r}... is {len(raw)} UTF-8 bytes; at most 255 are allowed")
    return raw


def key_prefix(group: int, kind: bytes, name: str, key: bytes) -> bytes:
    """The prefix every entry of one (group, state, key) shares: the full key of value and list state."""
    if kind not in _KINDS:
        raise StateEncodingError(f"state kind {kind!r} is not one of {_KINDS}")
    if not 0 <= group < MAX_PARALLELISM:
        raise StateEncodingError(f"key group {group} is out of range [0, {MAX_PARALLELISM})")
    raw = _name_bytes(name)
    return b"".join((_GROUP.pack(group), kind, bytes((len(raw),)), raw, _LEN.pack(len(key)), key))


def state_key(group: int, kind: bytes, name: str, key: bytes, map_key: object = None) -> bytes:
    """The RocksDB key of one entry; map state appends the encoded ``map_key``."""
    prefix = key_prefix(group, kind, name, key)
    if kind == KIND_MAP:
        if map_key is None:
            raise StateEncodingError("a map state entry needs a map key that is not None")
        return prefix + encode_value(map_key)
    return prefix


def split_key(raw: bytes) -> tuple[int, bytes, str, bytes, bytes]:
    """Parse a stored key into ``(group, kind, name, key bytes, encoded map key or b"")``."""
    try:
        group = _GROUP.unpack_from(raw, 0)[0]
        kind = raw[2:3]
        n = raw[3]
        name = raw[4:4 + n].decode("utf-8")
        k = _LEN.unpack_from(raw, 4 + n)[0]
        start = 8 + n
        key = raw[start:start + k]
        if len(key) != k or kind not in _KINDS:
            raise ValueError("truncated")
        return group, kind, name, key, raw[start + k:]
    except (IndexError, struct.error, UnicodeDecodeError, ValueError) as exc:
        raise StateEncodingError(f"stored state key {raw[:40]!r} is not in the spark-steward key format") from exc


def group_bounds(start: int, stop: int) -> tuple[bytes, bytes]:
    """The byte range ``[lower, upper)`` that holds exactly key groups ``[start, stop)``."""
    if not 0 <= start <= stop <= MAX_PARALLELISM:
        raise StateEncodingError(f"key group range [{start}, {stop}) is out of range")
    return _GROUP.pack(start), _GROUP.pack(stop)
